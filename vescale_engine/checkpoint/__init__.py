"""Checkpoints on disk: the sharded DCP save/load/consolidate (sharded.py) with its pieces as
DCP chunks (dcp.py), named entries and plain-data IO (entries.py) and directory layout
(layout.py); DeepSpeed ZeRO checkpoint import (zero.py); Hugging Face safetensors in and out
(hf.py, safetensors_format.py). Save and load take a training state (state.py's TrainingState:
model, optimizer, step, plain values; the engine builds its own in engine/training_state.py)
and optimizers plug in through `checkpoint_state` (sharded.py's docstring): this package must
not know the engine, its counters or config, any optimizer class, or how models are built.
"""
from ..shard.ragged_piece import RaggedPiece
from .dcp import CheckpointError, CheckpointWriteError
from .hf import load_hf_checkpoint, save_hf_checkpoint
from .layout import LATEST_FILE, STATE_FILE
from .sharded import consolidate, load_checkpoint, save_checkpoint
from .state import Stateful, TrainingState
from .zero import convert_zero

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate", "convert_zero",
           "load_hf_checkpoint", "save_hf_checkpoint", "CheckpointError", "CheckpointWriteError",
           "RaggedPiece", "Stateful", "TrainingState", "STATE_FILE", "LATEST_FILE"]

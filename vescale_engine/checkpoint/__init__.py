"""Checkpoints on disk: the sharded DCP save/load/consolidate (sharded.py) with its pieces as
DCP chunks (dcp.py), named entries and plain-data IO (entries.py) and directory layout
(layout.py); DeepSpeed ZeRO checkpoint import (zero.py); Hugging Face safetensors in and out
(hf.py, safetensors_format.py). Optimizers plug in through `checkpoint_state` (sharded.py's
docstring): this package must not know any optimizer class, the engine's config or how models
are built.
"""
from .dcp import CheckpointError, CheckpointWriteError
from .hf import load_hf_checkpoint, save_hf_checkpoint
from .layout import LATEST_FILE, STATE_FILE
from .piece import RaggedPiece
from .sharded import consolidate, load_checkpoint, save_checkpoint
from .zero import convert_zero

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate", "convert_zero",
           "load_hf_checkpoint", "save_hf_checkpoint", "CheckpointError", "CheckpointWriteError",
           "RaggedPiece", "STATE_FILE", "LATEST_FILE"]

"""What training hands a checkpoint: the protocol save_checkpoint and load_checkpoint
(sharded.py) take instead of an engine, in the spirit of torch DCP's `Stateful`. Torch-free.

A part of training contributes plain values (`state_dict()` / `load_state_dict()`: numbers,
strings, lists, dicts and small tensors; entries.py's to_json keeps them in vescale_state.json)
and tensor entries (tensors, or RaggedPieces in their own global shape: piece.py). A
`TrainingState` is everything a checkpoint of a training run holds besides the RNG states and
the client state:
- `module`: the model; its sharded parameters and persistent buffers are the `model.*` entries.
- `optimizer`: its state is the `optim.state.*` entries (the `checkpoint_state` interface of
  sharded.py's docstring, or a torch optimizer's own state) and its hyperparameters (each
  param group but its parameters) the plain values under "optimizer".
- `step`: the optimizer steps taken; it names the default tag (`global_step<step>`) and the
  save and load log lines (read after `load_state_dict`).
- `state_dict()`: the other plain values, each a top-level key of vescale_state.json (the
  engine's, engine/training_state.py: global_steps, global_samples, micro_steps,
  skipped_steps, lr_scheduler, loss_scaler). `load_state_dict(values)` is given every top-level
  key of the loaded checkpoint that is not the checkpoint's own (an older checkpoint may lack
  some) and restores what it holds.
This package never sees the engine: the engine builds its state (engine/training_state.py).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Stateful", "TrainingState", "HoldsModel", "model_of"]


@runtime_checkable
class Stateful(Protocol):
    """Plain values out and back in (torch.distributed.checkpoint.stateful.Stateful's shape)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...


@runtime_checkable
class HoldsModel(Protocol):
    """An object a model is reached through (the engine): checkpoint functions given one
    read its model."""

    def sharded_model(self): ...


def model_of(obj):
    """`obj`'s model when it holds one (HoldsModel, asked of its class: an engine forwards
    unknown attributes to its model), else `obj` itself."""
    return obj.sharded_model() if callable(getattr(type(obj), "sharded_model", None)) else obj


@runtime_checkable
class TrainingState(Stateful, Protocol):
    """The training run a checkpoint saves and loads (the module docstring says what each part
    contributes)."""

    @property
    def module(self): ...

    @property
    def optimizer(self): ...

    @property
    def step(self) -> int: ...

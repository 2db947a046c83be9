"""The engine's side of a checkpoint: the checkpoint.state.TrainingState the engine hands
checkpoint/sharded.py's save_checkpoint and load_checkpoint, so that the checkpoint code never
reads or writes the engine's attributes. Its plain values keep vescale_state.json's keys
(global_steps, global_samples, micro_steps, skipped_steps, lr_scheduler, loss_scaler)."""
from __future__ import annotations

__all__ = ["EngineTrainingState"]


class EngineTrainingState:
    """A VeScaleEngine's model, optimizer, counters, LR scheduler and fp16 loss scaler as a
    checkpoint.state.TrainingState. `load_lr_scheduler_states=False` (DeepSpeed's
    load_checkpoint flag) leaves the scheduler as it is when loading."""

    def __init__(self, engine, load_lr_scheduler_states: bool = True):
        self._engine = engine
        self._load_lr_scheduler_states = load_lr_scheduler_states

    @property
    def module(self):
        return self._engine.module

    @property
    def optimizer(self):
        return self._engine.optimizer

    @property
    def step(self) -> int:
        return self._engine.global_steps

    def state_dict(self) -> dict:
        engine = self._engine
        values = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                  "micro_steps": engine.micro_steps,
                  "skipped_steps": engine.skipped_steps}  # fp16 overflow skips
        if engine.lr_scheduler is not None:
            values["lr_scheduler"] = engine.lr_scheduler.state_dict()
        if engine.loss_scaler is not None:
            values["loss_scaler"] = engine.loss_scaler.state_dict()
        return values

    def load_state_dict(self, values: dict) -> None:
        """The checkpoint's values: the scheduler (unless told not to) and the loss scaler
        where both the engine and the checkpoint have one, then the counters (a checkpoint
        without skipped_steps, from before fp16 skipping, has none skipped)."""
        engine = self._engine
        if self._load_lr_scheduler_states and engine.lr_scheduler is not None \
                and "lr_scheduler" in values:
            engine.lr_scheduler.load_state_dict(values["lr_scheduler"])
        if engine.loss_scaler is not None and "loss_scaler" in values:
            engine.loss_scaler.load_state_dict(values["loss_scaler"])
        engine.global_steps = values["global_steps"]
        engine.global_samples = values["global_samples"]
        engine.micro_steps = values["micro_steps"]
        engine.skipped_steps = values.get("skipped_steps", 0)

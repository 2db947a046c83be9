"""fp16 loss scaling with DeepSpeed's `fp16` keys and semantics.

Gradients of an fp16 model underflow unless the loss is multiplied by a large scale first. The
scale is divided out again before the optimizer step (folded into gradient clipping: one pass
over each flat gradient shard). When any rank's gradients hold inf or nan, the step is skipped
on every rank and a dynamic scale is lowered; after `loss_scale_window` good steps in a row it
is raised again (DeepSpeed's counting: after window + 1 good steps, then every window). With
hysteresis H, only the H-th overflow since the last raise lowers it; an overflow at the
minimum scale is an error, as in DeepSpeed.

Under tensor/expert parallelism (and HSDP) the norm's all-reduces do not reach every rank for
every tensor (a TP-replicated tensor is summed over its data-parallel group only; experts over
efsdp and ep, dense tensors over the dense group), so the overflow decision is agreed over the
whole world in one more 1-element all-reduce: every rank skips, or none does.
"""
from __future__ import annotations

import logging
import torch
import torch.distributed as dist

from ..fsdp.param import sharding_of
from ..launch.collective_timeout import explain_timeout
from ..optim.clip import clip_coefficient, global_grad_norm, scale_gradients_

__all__ = ["LossScaler", "from_config", "overflowed_anywhere", "unscale_and_clip_"]

LOG = logging.getLogger("vescale_engine")


class LossScaler:
    """Static (`dynamic=False`: the scale never changes) or dynamic loss scale."""

    def __init__(self, init_scale: float, dynamic: bool = True, scale_window: int = 1000,
                 min_scale: float = 1.0, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False, scale_factor: float = 2.0):
        self.cur_scale = float(init_scale)
        self.dynamic = dynamic
        self.scale_window = scale_window
        self.min_scale = float(min_scale)
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = consecutive_hysteresis
        self.scale_factor = scale_factor
        self.cur_hysteresis = hysteresis
        self.good_steps = 0      # optimizer steps without overflow since the last change
        self.overflows = 0       # skipped steps, for the log

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> str | None:
        """Account for one optimizer step; returns what changed, for rank 0's log."""
        if overflow:
            self.overflows += 1
            self.good_steps = 0
            if not self.dynamic:
                return f"fp16 overflow: step skipped, static loss scale {self.cur_scale:g} kept"
            if self.cur_scale == self.min_scale and self.cur_hysteresis <= 1:
                raise FloatingPointError(
                    f"fp16: gradients overflow at the minimum loss scale {self.min_scale:g}; "
                    "lower fp16.min_loss_scale, the learning rate, or train in bf16")
            if self.cur_hysteresis > 1:
                self.cur_hysteresis -= 1
                return (f"fp16 overflow: step skipped, loss scale {self.cur_scale:g} kept "
                        f"(hysteresis left {self.cur_hysteresis})")
            attempted = self.cur_scale
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            return f"fp16 overflow: step skipped, loss scale {attempted:g} -> {self.cur_scale:g}"
        if not self.dynamic:
            return None
        self.good_steps += 1
        if self.consecutive_hysteresis:  # only overflows in a row count against the scale
            self.cur_hysteresis = self.hysteresis
        stable = self.good_steps - 1  # DeepSpeed counts the first good step as interval 0
        if stable > 0 and stable % self.scale_window == 0:
            self.cur_hysteresis = self.hysteresis
            self.cur_scale *= self.scale_factor
            return f"fp16: no overflow for {self.scale_window} steps, loss scale " \
                   f"{self.cur_scale / self.scale_factor:g} -> {self.cur_scale:g}"
        return None

    def state_dict(self) -> dict:
        return {"cur_scale": self.cur_scale, "cur_hysteresis": self.cur_hysteresis,
                "good_steps": self.good_steps, "overflows": self.overflows,
                "dynamic": self.dynamic}

    def load_state_dict(self, state: dict) -> None:
        missing = {"cur_scale", "cur_hysteresis", "good_steps"} - set(state)
        if missing:
            raise ValueError(f"loss scaler state lacks {sorted(missing)}")
        self.cur_scale = float(state["cur_scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.good_steps = int(state["good_steps"])
        self.overflows = int(state.get("overflows", 0))


def from_config(fp16: dict) -> LossScaler | None:
    """The scaler the `fp16` section asks for; None when fp16 is off."""
    if not fp16.get("enabled", False):
        return None
    static = fp16.get("loss_scale", 0)
    if static:
        return LossScaler(static, dynamic=False)
    return LossScaler(2.0 ** fp16.get("initial_scale_power", 16), dynamic=True,
                      scale_window=fp16.get("loss_scale_window", 1000),
                      min_scale=fp16.get("min_loss_scale", 1),
                      hysteresis=fp16.get("hysteresis", 2),
                      consecutive_hysteresis=fp16.get("consecutive_hysteresis", False))


def unscale_and_clip_(parameters, scale: float, max_norm: float, eps: float = 1e-6):
    """One global norm (one all-reduce per shard group, so every rank sees the same value and
    takes the same decision). Returns (overflow, norm of the unscaled gradients or None). On
    overflow the gradients are left alone (the step is skipped); otherwise they are divided by
    `scale` and, when `max_norm` > 0, clipped, in one pass. Reading the overflow is the step's
    one host-device sync; the returned norm stays on the device."""
    parameters = list(parameters)
    scaled_norm = global_grad_norm(parameters)
    if overflowed_anywhere(scaled_norm, parameters):
        return True, None
    norm = scaled_norm / scale
    factor = 1.0 / scale
    if max_norm > 0:
        factor = clip_coefficient(norm, max_norm, eps) * factor
    scale_gradients_(parameters, factor)
    return False, norm


def _norm_misses_ranks(parameters) -> bool:
    """Can one rank's inf fail to reach another through the norm's all-reduces? Yes when a
    parameter is a TP/EP DTensor piece or a buffer's norm group is not the whole world (HSDP,
    TP's data-parallel group, experts' efsdp)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    world = dist.get_world_size()
    for p in parameters:
        sp = sharding_of(p)
        if sp is not None and (sp.dtensor_spec is not None or
                               dist.get_world_size(sp.buffer.comm.norm_group) != world):
            return True
    return False


def overflowed_anywhere(scaled_norm: torch.Tensor, parameters) -> bool:
    """True on every rank when any rank's gradients hold inf or nan (the step's one sync)."""
    flag = (~torch.isfinite(scaled_norm)).to(torch.float32).reshape(1)
    if _norm_misses_ranks(parameters):
        with explain_timeout("the all-reduce of the fp16 overflow flag"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the world: dense and expert groups
    return bool(flag.item())

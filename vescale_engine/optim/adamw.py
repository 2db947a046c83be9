"""AdamW that steps each DBuffer's whole flat shard in one vectorized pass.

Same math as `torch.optim.AdamW` (decoupled weight decay, bias correction), applied to the
master shard, the gradient shard and two flat state tensors per buffer instead of once per
parameter. Padding holds zero parameters and gradients and stays zero.
"""
from __future__ import annotations

import math

import torch

from .flat import evaluate_closure, flat_buffers


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyperparameters lr={lr} betas={betas} eps={eps}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._buffers = flat_buffers(self.param_groups, "vescale_engine.optim.AdamW")

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for buf, group, decay, probe in self._buffers:
            if probe.grad is None:  # no backward since zero_grad: like torch, skip
                continue
            state = self.state.setdefault(buf.master, {})
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(buf.master)
                state["exp_avg_sq"] = torch.zeros_like(buf.master)
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            if isinstance(decay, torch.Tensor):  # per-element decay first, then none inside
                buf.master.mul_(1 - lr * decay)
            _adamw(buf.master, buf.grad, state, lr, beta1, beta2, eps,
                   0.0 if isinstance(decay, torch.Tensor) else decay)
        return loss


def _adamw(p, g, state, lr, beta1, beta2, eps, weight_decay):
    """torch.optim.AdamW's update of one flat tensor: torch's fused kernel where this torch
    build has it (one pass over memory), else the same math op by op."""
    state["step"] += 1
    if _FUSED is not None and p.device.type in ("cpu", "cuda"):
        _FUSED([p], [g], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]],
               lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
               amsgrad=False, maximize=False)
        return
    step = state["step"].item()
    p.mul_(1 - lr * weight_decay)
    state["exp_avg"].lerp_(g, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))


_FUSED = getattr(torch, "_fused_adamw_", None)

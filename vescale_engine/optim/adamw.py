"""AdamW that steps each DBuffer's whole flat shard in one vectorized pass.

Same math as `torch.optim.AdamW` (decoupled weight decay, bias correction), applied to the
master shard, the gradient shard and two flat state tensors per buffer instead of once per
parameter. Padding holds zero parameters and gradients and stays zero. As in torch, a parameter
without a gradient (frozen: requires_grad=False) is not touched, neither decayed nor moved by
its moments; a buffer with some of those is stepped over its other tensors' ranges only, and
such a tensor's step count lags its buffer's by the steps it missed, as torch's per-tensor count
does. (The lag is not checkpointed: after a load every tensor resumes at its buffer's count.)
"""
from __future__ import annotations

import math

import torch

from .flat import evaluate_closure, flat_buffers, stepped_members
from .offload import OptimizerOffload, faces_in

__all__ = ["AdamW", "new_adamw_state", "adamw_update", "adamw_math"]


class AdamW(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyperparameters lr={lr} betas={betas} eps={eps}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._buffers = flat_buffers(self.param_groups, "vescale_engine.optim.AdamW")
        self._missed = {}  # id(buffer) -> per tensor: steps of the buffer it had no gradient
        self.offload = None  # OptimizerOffload once `offload_to_host` chose buffers

    def offload_to_host(self, ratio: float = 1.0, pin_memory: bool = False,
                        offload_param: bool = False) -> OptimizerOffload:
        """Step `ratio` of the buffers (by bytes, largest first) on the host from now on: their
        fp32 master and state move to host memory, the device keeps a compute-dtype shard (on
        the host too with `offload_param`; optim/offload.py). Before the first step only."""
        if self.state:
            raise RuntimeError("offload_to_host: the optimizer already holds state")
        self.offload = OptimizerOffload(
            [b for b, *_ in self._buffers],
            lambda b: [(name, b.master.dtype, b.shard_size) for name in ("exp_avg", "exp_avg_sq")],
            ratio=ratio, pin_memory=pin_memory, offload_param=offload_param,
            faces_of=faces_in([p for g in self.param_groups for p in g["params"]]))
        self._buffers = [(b, g, d.cpu() if isinstance(d, torch.Tensor) and
                          self.offload.offloads(b) else d, m) for b, g, d, m in self._buffers]
        return self.offload

    def held_tensors(self) -> list:
        """Device tensors this optimizer keeps besides `state`: the per-element weight decay
        of buffers whose tensors' groups decay differently (Trainer's decay / no-decay groups).
        engine/colocation.py moves them with the state."""
        return [d for b, _g, d, _m in self._buffers
                if isinstance(d, torch.Tensor) and not self._offloaded(b)]

    def _offloaded(self, buf) -> bool:
        return self.offload is not None and self.offload.offloads(buf)

    def _state_of(self, buf) -> dict:
        """The buffer's state, made when missing: on the device, or in its host memory."""
        state = self.state.setdefault(buf.master, {})
        if not state:
            if self._offloaded(buf):
                host = self.offload.host(buf)
                state.update(step=torch.zeros((), dtype=torch.float32, device="cpu"),
                             exp_avg=host.parts["exp_avg"], exp_avg_sq=host.parts["exp_avg_sq"])
            else:
                state.update(new_adamw_state(buf.master))
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for buf, group, decay, members in self._buffers:
            stepped, everything = stepped_members(buf, members)
            if not stepped:  # no gradient since zero_grad: like torch, skip
                continue
            state = self._state_of(buf)
            missed = self._missed.setdefault(id(buf), [0] * len(buf.layout.placements))
            torch._foreach_add_([state["step"]], 1)
            if everything and not any(missed):
                pieces, steps = [slice(None)], [state["step"]]
            else:
                ranges = [(buf.local_ranges[sp.index], missed[sp.index]) for sp in stepped]
                pieces = [slice(a, b) for (a, b), _ in ranges if b > a]
                steps = [state["step"] - lag if lag else state["step"]
                         for (a, b), lag in ranges if b > a]
                done = {sp.index for sp in stepped}
                for i in range(len(missed)):
                    missed[i] += i not in done
            if not pieces:  # this rank holds none of the stepped tensors
                continue
            offloaded = self._offloaded(buf)
            # the step's master and gradient: on the device, or in the host allocation
            master, grad = buf.master, buf.grad
            if offloaded:
                grad = self.offload.to_host(buf).grad
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            if isinstance(decay, torch.Tensor):  # per-element decay first, then none inside
                for piece in pieces:
                    master[piece].mul_(1 - lr * decay[piece])
            adamw_math([master[k] for k in pieces], [grad[k] for k in pieces],
                       [state["exp_avg"][k] for k in pieces],
                       [state["exp_avg_sq"][k] for k in pieces], steps,
                       lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                       weight_decay=0.0 if isinstance(decay, torch.Tensor) else decay)
            if offloaded:
                self.offload.stepped(buf)
        return loss

    def checkpoint_state(self, create: bool) -> dict:
        """The checkpoint interface (checkpoint.py): state is flat per buffer; each parameter's
        is its slice of it (1-D views of its local numel) and the buffer's 0-d `step`."""
        out = {}
        for buf, _group, _decay, _members in self._buffers:
            state = self._state_of(buf) if create else self.state.get(buf.master, {})
            if not state:
                continue
            for group in self.param_groups:
                for p in group["params"]:
                    sp = p._vescale
                    if sp.buffer is buf:
                        start, end = buf.local_ranges[sp.index]
                        out[p] = {"step": state["step"], "exp_avg": state["exp_avg"][start:end],
                                  "exp_avg_sq": state["exp_avg_sq"][start:end]}
        return out


def new_adamw_state(p: torch.Tensor) -> dict:
    """Fresh AdamW state for flat tensor `p`, every tensor on p's device (torch's fused CUDA
    kernel reads `step` on the device)."""
    return {"step": torch.zeros((), dtype=torch.float32, device=p.device),
            "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def adamw_update(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
                 weight_decay):
    """torch.optim.AdamW's update of lists of tensors; `steps` (0-d tensors on the parameters'
    device) are advanced first, as torch does."""
    torch._foreach_add_(steps, 1)
    adamw_math(params, grads, exp_avgs, exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2,
               eps=eps, weight_decay=weight_decay)


def adamw_math(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps,
               weight_decay):
    """The update with already-advanced steps: torch's fused kernel where this torch build has
    it for the device (one pass over memory), else the same math op by op with the bias
    corrections computed on the device, so that no step reads a value back to the host."""
    if _FUSED is not None and params[0].device.type in ("cpu", "cuda"):
        _FUSED(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
               weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
        correction1, correction2 = _bias_correction(beta1, step), _bias_correction(beta2, step)
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / correction2.sqrt()).add_(eps)
        if lr:  # p -= lr / correction1 * m / denom, the step size folded into the divisor
            p.addcdiv_(m, denom.mul_(correction1 / -lr))  # (addcdiv's value is a host number)


def _bias_correction(beta: float, step: torch.Tensor) -> torch.Tensor:
    """1 - beta ** step on step's device, as -expm1(step * log(beta)): accurate in fp32 where
    1 - pow would cancel (beta2 = 0.999 early in training)."""
    return -torch.expm1(step * math.log(beta)) if beta else torch.ones_like(step)


_FUSED = getattr(torch, "_fused_adamw_", None)

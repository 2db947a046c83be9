"""AdamW with both moments stored block-wise in 8 bits, stepping whole DBuffer shards.

The quantization block of a parameter is its RaggedShard block (`block`: "block:N" for N
consecutive elements, "rows:K", or "tile:RxC" for the R whole rows that enclose an R x C tile).
The planner never cuts a block with a shard boundary, so every rank owns whole blocks and
computes their scales alone: no collective for scales, ever, and the same blocks (hence the same
numbers, bit for bit) on any number of ranks. Master weights stay fp32.

One step per buffer: restore both moments from their codes (one pass), AdamW's update on the
flat shard (torch's math), quantize both moments again (one pass). Padding between tensors is
its own segment: zero gradients, zero moments, zero scales.
"""
from __future__ import annotations

import torch

from ..granularity import parse_granularity
from .adamw import _adamw
from .quantize import MAPS, BlockQuantizer

DEFAULT_BLOCK = "block:256"


def quantization_granularity(block: str):
    """The sharding granularity AdamW8bit needs: its quantization block, checked."""
    granularity = parse_granularity(block)
    if granularity.kind in ("element", "tensor"):
        raise ValueError(f"AdamW8bit block {block!r}: quantize in blocks of block:N elements, "
                         "rows:K or tile:RxC (one scale per element or per tensor is not 8-bit "
                         "block-wise quantization)")
    return granularity


class AdamW8bit(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 block=DEFAULT_BLOCK, quant_map="dynamic"):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW8bit hyperparameters lr={lr} betas={betas} eps={eps}")
        if quant_map not in MAPS:
            raise ValueError(f"AdamW8bit quant_map {quant_map!r} is not one of {', '.join(MAPS)}")
        self.granularity = quantization_granularity(block)
        self.quant_map = quant_map
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._buffers = self._index_buffers()

    def _index_buffers(self):
        """Per DBuffer: its group, weight decay (a vector when it differs per parameter), one
        trainable parameter to test for gradients, and the quantizer of its shard's blocks."""
        owners = {}
        for group in self.param_groups:
            for p in group["params"]:
                sp = getattr(p, "_vescale", None)
                if sp is None:
                    raise ValueError("AdamW8bit needs parameters sharded by vescale_engine."
                                     f"fully_shard; got a plain parameter of shape {list(p.shape)}")
                want = self._block_of(sp)
                if sp.block != want:
                    raise ValueError(
                        f"parameter {sp.fqn}: sharded in blocks of {sp.block} elements but "
                        f"AdamW8bit quantizes it in blocks of {want} ({self.granularity}): shard "
                        f"it with granularity {self.granularity} so that no rank holds part "
                        "of a block")
                owners.setdefault(id(sp.buffer), (sp.buffer, []))[1].append((sp, group))
        entries = []
        for buf, members in owners.values():
            first = members[0][1]
            for sp, group in members:
                for key in ("lr", "betas", "eps"):
                    if group[key] != first[key]:
                        raise ValueError(f"parameter {sp.fqn}: shares a flat buffer with "
                                         f"parameters whose {key} differs")
            given = {id(sp) for sp, _ in members}
            for sp in members[0][0].unit.params:
                if sp.buffer is buf and sp.sharded.requires_grad and id(sp) not in given:
                    raise ValueError(f"parameter {sp.fqn}: trainable and in a flat buffer the "
                                     "optimizer steps, but not given to the optimizer")
            decays = {group["weight_decay"] for _, group in members}
            if len(decays) == 1:
                decay = decays.pop()
            else:
                decay = torch.zeros_like(buf.master)
                for sp, group in members:
                    start, end = buf.local_ranges[sp.index]
                    decay[start:end] = group["weight_decay"]
            trainable = [sp.sharded for sp, _ in members if sp.sharded.requires_grad]
            if trainable and buf.shard_size:
                entries.append((buf, first, decay, trainable[0], BlockQuantizer(
                    shard_segments(buf).to(buf.master.device), self.quant_map)))
        return entries

    @staticmethod
    def _new_state(buf, quantizer) -> dict:
        return {"step": torch.zeros((), dtype=torch.float32, device=buf.master.device),
                "exp_avg_codes": torch.zeros_like(buf.master, dtype=torch.int8),
                "exp_avg_scales": buf.master.new_zeros(quantizer.num_blocks),
                "exp_avg_sq_codes": torch.zeros_like(buf.master, dtype=torch.uint8),
                "exp_avg_sq_scales": buf.master.new_zeros(quantizer.num_blocks)}

    def _block_of(self, sp) -> int:
        try:
            return self.granularity.block_size(sp.shape)
        except ValueError as err:
            raise ValueError(f"parameter {sp.fqn}: AdamW8bit block {self.granularity}: {err}") \
                from None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for buf, group, decay, probe, quantizer in self._buffers:
            if probe.grad is None:  # no backward since zero_grad: like torch, skip
                continue
            if not self.state.get(buf.master):
                self.state[buf.master] = self._new_state(buf, quantizer)
            state = self.state[buf.master]
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            moments = {
                "step": state["step"],
                "exp_avg": quantizer.dequantize(state["exp_avg_codes"], state["exp_avg_scales"],
                                                signed=True),
                "exp_avg_sq": quantizer.dequantize(state["exp_avg_sq_codes"],
                                                   state["exp_avg_sq_scales"], signed=False),
            }
            if isinstance(decay, torch.Tensor):
                buf.master.mul_(1 - lr * decay)
            _adamw(buf.master, buf.grad, moments, lr, beta1, beta2, eps,
                   0.0 if isinstance(decay, torch.Tensor) else decay)
            quantizer.quantize(moments["exp_avg"], True, state["exp_avg_codes"],
                               state["exp_avg_scales"])
            quantizer.quantize(moments["exp_avg_sq"], False, state["exp_avg_sq_codes"],
                               state["exp_avg_sq_scales"])
        return loss

    # -- checkpoints (the interface vescale_engine.checkpoint documents) ------------------------

    def checkpoint_state(self, create: bool) -> dict:
        """{parameter: {name: view}}: the moments restored to fp32, one element per parameter
        element, so a checkpoint reshards to any mesh or granularity; `step` as a 0-d tensor.
        With `create`, missing state is made first; `checkpoint_state_loaded` requantizes what
        was loaded into these views (exactly what was saved: the restored values quantize back
        to the same codes and scales)."""
        self._restored = []
        out = {}
        for buf, group, decay, probe, quantizer in self._buffers:
            if create and not self.state.get(buf.master):
                self.state[buf.master] = self._new_state(buf, quantizer)
            state = self.state.get(buf.master)
            if not state:
                continue
            exp_avg, exp_avg_sq = self.moments(buf)
            self._restored.append((buf, quantizer, exp_avg, exp_avg_sq))
            for g in self.param_groups:
                for p in g["params"]:
                    if p._vescale.buffer is buf:
                        start, end = buf.local_ranges[p._vescale.index]
                        out[p] = {"step": state["step"], "exp_avg": exp_avg[start:end],
                                  "exp_avg_sq": exp_avg_sq[start:end]}
        return out

    def checkpoint_state_loaded(self) -> None:
        for buf, quantizer, exp_avg, exp_avg_sq in getattr(self, "_restored", []):
            state = self.state[buf.master]
            quantizer.quantize(exp_avg, True, state["exp_avg_codes"], state["exp_avg_scales"])
            quantizer.quantize(exp_avg_sq, False, state["exp_avg_sq_codes"],
                               state["exp_avg_sq_scales"])
        self._restored = []

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (codes, scales, segment lengths, steps)."""
        total = sum(q.lengths.numel() * q.lengths.element_size() for *_, q in self._buffers)
        for state in self.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values())
        return total

    def moments(self, buf):
        """(exp_avg, exp_avg_sq) of one buffer's shard, restored to fp32 (tests, inspection)."""
        for entry_buf, *_, quantizer in self._buffers:
            if entry_buf is buf:
                state = self.state[buf.master]
                return (quantizer.dequantize(state["exp_avg_codes"], state["exp_avg_scales"], True),
                        quantizer.dequantize(state["exp_avg_sq_codes"],
                                             state["exp_avg_sq_scales"], False))
        raise KeyError(f"buffer {buf.name} is not stepped by this optimizer")


def shard_segments(buf) -> torch.Tensor:
    """Lengths of consecutive segments covering this rank's shard of `buf`: each tensor's piece
    cut into its blocks (the last one shorter at the tensor's end), gaps as segments of their
    own. A piece starts on a block edge: the planner never puts a shard boundary inside one."""
    lengths, cursor = [], 0
    lo = buf.rank * buf.shard_size
    for placement, (start, end) in zip(buf.layout.placements, buf.local_ranges):
        if end <= start:
            continue
        first = lo + start - placement.offset  # element of the tensor where the piece starts
        if first % placement.block:
            raise AssertionError(f"{placement.name}: shard starts inside a block (planner bug)")
        if start > cursor:
            lengths.append(start - cursor)
        whole, rest = divmod(end - start, placement.block)
        lengths += [placement.block] * whole + ([rest] if rest else [])
        cursor = end
    if buf.shard_size > cursor:
        lengths.append(buf.shard_size - cursor)
    return torch.tensor(lengths, dtype=torch.int64)


def fp32_adamw_state_bytes(shard_numel: int) -> int:
    """What torch's (and our flat) AdamW holds for the same elements: two fp32 moments."""
    return 2 * 4 * shard_numel + 4


__all__ = ["AdamW8bit", "quantization_granularity", "shard_segments", "fp32_adamw_state_bytes",
           "DEFAULT_BLOCK"]

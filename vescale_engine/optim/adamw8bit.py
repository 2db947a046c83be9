"""AdamW with both moments stored block-wise in 8 bits, stepping whole DBuffer shards.

The quantization block of a parameter is its RaggedShard block (`block`: "block:N" for N
consecutive elements, "rows:K", or "tile:RxC" for the R whole rows that enclose an R x C tile).
The planner never cuts a block with a shard boundary, so every rank owns whole blocks and
computes their scales alone: no collective for scales, ever, and the same blocks (hence the same
numbers, bit for bit) on any number of ranks. Master weights stay fp32.

A TP/EP (DTensor) parameter is quantized in blocks of its TP/EP-local tensor (still no
collective for scales). That equals one process only where those blocks are one process's
blocks of the global tensor (e.g. EP Shard(0) with block:N dividing one expert, TP Shard(0)
with N dividing the local numel, Shard(1) with N dividing the local last dim; its RaggedShard
block is then a multiple of N); anything else is refused in one line. Because they are, a
checkpoint holds the global tensor's codes and scales: each local block's scale is placed at
the global block of its first element, so the state loads bitwise at any layout.

One step per buffer: restore both moments from their codes (one pass), AdamW's update on the
flat shard (torch's math), quantize both moments again (one pass). Padding between tensors is
its own segment: zero gradients, zero moments, zero scales.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate, Shard

from ..checkpoint.dcp import CheckpointError
from ..shard.ragged_piece import RaggedPiece
from ..fsdp.dtensor_params import local_index_maps, sharded_mesh_dims
from ..plan.granularity import parse_granularity
from ..plan.optim_spec import ADAMW8BIT_BLOCK
from .adamw import adamw_math
from .flat import evaluate_closure, flat_buffers, stepped_members
from .offload import OptimizerOffload, faces_in
from .quantize import MAPS, BlockQuantizer, code_table

DEFAULT_BLOCK = ADAMW8BIT_BLOCK
MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))  # (state name, signed code table)


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
        self.offload = None  # OptimizerOffload once `offload_to_host` chose buffers

    def offload_to_host(self, ratio: float = 1.0, pin_memory: bool = False,
                        offload_param: bool = False) -> OptimizerOffload:
        """Step `ratio` of the buffers (by bytes, largest first) on the host from now on: their
        fp32 master, codes and scales in host memory, quantized there, the device keeping a
        compute-dtype shard (on the host too with `offload_param`; optim/offload.py). Before
        the first step only."""
        if self.state:
            raise RuntimeError("offload_to_host: the optimizer already holds state")
        blocks = {id(b): q.num_blocks for b, *_, q in self._buffers}
        self.offload = OptimizerOffload(
            [b for b, *_ in self._buffers],
            lambda b: [("exp_avg_scales", b.master.dtype, blocks[id(b)]),
                       ("exp_avg_sq_scales", b.master.dtype, blocks[id(b)]),
                       ("exp_avg_codes", torch.int8, b.shard_size),
                       ("exp_avg_sq_codes", torch.uint8, b.shard_size)],
            ratio=ratio, pin_memory=pin_memory, offload_param=offload_param,
            faces_of=faces_in([p for g in self.param_groups for p in g["params"]]))
        self._buffers = [
            (b, g, d.cpu() if isinstance(d, torch.Tensor) and self.offload.offloads(b) else d,
             m, BlockQuantizer(shard_segments(b, self._buffer_blocks(b)), self.quant_map,
                               device="cpu")
             if self.offload.offloads(b) else q) for b, g, d, m, q in self._buffers]
        return self.offload

    def held_tensors(self) -> list:
        """Device tensors this optimizer keeps besides `state`: the per-element weight decay
        of buffers whose tensors' groups decay differently (Trainer's decay / no-decay groups).
        engine/colocation.py moves them with the state."""
        return [d for b, _g, d, *_ in self._buffers
                if isinstance(d, torch.Tensor) and not self._offloaded(b)]

    def _offloaded(self, buf) -> bool:
        return self.offload is not None and self.offload.offloads(buf)

    def _state_device(self, buf) -> torch.device:
        return torch.device("cpu") if self._offloaded(buf) else buf.master.device

    def _index_buffers(self):
        """Per DBuffer: its group, weight decay, its given parameters, and the quantizer of its
        shard's blocks."""
        self._ever_stepped = set()  # ids of the ShardedParameters a step has updated
        self._quant_blocks = {}  # (id(buffer), index): a TP/EP tensor's quantization block
        return [(buf, group, decay, members, BlockQuantizer(
                    shard_segments(buf, self._buffer_blocks(buf)), self.quant_map,
                    device=buf.master.device))
                for buf, group, decay, members in flat_buffers(
                    self.param_groups, "AdamW8bit", self._check_block)
                if buf.shard_size]

    def _buffer_blocks(self, buf) -> list:
        """The quantization block of each tensor in `buf` (its RaggedShard block unless TP/EP
        made that a multiple of the quantization block)."""
        return [self._quant_blocks.get((id(buf), k), placement.block)
                for k, placement in enumerate(buf.layout.placements)]

    def _check_block(self, sp):
        want = self._block_of(sp)
        if sp.dtensor_spec is not None and sharded_mesh_dims(sp.dtensor_spec):
            why = _inexact_tp_ep_blocks(sp, want, self.granularity)
            if why:
                raise NotImplementedError(
                    f"AdamW8bit: {sp.fqn} is a tensor/expert-parallel (TP/EP-sharded DTensor) "
                    f"parameter whose {self.granularity} blocks of its local piece are not one "
                    f"process's blocks ({why}); use AdamW or a block that divides the pieces")
            if sp.block % want:
                raise ValueError(
                    f"parameter {sp.fqn}: sharded in blocks of {sp.block} elements, not a "
                    f"multiple of the {want} AdamW8bit quantizes it in ({self.granularity}): "
                    f"shard it with granularity {self.granularity}")
            self._quant_blocks[(id(sp.buffer), sp.index)] = want
            return
        if sp.block != want:
            raise ValueError(
                f"parameter {sp.fqn}: sharded in blocks of {sp.block} elements but "
                f"AdamW8bit quantizes it in blocks of {want} ({self.granularity}): shard "
                f"it with granularity {self.granularity} so that no rank holds part "
                "of a block")

    def _new_state(self, buf, quantizer) -> dict:
        if self._offloaded(buf):  # in the buffer's one host allocation
            parts = self.offload.host(buf).parts
            return {"step": torch.zeros((), dtype=torch.float32, device="cpu"),
                    **{name: parts[name] for name in ("exp_avg_codes", "exp_avg_scales",
                                                      "exp_avg_sq_codes", "exp_avg_sq_scales")}}
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
        loss = evaluate_closure(closure)
        for buf, group, decay, members, quantizer in self._buffers:
            stepped, everything = stepped_members(buf, members)
            if not stepped:  # no gradient since zero_grad: like torch, skip
                continue
            if not everything:
                self._check_untouched(buf, members, decay)
            self._ever_stepped.update(id(sp) for sp in stepped)
            if not self.state.get(buf.master):
                self.state[buf.master] = self._new_state(buf, quantizer)
            state = self.state[buf.master]
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            offloaded = self._offloaded(buf)
            # the step's master and gradient: on the device, or in the host allocation
            master, grad = buf.master, buf.grad
            if offloaded:
                grad = self.offload.to_host(buf).grad
            if isinstance(decay, torch.Tensor):
                master.mul_(1 - lr * decay)
            state["step"] += 1
            for chunk in quantizer.chunks:  # restore, update, quantize: one chunk at a time
                self._step_chunk(master, grad, state, quantizer, chunk, lr=lr, beta1=beta1,
                                 beta2=beta2, eps=eps,
                                 weight_decay=0.0 if isinstance(decay, torch.Tensor) else decay)
            if offloaded:
                self.offload.stepped(buf)
        return loss

    def _check_untouched(self, buf, members, decay):
        """This optimizer steps whole shards: a tensor without a gradient in a stepped buffer
        gets a zero gradient instead of being skipped. That changes nothing only while its
        moments are zero (never stepped) and it has no weight decay; otherwise an error."""
        for sp in buf_params(buf, members):
            if sp.sharded.grad is not None:
                continue
            decayed = bool(decay[slice(*buf.local_ranges[sp.index])].any()) \
                if isinstance(decay, torch.Tensor) else decay != 0
            if decayed or id(sp) in self._ever_stepped:
                raise ValueError(
                    f"parameter {sp.fqn}: has no gradient (frozen) but shares a flat buffer with "
                    "parameters AdamW8bit steps, which would "
                    + ("decay it" if decayed else "move it by its moments")
                    + "; freeze whole units, use weight_decay=0 for frozen weights, or use "
                    "AdamW, which skips it")

    @staticmethod
    def _step_chunk(master, grad, state, quantizer, chunk, **hyper):
        """AdamW on one chunk of whole blocks: its moments restored to fp32, torch's update,
        quantized again, so the fp32 moments exist for one chunk at a time."""
        moments = [quantizer.dequantize_chunk(chunk, state[f"{name}_codes"],
                                              state[f"{name}_scales"], signed)
                   for name, signed in MOMENTS]
        piece = slice(chunk.lo, chunk.hi)
        adamw_math([master[piece]], [grad[piece]], moments[:1], moments[1:],
                   [state["step"]], **hyper)
        for (name, signed), moment in zip(MOMENTS, moments):
            quantizer.quantize_chunk(chunk, moment, signed, state[f"{name}_codes"],
                                     state[f"{name}_scales"])

    # -- checkpoints (the interface vescale_engine.checkpoint documents) ------------------------

    def checkpoint_info(self) -> dict:
        """Plain data saved next to the state (vescale_state.json): how the codes were made."""
        return {"quantized_moments": {"block": str(self.granularity), "quant_map": self.quant_map}}

    def checkpoint_state(self, create: bool, saved_info) -> dict:
        """{parameter: {name: view}}: each moment as its 8-bit codes (one per parameter element,
        the parameter's shape in the checkpoint) and its per-block fp32 scales (a RaggedPiece
        over the parameter's blocks: a rank owns whole blocks, so its scales are one contiguous
        range); `step` as a 0-d tensor. With `create`, missing state is made first.

        `saved_info` is the `checkpoint_info()` of the state's format: our own when saving, the
        checkpoint's when loading. A parameter whose saved blocks and tables equal the current
        ones loads straight into the state (bit-exact, any world size). Any other is read into
        scratch and converted by `checkpoint_state_loaded` (lossy: within one quantization step):
        codes and scales of other blocks or tables are restored with those and quantized again
        with ours; with no record at all (an fp32 optimizer's checkpoint, e.g. AdamW's or one
        imported from DeepSpeed) fp32 `exp_avg`/`exp_avg_sq` are read and quantized."""
        saved = None if saved_info is None else _quantization_record(saved_info)
        saved_granularity = parse_granularity(saved["block"]) if saved else None
        self._converting = []  # (buffer, start, end, restore(moment, signed, codes) -> fp32)
        out = {}
        for buf, group, decay, _members, quantizer in self._buffers:
            if create and not self.state.get(buf.master):
                self.state[buf.master] = self._new_state(buf, quantizer)
            state = self.state.get(buf.master)
            if not state:
                continue
            for g in self.param_groups:
                for p in g["params"]:
                    sp = p._vescale
                    if sp.buffer is not buf:
                        continue
                    start, end = buf.local_ranges[sp.index]
                    entry = {"step": state["step"]}
                    if saved is None:
                        entry.update(self._fp32_scratch(buf, start, end))
                        out[p] = entry
                        continue
                    entry.update(exp_avg_codes=state["exp_avg_codes"][start:end],
                                 exp_avg_sq_codes=state["exp_avg_sq_codes"][start:end])
                    first = _local_first_element(sp)  # of the tensor, at `start`
                    saved_block = _saved_block(saved_granularity, sp)
                    block = self._quant_blocks.get((id(buf), sp.index), sp.block)
                    if saved_block == block and saved["quant_map"] == self.quant_map:
                        # this tensor's segments: those starting inside its piece, in order
                        lo, hi = quantizer.segment_range(start, end)
                        for name in ("exp_avg_scales", "exp_avg_sq_scales"):
                            entry[name] = _scales_piece(sp, state[name][lo:hi], block,
                                                        first // block if end > start else 0)
                    else:
                        entry.update(self._codes_scratch(buf, sp, start, end, first, saved_block,
                                                         saved["quant_map"]))
                    out[p] = entry
        return out

    def _fp32_scratch(self, buf, start, end) -> dict:
        """fp32 moments to read an unquantized checkpoint into."""
        scratch = {name: torch.zeros(end - start, dtype=buf.master.dtype,
                                     device=self._state_device(buf))
                   for name in ("exp_avg", "exp_avg_sq")}
        self._converting.append((buf, start, end, lambda moment, signed, codes: scratch[moment]))
        return scratch

    def _codes_scratch(self, buf, sp, start, end, first, saved_block, saved_map) -> dict:
        """Scales of the saved blocks that overlap this rank's elements (the codes load into the
        state as they are: one per element whatever the blocks), and how to restore them. A
        TP/EP piece's elements are global elements by its index maps; the saved blocks they
        fall in, in order, are the scratch's (several runs when the piece has several)."""
        device = self._state_device(buf)
        elements = torch.arange(first, first + end - start)
        if _tp_ep(sp):
            saved = torch.unique(_global_elements(sp, elements) // saved_block)  # sorted
            scratch = lambda: RaggedPiece(  # noqa: E731
                torch.zeros(saved.numel(), dtype=buf.master.dtype, device=device),
                (-(-math.prod(sp.dtensor_spec.shape) // saved_block),), 0,
                local_shape=(saved.numel(),), index_maps=[saved.tolist()])
            position = torch.searchsorted(saved, _global_elements(sp, elements) // saved_block)
        else:
            lo, hi = (first // saved_block, -(-(first + end - start) // saved_block)) \
                if end > start else (0, 0)
            scratch = lambda: RaggedPiece(  # noqa: E731
                torch.zeros(hi - lo, dtype=buf.master.dtype, device=device),
                (_blocks(sp, saved_block),), lo)
            position = elements // saved_block - lo
        scales = {name: scratch() for name in ("exp_avg_scales", "exp_avg_sq_scales")}

        def restore(moment, signed, codes):
            table = code_table(saved_map, signed, codes.device)
            index = codes[start:end].to(torch.int64) + (127 if signed else 0)
            return table[index] * scales[f"{moment}_scales"].local[position.to(codes.device)]

        self._converting.append((buf, start, end, restore))
        return scales

    def checkpoint_state_loaded(self) -> None:
        """Convert what was read into scratch: restore those pieces' fp32 moments, then quantize
        each such shard again with our blocks and tables (its other pieces round-trip exactly)."""
        pieces = {}
        for buf, start, end, restore in getattr(self, "_converting", []):
            pieces.setdefault(id(buf), []).append((start, end, restore))
        for buf, *_, quantizer in self._buffers:
            if id(buf) not in pieces:
                continue
            state = self.state[buf.master]
            for signed, moment in ((True, "exp_avg"), (False, "exp_avg_sq")):
                codes, scales = state[f"{moment}_codes"], state[f"{moment}_scales"]
                values = quantizer.dequantize(codes, scales, signed)  # pieces loaded as they are
                for start, end, restore in pieces[id(buf)]:
                    if end > start:
                        values[start:end] = restore(moment, signed, codes)
                quantizer.quantize(values, signed, codes, scales)
        self._converting = []

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (codes, scales, segment lengths, steps)."""
        total = sum(q.device_bytes() for *_, q in self._buffers)
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


def _quantization_record(info) -> dict:
    """The checkpoint's {"block", "quant_map"}, checked: a bad record is one clear line."""
    record = info.get("quantized_moments") if isinstance(info, dict) else None
    if not isinstance(record, dict):
        raise CheckpointError(f"AdamW8bit checkpoint: no quantization record in the optimizer's "
                              f"checkpoint_info ({info!r}): not saved by AdamW8bit")
    if record.get("quant_map") not in MAPS:
        raise CheckpointError(f"AdamW8bit checkpoint: quant_map {record.get('quant_map')!r} is "
                              f"not one of {', '.join(MAPS)}")
    try:
        quantization_granularity(record.get("block"))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"AdamW8bit checkpoint: saved block: {err}") from None
    return record


def _local_first_element(sp) -> int:
    """Index (in the tensor's flat storage) of this rank's first element of `sp`."""
    buf = sp.buffer
    start, _ = buf.local_ranges[sp.index]
    return buf.rank * buf.shard_size + start - buf.layout.placements[sp.index].offset


def _blocks(sp, block: int) -> int:
    """How many blocks of `block` elements tensor `sp` has (the last may be shorter)."""
    return -(-sp.buffer.layout.placements[sp.index].numel // block) if block else 0


def _tp_ep(sp) -> bool:
    return sp.dtensor_spec is not None and bool(sharded_mesh_dims(sp.dtensor_spec))


def _global_elements(sp, local: torch.Tensor) -> torch.Tensor:
    """Flat indices in the global tensor of the TP/EP-local tensor's flat indices `local`."""
    spec = sp.dtensor_spec
    maps = local_index_maps(spec)
    out = torch.zeros_like(local)
    rest, stride = local.clone(), 1
    for d in reversed(range(len(sp.shape))):
        index = rest % sp.shape[d]
        rest //= sp.shape[d]
        if maps[d] is not None:
            index = torch.tensor(maps[d], dtype=torch.int64)[index]
        out += index * stride
        stride *= spec.shape[d]
    return out


def _scales_piece(sp, scales: torch.Tensor, block: int, first_block: int) -> RaggedPiece:
    """A tensor's per-block scales on this rank as a piece of its global list of blocks. A
    TP/EP piece's blocks are one process's blocks (checked when the optimizer is built), each
    placed at the global block of its first element."""
    if not _tp_ep(sp):
        return RaggedPiece(scales, (_blocks(sp, block),), first_block)
    blocks = _blocks(sp, block)
    where = _global_elements(sp, torch.arange(blocks, dtype=torch.int64) * block) // block
    return RaggedPiece(scales, (-(-math.prod(sp.dtensor_spec.shape) // block),), first_block,
                       local_shape=(blocks,), index_maps=[where.tolist()])


def _saved_block(granularity, sp) -> int:
    """The block of the saved granularity for `sp` (of its global shape under TP/EP: the
    checkpoint's blocks are the global tensor's)."""
    try:
        return granularity.block_size(sp.dtensor_spec.shape if _tp_ep(sp) else sp.shape)
    except ValueError as err:
        raise CheckpointError(f"AdamW8bit checkpoint: parameter {sp.fqn}: saved block "
                              f"{granularity}: {err}") from None


def shard_segments(buf, blocks=None) -> torch.Tensor:
    """Lengths of consecutive segments covering this rank's shard of `buf`: each tensor's piece
    cut into its blocks (the last one shorter at the tensor's end), gaps as segments of their
    own. A piece starts on a block edge: the planner never puts a shard boundary inside one.
    `blocks` (one per tensor, each dividing its RaggedShard block) cuts finer than the
    RaggedShard blocks; default: those."""
    lengths, cursor = [], 0
    lo = buf.rank * buf.shard_size
    blocks = blocks or [p.block for p in buf.layout.placements]
    for placement, block, (start, end) in zip(buf.layout.placements, blocks, buf.local_ranges):
        if end <= start:
            continue
        first = lo + start - placement.offset  # element of the tensor where the piece starts
        if first % block or placement.block % block:
            raise AssertionError(f"{placement.name}: shard starts inside a block (planner bug)")
        if start > cursor:
            lengths.append(start - cursor)
        whole, rest = divmod(end - start, block)
        lengths += [block] * whole + ([rest] if rest else [])
        cursor = end
    if buf.shard_size > cursor:
        lengths.append(buf.shard_size - cursor)
    return torch.tensor(lengths, dtype=torch.int64, device="cpu")  # planned on the host


def _inexact_tp_ep_blocks(sp, block: int, granularity) -> str | None:
    """Why quantizing the TP/EP-local tensor of `sp` in blocks of `block` elements would not
    reproduce one process's blocks of the global tensor, on any rank (None: it does).

    One TP/EP split of dim d (prod of the dims before it: `outer` runs per piece, each of
    `inner` = prod(dims after d) elements per index of d). A piece's local blocks are the
    global ones iff every run starts on a global block edge and, when the piece has several
    runs, each run is whole blocks; a single run may end in the tensor's last, shorter block."""
    spec = sp.dtensor_spec
    shape = tuple(spec.shape)
    cuts = [(m, p) for m, p in enumerate(spec.placements) if not isinstance(p, Replicate)]
    if len(cuts) != 1 or type(cuts[0][1]) is not Shard:
        return f"placements {list(spec.placements)}: only one Shard split is supported"
    mesh_dim, placement = cuts[0]
    d = placement.dim % len(shape)
    try:
        if granularity.block_size(shape) != block:
            return (f"blocks of {block} elements of the local {list(sp.shape)} but "
                    f"{granularity.block_size(shape)} of the global {list(shape)}")
    except ValueError as err:
        return str(err)
    outer, inner = math.prod(shape[:d]), math.prod(shape[d + 1:])
    pieces = spec.mesh.size(mesh_dim)
    for index in range(pieces):
        size, offset = Shard.local_shard_size_and_offset(shape[d], pieces, index)
        if size == 0:
            continue
        run = size * inner
        if (offset * inner) % block:
            return (f"TP/EP piece {index} of dim {d} starts at element {offset * inner}, not a "
                    f"multiple of {block}")
        if outer > 1 and (run % block or (shape[d] * inner) % block):
            return (f"TP/EP piece {index} of dim {d} has {outer} runs of {run} elements, not "
                    f"whole blocks of {block} in a tensor of rows of {shape[d] * inner}")
        if outer == 1 and run % block and offset + size != shape[d]:
            return (f"TP/EP piece {index} of dim {d} ({run} elements) ends inside a block of "
                    f"{block}")
    return None


def fp32_adamw_state_bytes(shard_numel: int) -> int:
    """What torch's (and our flat) AdamW holds for the same elements: two fp32 moments."""
    return 2 * 4 * shard_numel + 4


__all__ = ["AdamW8bit", "quantization_granularity", "shard_segments", "fp32_adamw_state_bytes",
           "DEFAULT_BLOCK"]


def buf_params(buf, members):
    """Every ShardedParameter laid out in `buf` (given to the optimizer or not)."""
    return [sp for sp in members[0].unit.params if sp.buffer is buf]

"""The two collectives a DBuffer runs over a flat buffer cut into W equal shards: all-gather
into the full buffer, and reduce-scatter (sum) out of it into one shard.

Every backend but gloo gets its native collectives (NCCL's are what they should be). gloo's
are slow for this use: its reduce-scatter is an all-reduce of a copy of the whole input
followed by a copy out, and its all-gather gathers into a fresh buffer and copies out of it
(`benchmarks/results/collectives.md`: on 2 ranks and 12.6 MB, the exchanges below take 0.58x
gloo's reduce-scatter time and 0.70x its all-gather time). So on gloo every rank exchanges shards
directly with each peer (point-to-point, all sends and receives in flight at once): for the
all-gather it sends its shard to every peer and receives each peer's shard straight into that
peer's range of the full buffer; for the reduce-scatter it sends each peer the range that peer
owns and receives the peers' pieces of its own range into a scratch buffer of W-1 shards, then
sums. The bytes each rank sends are (W-1) shards either way, as in a ring.

Both ranks of a pair post their messages in the same program order and gloo matches them in
order per tag; each collective gets its own tag so the two kinds can never be confused.

`native=True` (fully_shard's `native_collectives`) makes gloo use its own collectives too:
the path NCCL always takes, so that it runs in CI. The choice is made per tensor: a process
group may hold one backend per device type ("cpu:gloo,cuda:nccl"), and only a tensor whose
device is served by gloo takes the exchange.

`gradient_reduction` decides how gradients are averaged over the data-parallel ranks, as FSDP2
does: AVG inside the collective where the backend has it (NCCL) for fp32/bf16; for fp16, which
overflows at 65504, a divide by about sqrt(W) before the sum and the rest after it.
`CommSettings` holds one buffer's inputs to these choices and what they chose.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import torch_compat

__all__ = ["Joined", "all_gather", "reduce_scatter", "GradientReduction",
           "gradient_reduction", "CommSettings",
           "backend_for", "tensor_backend", "uses_exchange", "default_device"]

_native_all_gather = torch_compat.all_gather_native
_native_reduce_scatter = torch_compat.reduce_scatter_native

_GATHER_TAG = 0x7E5C
_REDUCE_TAG = 0x7E5D


def backend_for(backend_config: str, device_type: str) -> str:
    """The backend that serves `device_type` in a process group's backend config: "gloo" for
    ("cpu:gloo,cuda:nccl", "cpu"); a config without device prefixes ("gloo") serves every
    device."""
    entries = [e.strip() for e in backend_config.split(",") if e.strip()]
    if len(entries) == 1 and ":" not in entries[0]:
        return entries[0]
    for entry in entries:
        device, _, backend = entry.partition(":")
        if device == device_type:
            return backend
    raise ValueError(f"the process group (backends {backend_config!r}) has no backend for "
                     f"{device_type} tensors")


def tensor_backend(group, tensor: torch.Tensor) -> str:
    """The backend `group` runs `tensor`'s collectives on."""
    return backend_for(dist.get_backend_config(group), tensor.device.type)


def uses_exchange(group, tensor: torch.Tensor, native: bool = False) -> bool:
    """Whether a collective over `tensor` on `group` runs as direct point-to-point exchanges:
    when gloo serves the tensor's device, unless `native` asks for gloo's own collectives."""
    return not native and tensor_backend(group, tensor) == "gloo"


# Backends whose reduce-scatter and all-reduce average in the collective (ReduceOp.AVG).
_AVG_BACKENDS = frozenset({"nccl"})


@dataclass(frozen=True)
class GradientReduction:
    """How gradients become their average over the data-parallel ranks: divide by
    `pre_divide` before the collectives, reduce with `reduce_scatter_op` over the shard group
    and `all_reduce_op` over the replicas, then divide by `post_divide` (1.0: no kernel)."""
    pre_divide: float
    reduce_scatter_op: object
    all_reduce_op: object
    post_divide: float


def gradient_reduction(dtype: torch.dtype, shard_size: int, replicas: int,
                       shard_backend: str, replicate_backend: str | None = None,
                       exchange: bool = False,
                       divide_factor: float | None = None,
                       force_sum: bool = False) -> GradientReduction:
    """The reduction for gradients in `dtype` over `shard_size` ranks times `replicas`,
    divided by `divide_factor` (None: that number of ranks, the average).

    fp32/bf16 cannot overflow a sum of W gradients: AVG inside the collective where the
    backend has it (no divide kernel), else SUM and one divide after. fp16 can (the loss scale
    puts gradients near its 65504 limit), so the sum is kept small: divide by the power of two
    nearest below sqrt(W) first, by the rest after. The exchange sums itself (SUM). A factor
    other than the group's size (experts: their group is a part of the data-parallel world,
    their gradients are divided by all of it) is SUM and a divide after, never PREMUL_SUM
    (gloo rejects it). `force_sum`: SUM in every collective and one divide after, even where
    the backend averages (FSDP2's set_force_sum_reduction_for_comms)."""
    world = shard_size * replicas
    factor = float(world if divide_factor is None else divide_factor)
    if factor <= 0:
        raise ValueError(f"gradient_divide_factor must be > 0, got {divide_factor}")
    if world == 1 and factor == 1:
        return GradientReduction(1.0, dist.ReduceOp.SUM, dist.ReduceOp.SUM, 1.0)
    if dtype == torch.float16:
        pre = 1
        while (pre * 2) ** 2 <= min(world, factor):
            pre *= 2
        return GradientReduction(float(pre), dist.ReduceOp.SUM, dist.ReduceOp.SUM, factor / pre)
    if factor != world:
        return GradientReduction(1.0, dist.ReduceOp.SUM, dist.ReduceOp.SUM, factor)
    rs_avg = shard_size > 1 and not exchange and shard_backend in _AVG_BACKENDS and not force_sum
    ar_avg = replicas > 1 and replicate_backend in _AVG_BACKENDS and not force_sum
    post = (1 if rs_avg else shard_size) * (1 if ar_avg else replicas)
    return GradientReduction(1.0, dist.ReduceOp.AVG if rs_avg else dist.ReduceOp.SUM,
                             dist.ReduceOp.AVG if ar_avg else dist.ReduceOp.SUM, float(post))



@dataclass
class CommSettings:
    """One buffer's settings for its collectives: the groups besides its shard group, how its
    gradients are averaged (set at construction, changed by DBuffer.set_reduction), and what
    follows from the backend that serves its storage's device (`native` and `reduction`,
    None until `choose` knows that device)."""
    replicate_group: object  # HSDP's replicas, all-reduced after the reduce-scatter; or None
    replicas: int            # its size (1 without one)
    # The group over which the gradient norm sums the buffer's shards: its shard group, unless
    # other groups hold different tensors under the same layout (DeepSpeed MoE experts,
    # ShardingPolicy.rank_local: None, the world, which spans every expert-parallel rank's)
    norm_group: object
    reduce_dtype: torch.dtype
    native_requested: bool = False  # fully_shard's native_collectives
    divide_factor: float | None = None  # None: the average over shard group x replicas
    force_sum: bool = False  # SUM collectives and one divide after (set_force_sum)
    native: bool | None = None  # the backend's collectives, not gloo's exchange
    reduction: GradientReduction | None = None

    def choose(self, shard_group, tensor: torch.Tensor, shard_size: int,
               sums_itself: bool) -> None:
        """`native` and `reduction` for storage on `tensor`'s device, over `shard_group` of
        `shard_size` ranks; `sums_itself`: the reduce format sums outside the backend."""
        self.native = not uses_exchange(shard_group, tensor, native=self.native_requested)
        self.reduction = gradient_reduction(
            self.reduce_dtype, shard_size, self.replicas, tensor_backend(shard_group, tensor),
            None if self.replicate_group is None else
            tensor_backend(self.replicate_group, tensor),
            exchange=not self.native or sums_itself,
            divide_factor=self.divide_factor,
            force_sum=self.force_sum)


class Joined:
    """One handle for several collectives (an exchange's messages, a quantized all-gather's
    two): wait() waits for every one, then runs `finish`."""

    def __init__(self, works, finish=None):
        self.works = works
        self.finish = finish

    def wait(self):
        for work in self.works:
            work.wait()
        self.works = []
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        return True


def all_gather(full: torch.Tensor, shard: torch.Tensor, group, async_op: bool = True,
               native: bool = False):
    """Fill `full` (W shards of `shard.numel()`) with every rank's `shard`, in rank order.
    `shard` may already be this rank's range of `full`. `native`: the backend's own
    collective even on gloo."""
    if not uses_exchange(group, full, native):
        return _native_all_gather(full, shard, group=group, async_op=async_op)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    S = shard.numel()
    mine = full[rank * S:(rank + 1) * S]
    if mine.data_ptr() != shard.data_ptr():
        mine.copy_(shard)  # what every all-gather does with the caller's own shard
    works = []
    for peer in _peers(rank, world):
        works.append(dist.irecv(full[peer * S:(peer + 1) * S], group=group, group_src=peer,
                                tag=_GATHER_TAG))
        works.append(dist.isend(mine, group=group, group_dst=peer, tag=_GATHER_TAG))
    handle = Joined(works)
    if async_op:
        return handle
    handle.wait()
    return None


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group, op=dist.ReduceOp.SUM,
                   native: bool = False):
    """Asynchronously reduce every rank's `full` (W shards of `out.numel()`) with `op` and
    leave this rank's shard of the result in `out`. Returns a handle; `out` holds the result
    once wait() returns. The exchange only sums."""
    if not uses_exchange(group, full, native):
        return _native_reduce_scatter(out, full, op=op, group=group, async_op=True)
    if op != dist.ReduceOp.SUM:
        raise ValueError(f"the gloo exchange reduce-scatter only sums, not {op}")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    S = out.numel()
    peers = _peers(rank, world)
    received = torch.empty(len(peers), S, dtype=full.dtype, device=full.device)
    works = []
    for k, peer in enumerate(peers):
        works.append(dist.irecv(received[k], group=group, group_src=peer, tag=_REDUCE_TAG))
        works.append(dist.isend(full[peer * S:(peer + 1) * S], group=group, group_dst=peer,
                                tag=_REDUCE_TAG))
    mine = full[rank * S:(rank + 1) * S]

    def finish():
        if len(peers) == 0:
            out.copy_(mine)
        elif len(peers) == 1:
            torch.add(mine, received[0], out=out)
        else:
            torch.add(mine, received.sum(dim=0), out=out)

    return Joined(works, finish)


def _peers(rank: int, world: int) -> list[int]:
    """Every other rank, starting after this one: each rank talks to a different peer first,
    which spreads the traffic instead of everybody sending to rank 0 at once."""
    return [(rank + k) % world for k in range(1, world)]


def default_device(group=None) -> torch.device:
    """The device a process group's tensors live on when nobody said: the current CUDA device
    when NCCL serves CUDA tensors in `group`, else the CPU (what `materialize(device=None)`
    uses outside the engine; inside it, `engine.device`)."""
    config = dist.get_backend_config(group if group is not None else dist.group.WORLD)
    try:
        if backend_for(config, "cuda") == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    except ValueError:  # no backend for CUDA tensors in this group
        pass
    return torch.device("cpu")

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
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 prefers the *_single names; older releases only have the *_tensor ones.
_native_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_native_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_GATHER_TAG = 0x7E5C
_REDUCE_TAG = 0x7E5D


def uses_exchange(group) -> bool:
    """Whether collectives on `group` run as direct point-to-point exchanges (gloo)."""
    return dist.get_backend(group) == "gloo"


class _Exchange:
    """The handle of an exchange: wait() waits for every message, then runs `finish`."""

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


def all_gather(full: torch.Tensor, shard: torch.Tensor, group, async_op: bool = True):
    """Fill `full` (W shards of `shard.numel()`) with every rank's `shard`, in rank order.
    `shard` may already be this rank's range of `full`."""
    if not uses_exchange(group):
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
    handle = _Exchange(works)
    if async_op:
        return handle
    handle.wait()
    return None


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group):
    """Asynchronously sum every rank's `full` (W shards of `out.numel()`) and leave this rank's
    shard of the sum in `out`. Returns a handle; `out` holds the sum once wait() returns."""
    if not uses_exchange(group):
        return _native_reduce_scatter(out, full, group=group, async_op=True)
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

    return _Exchange(works, finish)


def _peers(rank: int, world: int) -> list[int]:
    """Every other rank, starting after this one: each rank talks to a different peer first,
    which spreads the traffic instead of everybody sending to rank 0 at once."""
    return [(rank + k) % world for k in range(1, world)]

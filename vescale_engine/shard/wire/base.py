"""The two wire-format interfaces a DBuffer calls (as FSDP2's AllGather and ReduceScatter
comms): a gather format fills the full buffer from every rank's shard, a reduce format fills
one rank's shard from every rank's full gradients. Each issues its collectives, counts what
they move in STATS and returns one handle to wait for; the storage, the views and what
happens around the collectives stay DBuffer's. (`buf` is that DBuffer, unannotated: a type-only
import of dbuffer.py, which imports this package, is an import circle.)
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from ..stats import TimedWork

__all__ = ["GatherFormat", "ReduceFormat"]


class GatherFormat(ABC):
    """How the weights travel into `full` (DBuffer.all_gather, once `full` has storage)."""

    plain = False     # the values travel as they are (a dtype change keeps the format valid)
    tiles = None      # FP8 tiles the weights travel as (fp8_linear routes Linears by them)
    secondary = None  # hpZ's copy of this rank's part of `full`
    hpz_group = None  # the group hpZ's secondary gathers run in
    # fully_shard(fp8_matmul=True): a format with an FP8 form keeps the last gather's
    # (fp8_tensor) for the Linears that compute from it (fsdp/fp8_linear.py)
    keep_fp8 = False

    def __call__(self, buf, async_op: bool = True, tag=None, backward: bool = False):
        """Gather every rank's shard into `buf.full`: the handle, or None once done when not
        `async_op`. `tag` and `backward` are for formats that keep something across the
        gathers of one iteration (hpZ)."""
        work = self.send(buf, buf.gather_input())
        if not async_op:
            work.wait()
            return None
        return TimedWork(work, buf.device)

    @abstractmethod
    def send(self, buf, source):
        """Issue the collectives that put every rank's `source` (S elements) into `buf.full`,
        count their bytes, and return one handle whose wait() leaves `full` filled."""

    def to(self, device) -> None:
        """Index tensors onto the storage's device (meta: nothing)."""

    def forget(self) -> None:
        """`full` is freed or refilled: whatever the last gather kept beside it is stale."""

    def held(self) -> list:
        """[(name, tensor)] the format keeps on the device between gathers
        (engine/colocation.py's device_state)."""
        return []

    def fp8_tensor(self, index: int, weight):
        """Tensor `index`'s gathered FP8 form (DBuffer.fp8_tensor); None: not kept."""
        return None


class ReduceFormat(ABC):
    """How the full gradients travel into one rank's shard (DBuffer.reduce_scatter)."""

    plain = False  # the values travel as they are

    # Sums outside the backend's reduce-scatter: no AVG inside it, the divide comes after
    # (collectives.gradient_reduction's `exchange`)
    sums_itself = False

    @abstractmethod
    def __call__(self, buf, out, source):
        """Issue the reduction of every rank's `source` (W x S) into this rank's `out` (S),
        count its bytes, and return one handle whose wait() leaves `out` filled."""

    def to(self, device) -> None:
        """Index tensors onto the storage's device (meta: nothing)."""

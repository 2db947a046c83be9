"""DBuffer: the flat distributed buffer that one planner layout describes.

Every parameter of the layout is a view of it: its piece of the rank's fp32 master shard
(between steps), its full tensor in the compute dtype (while unsharded), its piece of the local
gradient shard, and its full gradient (during backward). All-gather writes straight into the
full buffer from the local shard and reduce-scatter reads straight from the full gradient buffer
into the local shard: no copy-in, no copy-out, one collective per buffer. Full buffers keep their
tensor objects for life and only their storage is allocated and freed (`resize_`), so parameter
views and tensors saved by autograd stay valid; no `record_stream` is ever needed. What the
collectives send (the weights as they are, int8 groups, FP8 tiles; hpZ's secondary gather) is
the buffer's wire formats, chosen once, by `wire.formats`. What backward leaves for the
reduction is the buffer's UnreducedGrads (unreduced_grads.py); a master moved to host memory
adds an OffloadState (offload_state.py).

Must not know about modules or config.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan.planner import BufferLayout
from . import collectives, wire
from .compute_shard import ComputeShard
from .offload_state import OffloadState
from .stats import STATS, TimedWork
from .unreduced_grads import UnreducedGrads

__all__ = ["DBuffer", "PendingReduction"]


def _held(tensor) -> int:
    return 0 if tensor is None else tensor.untyped_storage().nbytes()


def _local_ranges(layout: BufferLayout, rank: int) -> list:
    """Per tensor: (start, end) of its local piece on `rank` inside the shard."""
    S = layout.shard_size
    lo = rank * S
    ranges = []
    for p in layout.placements:
        start = min(max(p.offset, lo), lo + S) - lo
        end = max(min(p.offset + p.numel, lo + S), lo) - lo
        ranges.append((start, max(start, end)))
    return ranges


class DBuffer:
    """Storage for one buffer layout on one rank.

    `master` (S elements, the parameters' dtype) and `grad` (S elements) persist; `full`
    (world_size * S elements, the compute dtype) holds storage only while unsharded (None
    until first needed). Backward's gradients until reduced: `unreduced`; how collectives run
    and average: `comm`; a master in host memory: `offloaded`. `rank_local`: the gradient norm
    sums the shards over the world (ShardingPolicy's)."""

    def __init__(self, layout: BufferLayout, *, dtype: torch.dtype, device: torch.device,
                 shard_group, replicate_group=None, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None,
                 grad_dtype: torch.dtype | None = None, name: str = "buffer",
                 native_collectives: bool = False, divide_factor: float | None = None,
                 quantize_group: int | None = None, quantized: tuple = (), hpz_group=None,
                 quantize_format: str = "int8", rank_local: bool = False):
        self.layout = layout
        # What crosses the network (wire/): one format for the weights' gathers, one for the
        # gradients' reductions
        self.gather_format, self.reduce_format = wire.formats(
            layout, quantize_group, quantized, hpz_group, quantize_format)
        self._formats_to(device)
        self.name = name
        self.shard_group = shard_group
        self.device = torch.device(device)
        self.rank = dist.get_rank(shard_group)
        self.world_size = layout.world_size
        if dist.get_world_size(shard_group) != self.world_size:
            raise ValueError(f"{name}: layout is for {self.world_size} ranks, the shard group has "
                             f"{dist.get_world_size(shard_group)}")
        replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        S = layout.shard_size
        self.shard_size = S
        self.param_dtype = param_dtype or dtype
        self.comm = collectives.CommSettings(
            replicate_group, replicas, norm_group=None if rank_local else shard_group,
            reduce_dtype=reduce_dtype or self.param_dtype,
            native_requested=native_collectives, divide_factor=divide_factor)
        self.offloaded = None  # an OffloadState once move_master_to_host
        self.master = torch.zeros(S, dtype=dtype, device=device)
        self.grad = torch.zeros(S, dtype=dtype, device=device)
        self.release_grad()  # gradient storage exists only between backward and zero_grad
        # The full buffers' tensors are made when their storage is first needed (nothing
        # full-size is allocated at wrap time), then kept for life; see `_allocate`.
        self._full_bytes = self.world_size * S * self.param_dtype.itemsize
        self.full = None
        self.keep_full_storage = False  # FSDP2's set_keep_unsharded_storage: free_full keeps it
        self._full_views = None
        self.unreduced = UnreducedGrads(self, grad_dtype or self.param_dtype)
        if not self.is_meta:
            self._choose_collectives()
        self.local_ranges = _local_ranges(layout, self.rank)

    def _choose_collectives(self) -> None:
        """Native (the backend's) collectives or gloo's exchange, and how gradients are
        averaged: both depend on the backend that serves the storage's device."""
        self.comm.choose(self.shard_group, self.master, self.world_size,
                         self.reduce_format.sums_itself)

    def set_reduction(self, divide_factor: float | None, force_sum: bool) -> None:
        """What gradients are divided by (None: the ranks, the average) and whether every
        collective sums; takes effect from the next reduction."""
        self.comm.divide_factor = divide_factor
        self.comm.force_sum = force_sum
        if not self.is_meta:  # (a meta buffer chooses at allocate)
            self._choose_collectives()

    # -- deferred (meta-device) storage ---------------------------------------------------------

    @property
    def is_meta(self) -> bool:
        """Planned from shapes only: no storage yet (a model built on the meta device)."""
        return self.master.is_meta

    def allocate(self, device) -> None:
        """Give a meta buffer real storage on `device`: the master shard uninitialized (its
        tensors' ranges are for the caller to fill; the padding between them is zeroed, as the
        optimizer and the norm rely on), the gradient shard released as usual. Views made
        before (`master_view`) still point at meta: the caller re-points them."""
        if not self.is_meta:
            raise RuntimeError(f"{self.name}: already has storage on {self.device}")
        self.device = torch.device(device)
        self.master = torch.empty(self.shard_size, dtype=self.master.dtype, device=self.device)
        covered = sorted(r for r in self.local_ranges if r[1] > r[0])
        at = 0
        for start, end in covered + [(self.shard_size, self.shard_size)]:
            if start > at:
                self.master[at:start].zero_()
            at = max(at, end)
        # Never written before it is released: no page of it becomes resident.
        self.grad = torch.empty(self.shard_size, dtype=self.master.dtype, device=self.device)
        self.release_grad()
        self._choose_collectives()
        self._formats_to(self.device)

    def cast(self, dtype, param_dtype, reduce_dtype, grad_dtype) -> None:
        """FSDP2's `module.to(dtype)` after sharding, between steps (no full buffer, no
        gradient held): the master shard in `dtype`; the compute, reduction and unreduced
        gradient dtypes as the unit's policy derives them from it (its `buffer_dtypes`).
        The full buffers are made anew, in the new compute dtype, at the next unshard."""
        self.master = self.master.to(dtype)
        self.grad = torch.empty_like(self.master)
        self.release_grad()
        self.param_dtype, self.comm.reduce_dtype, self.unreduced.dtype = \
            param_dtype, reduce_dtype, grad_dtype
        self.full = self._full_views = None
        self._full_bytes = self.world_size * self.shard_size * param_dtype.itemsize
        if not self.is_meta:
            self._choose_collectives()

    def _formats_to(self, device) -> None:
        """The wire formats' index tensors where the storage is."""
        self.gather_format.to(device)
        self.reduce_format.to(device)

    # -- the master in host memory (ZeRO-Offload) -----------------------------------------------

    def move_master_to_host(self, host_master: torch.Tensor, host_grad: torch.Tensor, *,
                            compute_on_host: bool, host_compute: torch.Tensor | None = None,
                            staging: torch.Tensor | None = None, stats=None) -> None:
        """Make `host_master` (S elements of the master's dtype, in host memory) the master:
        the current value is copied into it and the device master is dropped. From now on
        all-gather sends a ComputeShard (compute_shard.py): on the device, or with
        `compute_on_host` on the host as well. The gradient shard becomes `host_grad` (S
        elements of the master's dtype in host memory, never resized: it belongs to the
        caller's allocation): each reduction copies its result there (the sharded parameters'
        `.grad` must be on their device) and no gradient shard stays on the device. `stats`:
        an object whose `bytes_to_host` / `bytes_to_device` get the bytes copied each way.
        The sharded parameters still view the old master: the caller re-points them
        (ShardedParameter.bind_storage)."""
        if self.offloaded is not None or self.is_meta:
            raise RuntimeError(f"{self.name}: the master is already on the host, or on meta")
        for tensor in (host_master, host_grad):
            if tensor.device.type != "cpu" or tensor.numel() != self.shard_size or \
                    tensor.dtype != self.master.dtype:
                raise ValueError(f"{self.name}: a host master and gradient need "
                                 f"{self.shard_size} CPU elements of {self.master.dtype} each")
        if self.has_grad:
            raise RuntimeError(f"{self.name}: holds a gradient; move the master before backward")
        with torch.no_grad():
            host_master.copy_(self.master)
        self.master = host_master
        self.grad = host_grad
        self.offloaded = OffloadState(ComputeShard(
            host_master, self.param_dtype, self.device, on_host=compute_on_host,
            host_tensor=host_compute, staging=staging, stats=stats), stats)

    @property
    def compute(self) -> ComputeShard | None:
        """What all-gather sends once the master is in host memory; None before."""
        return None if self.offloaded is None else self.offloaded.compute

    # -- views ---------------------------------------------------------------------------------

    def master_view(self, i: int) -> torch.Tensor:
        start, end = self.local_ranges[i]
        return self.master[start:end]

    def grad_view(self, i: int) -> torch.Tensor:
        start, end = self.local_ranges[i]
        return self.grad[start:end]

    def full_view(self, i: int) -> torch.Tensor:
        """Tensor i's full view of `full`: made once, while storage is there, then kept (it
        follows the storage as it is freed and given back)."""
        if self._full_views is None:
            assert self.is_unsharded, "full views are made while the buffer is unsharded"
            self._full_views = self.views_of(self.full)
        return self._full_views[i]

    def views_of(self, flat):
        """Views over `flat`'s storage with version counters of their own: refilling the buffer
        for backward restores exactly what forward saw, and autograd must not mistake the
        collective's write for a change to the tensors it saved. Made as normal tensors even
        inside torch.inference_mode (the first forward may be one): training uses them later."""
        views = []
        with torch.inference_mode(False):
            for p in self.layout.placements:
                view = torch.empty(0, dtype=flat.dtype, device=flat.device)
                view.set_(flat.untyped_storage(), flat.storage_offset() + p.offset,
                          p.spec.shape)
                views.append(view)
        return views

    def load_full_tensor(self, i: int, full: torch.Tensor) -> None:
        """Initialise this rank's piece of tensor i from its full value (wrap time only)."""
        p = self.layout.placements[i]
        start, end = self.local_ranges[i]
        if end > start:
            lo = self.rank * self.shard_size + start - p.offset
            self.master[start:end].copy_(full.detach().reshape(-1)[lo:lo + end - start])

    # -- all-gather ----------------------------------------------------------------------------

    @property
    def is_unsharded(self) -> bool:
        return _held(self.full) > 0

    @property
    def full_bytes_held(self) -> int:
        """Bytes of full-size storage this buffer holds now (parameters and gradients)."""
        return _held(self.full) + self.unreduced.bytes_held

    def _allocate(self, name: str) -> torch.Tensor:
        """Give `full` ("full") or the separate full gradient buffer ("full_grad", the
        unreduced gradients') its storage, making the tensor the first time. Every full-size
        allocation passes here: the memory benchmarks and tests sample it."""
        owner = self if name == "full" else self.unreduced
        tensor = getattr(owner, name)
        if tensor is None:
            dtype = self.param_dtype if name == "full" else self.unreduced.dtype
            with torch.inference_mode(False):  # kept for life: training uses it too
                tensor = torch.empty(self.world_size * self.shard_size, dtype=dtype,
                                     device=self.device)
            setattr(owner, name, tensor)
        elif tensor.untyped_storage().nbytes() != tensor.nbytes:  # (kept: resize_ moves it)
            tensor.untyped_storage().resize_(tensor.nbytes)
        return tensor

    def all_gather(self, async_op: bool = True, hpz_tag=None, backward: bool = False):
        """Gather every rank's shard into `full`, in place, in the buffer's gather format
        (wire/). With hpZ a forward gather given `hpz_tag` (its iteration) keeps this rank's
        secondary copy, and a `backward` gather of that iteration gathers the copies inside
        the hpZ group (what that forward computed with)."""
        self._allocate("full")
        return self.gather_format(self, async_op, hpz_tag, backward)

    def gather_input(self) -> torch.Tensor:
        """What this rank's gather sends, counted as one all-gather. With a lower compute
        dtype the master shard is cast straight into this rank's slot of `full` (one fused
        op), which is then the collective's input; otherwise the master shard is the input. A
        master in host memory sends its compute shard instead (refreshed first if the master
        changed)."""
        S = self.shard_size
        slot = self.full[self.rank * S:(self.rank + 1) * S]
        if self.offloaded is not None:
            source = self.offloaded.compute.gather_source(slot)
        elif self.param_dtype != self.master.dtype:
            slot.copy_(self.master)  # the cast to the compute dtype, not a staging copy
            source = slot
        else:
            source = self.master
        STATS.all_gathers += 1
        STATS.native += self.comm.native
        STATS.log("all_gather", self.name)
        return source

    def full_views(self) -> list:
        """Every tensor's full view (full_view), made now if they are not yet."""
        if self._full_views is None:
            self._full_views = self.views_of(self.full)
        return self._full_views

    @property
    def tiles(self):
        """The FP8 tiles the weights travel as (quantize.py's TileLayout); None if not."""
        return self.gather_format.tiles

    @property
    def secondary(self):
        """hpZ's copy of this rank's part of `full`; None without hpZ or before a gather."""
        return self.gather_format.secondary

    def fp8_tensor(self, index: int, weight: torch.Tensor):
        """Tensor `index`'s gathered FP8 values (rows x width, float8_e4m3fn), its tile scales
        (tile rows x width / 128) and rows per tile, while `weight` (its view of `full`) still
        holds what they were dequantized to; None otherwise (not gathered as FP8 tiles, the
        weight written since (its version counter is its full view's), or freed)."""
        return self.gather_format.fp8_tensor(index, weight)

    def free_full(self) -> None:
        if self.unreduced.reading_full:  # the in-flight reduce-scatter frees it when done
            return
        self.unreduced.in_full = False
        self.gather_format.forget()
        if self.full is not None and not self.keep_full_storage:
            self.full.untyped_storage().resize_(0)

    # -- the gradient shard ------------------------------------------------------------------

    @property
    def grad_on_host(self) -> bool:
        """The gradient shard is in host memory (an offloaded buffer)."""
        return self.offloaded is not None

    @property
    def has_grad(self) -> bool:
        if self.offloaded is not None:
            return self.offloaded.grad_live
        return self.grad.untyped_storage().nbytes() > 0

    def release_grad(self) -> None:
        if self.offloaded is not None:  # part of the offload's host allocation: it stays
            self.offloaded.grad_live = False
        else:
            self.grad.untyped_storage().resize_(0)

    def zero_grad_if_released(self) -> None:
        """Give a released gradient shard its storage back, zeroed (tensors without a
        gradient have zeros there), so one tensor's gradient can be added into it."""
        if self.has_grad:
            return
        if self.offloaded is not None:
            self.offloaded.wait_grad_copies()
            self.offloaded.grad_live = True
        else:
            self.grad.untyped_storage().resize_(self.grad.nbytes)
        self.grad.zero_()

    def wait_grad_copies(self) -> None:
        """The last asynchronous copy of a reduction into the host gradient shard is done."""
        if self.offloaded is not None:
            self.offloaded.wait_grad_copies()

    def reduce_scatter(self, accumulate: bool, all_reduce: bool = True) -> "PendingReduction":
        """Reduce the full gradients into the local gradient shard, in place, averaged over the
        data parallel ranks (`comm.reduction` says how); with `accumulate`, add to what the
        shard already holds. Returns the pending reduction, to be finished later. HSDP with
        `all_reduce` False: the reduce-scatter's output is added to `unreduced.partial`
        instead, and the gradient shard is left alone (the next reduction with the all-reduce
        takes it)."""
        comm = self.comm
        defer = comm.replicate_group is not None and not all_reduce
        source = self.unreduced.source(comm.reduce_dtype)
        if comm.reduction.pre_divide != 1.0:  # fp16: keep the sum over ranks finite
            source.div_(comm.reduction.pre_divide)  # in place: the source is dead after this
        if not accumulate and not self.has_grad and not defer:
            if self.offloaded is not None:
                self.offloaded.grad_live = True
            else:
                self.grad.untyped_storage().resize_(self.grad.nbytes)  # fully overwritten below
        direct = not accumulate and not defer and comm.reduce_dtype == self.grad.dtype and \
            self.offloaded is None
        out = self.grad if direct else torch.empty(self.shard_size, dtype=comm.reduce_dtype,
                                                   device=self.device)
        STATS.reduce_scatters += 1
        STATS.native += comm.native
        STATS.log("reduce_scatter", self.name)
        work = self.reduce_format(self, out, source)
        return PendingReduction(self, TimedWork(work, self.device), out, accumulate, direct,
                                source, deferred=defer)

    # -- fused group operations ----------------------------------------------------------------

    def scale_grad(self, factor) -> None:
        """Multiply the gradient shard by `factor` (a number or a 0-d tensor)."""
        if self.has_grad:
            if isinstance(factor, torch.Tensor) and factor.device != self.grad.device:
                factor = factor.to(self.grad.device)  # a host gradient shard (offload)
            self.grad.mul_(factor)


class PendingReduction:
    """A buffer's gradient reduction in flight, finished in two stages so that the replicas'
    all-reduce (HSDP) runs while compute goes on instead of on the compute path:

    `wait_reduce_scatter()`: the reduce-scatter is done; free the full gradients it read, and
    issue the all-reduce over the replicas asynchronously. `finish()`: wait for that too, divide
    what is left of the average, and put the result into (or add it to) the gradient shard."""

    def __init__(self, buffer: DBuffer, work, out: torch.Tensor, accumulate: bool,
                 direct: bool, source: torch.Tensor | None = None, deferred: bool = False):
        self.buffer = buffer
        self.work = work
        # The collective's input lives until it is done, whatever the backend keeps (NCCL and
        # the gloo exchange keep it; the fake process group does not): the same memory on all.
        self.source = source
        self.out = out
        self.accumulate = accumulate
        self.direct = direct
        self.all_reduce = None
        self.finished = False
        self.deferred = deferred  # HSDP without the all-reduce: into unreduced.partial only

    @property
    def all_reducing(self) -> bool:
        """Whether the replicas' all-reduce is in flight (issued, not finished)."""
        return self.all_reduce is not None

    def wait_reduce_scatter(self) -> None:
        if self.work is None:
            return
        self.work.wait()
        self.work = self.source = None
        buf, unreduced = self.buffer, self.buffer.unreduced
        unreduced.free_source()
        if self.deferred:  # summed with the other skipped micro-steps', reduced later
            unreduced.partial = self.out if unreduced.partial is None else \
                unreduced.partial.add_(self.out)
            return
        if unreduced.partial is not None:
            self.out.add_(unreduced.partial)
            unreduced.partial = None
        if buf.comm.replicate_group is not None:
            STATS.all_reduces += 1
            STATS.log("all_reduce", buf.name)
            work = dist.all_reduce(self.out, op=buf.comm.reduction.all_reduce_op,
                                   group=buf.comm.replicate_group, async_op=True)
            self.all_reduce = TimedWork(work, buf.device)

    def discard(self) -> None:
        """Wait for the collectives in flight, keep nothing of their result."""
        if self.work is not None:
            self.work.wait()
            self.work = self.source = None
            self.buffer.unreduced.free_source()
        if self.all_reduce is not None:
            self.all_reduce.wait()
            self.all_reduce = None
        self.finished = True

    def finish(self) -> None:
        if self.finished:
            return
        self.wait_reduce_scatter()
        if self.deferred:
            self.finished = True
            return
        if self.all_reduce is not None:
            self.all_reduce.wait()
            self.all_reduce = None
        buf, out = self.buffer, self.out
        if buf.comm.reduction.post_divide != 1.0:
            out.div_(buf.comm.reduction.post_divide)
        if buf.offloaded is not None:
            buf.offloaded.receive(buf.grad, out, self.accumulate)
        elif self.accumulate:
            buf.grad.add_(out)
        elif not self.direct:
            buf.grad.copy_(out)  # a staging copy: only when reduce and master dtypes differ
            STATS.bytes_copied += out.numel() * out.element_size()
        STATS.log("reduced", buf.name)
        self.finished = True

"""DBuffer: the flat distributed buffer that one planner layout describes.

Every parameter of the layout is a view of it: its piece of the rank's fp32 master shard
(between steps), its full tensor in the compute dtype (while unsharded), its piece of the local
gradient shard, and its full gradient (during backward). All-gather writes straight into the
full buffer from the local shard and reduce-scatter reads straight from the full gradient buffer
into the local shard: no copy-in, no copy-out, one collective per buffer. Full buffers keep their
tensor objects for life and only their storage is allocated and freed (`resize_`), so parameter
views and tensors saved by autograd stay valid; no `record_stream` is ever needed. What the
collectives send (the weights as they are, int8 groups, FP8 tiles; hpZ's secondary gather) is
the buffer's wire formats (wire/), chosen once, in `_wire_formats`.

Must not know about modules or config.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan.planner import BufferLayout
from . import collectives
from .compute_shard import ComputeShard
from .quantize import GroupLayout
from .stats import STATS, TimedWork
from .wire import Fp8TileGather, HpzGather, Int8Gather, Int8Reduce, PlainGather, PlainReduce

__all__ = ["DBuffer", "PendingReduction"]


def _held(tensor) -> int:
    return 0 if tensor is None else tensor.untyped_storage().nbytes()


class DBuffer:
    """Storage for one buffer layout on one rank.

    `master` (S elements, the parameters' dtype) and `grad` (S elements) persist; `full`
    (world_size * S elements, the compute dtype) and `full_grad` (as many, `grad_dtype`: the
    compute dtype, or a wider reduce dtype that gradients are accumulated in) hold storage only
    while unsharded and during backward (and are None until first needed).
    """

    def __init__(self, layout: BufferLayout, *, dtype: torch.dtype, device: torch.device,
                 shard_group, replicate_group=None, param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None,
                 grad_dtype: torch.dtype | None = None, name: str = "buffer",
                 native_collectives: bool = False, divide_factor: float | None = None,
                 quantize_group: int | None = None, quantized: tuple = (), hpz_group=None,
                 quantize_format: str = "int8"):
        self.layout = layout
        self.hpz_group = hpz_group
        # What crosses the network (wire/): one format for the weights' gathers, one for the
        # gradients' reductions
        self.gather_format, self.reduce_format = self._wire_formats(
            layout, quantize_group, quantized, hpz_group, quantize_format)
        # fully_shard(fp8_matmul=True): a gather format with an FP8 form keeps the last
        # gather's (fp8_tensor) for the Linears that compute from it (fsdp/fp8_linear.py)
        self.keep_fp8 = False
        self._formats_to(device)
        self.name = name
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        # The group over which the gradient norm sums this buffer's shards: its shard group,
        # unless other groups hold different tensors under the same layout (DeepSpeed MoE
        # experts: set to None, the world, which spans every expert-parallel rank's experts)
        self.norm_group = shard_group
        self.device = torch.device(device)
        self.rank = dist.get_rank(shard_group)
        self.world_size = layout.world_size
        if dist.get_world_size(shard_group) != self.world_size:
            raise ValueError(f"{name}: layout is for {self.world_size} ranks, the shard group has "
                             f"{dist.get_world_size(shard_group)}")
        replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.data_parallel_size = self.world_size * replicas
        S = layout.shard_size
        self.shard_size = S
        self.param_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.grad_dtype = grad_dtype or self.param_dtype  # full_grad's
        self._native_requested = native_collectives
        self._replicas = replicas
        self.divide_factor = divide_factor  # None: the average over shard group x replicas
        self.force_sum = False  # SUM collectives and one divide after (set_force_sum)
        # HSDP micro-steps that skip the replicas' all-reduce (FSDP2's set_requires_all_reduce
        # False): the sum of their reduce-scatter outputs, all-reduced with the next one's
        self.partial = None
        # set by move_master_to_host (ZeRO-Offload): what all-gather sends, the host gradient
        # shard's state and the offload's byte counters
        self.compute = None
        self._host_grad_live = False
        self._grad_copied = None
        self.offload_stats = None
        self.master = torch.zeros(S, dtype=dtype, device=device)
        self.grad = torch.zeros(S, dtype=dtype, device=device)
        self._grad_bytes = S * dtype.itemsize
        self.release_grad()  # gradient storage exists only between backward and zero_grad
        # The full buffers' tensors are made when their storage is first needed (nothing
        # full-size is allocated at wrap time), then kept for life; see `_allocate`.
        self._full_bytes = self.world_size * S * self.param_dtype.itemsize
        self._full_grad_bytes = self.world_size * S * self.grad_dtype.itemsize
        self.full = self.full_grad = None
        self.keep_full_storage = False  # FSDP2's set_keep_unsharded_storage: free_full keeps it
        self.full_grad_live = False   # holds gradients not yet reduced (no_sync accumulation)
        # Gradients in place of the parameters: this backward writes each tensor's gradient
        # over its own full parameter once that value is dead (see `begin_backward`).
        self.grads_in_full = False
        self._grad_written = []
        self._deferred = {}  # tensor index -> its gradient held aside (grad_arrived)
        self._early = {}     # tensor index -> [gradients that came before backward began]
        self._wide = {}      # tensor index -> its gradient kept wider (keep_wide_grad)
        self._reducing_full = False   # a reduce-scatter reads `full`: keep its storage
        self._full_views = self._full_grad_views = self._full_as_grad_views = None
        self.native = self.reduction = None
        if not self.is_meta:
            self._choose_collectives()
        lo = self.rank * S
        # Per tensor: (start, end) of its local piece inside the shard, and its full view range.
        self.local_ranges = []
        for p in layout.placements:
            start = min(max(p.offset, lo), lo + S) - lo
            end = max(min(p.offset + p.numel, lo + S), lo) - lo
            self.local_ranges.append((start, max(start, end)))

    @staticmethod
    def _wire_formats(layout, quantize_group, quantized, hpz_group, quantize_format):
        """The buffer's gather and reduce formats, from its constructor's arguments: ZeRO++'s
        int8 groups of `quantize_group` elements for the weights ("weights" in `quantized`)
        and the gradients ("gradients"); FP8 weights ("fp8_e4m3": matrices of whole-row
        blocks by FP8 tiles, every other tensor by int8 groups; gradients stay int8); hpZ's
        secondary gather inside `hpz_group` around the weights' format. The one place that
        knows the formats."""
        groups = GroupLayout(layout, quantize_group) if quantized else None
        if "weights" not in quantized:
            gather = PlainGather()
        elif quantize_format == "fp8_e4m3":
            gather = Fp8TileGather(layout, quantize_group)
        else:
            gather = Int8Gather(groups)
        if hpz_group is not None:
            gather = HpzGather(gather, hpz_group)
        reduce = Int8Reduce(groups) if "gradients" in quantized else PlainReduce()
        return gather, reduce

    def _choose_collectives(self) -> None:
        """Native (the backend's) collectives or gloo's exchange, and how gradients are
        averaged: both depend on the backend that serves the storage's device."""
        self.native = not collectives.uses_exchange(self.shard_group, self.master,
                                                    native=self._native_requested)
        self.reduction = collectives.gradient_reduction(
            self.reduce_dtype, self.world_size, self._replicas,
            collectives.tensor_backend(self.shard_group, self.master),
            None if self.replicate_group is None else
            collectives.tensor_backend(self.replicate_group, self.master),
            exchange=not self.native or self.reduce_format.sums_itself,
            divide_factor=self.divide_factor,
            force_sum=self.force_sum)

    def set_reduction(self, divide_factor: float | None, force_sum: bool) -> None:
        """What gradients are divided by (None: the ranks, the average) and whether every
        collective sums; takes effect from the next reduction."""
        self.divide_factor = divide_factor
        self.force_sum = force_sum
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
        if self.compute is not None or self.is_meta:
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
        self.offload_stats = stats
        self.compute = ComputeShard(host_master, self.param_dtype, self.device,
                                    on_host=compute_on_host, host_tensor=host_compute,
                                    staging=staging, stats=stats)

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
            self._full_views = self._views(self.full)
        return self._full_views[i]

    def full_grad_view(self, i: int) -> torch.Tensor:
        if self._full_grad_views is None:
            assert self.full_grad_live, "gradient views are made during backward"
            self._full_grad_views = self._views(self.full_grad)
        return self._full_grad_views[i]

    def _views(self, flat):
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
        return _held(self.full) + self.full_grad_bytes_held

    @property
    def full_grad_bytes_held(self) -> int:
        """Bytes held by the separate full gradient buffer (no_sync, grads_in_place=False)."""
        return _held(self.full_grad)

    def _allocate(self, name: str) -> torch.Tensor:
        """Give `full` or `full_grad` its storage, making the tensor the first time."""
        tensor = getattr(self, name)
        if tensor is None:
            dtype = self.param_dtype if name == "full" else self.grad_dtype
            with torch.inference_mode(False):  # kept for life: training uses it too
                tensor = torch.empty(self.world_size * self.shard_size, dtype=dtype,
                                     device=self.device)
            setattr(self, name, tensor)
        else:
            nbytes = self._full_bytes if name == "full" else self._full_grad_bytes
            if tensor.untyped_storage().nbytes() != nbytes:  # (kept: resize_ would move it)
                tensor.untyped_storage().resize_(nbytes)
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
        if self.compute is not None:
            source = self.compute.gather_source(slot)
        elif self.param_dtype != self.master.dtype:
            slot.copy_(self.master)  # the cast to the compute dtype, not a staging copy
            source = slot
        else:
            source = self.master
        STATS.all_gathers += 1
        STATS.native += self.native
        STATS.log("all_gather", self.name)
        return source

    def full_views(self) -> list:
        """Every tensor's full view (full_view), made now if they are not yet."""
        if self._full_views is None:
            self._full_views = self._views(self.full)
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
        if self._reducing_full:  # the in-flight reduce-scatter frees it when it finishes
            return
        self.grads_in_full = False
        self.gather_format.forget()
        if self.full is not None and not self.keep_full_storage:
            self.full.untyped_storage().resize_(0)

    # -- gradients -----------------------------------------------------------------------------

    def begin_backward(self, grads_in_place: bool) -> None:
        """Choose where this backward's full gradients go.

        In place (when no unreduced gradients are kept from an earlier micro-step): into the
        full parameter buffer itself. A parameter's full value is dead once its own gradient is
        complete, so the caller zeroes each tensor's range right then (`grad_arrived`) and
        autograd adds the gradient there; the reduce-scatter then reads `full`. One full-size
        buffer per unit instead of two (a gradient that arrives wider than `full` holds it and
        should stay so is kept aside: `keep_wide_grad`). Otherwise: a separate zeroed
        `full_grad` buffer (in `grad_dtype`), kept across `no_sync` micro-steps."""
        self._wide = {}
        self._early = {}
        if grads_in_place and not self.full_grad_live:
            self.grads_in_full = True
            self._grad_written = [False] * len(self.layout.placements)
            self._deferred = {}
        elif not self.full_grad_live:
            self._allocate("full_grad").zero_()
            self.full_grad_live = True

    def keep_grads_unreduced(self) -> None:
        """`no_sync` began after this backward put gradients in place (entered from a hook
        mid-backward): move them to the separate buffer that outlives the micro-step, since
        `full` is freed at reshard. A copy, on this path only."""
        if self.grads_in_full:
            self._zero_unwritten()
            self._allocate("full_grad").copy_(self.full)
            self._write_wide(self.full_grad)
            STATS.bytes_copied += self._full_bytes
            self.full_grad_live = True
            self.grads_in_full = False

    def backward_grad_view(self, i: int) -> torch.Tensor:
        """The full-shape tensor autograd accumulates tensor i's gradient into."""
        if not self.grads_in_full:
            return self.full_grad_view(i)
        if self._full_as_grad_views is None:
            self._full_as_grad_views = self._views(self.full)
        return self._full_as_grad_views[i]

    def grad_arrived(self, i: int, unsharded: torch.Tensor, defer: bool = False) -> None:
        """Tensor i's gradient is complete and about to be added into its range: zero that
        range through `unsharded` (the parameter autograd saw), whose version counter moves, so
        a backward node that still wanted the old value fails loudly instead of reading zeros.
        `defer`: the value may still be read after this (the gradient came from a nested
        backward, and another recomputation may follow): autograd adds into a tensor aside
        instead, copied into the range by `flush_deferred_grads`."""
        if not self.grads_in_full:
            return
        if defer:
            if self._grad_written[i]:  # zeroed already, and now recomputed from the zeros
                raise RuntimeError(
                    f"{self.name}: tensor {self.layout.placements[i].name}'s gradient arrived "
                    "again, from a reentrant checkpoint's recomputation, after it was written "
                    "over the parameter; shard this module with grads_in_place=False")
            if i not in self._deferred:
                self._deferred[i] = unsharded.grad = torch.zeros_like(unsharded.grad)
            return
        if not self._grad_written[i]:
            with torch.no_grad():
                unsharded.zero_()
            self._grad_written[i] = True

    def keep_wide_grad(self, i: int, grad: torch.Tensor, slot: torch.Tensor) -> None:
        """Tensor i's gradient, about to be added into its range of `full` (in the compute
        dtype, so rounded), is kept in `grad_dtype` too, summed with its earlier arrivals (what
        `slot`, the range autograd adds into, holds now); the reduction reads the kept sum
        instead of the range (torch 2.15's FSDP2 keeps such gradients wide)."""
        grad = getattr(grad, "_local_tensor", grad).detach()
        kept = self._wide.get(i)
        if kept is None:
            kept = getattr(slot, "_local_tensor", slot).detach().to(self.grad_dtype)
        self._wide[i] = kept + grad

    def keeps_wide(self, i: int) -> bool:
        return i in self._wide

    def _write_wide(self, target: torch.Tensor) -> None:
        """The gradients kept wide into their ranges of `target` (the reduction's source)."""
        for i, grad in self._wide.items():
            p = self.layout.placements[i]
            target[p.offset:p.offset + p.numel].copy_(grad.reshape(-1))
        self._wide = {}

    def add_early_grad(self, i: int, grad: torch.Tensor, keep_wide: bool = False) -> None:
        """Tensor i's gradient that autograd put in its `.grad` before this backward began
        (the parameter was used outside its unit's forward: a head called after the forward,
        a loss over several backwards), which would be lost when `.grad` becomes the slot.
        Added into the separate gradient buffer now; in place, the range still holds the
        parameter until the unit's backward is over, so it waits for `flush_deferred_grads`.
        `keep_wide`: one wider than the compute dtype is summed wide (keep_wide_grad)."""
        grad = getattr(grad, "_local_tensor", grad).detach()
        if not self.grads_in_full:
            self.full_grad_view(i).add_(grad)
            return
        self._early.setdefault(i, []).append((grad, keep_wide and grad.dtype != self.param_dtype))

    def flush_deferred_grads(self) -> None:
        """The gradients `grad_arrived` held aside go into their ranges (no value is read any
        more: the unit's backward is over), then those that came before it began are added."""
        for i, grad in self._deferred.items():
            self.backward_grad_view(i).copy_(getattr(grad, "_local_tensor", grad))
            self._grad_written[i] = True
        self._deferred = {}
        for i, grads in self._early.items():
            view = self.backward_grad_view(i)
            if not self._grad_written[i]:  # nothing else came: the range is still the value
                view.zero_()
                self._grad_written[i] = True
            for grad, wide in grads:
                if wide or i in self._wide:  # the reduction reads the wide sum, not the range
                    self.keep_wide_grad(i, grad, view)
                else:
                    view.add_(grad)
        self._early = {}

    @property
    def grad_on_host(self) -> bool:
        """The gradient shard is in host memory (an offloaded buffer)."""
        return self.compute is not None

    @property
    def has_grad(self) -> bool:
        if self.grad_on_host:
            return self._host_grad_live
        return self.grad.untyped_storage().nbytes() > 0

    def release_grad(self) -> None:
        if self.grad_on_host:  # part of the offload's host allocation: it stays
            self._host_grad_live = False
        else:
            self.grad.untyped_storage().resize_(0)

    def zero_grad_if_released(self) -> None:
        """Give a released gradient shard its storage back, zeroed (tensors without a
        gradient have zeros there), so one tensor's gradient can be added into it."""
        if self.has_grad:
            return
        if self.grad_on_host:
            self.wait_grad_copies()
            self._host_grad_live = True
        else:
            self.grad.untyped_storage().resize_(self._grad_bytes)
        self.grad.zero_()

    def wait_grad_copies(self) -> None:
        """The last asynchronous copy of a reduction into the host gradient shard is done."""
        if self._grad_copied is not None:
            self._grad_copied.synchronize()
            self._grad_copied = None

    def reduce_scatter(self, accumulate: bool, all_reduce: bool = True) -> "PendingReduction":
        """Reduce the full gradients into the local gradient shard, in place, averaged over the
        data parallel ranks (`self.reduction` says how); with `accumulate`, add to what the
        shard already holds. Returns the pending reduction, to be finished later. HSDP with
        `all_reduce` False: the reduce-scatter's output is added to `partial` instead, and
        the gradient shard is left alone (the next reduction with the all-reduce takes it)."""
        defer = self.replicate_group is not None and not all_reduce
        source = self.full_grad
        if self.grads_in_full:
            self._zero_unwritten()
            source = self.full
        if self.reduce_dtype != source.dtype:
            source = source.to(self.reduce_dtype)  # the one fused cast of the buffer
            self._write_wide(source)
        elif source is self.full:
            self._reducing_full = True  # read in flight: reshard leaves `full` to the reduction
        if self.reduction.pre_divide != 1.0:  # fp16: keep the sum over ranks finite
            source.div_(self.reduction.pre_divide)  # in place: the source is dead after this
        if not accumulate and not self.has_grad and not defer:
            if self.grad_on_host:
                self._host_grad_live = True
            else:
                self.grad.untyped_storage().resize_(self._grad_bytes)  # fully overwritten below
        direct = not accumulate and not defer and self.reduce_dtype == self.grad.dtype and \
            not self.grad_on_host
        out = self.grad if direct else torch.empty(self.shard_size, dtype=self.reduce_dtype,
                                                   device=self.device)
        STATS.reduce_scatters += 1
        STATS.native += self.native
        STATS.log("reduce_scatter", self.name)
        work = self.reduce_format(self, out, source)
        return PendingReduction(self, TimedWork(work, self.device), out, accumulate, direct,
                                source, deferred=defer)

    def _free_reduced_source(self) -> None:
        if self._reducing_full:
            self._reducing_full = False
            self.free_full()
        else:
            self.drop_full_grad()

    def _zero_unwritten(self) -> None:
        """Ranges of `full` that received no gradient (frozen tensors, unused experts) still
        hold parameter values: make them zero gradients. Padding is zero already."""
        for i, written in enumerate(self._grad_written):
            if not written:
                p = self.layout.placements[i]
                self.full[p.offset:p.offset + p.numel].zero_()

    def discard_unreduced(self) -> None:
        """Forget gradients not yet in the gradient shard (FSDP2's reset_iter_state): the
        no_sync accumulation, the HSDP partial sum, this backward's gradients in `full`."""
        self.drop_full_grad()
        self.partial = None
        self._deferred = {}
        self._early = {}
        self._wide = {}
        self._reducing_full = False
        self.free_full()

    def drop_full_grad(self) -> None:
        """Free the separate full gradient buffer (after its reduce-scatter, or at teardown)."""
        if self.full_grad is not None:
            self.full_grad.untyped_storage().resize_(0)
        self.full_grad_live = False

    # -- fused group operations ----------------------------------------------------------------

    def scale_grad(self, factor) -> None:
        """Multiply the gradient shard by `factor` (a number or a 0-d tensor)."""
        if self.has_grad:
            if isinstance(factor, torch.Tensor) and factor.device != self.grad.device:
                factor = factor.to(self.grad.device)  # a host gradient shard (offload)
            self.grad.mul_(factor)

    def device_state(self) -> list:
        """[(name, tensor)] of the shard tensors this buffer holds on its device now (the
        master, a compute-dtype shard where there is one, the gradient, hpZ's secondary
        copy): what engine/colocation.py moves off the device and back. Full buffers are not
        among them."""
        if self.compute is not None:  # offloaded: master and gradient are in host memory
            held = [] if self.compute.on_host else [("compute", self.compute.tensor)]
        else:
            held = [("master", self.master), ("grad", self.grad)]
        held += self.gather_format.held()  # (hpZ's secondary copy)
        return [(name, t) for name, t in held if isinstance(t, torch.Tensor) and
                t.device.type == self.device.type and _held(t) > 0]


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
        self.deferred = deferred  # HSDP without the all-reduce: into buffer.partial only

    @property
    def all_reducing(self) -> bool:
        """Whether the replicas' all-reduce is in flight (issued, not finished)."""
        return self.all_reduce is not None

    def wait_reduce_scatter(self) -> None:
        if self.work is None:
            return
        self.work.wait()
        self.work = self.source = None
        buf = self.buffer
        buf._free_reduced_source()
        if self.deferred:  # summed with the other skipped micro-steps', reduced later
            buf.partial = self.out if buf.partial is None else buf.partial.add_(self.out)
            return
        if buf.partial is not None:
            self.out.add_(buf.partial)
            buf.partial = None
        if buf.replicate_group is not None:
            STATS.all_reduces += 1
            STATS.log("all_reduce", buf.name)
            work = dist.all_reduce(self.out, op=buf.reduction.all_reduce_op,
                                   group=buf.replicate_group, async_op=True)
            self.all_reduce = TimedWork(work, buf.device)

    def discard(self) -> None:
        """Wait for the collectives in flight, keep nothing of their result."""
        if self.work is not None:
            self.work.wait()
            self.work = self.source = None
            self.buffer._free_reduced_source()
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
        if buf.reduction.post_divide != 1.0:
            out.div_(buf.reduction.post_divide)
        if buf.grad_on_host:
            self._to_host_grad()
        elif self.accumulate:
            buf.grad.add_(out)
        elif not self.direct:
            buf.grad.copy_(out)  # a staging copy: only when reduce and master dtypes differ
            STATS.bytes_copied += out.numel() * out.element_size()
        STATS.log("reduced", buf.name)
        self.finished = True

    def _to_host_grad(self) -> None:
        """The reduced shard into the host gradient shard (an offloaded buffer): cast to its
        dtype on the device, then one copy (asynchronous into pinned memory: the step waits,
        `wait_grad_copies`); added there when accumulating."""
        buf, out = self.buffer, self.out
        if out.dtype != buf.grad.dtype:
            out = out.to(buf.grad.dtype)
        if self.accumulate:  # the sum needs the values on the host now
            buf.wait_grad_copies()
            buf.grad.add_(out.to(buf.grad.device))
        else:
            pinned = buf.grad.is_pinned() and out.device.type != "cpu"
            buf.grad.copy_(out, non_blocking=pinned)
            if pinned:
                buf._grad_copied = torch.Event(device=out.device)
                buf._grad_copied.record()
        if buf.offload_stats is not None:
            buf.offload_stats.bytes_to_host += out.numel() * out.element_size()


"""UnreducedGrads: a DBuffer's gradients from autograd until its reduction takes them.

A backward's full gradients go either over the full parameters themselves (`in_full`: a
tensor's range is zeroed once its value is dead and autograd adds its gradient there, so a
unit needs one full-size buffer instead of two) or into a separate zeroed full gradient
buffer (`full_grad`, which outlives no_sync micro-steps). Around them: gradients held aside
until their range may be written (a nested backward's, those that came before backward
began), gradients kept wider than the compute dtype, and HSDP's sum of reduce-scatter outputs
not yet all-reduced (`partial`). DBuffer.reduce_scatter reads what `source` gives.

Must not know about modules or config.
"""
from __future__ import annotations

import torch

from .stats import STATS

__all__ = ["UnreducedGrads"]


class UnreducedGrads:
    """The gradients of one DBuffer (`buffer`) not yet in its gradient shard. The storage
    comes from the buffer: `full`, and `full_grad` through DBuffer._allocate, which every
    full-size allocation passes (the memory benchmarks sample it)."""

    def __init__(self, buffer, dtype: torch.dtype):
        self.buffer = buffer
        self.dtype = dtype  # full_grad's: the compute dtype, or a wider reduce dtype
        self.full_grad = None  # made when first needed, then kept for life
        self.live = False  # full_grad holds gradients not yet reduced (no_sync accumulation)
        self.in_full = False  # this backward writes the gradients over `full`
        self.reading_full = False  # a reduce-scatter reads `full`: keep its storage
        # HSDP micro-steps that skip the replicas' all-reduce (FSDP2's set_requires_all_reduce
        # False): the sum of their reduce-scatter outputs, all-reduced with the next one's
        self.partial = None
        self._written = []   # per tensor: its range of `full` holds a gradient, no value
        self._deferred = {}  # tensor index -> its gradient held aside (grad_arrived)
        self._early = {}     # tensor index -> [gradients that came before backward began]
        self._wide = {}      # tensor index -> its gradient kept wider (keep_wide_grad)
        self._views = self._in_full_views = None

    @property
    def bytes_held(self) -> int:
        """Bytes held by the separate full gradient buffer (no_sync, grads_in_place=False)."""
        return 0 if self.full_grad is None else self.full_grad.untyped_storage().nbytes()

    def begin_backward(self, grads_in_place: bool) -> None:
        """Choose where this backward's full gradients go.

        In place (when no unreduced gradients are kept from an earlier micro-step): into the
        full parameter buffer itself. A parameter's full value is dead once its own gradient is
        complete, so the caller zeroes each tensor's range right then (`grad_arrived`) and
        autograd adds the gradient there; the reduce-scatter then reads `full`. One full-size
        buffer per unit instead of two (a gradient that arrives wider than `full` holds it and
        should stay so is kept aside: `keep_wide_grad`). Otherwise: a separate zeroed
        `full_grad` buffer (in `dtype`), kept across `no_sync` micro-steps."""
        self._wide = {}
        self._early = {}
        if grads_in_place and not self.live:
            self.in_full = True
            self._written = [False] * len(self.buffer.layout.placements)
            self._deferred = {}
        elif not self.live:
            self.buffer._allocate("full_grad").zero_()
            self.live = True

    def move_to_full_grad(self) -> None:
        """`no_sync` began after this backward put gradients in place (entered from a hook
        mid-backward): move them to the separate buffer that outlives the micro-step, since
        `full` is freed at reshard. A copy, on this path only."""
        if self.in_full:
            buf = self.buffer
            self._zero_unwritten()
            buf._allocate("full_grad").copy_(buf.full)
            self._write_wide(self.full_grad)
            STATS.bytes_copied += buf._full_bytes
            self.live = True
            self.in_full = False

    def backward_grad_view(self, i: int) -> torch.Tensor:
        """The full-shape tensor autograd accumulates tensor i's gradient into."""
        if not self.in_full:
            return self._full_grad_view(i)
        if self._in_full_views is None:
            self._in_full_views = self.buffer.views_of(self.buffer.full)
        return self._in_full_views[i]

    def _full_grad_view(self, i: int) -> torch.Tensor:
        if self._views is None:
            assert self.live, "gradient views are made during backward"
            self._views = self.buffer.views_of(self.full_grad)
        return self._views[i]

    def grad_arrived(self, i: int, unsharded: torch.Tensor, defer: bool = False) -> None:
        """Tensor i's gradient is complete and about to be added into its range: zero that
        range through `unsharded` (the parameter autograd saw), whose version counter moves, so
        a backward node that still wanted the old value fails loudly instead of reading zeros.
        `defer`: the value may still be read after this (the gradient came from a nested
        backward, and another recomputation may follow): autograd adds into a tensor aside
        instead, copied into the range by `flush_deferred_grads`."""
        if not self.in_full:
            return
        if defer:
            if self._written[i]:  # zeroed already, and now recomputed from the zeros
                raise RuntimeError(
                    f"{self.buffer.name}: tensor {self.buffer.layout.placements[i].name}'s "
                    "gradient arrived again, from a reentrant checkpoint's recomputation, after "
                    "it was written over the parameter; shard this module with "
                    "grads_in_place=False")
            if i not in self._deferred:
                self._deferred[i] = unsharded.grad = torch.zeros_like(unsharded.grad)
            return
        if not self._written[i]:
            with torch.no_grad():
                unsharded.zero_()
            self._written[i] = True

    def keep_wide_grad(self, i: int, grad: torch.Tensor, slot: torch.Tensor) -> None:
        """Tensor i's gradient, about to be added into its range of `full` (in the compute
        dtype, so rounded), is kept in `dtype` too, summed with its earlier arrivals (what
        `slot`, the range autograd adds into, holds now); the reduction reads the kept sum
        instead of the range (torch 2.15's FSDP2 keeps such gradients wide)."""
        grad = getattr(grad, "_local_tensor", grad).detach()
        kept = self._wide.get(i)
        if kept is None:
            kept = getattr(slot, "_local_tensor", slot).detach().to(self.dtype)
        self._wide[i] = kept + grad

    def keeps_wide(self, i: int) -> bool:
        return i in self._wide

    def _write_wide(self, target: torch.Tensor) -> None:
        """The gradients kept wide into their ranges of `target` (the reduction's source)."""
        for i, grad in self._wide.items():
            p = self.buffer.layout.placements[i]
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
        if not self.in_full:
            self._full_grad_view(i).add_(grad)
            return
        wide = keep_wide and grad.dtype != self.buffer.param_dtype
        self._early.setdefault(i, []).append((grad, wide))

    def flush_deferred_grads(self) -> None:
        """The gradients `grad_arrived` held aside go into their ranges (no value is read any
        more: the unit's backward is over), then those that came before it began are added."""
        for i, grad in self._deferred.items():
            self.backward_grad_view(i).copy_(getattr(grad, "_local_tensor", grad))
            self._written[i] = True
        self._deferred = {}
        for i, grads in self._early.items():
            view = self.backward_grad_view(i)
            if not self._written[i]:  # nothing else came: the range is still the value
                view.zero_()
                self._written[i] = True
            for grad, wide in grads:
                if wide or i in self._wide:  # the reduction reads the wide sum, not the range
                    self.keep_wide_grad(i, grad, view)
                else:
                    view.add_(grad)
        self._early = {}

    def _zero_unwritten(self) -> None:
        """Ranges of `full` that received no gradient (frozen tensors, unused experts) still
        hold parameter values: make them zero gradients. Padding is zero already."""
        full = self.buffer.full
        for i, written in enumerate(self._written):
            if not written:
                p = self.buffer.layout.placements[i]
                full[p.offset:p.offset + p.numel].zero_()

    # -- the reduction's side ------------------------------------------------------------------

    def source(self, reduce_dtype: torch.dtype) -> torch.Tensor:
        """What the reduce-scatter reads, in `reduce_dtype`: `full_grad`, or `full` with the
        ranges no gradient reached zeroed; cast where the dtypes differ (the one fused cast of
        the buffer), with the gradients kept wide written into the cast. Read in place,
        `full` keeps its storage until `free_source`."""
        buf = self.buffer
        source = self.full_grad
        if self.in_full:
            self._zero_unwritten()
            source = buf.full
        if reduce_dtype != source.dtype:
            source = source.to(reduce_dtype)
            self._write_wide(source)
        elif source is buf.full:
            self.reading_full = True  # read in flight: reshard leaves `full` to the reduction
        return source

    def free_source(self) -> None:
        """The reduce-scatter read its source: free the full buffer it came from."""
        if self.reading_full:
            self.reading_full = False
            self.buffer.free_full()
        else:
            self.drop_full_grad()

    def discard(self) -> None:
        """Forget gradients not yet in the gradient shard (FSDP2's reset_iter_state): the
        no_sync accumulation, the HSDP partial sum, this backward's gradients in `full`."""
        self.drop_full_grad()
        self.partial = None
        self._deferred = {}
        self._early = {}
        self._wide = {}
        self.reading_full = False
        self.buffer.free_full()

    def drop_full_grad(self) -> None:
        """Free the separate full gradient buffer (after its reduce-scatter, or at teardown)."""
        if self.full_grad is not None:
            self.full_grad.untyped_storage().resize_(0)
        self.live = False

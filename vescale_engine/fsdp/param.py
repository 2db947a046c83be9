"""ShardedParameter: one managed parameter, its sharded and full-shape faces, and the one
`requires_grad` flag both carry."""
from __future__ import annotations

import torch
from torch import nn

from ..shard.ragged import RaggedShard
from .dtensor_params import LocalLeafRoute, dtensor_face, grad_face, grad_in_placements

__all__ = ["ShardedParameter", "sharding_of"]


def sharding_of(t, *, full: bool = False) -> "ShardedParameter | None":
    """The one accessor for a tensor's sharding state: the ShardedParameter whose sharded face
    `t` is (what the module holds between steps, and what optimizers, clipping and checkpoint
    code are handed), else None (a plain tensor, or a full-shape parameter of forward); with
    `full`, also the one whose full-shape parameter `t` is."""
    if not isinstance(t, torch.Tensor):
        return None
    found = t.__dict__.get("_vescale")
    return t.__dict__.get("_vescale_full") if found is None and full else found


class ShardedParameter:
    """One managed parameter: where the module holds it, and its two faces.

    Users and libraries set `requires_grad` on whichever face the module holds at that moment
    (PEFT's disable_adapter, `module.requires_grad_()`) or on one they kept a reference to.
    `requires_grad` reads the flag as last set on either face and puts it on both, so every
    swap (`register`) and every decision about gradients sees one flag."""

    def __init__(self, unit, fqn, registrations, buffer, index, requires_grad,
                 dtensor_spec=None, face_mesh=None):
        self.unit = unit
        self.fqn = fqn
        self.registrations = registrations          # [(module, attribute name)], >1 when tied
        self.buffer = buffer
        self.index = index
        spec = buffer.layout.placements[index].spec
        # A DTensor parameter (TP/EP): its spec (mesh, placements, global shape and stride);
        # `shape` is then the local tensor's, the one the buffer holds. None for a plain one.
        self.dtensor_spec = dtensor_spec
        self.shape = spec.shape
        self.block = spec.block
        self._grad_face = None    # (gradient shard it views, its RaggedDTensor over it)
        self._layout = None       # its RaggedShard (layout), made at first use
        # (a TP/EP parameter's face_mesh: its shard group's and TP/EP mesh's dims; read back
        # from the face afterwards)
        self.sharded = nn.Parameter(self._face(buffer.master_view(index), face_mesh),
                                    requires_grad=requires_grad)
        self.sharded._vescale = self  # how optimizers and clipping find the flat buffer
        self._unsharded = None
        self._local_leaf = None  # a DTensor face's to_local() leaf, once asked for
        # The value a real parameter had when its unit was planned on meta (a tensor added to
        # a deferred build): kept until `FSDPUnit.allocate` writes it; loaders and inits skip it.
        self.initial = None
        # In-place writes a meta parameter had when its unit was planned (its version counter):
        # what the model's constructor did to it, which materialize must be able to replay.
        self.build_writes = None
        self._requires_grad = requires_grad  # what both faces carried when last in agreement
        self._hooked = False
        self.graphed = False      # a forward with gradients used it with requires_grad set
        self.unreduced = False    # its gradient sits in a no_sync full buffer, not yet reduced
        self.backward_flag = None  # requires_grad when its unit's backward began

    def _face(self, piece: torch.Tensor, mesh=None) -> torch.Tensor:
        """What the module holds between steps over `piece` (this rank's flat range of the
        master or gradient shard): its unit's face (fsdp/faces.py; FSDP2's RaggedDTensor of
        the global shape unless the sharding policy names another)."""
        return self.unit.sharding.face.make(self, piece, mesh)

    def local(self) -> torch.Tensor:
        """This rank's flat piece of the master (the plain tensor the engine computes on)."""
        return self.buffer.master_view(self.index)

    def set_sharded_grad(self) -> None:
        """`sharded.grad` to the reduced gradient, a face over its range of the gradient shard:
        made again only when that shard is another tensor (offload, allocation). A gradient
        autograd put on the sharded parameter itself (`foreign_grad`) is added to it, as
        FSDP2 adds the reduced gradient to the sharded `.grad` it finds."""
        foreign = self.foreign_grad()
        source = self.buffer.grad
        if self._grad_face is None or self._grad_face[0] is not source:
            self._grad_face = (source, self._face(self.buffer.grad_view(self.index)))
        if foreign is not None:
            self.buffer.wait_grad_copies()  # (an offloaded shard's copy may be in flight)
            with torch.no_grad():
                self.buffer.grad_view(self.index).add_(
                    getattr(foreign, "_local_tensor", foreign).reshape(-1))
        self.sharded.grad = self._grad_face[1]

    def foreign_grad(self) -> torch.Tensor | None:
        """`sharded.grad` when it is not our face over the gradient shard: a gradient autograd
        accumulated into the sharded parameter (used outside its unit's forward, between
        steps: `p.full_tensor()`, a loss term), or one the user assigned. The shard's range
        does not hold it."""
        grad = self.sharded.grad
        if grad is None or (self._grad_face is not None and grad is self._grad_face[1]):
            return None
        return grad

    @property
    def unsharded(self) -> nn.Parameter:
        """The full-shape parameter the module holds while unsharded (made at first unshard)."""
        if self._unsharded is None:
            with torch.inference_mode(False):  # made once, for training too
                view = self.buffer.full_view(self.index)
                if self.dtensor_spec is None:
                    self._unsharded = nn.Parameter(view, requires_grad=self.requires_grad)
                else:  # its local tensor is the view itself
                    self._unsharded = dtensor_face(view, self.dtensor_spec, self.requires_grad)
                    # to_local() with gradients: a leaf over the view (dtensor_params says why)
                    self._unsharded.to_local = LocalLeafRoute(self._unsharded, self._local_leaf_of)
            self._unsharded._vescale_full = self  # what it is a face of (sharding_of)
            self._accept_wide_grads(self._unsharded)
            self._hook_when_trainable()
        return self._unsharded

    def _accept_wide_grads(self, leaf) -> None:
        """Where gradients are reduced in a wider dtype than the compute dtype, a full-shape
        leaf takes gradients of any dtype (grad_dtype None, as FSDP2 sets it in backward from
        torch 2.15): autograd adds what it computed into the preset slot, and the hook sees a
        gradient autograd made wider (rms_norm's weight under bf16) before any rounding."""
        if self.buffer.unreduced.dtype != self.buffer.param_dtype:
            leaf.grad_dtype = None

    def _widened(self, grad, slot):
        """The gradient a hook returns to autograd, which adds it into `slot`. With gradients
        reduced in a wider dtype: one that arrives wider than the compute dtype is kept so (the
        buffer keeps it aside where the slot is in the compute dtype) if the unit's policy
        keeps wide gradients (mp_policy.keep_wide_grads: torch 2.15's FSDP2), and is rounded to
        the compute dtype otherwise (torch 2.14's FSDP2 and DeepSpeed, whose unsharded
        gradients have the parameter's dtype)."""
        buf = self.buffer
        if buf.unreduced.dtype == buf.param_dtype:
            return grad  # the slot has the compute dtype: autograd's add rounds
        if not self.unit.mp_policy.keeps_wide_grads:
            # (no slot: it came before the unit's backward, autograd keeps it as it is)
            if grad.dtype == buf.param_dtype or (slot is not None and
                                                 slot.dtype == buf.param_dtype):
                return grad
            return grad.to(buf.param_dtype).to(grad.dtype)
        unreduced = buf.unreduced
        if unreduced.in_full and (grad.dtype != buf.param_dtype or
                                  unreduced.keeps_wide(self.index)):
            unreduced.keep_wide_grad(self.index, grad, slot)
        return grad

    def _local_leaf_of(self) -> nn.Parameter:
        """The plain leaf over the full view that a DTensor face's `to_local()` hands out
        while gradients are recorded; made once, hooked like the face, its `.grad` preset to
        the same slot of the buffer (preset_grad)."""
        if self._local_leaf is None:
            with torch.inference_mode(False):
                leaf = nn.Parameter(self._unsharded._local_tensor, requires_grad=True)
            leaf._vescale_full = self
            self._accept_wide_grads(leaf)
            leaf.register_hook(self._local_grad_arrived)
            leaf.register_post_accumulate_grad_hook(self._accumulated)
            if self.unit.backward.in_backward:  # (a recompute in backward: the slot is set)
                leaf.grad = self.buffer.unreduced.backward_grad_view(self.index)
            self._local_leaf = leaf
        return self._local_leaf

    def _local_grad_arrived(self, grad):
        self._refuse_late_grad()
        self.unit.backward.grad_arrives(grad)
        self.buffer.unreduced.grad_arrived(self.index, self._local_leaf,
                                           self.unit.backward.in_nested_backward())
        return self._widened(grad, self._local_leaf.grad)

    @property
    def full_face(self) -> nn.Parameter | None:
        """The full-shape parameter if one was made (None before the first unshard)."""
        return self._unsharded

    @property
    def requires_grad(self) -> bool:
        """The flag as last set on either face; both faces carry it afterwards. (Both set
        since the last call: they were set the same way, a flag has only two values.)"""
        faces = [f for f in (self.sharded, self._unsharded) if f is not None]
        for face in faces:
            if face.requires_grad != self._requires_grad:
                self._requires_grad = face.requires_grad
                break
        for face in faces:
            if face.requires_grad != self._requires_grad:
                face.requires_grad_(self._requires_grad)
        self._hook_when_trainable()
        return self._requires_grad

    def _hook_when_trainable(self):
        """The gradient hook goes on the full-shape face once it requires grad (torch refuses a
        hook on a tensor that does not), whenever that happens first; it stays for life."""
        if not self._hooked and self._requires_grad and self._unsharded is not None:
            self._unsharded.register_hook(self._grad_arrived)
            self._unsharded.register_post_accumulate_grad_hook(self._accumulated)
            self._hooked = True

    def _accumulated(self, _):
        """Autograd added into `.grad` (not so in torch.autograd.grad, which only returns)."""
        self.unit.backward.calls.accumulated = True

    def _grad_arrived(self, grad):
        """Runs once all of this parameter's gradient is summed, just before autograd adds it
        into the preset `.grad` view. A DTensor gradient in other placements (Partial) is
        redistributed to the parameter's first, so what lands in the buffer is the gradient of
        this rank's local piece."""
        self._refuse_late_grad()
        self.unit.backward.grad_arrives(grad)
        if self.dtensor_spec is not None:
            grad = grad_in_placements(grad, self.dtensor_spec)
        self.buffer.unreduced.grad_arrived(self.index, self._unsharded,
                                           self.unit.backward.in_nested_backward())
        return self._widened(grad, self._unsharded.grad)

    def _refuse_late_grad(self):
        """A gradient after the unit reduced this backward's gradients and resharded (the
        full-shape parameter used outside the unit's forward, reached by backward after the
        unit's own backward) would land in a `.grad` nobody reduces: refused by name."""
        if self.unit.backward.reduced:
            raise RuntimeError(
                f"{self.fqn}: a gradient arrived after its unit ({self.unit.name}) reduced its "
                "gradients in this backward (the parameter is used outside the unit's forward, "
                "and backward reached that use after the unit's own backward): use it inside "
                "a forward of a module of its unit, or shard the module that uses it in the "
                "same unit")

    def preset_grad(self) -> None:
        """Point the full-shape face's `.grad` at its slot of the buffer backward accumulates
        into (a DTensor over that slot for a DTensor parameter), so autograd adds in place.
        A `.grad` already there came in this iteration before the unit's backward began (the
        faces' `.grad` are dropped at every reshard): the parameter was used outside the
        unit's forward (a head of the root called after the root's forward, the backwards of
        a chunked loss); the buffer adds it instead of it being overwritten."""
        early = [face.grad for face in (self._unsharded, self._local_leaf)
                 if face is not None and face.grad is not None]
        view = self.buffer.unreduced.backward_grad_view(self.index)
        self.unsharded.grad = view if self.dtensor_spec is None else \
            grad_face(view, self.dtensor_spec)
        if self._local_leaf is not None:
            self._local_leaf.grad = view
        for grad in early:
            self.buffer.unreduced.add_early_grad(self.index, grad,
                                                 self.unit.mp_policy.keeps_wide_grads)

    @property
    def layout(self) -> RaggedShard:
        """This parameter's RaggedShard over its shard group (of its TP/EP-local tensor): which
        whole blocks each rank holds. Made once; the sharded face, the optimizers' matrices and
        the checkpoints' boxes all read it."""
        if self._layout is None:
            buf = self.buffer
            self._layout = RaggedShard(self.shape, self.block,
                                       buf.layout.placements[self.index].local_units(
                                           buf.world_size))
        return self._layout

    @property
    def local_range(self) -> tuple[int, int]:
        """[start, end) of this rank's piece in the (TP/EP-local) tensor flattened row-major,
        as its layout places it (start == end where it holds nothing): what optimizers and
        checkpoints index by."""
        return self.layout.local_range(self.buffer.rank)

    @property
    def flat_range(self) -> tuple[int, int]:
        """[begin, end) of this rank's piece in the full tensor flattened row-major: `sharded`
        holds exactly `full.reshape(-1)[begin:end]` ((0, 0) when it holds nothing)."""
        begin, end = self.local_range
        return (begin, end) if end > begin else (0, 0)

    def drop_full_grads(self) -> None:
        """The full-shape faces' `.grad` views point into the full buffer: dropped at reshard."""
        if self._unsharded is not None:
            self._unsharded.grad = None
        if self._local_leaf is not None:
            self._local_leaf.grad = None

    def register(self, which: nn.Parameter):
        self.requires_grad  # the outgoing face's flag goes to the incoming one
        for module, name in self.registrations:
            module._parameters[name] = which

    def forget_full_faces(self) -> None:
        """The full-shape faces are made again at the next unshard (after a cast: views of a
        full buffer in another dtype)."""
        self._unsharded = self._local_leaf = None
        self._hooked = False

    def bind_storage(self) -> None:
        """After the buffer got real storage (`DBuffer.allocate`): `sharded` becomes the view of
        the new master shard. The same Parameter object (its contents are swapped), so every
        reference taken while it was on meta (`model.parameters()`, registrations) stays valid,
        with the attributes set on it."""
        attributes = dict(self.sharded.__dict__)
        fresh = nn.Parameter(self._face(self.buffer.master_view(self.index)),
                             requires_grad=self.requires_grad)
        self._grad_face = None
        torch.utils.swap_tensors(self.sharded, fresh)  # swaps the __dict__s too
        self.sharded.__dict__.update(attributes)

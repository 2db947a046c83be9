"""A unit's parameters and the DBuffers that hold them: unshard, reshard, reduce (FSDP2's
FSDPParamGroup). Its sharded state is one enum whose transitions are asserted; when to unshard
or reduce is the unit's business (unit.py), how is this module's."""
from __future__ import annotations

import enum

import torch
from torch.profiler import record_function

from ..launch.collective_timeout import explain_timeout
from ..shard.stats import STATS

__all__ = ["ParamGroup", "ShardedState"]


class ShardedState(enum.Enum):
    SHARDED = "sharded"        # the module holds the sharded faces; no full buffer is live
    UNSHARDING = "unsharding"  # all-gathers in flight
    UNSHARDED = "unsharded"    # the module holds full-shape parameters over the full buffers


_MOVES = {  # the transitions a group may make
    (ShardedState.SHARDED, ShardedState.UNSHARDING),
    (ShardedState.SHARDED, ShardedState.UNSHARDED),    # no gather (unshard_in_backward False)
    (ShardedState.UNSHARDING, ShardedState.UNSHARDED),
    (ShardedState.UNSHARDING, ShardedState.SHARDED),   # a prefetch nobody used
    (ShardedState.UNSHARDED, ShardedState.SHARDED),
    (ShardedState.SHARDED, ShardedState.SHARDED),      # reshard of buffers gathered elsewhere
}


class ParamGroup:
    def __init__(self, name: str, device, buffers: list, params: list, divide_factor=None):
        self.name = name
        self.device = device
        self.buffers = buffers
        self.params = params
        self.state = ShardedState.SHARDED
        self._gathers = []    # the all-gathers in flight (UNSHARDING)
        self._finishers = []  # (buffer, parameters, pending reduction) of this backward
        self.gradient_divide_factor = divide_factor
        self.force_sum = False
        self.offload = None  # CPUOffloadPolicy's pin_memory, once offloaded (None: not)

    def _move(self, to: ShardedState) -> None:
        assert (self.state, to) in _MOVES, f"{self.name}: {self.state.name} -> {to.name}"
        self.state = to

    # -- storage -------------------------------------------------------------------------------

    @property
    def is_meta(self) -> bool:
        """Planned on the meta device and not yet given storage (vescale_engine.materialize)."""
        return any(buf.is_meta for buf in self.buffers)

    @property
    def numel(self) -> int:
        """Elements of the full parameters (what the all-gathers bring in)."""
        return sum(p.buffer.layout.placements[p.index].numel for p in self.params)

    def allocate(self, device) -> None:
        """Real, uninitialized master storage on `device` for every buffer, and the managed
        parameters re-pointed at it (the reset_parameters guards stay); the parameters that had
        values at wrap time (`initial`) get them back."""
        for buf in self.buffers:
            buf.allocate(device)
        for p in self.params:
            p.bind_storage()
            if p.initial is not None:  # the value it had at wrap time (not on meta)
                with torch.no_grad():
                    p.buffer.load_full_tensor(p.index, p.initial.to(device))
                p.initial = None
        self.device = torch.device(device)
        if self.offload is not None:
            self.offload_to_host(self.offload)

    def cast(self, dtype, mp_policy) -> None:
        """FSDP2's `module.to(dtype)` after sharding: every buffer's master in `dtype`, the
        sharded parameters (the same objects) over it, the full-shape faces made again at the
        next unshard. Only between steps, on buffers in device memory that travel plain; one
        line naming the unit otherwise, before anything changes."""
        why = "its parameters are unsharded (call it between steps)" \
            if self.state is not ShardedState.SHARDED else \
            "its shards are offloaded to host memory" if self.offload is not None else \
            "its gradients are held (call it after zero_grad)" if any(
                b.has_grad or b.unreduced.bytes_held for b in self.buffers) else \
            "its collectives are quantized or hpZ's" if any(
                not (b.gather_format.plain and b.reduce_format.plain) for b in self.buffers) \
            else None
        if why is not None:
            raise RuntimeError(f"{self.name}: cannot cast the sharded parameters to {dtype}: "
                               f"{why}")
        for buf in self.buffers:
            buf.cast(dtype, *mp_policy.buffer_dtypes(dtype))
        for p in self.params:
            p.forget_full_faces()
            p.bind_storage()

    def offload_to_host(self, pin_memory: bool) -> None:
        """FSDP2's CPUOffloadPolicy: the master and gradient shards live in host memory (pinned
        on an accelerator when asked), the sharded parameters view them, so any optimizer over
        `model.parameters()` steps on the host; each all-gather copies this rank's shard in the
        compute dtype from the host (DBuffer.move_master_to_host, ZeRO-Offload's offload_param).
        A group still on meta moves at allocate."""
        self.offload = pin_memory
        if self.is_meta:
            return
        for buf in self.buffers:
            if buf.compute is not None:
                continue
            pin = pin_memory and buf.device.type != "cpu"
            S = buf.shard_size
            master, grad = (torch.empty(S, dtype=buf.master.dtype, pin_memory=pin)
                            for _ in range(2))
            compute = torch.empty(S, dtype=buf.param_dtype, pin_memory=pin) \
                if buf.param_dtype != buf.master.dtype else None
            buf.move_master_to_host(master, grad, compute_on_host=True, host_compute=compute)
        for p in self.params:
            p.bind_storage()

    def refresh_host_shards(self) -> None:
        """Offloaded buffers: the compute-dtype shard cast again from the host master (a fused
        optimizer step writes it without moving its version counter)."""
        for buf in self.buffers:
            if buf.compute is not None:
                buf.compute.refresh(force=True)

    def set_reduction(self, divide_factor, force_sum: bool) -> None:
        """What the summed gradients are divided by, and whether every collective sums, from
        the next reduction on."""
        self.gradient_divide_factor, self.force_sum = divide_factor, force_sum
        for buf in self.buffers:
            buf.set_reduction(divide_factor, force_sum)

    # -- unshard / reshard ---------------------------------------------------------------------

    def unshard(self, hpz_tag, backward: bool) -> None:
        """Issue the all-gathers (unless in flight or done)."""
        if self.state is not ShardedState.SHARDED:
            return
        STATS.log("unshard_issue", self.name)
        with record_function(f"vescale::all_gather ({self.name})"):
            self._gathers = [buf.all_gather(async_op=True, hpz_tag=hpz_tag, backward=backward)
                             for buf in self.buffers]
        self._move(ShardedState.UNSHARDING)

    def wait_unshard(self) -> None:
        """The all-gathers are done: the module holds the full-shape parameters."""
        with explain_timeout(f"the all-gather of unit {self.name}'s parameters"), \
                record_function(f"vescale::all_gather_wait ({self.name})"):
            for work in self._gathers:
                work.wait()
        STATS.log("unshard_wait", self.name)
        self._gathers = []
        for p in self.params:
            p.register(p.unsharded)
        self._move(ShardedState.UNSHARDED)

    def unshard_without_gather(self) -> None:
        """Full-shape parameters over zeroed full buffers, no all-gather: backward computes
        the gradients without reading the parameters (set_unshard_in_backward(False), e.g. an
        embedding); the zeros keep the buffers' padding a zero gradient."""
        for buf in self.buffers:
            buf._allocate("full").zero_()
        for p in self.params:
            p.register(p.unsharded)
        self._move(ShardedState.UNSHARDED)

    def reshard(self) -> None:
        if self._gathers:  # a prefetch nobody used: finish it before freeing its target
            with explain_timeout(f"the all-gather of unit {self.name}'s parameters"):
                for work in self._gathers:
                    work.wait()
            self._gathers = []
        if self.state is ShardedState.SHARDED and not any(b.is_unsharded for b in self.buffers):
            return
        for p in self.params:
            p.register(p.sharded)
            p.drop_full_grads()
        for buf in self.buffers:
            buf.free_full()
        self._move(ShardedState.SHARDED)

    # -- gradients -----------------------------------------------------------------------------

    def reduce(self, gradients, all_reduce: bool) -> None:
        """Start the reduce-scatters of these parameters' full gradients, per buffer; added
        to what each gradient shard holds unless the user dropped it."""
        with record_function(f"vescale::reduce_scatter ({self.name})"):
            for buf in {id(p.buffer): p.buffer for p in gradients}.values():
                pending = buf.reduce_scatter(
                    accumulate=_prepare_accumulation(
                        buf, [p for p in self.params if p.buffer is buf]),
                    all_reduce=all_reduce)
                self._finishers.append((buf, [p for p in gradients if p.buffer is buf], pending))
        for p in gradients:
            p.unreduced = False

    def keep_unreduced(self, gradients) -> None:
        """no_sync: the full gradients stay, unreduced, for a later backward's reduction."""
        for buf in self.buffers:
            buf.unreduced.move_to_full_grad()
        for p in gradients:
            p.unreduced = True

    def advance_gradients(self) -> bool:
        """Wait for the reduce-scatters and start the replicas' all-reduces; finish at once
        where there is none. Whether all-reduces are now in flight."""
        with explain_timeout(f"the reduce-scatter of unit {self.name}'s gradients"), \
                record_function(f"vescale::reduce_scatter_wait ({self.name})"):
            for _, _, pending in self._finishers:
                pending.wait_reduce_scatter()
        if any(pending.all_reducing for _, _, pending in self._finishers):
            return True
        self.finish_gradients()
        return False

    def finish_gradients(self) -> None:
        for buf, members, pending in self._finishers:
            with explain_timeout(f"the replicas' all-reduce of unit {self.name}'s gradients"):
                pending.finish()
            if pending.deferred:  # HSDP, no all-reduce yet: the shard's gradient is not due
                continue
            for p in members:
                p.set_sharded_grad()
        self._finishers = []

    def fold_outside_grads(self) -> None:
        """Sharded parameters that got a gradient from outside their unit's forward and none
        reduced for them in this backward (no_sync, or no use inside): it goes into the
        gradient shard too, which the flat optimizers and the norm read."""
        for p in self.params:
            if p.foreign_grad() is not None:
                p.buffer.zero_grad_if_released()
                p.set_sharded_grad()

    def release_dropped_gradients(self) -> None:
        """Free a buffer's gradient shard once the user dropped every gradient in it
        (zero_grad's set_to_none), so it does not sit through forward and backward."""
        for buf in self.buffers:
            if buf.has_grad and all(p.sharded.grad is None for p in self.params
                                    if p.buffer is buf):
                buf.release_grad()

    def abandon(self) -> None:
        """Forget what this iteration's gradients left in flight or unreduced
        (reset_iteration; the unit reshards after)."""
        for _, _, pending in self._finishers:
            pending.discard()
        self._finishers = []
        for buf in self.buffers:
            buf.unreduced.discard()
        for p in self.params:
            p.unreduced = False


def _prepare_accumulation(buf, params) -> bool:
    """Does the shard hold gradients to add to? Not if the user dropped all of the buffer's
    (zero_grad's set_to_none): then the reduce-scatter writes straight into the shard. Ranges
    of dropped ones are zeroed first: a tensor without `.grad` has zeros in the shard, which
    the norm and the optimizer rely on (this backward may bring it none, being frozen)."""
    # (a gradient autograd put on the sharded parameter is added after: set_sharded_grad)
    dropped = [p for p in params if p.sharded.grad is None or p.foreign_grad() is not None]
    if len(dropped) == len(params):
        return False
    for p in dropped:  # rare: some dropped, some kept
        buf.grad_view(p.index).zero_()
    return True

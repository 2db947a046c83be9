"""RL colocation: `engine.offload_states()` / `engine.reload_states()` with DeepSpeed's meaning.

Colocated RL (OpenRLHF's hybrid engine, DeepSpeed-Chat, verl-style loops) frees the trainer's
device memory while an inference engine generates on the same device, then takes it back.
DeepSpeed's names for what moves (`include`, OffloadStateTypeEnum's values or the same
strings), and what each means here:

    optim_states            the optimizer's state tensors (moments, 8-bit codes and scales,
                            Muon's momentum, step counts) and what else it holds on the
                            device (`held_tensors`: ours' per-element weight decay)
    hp_params               every DBuffer's fp32 master shard (the sharded parameters' values)
    lp_params               every DBuffer's compute-dtype shard, where a buffer keeps one
    lp_grads                every DBuffer's gradient shard, where it holds one now (one
                            whose gradients were all dropped, as after a step, is freed)
    contiguous_grad_buffer  nothing: the full gradient buffers are freed after every
                            reduce-scatter (a unit that still holds unreduced ones is refused)

How: each device storage is copied to one host buffer of its own (pinned when asked and the
device is an accelerator), then the device storage is resized to 0 bytes; reload resizes it
back and copies the bytes in. The tensor objects and their storages stay the same, so the
parameters' faces, the optimizer's state views and checkpoint views stay valid, and the round
trip is exact. Storages are moved once however many tensors view them, and storages already in
host memory on purpose (the state of buffers `offload_optimizer` steps on the host) stay where
they are. On CPU the device is the host: the bytes still go to separate host buffers and the
originals are freed, so what is offloaded holds no storage of its own.

Full-size buffers must be free: offloading while a unit holds its full parameters (inside
`deepspeed.zero.GatheredParameters`, or a forward that keeps them) or unreduced full gradients
(`no_sync`) is refused in one line. While offloaded, a forward of any unit, a backward, a step,
zero_grad and checkpoint reads and writes are one-line errors saying to call reload_states().
"""
from __future__ import annotations

import torch

from ..fsdp.lending import holds_full
from ..fsdp.lookup import units_under

__all__ = ["STATE_TYPES", "Colocation", "state_type_names"]

# DeepSpeed's OffloadStateTypeEnum values, in its order.
STATE_TYPES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")
# device_state() names -> the state type that moves them.
_BUFFER_STATE_TYPE = {"master": "hp_params", "compute": "lp_params", "grad": "lp_grads",
                      "secondary": "lp_params"}


def device_state(buf) -> list:
    """[(name, tensor)] of the shard tensors a DBuffer holds on its device now (the master, a
    compute-dtype shard where there is one, the gradient, hpZ's secondary copy): what moves
    off the device and back. Full buffers are not among them."""
    if buf.offloaded is not None:  # master and gradient are in host memory
        compute = buf.offloaded.compute
        held = [] if compute.on_host else [("compute", compute.tensor)]
    else:
        held = [("master", buf.master), ("grad", buf.grad)]
    held += buf.gather_format.held()  # (hpZ's secondary copy)
    return [(name, t) for name, t in held if isinstance(t, torch.Tensor) and
            t.device.type == buf.device.type and t.untyped_storage().nbytes() > 0]


def _name(value) -> str:
    """An OffloadStateTypeEnum / OffloadDeviceEnum member (a str Enum) as its value."""
    value = getattr(value, "value", value)
    return value if isinstance(value, str) else repr(value)


def state_type_names(include) -> tuple:
    """`include` (None: everything; DeepSpeed's enum members or their strings, a collection of
    them or one) as state type names, checked."""
    if include is None:
        return STATE_TYPES
    if isinstance(include, str):
        items = [include]
    elif hasattr(include, "__iter__"):
        items = list(include)
    else:
        raise ValueError(f"offload_states: include must be None or a collection of DeepSpeed's "
                         f"state types ({', '.join(STATE_TYPES)}), got {include!r}")
    names = tuple(dict.fromkeys(_name(item) for item in items))
    unknown = [n for n in names if n not in STATE_TYPES]
    if unknown:
        raise ValueError(f"offload_states: unknown include {unknown[0]}; DeepSpeed's state "
                         f"types are {', '.join(STATE_TYPES)}")
    return names


class _Moved:
    """One device storage while offloaded: the storage object and its bytes on the host."""

    def __init__(self, storage, host: torch.Tensor):
        self.storage = storage
        self.host = host
        self.nbytes = host.numel()


def _as_bytes(storage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (copies in and out of it whatever its dtype)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Colocation:
    """What one engine has moved off its device (`engine._colocation`)."""

    def __init__(self, module, optimizer, device: torch.device):
        self.module = module
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.offloaded = None   # the state type names offloaded, while offloaded
        self._moved = []        # _Moved, in offload order
        self._hooks = []        # the forward guards on the units' modules
        self._exposed = []      # (optimizer, method name) set by expose_on
        self.bytes_offloaded = 0

    # -- what the engine holds on its device ---------------------------------------------------

    def _buffers(self):
        return [buf for unit in units_under(self.module) for buf in unit.buffers]

    def _host_resident(self) -> set:
        """Storages (data pointers) placed in host memory on purpose: the optimizer state of
        the buffers `offload_optimizer` steps on the host (keyed by the buffer's master)."""
        offload = getattr(self.optimizer, "offload", None)
        if offload is None:
            return set()
        state = getattr(self.optimizer, "state", {})
        return {t.untyped_storage().data_ptr() for buf in self._buffers() if offload.offloads(buf)
                for t in state.get(buf.master, {}).values() if isinstance(t, torch.Tensor)}

    def device_tensors(self, state_types=STATE_TYPES) -> list:
        """[(state type, tensor)] of what the engine holds on its device now, per state type
        asked; a storage appears once (the first tensor seen that views it)."""
        found, seen = [], self._host_resident()

        def add(state_type, tensor):
            storage = tensor.untyped_storage()
            if tensor.device.type != self.device.type or storage.nbytes() == 0:
                return
            if storage.data_ptr() in seen:
                return
            seen.add(storage.data_ptr())
            found.append((state_type, tensor))

        if "optim_states" in state_types:
            for state in getattr(self.optimizer, "state", {}).values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        add("optim_states", value)
            for tensor in getattr(self.optimizer, "held_tensors", list)():
                add("optim_states", tensor)  # (ours: per-element weight decay)
        for buf in self._buffers():
            for name, tensor in device_state(buf):
                if _BUFFER_STATE_TYPE[name] in state_types:
                    add(_BUFFER_STATE_TYPE[name], tensor)
        return found

    def device_bytes(self, state_types=STATE_TYPES) -> int:
        """Bytes of device storage the engine holds now for these state types."""
        return sum(t.untyped_storage().nbytes() for _, t in self.device_tensors(state_types))

    # -- offload and reload --------------------------------------------------------------------

    def _require_sharded(self) -> None:
        for unit in units_under(self.module):
            if unit.is_unsharded or any(b.is_unsharded for b in unit.buffers) or \
                    any(holds_full(sp.sharded, sp) for sp in unit.params):
                raise RuntimeError(
                    f"offload_states: unit {unit.name} holds its full parameters (inside "
                    "deepspeed.zero.GatheredParameters or a forward that keeps them): offload "
                    "between steps, outside it")
            if any(b.unreduced.live or b.unreduced.bytes_held for b in unit.buffers):
                raise RuntimeError(
                    f"offload_states: unit {unit.name} holds unreduced full gradients "
                    "(engine.no_sync or vescale.local_grad_accumulation): offload after the "
                    "accumulation boundary's step")

    def offload(self, include=None, device="cpu", pin_memory: bool = True,
                non_blocking: bool = False) -> None:
        state_types = state_type_names(include)
        where = _name(device) if not isinstance(device, torch.device) else device.type
        if where != "cpu":
            raise ValueError(f"offload_states: device {where} is not supported; offload to "
                             "\"cpu\" (OffloadDeviceEnum.cpu)")
        if self.offloaded is not None:
            raise RuntimeError(f"offload_states: already offloaded ({', '.join(self.offloaded)})"
                               "; call reload_states() first")
        self._require_sharded()
        if "lp_grads" in state_types:  # shards whose every gradient was dropped (zero_grad's
            for unit in units_under(self.module):  # set_to_none) are dead: freed, not copied
                unit.group.release_dropped_gradients()
        pin = bool(pin_memory) and self.device.type != "cpu"  # pinning needs an accelerator
        moved = []
        with torch.no_grad():
            for _, tensor in self.device_tensors(state_types):
                storage = tensor.untyped_storage()
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu",
                                   pin_memory=pin)
                host.copy_(_as_bytes(storage), non_blocking=non_blocking and pin)
                moved.append(_Moved(storage, host))
            # Freed after every copy is queued: the copies read them on the same stream.
            for m in moved:
                m.storage.resize_(0)
        self._moved = moved
        self.offloaded = state_types
        self.bytes_offloaded = sum(m.nbytes for m in moved)
        self._hooks = [mod.register_forward_pre_hook(self._refuse_forward, prepend=True)
                       for unit in units_under(self.module) for mod in unit.modules]

    def reload(self, non_blocking: bool = False) -> None:
        if self.offloaded is None:
            raise RuntimeError("reload_states: nothing is offloaded; call offload_states() first")
        with torch.no_grad():
            for m in self._moved:
                m.storage.resize_(m.nbytes)
                _as_bytes(m.storage).copy_(m.host, non_blocking=non_blocking and
                                           m.host.is_pinned())
        # (a pinned host buffer dropped while its copy runs is kept by torch's host allocator
        # until the copy is done)
        self._moved = []
        self.offloaded = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def release(self) -> None:
        """Before engine.destroy: whatever is offloaded comes back (the module keeps its
        parameters, as destroy promises)."""
        if self.offloaded is not None:
            self.reload()
        self.unexpose()

    # -- DeepSpeed's ZeRO optimizer face (OpenRLHF calls it there) ------------------------------

    def expose_on(self, optimizer, offload_states, reload_states) -> None:
        """`engine.optimizer.offload_states(...)` / `.reload_states(...)`, as DeepSpeed's ZeRO
        optimizer has them (OpenRLHF's offload_deepspeed_states calls the optimizer's): the
        engine's methods, set on the optimizer unless it has its own."""
        for name, method in (("offload_states", offload_states),
                             ("reload_states", reload_states)):
            if not hasattr(optimizer, name):
                setattr(optimizer, name, method)
                self._exposed.append((optimizer, name))

    def unexpose(self) -> None:
        for optimizer, name in self._exposed:
            optimizer.__dict__.pop(name, None)
        self._exposed = []

    # -- guards --------------------------------------------------------------------------------

    def require_on_device(self, what: str) -> None:
        if self.offloaded is not None:
            raise RuntimeError(f"{what} while the engine's states are offloaded "
                               f"({', '.join(self.offloaded)}): call reload_states() first")

    def _refuse_forward(self, module, args):
        self.require_on_device(f"forward of {type(module).__name__}")

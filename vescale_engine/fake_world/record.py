"""One training step recorded as rank 0 of W on torch's fake process group (FakeStore: the
collectives move no data, so one process stands for any world size).

The model is stand_in.py's, wrapped as `vescale plan` plans it (each non-root unit, then the
root with the rest) by ours (vescale_engine.fsdp.fully_shard, our optimizers) or torch's FSDP2
(its own fully_shard and torch.optim.AdamW), with the Setup's mixed precision, HSDP mesh,
reshard_after_forward and, for ours, granularity, buffers and ZeRO++. The reduce dtype is given
as the plan resolves it (Setup.reduce: the param dtype when none is asked for): from torch
2.15, FSDP2 (and ours under it) read reduce_dtype=None as the parameters' own dtype. Shards
only are allocated (a 70B model's rank holds 1/W of it; its gathered units are full size). One
step runs
to settle each engine's lazy state (FSDP2's lazy init; our prefetch order, recorded by the
first iteration), then the next step's first micro-step and optimizer step are recorded.

Each collective is seen where torch dispatches it (a TorchDispatchMode over the c10d ops, so
whatever API issued it): its kind, the bytes of its full buffer (all_reduce: of the tensor),
its group's size and stride (rank 0's group: consecutive ranks, or strided over the shard
group), the step's phase, and the unit it belongs to: the innermost of each unit's gather
(ours: ParamGroup.unshard; FSDP2: FSDPParamGroup.unshard) and reduction (UnitBackward.
post_backward; FSDPParamGroup.post_backward) running when it was issued, labelled on the
instances (nothing of torch's classes is changed). Supported: torch 2.11-2.15's FSDP2.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..plan.capacity import Setup, default_root
from ..plan.model_plan import ModelShapes
from . import stand_in

__all__ = ["record_step", "SYSTEMS"]

SYSTEMS = ("ours", "fsdp2")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}
# c10d op -> (kind, which argument holds the full buffer: its tensors' bytes are summed)
_OPS = {
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group(args) -> tuple:
    """(size, stride) of the process group among a c10d op's arguments."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                ranks = dist.get_process_group_ranks(dist.ProcessGroup.unbox(a))
            except (RuntimeError, ValueError, TypeError):
                continue
            return len(ranks), (ranks[1] - ranks[0] if len(ranks) > 1 else 1)
    raise RuntimeError("a c10d collective without a process group argument")


class _Recorder(TorchDispatchMode):
    """Every c10d collective while `on`, with the innermost unit label and the phase."""

    def __init__(self):
        super().__init__()
        self.on = False
        self.phase = "forward"
        self.labels = []        # (role, unit) of the unit methods running, innermost last
        self.collectives = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema.name
        if self.on and schema.startswith("c10d::"):
            op = schema.split("::", 1)[1]
            kind, which = _OPS.get(op, (op, 0))
            size, stride = _group(args)
            role, unit = self.labels[-1] if self.labels else (None, None)
            self.collectives.append({"kind": kind, "nbytes": _nbytes(args[which]),
                                     "group_size": size, "stride": stride,
                                     "phase": self.phase, "role": role, "unit": unit})
        return func(*args, **(kwargs or {}))

    def label(self, obj, method: str, role: str, unit: str) -> None:
        """Calls of `obj.method` (this instance only) label what they issue (role, unit)."""
        original = getattr(obj, method)

        @functools.wraps(original)
        def labelled(*args, **kwargs):
            self.labels.append((role, unit))
            try:
                return original(*args, **kwargs)
            finally:
                self.labels.pop()
        setattr(obj, method, labelled)


def _units(model, root_module) -> list:
    """(fully qualified name, module) of every unit, the root ("") last."""
    names = {id(m): n for n, m in model.named_modules()}
    return [(names[id(m)], m) for m in stand_in.unit_modules(model)] + [("", root_module)]


def _wrap_ours(model, setup: Setup, recorder: _Recorder):
    from .. import optim
    from ..fsdp import MixedPrecisionPolicy, fully_shard, unit_of
    from ..fsdp.materialize import allocate_shards
    mesh = _mesh(setup)
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[setup.param_dtype],
                              reduce_dtype=DTYPES[setup.reduce])
    group = setup.quantization_group
    for fqn, module in _units(model, model):
        fully_shard(module, mesh=mesh, reshard_after_forward=setup.reshard_after_forward
                    if fqn else None, mp_policy=mp, granularity=setup.layout_granularity,
                    max_buffers=setup.max_buffers, align_bytes=setup.align_bytes,
                    quantized_weights=group if setup.quantized_weights else None,
                    quantized_gradients=group if setup.quantized_gradients else None,
                    hpz_partition_size=setup.hpz)
    allocate_shards(model, torch.device("cpu"))
    for fqn, module in _units(model, model):
        unit = unit_of(module)
        for buf in unit.buffers:
            buf.master.fill_(0.01)   # uninitialized memory could be NaN
        recorder.label(unit.group, "unshard", "gather", fqn)
        recorder.label(unit.backward, "post_backward", "reduce", fqn)
    return getattr(optim, setup.optimizer)(model.parameters(), lr=1e-4)


def _wrap_fsdp2(model, setup: Setup, recorder: _Recorder):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    if setup.optimizer != "AdamW":
        raise ValueError(f"--fake-world runs FSDP2 with torch's AdamW only, not "
                         f"{setup.optimizer}")
    mesh = _mesh(setup)
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[setup.param_dtype],
                              reduce_dtype=DTYPES[setup.reduce])
    for fqn, module in _units(model, model):
        fully_shard(module, mesh=mesh, mp_policy=mp,
                    reshard_after_forward=setup.reshard_after_forward if fqn else None)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.01)
    for fqn, module in _units(model, model):
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None:
            recorder.label(group, "unshard", "gather", fqn)
            recorder.label(group, "post_backward", "reduce", fqn)
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def _mesh(setup: Setup):
    from torch.distributed.device_mesh import init_device_mesh
    if setup.hsdp > 1:
        return init_device_mesh("cpu", (setup.hsdp, setup.world_size // setup.hsdp),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (setup.world_size,))


def record_step(model: ModelShapes, setup: Setup, system: str) -> dict:
    """One recorded step of `system` (SYSTEMS) as rank 0 of setup.world_size, in this process
    (it starts and ends the fake process group): {"system", "world_size", "torch",
    "collectives": [{kind, nbytes, group_size, stride, phase, role, unit}, ...]} in the order
    issued, `unit` the fully qualified name of its unit's module ("" the root), `role`
    "gather" / "reduce" (None: issued outside any unit's gather or reduction)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if system not in SYSTEMS:
        raise ValueError(f"--fake-world records {' and '.join(SYSTEMS)}, not {system!r}")
    if setup.tp > 1 or setup.ep > 1 or setup.offloads:
        raise ValueError("--fake-world records FSDP and HSDP steps: drop --tp/--ep and "
                         "offload")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=setup.world_size)
    try:
        root = setup.root if setup.root is not None else default_root(model)
        module = stand_in.build(model, tuple(root))
        recorder = _Recorder()
        wrap = _wrap_ours if system == "ours" else _wrap_fsdp2
        optimizer = wrap(module, setup, recorder)
        x = torch.zeros(())
        with recorder:
            for step in range(2):
                for micro in range(setup.grad_accum):
                    recorder.on = step == 1 and micro == 0
                    recorder.phase = "forward"
                    loss = module(x)
                    recorder.phase = "backward"
                    loss.backward()
                recorder.on, recorder.phase = step == 1, "step"
                try:
                    optimizer.step()
                except RuntimeError as err:   # the fake group's checks of uneven all-to-alls
                    raise ValueError(f"{setup.optimizer}'s step cannot run as rank 0 of "
                                     f"{setup.world_size} on the fake process group ("
                                     f"{str(err).splitlines()[0]})") from None
                optimizer.zero_grad()
            recorder.on = False
    finally:
        dist.destroy_process_group()
    return {"system": system, "world_size": setup.world_size, "torch": torch.__version__,
            "setup": dataclasses.asdict(setup), "collectives": recorder.collectives}

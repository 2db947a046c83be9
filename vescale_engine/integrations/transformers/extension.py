"""What transformers adds to our engine and to `materialize`, for every model and whether or not
`patch_deepspeed()` ran: a model's own tensor- and expert-parallel plans (base_model_tp_plan,
base_model_ep_plan) applied with transformers' functions (engine/parallel_plan.py checks the
plans; the engine's extension points, engine/extensions.py, call these), and transformers'
guard of torch's init functions around a pretrained model's own init (fsdp/materialize.py)."""
from __future__ import annotations

import contextlib

from ...engine.extensions import EngineExtension, register
from ...fsdp.materialize import register_init_guard

__all__ = ["connect"]


def tensor_parallel(model, mesh, plan) -> None:
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    apply_tensor_parallelism(model, mesh, plan)


def expert_parallel(model, ep_mesh, tp_mesh, plan) -> None:
    from transformers.distributed.expert_parallel import apply_expert_parallelism
    # all_to_all: every rank of the EP group holds its own micro-batch (its tp group is
    # itself), so tokens travel to their expert's rank and back
    apply_expert_parallelism(model, ep_mesh, tp_mesh, plan, ep_implementation="all_to_all")


def init_guard():
    """transformers' guard of torch's init functions (what `post_init` runs inside), or
    nothing where transformers has none (its init functions are torch's own) or is absent."""
    try:
        from transformers.initialization import guard_torch_init_functions
    except ImportError:
        return contextlib.nullcontext()
    return guard_torch_init_functions()


def connect() -> None:
    register(EngineExtension("transformers", tensor_parallel=tensor_parallel,
                             expert_parallel=expert_parallel))
    register_init_guard(init_guard)

"""What transformers adds to our engine and to `materialize`, for every model and whether or not
`patch_deepspeed()` ran: a model's own tensor- and expert-parallel plans (base_model_tp_plan,
base_model_ep_plan) applied with transformers' functions (engine/parallel_plan.py checks the
plans; the engine's extension points, engine/extensions.py, call these), and transformers'
guard of torch's init functions around a pretrained model's own init (fsdp/materialize.py), and
the guard on the engine's model's own `save_pretrained`."""
from __future__ import annotations

import contextlib
import functools

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


def guard_save_pretrained(model) -> None:
    """A Hugging Face model's own `save_pretrained(dir)` reads `state_dict()`, which for a
    sharded model holds each rank's flat pieces: the file would not load. Without a state_dict
    it is therefore an error saying what to pass; with one (Trainer's save_model, Accelerate's
    get_state_dict pattern) it runs as written."""
    save = getattr(model, "save_pretrained", None)
    if save is None or getattr(save, "__vescale_guarded__", False):
        return

    @functools.wraps(save)
    def save_pretrained(*args, state_dict=None, **kwargs):
        if state_dict is None:
            raise ValueError(
                f"{type(model).__name__}.save_pretrained without state_dict= would write each "
                "rank's flat shard pieces: pass state_dict=accelerator.get_state_dict(engine) "
                "(or engine._zero3_consolidated_16bit_state_dict(), on every rank; rank 0 "
                "saves), or call vescale_engine.save_hf_checkpoint(engine, dir) on every rank")
        return save(*args, state_dict=state_dict, **kwargs)

    save_pretrained.__vescale_guarded__ = True
    model.save_pretrained = save_pretrained


def connect() -> None:
    register(EngineExtension(
        "transformers", tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
        # the engine's model: its own state_dict() holds flat pieces now
        engine_built=lambda engine: guard_save_pretrained(engine.module)))
    register_init_guard(init_guard)

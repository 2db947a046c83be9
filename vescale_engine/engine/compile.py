"""`engine.compile()`: torch.compile on each innermost FSDP unit's forward, the units' gather and
reduce hooks left eager around it (as torchtitan compiles each transformer block with FSDP2's
hooks outside the graph). AOTAutograd compiles the backward of each forward with it; the
gradients still reach the unit's buffers through its hooks.

- Innermost units only: a unit that contains another (the root around the decoder layers)
  runs eagerly, so no graph spans another unit's collectives.
- A unit whose forward the compiler refuses (a torch._dynamo error at its first call) runs
  eagerly from then on, with one warning naming it; an error of the model's own code is raised
  as it is.
- Graph breaks and recompilations are reported once each (`CompileReport`), after the
  optimizer steps that show them, not absorbed silently.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..fsdp.lookup import unit_of

__all__ = ["compile_units", "CompileReport", "refused_compile_keys"]

LOG = logging.getLogger("vescale_engine")

# DeepSpeed's compile section: DeepCompile's passes, all of them; none means what compiling
# each unit with torch.compile does, so a key set away from its default is named in a warning.
_DEEPCOMPILE_DEFAULTS = {"deepcompile": False, "autoep_non_moe": False,
                         "free_activation": False, "offload_activation": False,
                         "offload_opt_states": False, "offload_parameters": False,
                         "symmetric_memory": False}


def refused_compile_keys(section: dict | None) -> list:
    """The compile section's keys that ask for DeepCompile passes (set away from their
    defaults)."""
    section = section or {}
    return sorted(f"compile.{k}" for k, v in section.items()
                  if k in _DEEPCOMPILE_DEFAULTS and v != _DEEPCOMPILE_DEFAULTS[k])


def _innermost_units(root):
    """(name, module) of every unit module with no other unit below it."""
    found = []
    for name, module in root.named_modules():
        if unit_of(module) is None:
            continue
        inner = any(unit_of(m) is not None for m in list(module.modules())[1:])
        if not inner:
            found.append((name or type(module).__name__, module))
    return found


def compile_units(root, backend, compile_kwargs: dict) -> list:
    """Compile each innermost unit's forward; the names of the units compiled."""
    names = []
    for name, module in _innermost_units(root):
        module.forward = _Compiled(name, module.forward, backend, compile_kwargs)
        names.append(name)
    return names


class _Compiled:
    """A unit's forward through torch.compile, eager again after the compiler refused it."""

    def __init__(self, name, eager, backend, kwargs):
        self.name, self.eager = name, eager
        self.compiled = torch.compile(eager, backend=backend, **kwargs)
        self.failed = False

    def __call__(self, *args, **kwargs):
        if self.failed:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            self.failed = True
            if not dist.is_initialized() or dist.get_rank() == 0:
                LOG.warning("engine.compile: %s runs eagerly: torch.compile refused its forward "
                            "(%s: %s)", self.name, type(err).__name__,
                            (str(err).strip().splitlines() or [""])[0])
            return self.eager(*args, **kwargs)


class CompileReport:
    """Graph breaks and recompilations under engine.compile(), each reported once (rank 0):
    the counters torch._dynamo keeps, read after each optimizer step."""

    def __init__(self):
        from torch._dynamo.utils import counters
        self.counters = counters
        self.breaks_reported = self.recompiles_reported = False
        self.frames_after_first = None

    def after_step(self, rank: int) -> None:
        breaks = self.counters.get("graph_break", {})
        if breaks and not self.breaks_reported:
            self.breaks_reported = True
            if rank == 0:
                reasons = sorted(breaks, key=lambda r: -breaks[r])[:3]
                LOG.warning("engine.compile: %d graph break(s) in the compiled units (each "
                            "splits a unit's graph in two): %s", sum(breaks.values()),
                            "; ".join(str(r).splitlines()[0] for r in reasons))
        frames = self.counters.get("frames", {}).get("ok", 0)
        if self.frames_after_first is None:
            self.frames_after_first = frames
        elif frames > self.frames_after_first and not self.recompiles_reported:
            self.recompiles_reported = True
            if rank == 0:
                LOG.warning("engine.compile: the units were compiled again after the first step "
                            "(%d more graph(s): inputs of new shapes or dtypes; each costs a "
                            "compilation)", frames - self.frames_after_first)

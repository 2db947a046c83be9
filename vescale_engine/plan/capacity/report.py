"""The whole estimate `vescale plan --memory` prints: one setup's per-rank memory for ours,
FSDP2 and ZeRO-3 side by side, each one's traffic, and the setup as estimated, in one dict.
With offload, each system's memory also has `host` (its host bytes per rank) and its traffic
`pcie` (host<->device bytes per step); without, the dict is what it was before offload."""
from __future__ import annotations

from ..granularity import parse_granularity
from ..model_plan import ModelShapes
from ..optim_spec import ADAMW8BIT_BLOCK
from .fsdp2 import pcie_fsdp2, simulate_fsdp2, traffic_fsdp2
from .ours import PlanCache, pcie, simulate_ours, traffic
from .request import Setup, check_setup
from .units import default_root, model_units, tensor_uses
from .zero3 import estimate_zero3, pcie_zero3, traffic_zero3

__all__ = ["ACTIVATIONS_NOTE", "estimate"]

ACTIVATIONS_NOTE = "activations excluded"


def estimate(model: ModelShapes, setup: Setup, uses: dict | None = None,
             cache: PlanCache | None = None, device_memory_gb: float | None = None) -> dict:
    """{"memory": {ours, fsdp2, zero3}, "traffic": {...}, ...} in bytes per rank. With
    `device_memory_gb`, each system also gets `headroom`: what its peak leaves of the device."""
    check_setup(setup, model)
    root_groups = setup.root if setup.root is not None else default_root(model)
    uses = tensor_uses(model.path) if uses is None else uses
    root, others = model_units(model, root_groups, uses)
    cache = cache or PlanCache()
    memory = {"ours": simulate_ours(root, others, setup, cache),
              "fsdp2": simulate_fsdp2(root, others, setup),
              "zero3": estimate_zero3(root, others, setup)}
    if device_memory_gb is not None:
        for system in memory.values():
            system["headroom"] = int(device_memory_gb * 1e9) - system["total"]
    moved = {"traffic": {**traffic(root, others, setup, cache),
                         "fsdp2": traffic_fsdp2(root, others, setup),
                         "zero3": traffic_zero3(root, others, setup)}}
    offload = {}
    if setup.offloads:
        moved["traffic"]["pcie"] = pcie(root, others, setup, cache)
        moved["traffic"]["fsdp2"]["pcie"] = pcie_fsdp2(root, others, setup)
        moved["traffic"]["zero3"]["pcie"] = pcie_zero3(root, others, setup)
        offload = {"offload_optimizer": setup.offload_optimizer,
                   "offload_param": setup.offload_param}
    return {
        "memory": memory,
        **moved,
        "setup": {"world_size": setup.world_size, "shard_group_size": setup.shard_size,
                  "hsdp": setup.hsdp, "optimizer": setup.optimizer,
                  "param_dtype": setup.param_dtype, "reduce_dtype": setup.reduce,
                  "grad_accum": setup.grad_accum,
                  "reshard_after_forward": setup.reshard_after_forward,
                  "granularity": ADAMW8BIT_BLOCK if setup.optimizer == "AdamW8bit"
                  else str(parse_granularity(setup.granularity)),
                  "root": list(root_groups), "activations": "excluded", **offload},
        "activations": ACTIVATIONS_NOTE,
    }

"""The whole estimate `vescale plan --memory` prints: one setup's per-rank memory for ours,
FSDP2 and ZeRO-3 side by side, each one's traffic, and the setup as estimated, in one dict.
With offload, each system's memory also has `host` (its host bytes per rank) and its traffic
`pcie` (host<->device bytes per step); without, the dict is what it was before offload.
With tensor or expert parallelism (Setup.tp, Setup.ep) the model is first made TP/EP-local
(plan/parallel.py); the setup then says the mesh, and with ep > 1 each system's traffic has
`all_to_all`: the token dispatch bytes (`dispatch_bytes`). With Shampoo, ours' memory has
`shampoo_root_work`: how the eigendecompositions of a root recomputation spread over the
ranks (shampoo_work.py)."""
from __future__ import annotations

from ..granularity import parse_granularity
from ..model_plan import DTYPE_BYTES, ModelShapes, fsdp2_unsupported
from ..parallel import local_model, read_plans
from .fsdp2 import pcie_fsdp2, simulate_fsdp2, traffic_fsdp2
from .ours import PlanCache, pcie, simulate_ours, traffic
from .request import CapacityError, Setup, check_setup
from .shampoo_work import root_work_balance, root_work_per_rank
from .units import default_root, model_units, tensor_uses
from .zero3 import estimate_zero3, pcie_zero3, traffic_zero3

__all__ = ["ACTIVATIONS_NOTE", "estimate", "dispatch_bytes", "parallel_model"]

ACTIVATIONS_NOTE = "activations excluded"


def parallel_model(model: ModelShapes, setup: Setup) -> tuple:
    """(the TP/EP-local model, {group: E}, MoE or None); the model itself when tp = ep = 1."""
    if setup.tp == 1 and setup.ep == 1:
        return model, {}, None
    tp_plan, ep_plan, moe = read_plans(model.path)
    local, experts = local_model(model, setup.mesh, tp_plan, ep_plan)
    return local, experts, moe


def dispatch_bytes(local: ModelShapes, setup: Setup, moe) -> int:
    """All-to-all bytes each rank sends to other ranks per optimizer step with ep > 1: per MoE
    layer and micro-step, each of its tokens goes to `experts_per_token` experts (one hidden
    vector in the compute dtype each), (ep - 1) / ep of them on other EP ranks under uniform
    routing, and comes back (combine); backward sends the gradients the same two ways. A TP
    group's ranks split its tokens (experts are not TP-split: torchtitan's ETP 1, DeepSpeed's
    AutoEP+AutoTP folding). No deduplication of a token's copies bound for one rank (torchtitan's
    all_to_all_single dispatch); no activation recomputation."""
    if setup.ep == 1:
        return 0
    if moe is None:
        raise CapacityError(f"{local.path}: --ep needs 'moe': {{\"experts_per_token\": k, "
                            f"\"hidden_size\": H}} in the shapes file for the all-to-all bytes")
    layers = sum(g.repeat for g in local.groups if g.expert)
    per_direction = setup.tokens * moe.experts_per_token * moe.hidden_size * \
        DTYPE_BYTES[setup.param_dtype] * (setup.ep - 1) // (setup.ep * setup.tp)
    return 4 * per_direction * layers * setup.grad_accum


def estimate(model: ModelShapes, setup: Setup, uses: dict | None = None,
             cache: PlanCache | None = None, device_memory_gb: float | None = None) -> dict:
    """{"memory": {ours, fsdp2, zero3}, "traffic": {...}, ...} in bytes per rank. With
    `device_memory_gb`, each system also gets `headroom`: what its peak leaves of the device."""
    check_setup(setup, model)
    model, _, moe = parallel_model(model, setup)
    root_groups = setup.root if setup.root is not None else default_root(model)
    uses = tensor_uses(model.path) if uses is None else uses
    root, others = model_units(model, root_groups, uses)
    cache = cache or PlanCache()
    no_fsdp2 = fsdp2_unsupported(model, setup.shard_size, setup.expert_shard_size)
    memory = {"ours": simulate_ours(root, others, setup, cache),
              "fsdp2": {"unsupported": no_fsdp2} if no_fsdp2 else
              simulate_fsdp2(root, others, setup),
              "zero3": estimate_zero3(root, others, setup)}
    if device_memory_gb is not None:
        for system in memory.values():
            if "total" in system:
                system["headroom"] = int(device_memory_gb * 1e9) - system["total"]
    moved = {"traffic": {**traffic(root, others, setup, cache),
                         "fsdp2": {"unsupported": no_fsdp2} if no_fsdp2 else
                         traffic_fsdp2(root, others, setup),
                         "zero3": traffic_zero3(root, others, setup)}}
    parallel = {}
    if setup.tp > 1 or setup.ep > 1:
        a2a = dispatch_bytes(model, setup, moe)
        for system in (moved["traffic"], moved["traffic"]["fsdp2"], moved["traffic"]["zero3"]):
            if "unsupported" not in system:
                system["all_to_all"] = a2a
        m = setup.mesh
        parallel = {"tp": m.tp, "ep": m.ep, "dp": m.dp, "dp_shard": m.dp_shard,
                    "efsdp": m.efsdp, "tokens": setup.tokens}
    if setup.optimizer == "Shampoo":   # how evenly the eigendecompositions spread
        memory["ours"]["shampoo_root_work"] = root_work_balance(
            root_work_per_rank(root, others, setup, cache))
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
                  "granularity": str(parse_granularity(setup.layout_granularity)),
                  "root": list(root_groups), "activations": "excluded", **offload,
                  **parallel, **_zero_plus_plus(setup)},
        "activations": ACTIVATIONS_NOTE,
    }


def _zero_plus_plus(setup: Setup) -> dict:
    """The ZeRO++ settings ours is estimated with (none: nothing, as before they existed)."""
    out = {}
    if setup.quantized:
        out.update(quantized_weights=setup.quantized_weights,
                   quantized_gradients=setup.quantized_gradients,
                   quantization_group=setup.quantization_group)
    if setup.fp8_matmul:
        out["fp8_matmul"] = True
    if setup.hpz > 1:
        out["hpz"] = setup.hpz
    return out

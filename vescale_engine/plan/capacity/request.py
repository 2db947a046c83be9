"""What a capacity estimate is asked for, everything but the model (`Setup`), checked before
any planning (`check_setup`, `CapacityError`), and the bytes per step each rank's collectives
move for a given number of gathered and reduced elements under it (`Setup.traffic`).

Offload (`offload_optimizer`, `offload_param`) is part of the setup: each system's simulation
reads it and moves its own terms to the host (ours.py, fsdp2.py, zero3.py say which).

Tensor and expert parallelism (`tp`, `ep`) are part of it too: the model is then the TP/EP-local
one (plan/parallel.py), its dense units sharded over `shard_size` = world / (hsdp x tp) ranks
and its expert units over `expert_shard_size` = shard_size x tp / ep (efsdp), each unit's
collectives over its own group (`group_size`)."""
from __future__ import annotations

from dataclasses import dataclass

from ..granularity import parse_granularity
from ..model_plan import DTYPE_BYTES, ModelShapes
from ..optim_spec import (ADAMW8BIT_BLOCK, OPTIMIZERS, SHAMPOO_BLOCK, shampoo_block_cut,
                          shampoo_granularity_for)
from ..parallel import ParallelSizes, make_mesh
from ..planner import DEFAULT_ALIGN_BYTES, DEFAULT_MAX_BUFFERS
from ..quantization import DEFAULT_GROUP

__all__ = ["MASTER_BYTES", "CapacityError", "Setup", "check_setup", "add_traffic",
           "default_granularity"]

MASTER_BYTES = 4             # master weights, gradient shards and optimizer moments are fp32


class CapacityError(ValueError):
    """A capacity request that cannot be estimated; the message names the problem."""


@dataclass(frozen=True)
class Setup:
    """What is being estimated: everything but the model."""
    world_size: int
    optimizer: str = "AdamW"
    param_dtype: str = "bf16"          # compute and all-gather dtype
    reduce_dtype: str | None = None    # gradient reduction dtype (None: the param dtype)
    grad_accum: int = 1                # micro-steps per optimizer step
    hsdp: int = 1                      # replicate size: shard over world_size / hsdp ranks
    reshard_after_forward: bool = True
    granularity: str | None = None     # None: the optimizer's (`layout_granularity`)
    align_bytes: int = DEFAULT_ALIGN_BYTES
    max_buffers: int = DEFAULT_MAX_BUFFERS
    root: tuple | None = None          # groups the root unit owns (None: see default_root)
    # ZeRO-Offload: the fraction of the optimizer bytes kept on the host (0: none, 1: all) and
    # whether the sharded parameters live on the host between uses
    offload_optimizer: float = 0.0
    offload_param: bool = False
    tp: int = 1                        # tensor-parallel size (TP innermost)
    ep: int = 1                        # expert-parallel size (borrowed from dp_shard x tp)
    tokens: int = 4096                 # tokens per data-parallel rank per micro-step (EP)
    shampoo_block: int = SHAMPOO_BLOCK  # Shampoo's max_preconditioner_dim (its rows:B)
    # ZeRO++ (ours only): int8 all-gathers / gradient all-to-alls in groups of
    # `quantization_group` elements, and hpZ's secondary copies over `hpz` consecutive ranks
    quantized_weights: bool = False
    quantized_gradients: bool = False
    quantization_group: int = DEFAULT_GROUP
    hpz: int = 1
    fp8_matmul: bool = False  # FP8 weights' bytes kept with each gathered unit (fp8_linear)

    @property
    def quantized(self) -> bool:
        return self.quantized_weights or self.quantized_gradients

    @property
    def layout_granularity(self) -> str:
        """The granularity every tensor is sharded with, as the engine picks it: the one given,
        else the optimizer's (AdamW8bit: its quantization block, block:256; Shampoo:
        shampoo:B; else rows:1). AdamW8bit quantizes in the blocks it is sharded with, so a
        given granularity is also its quantization block (`"params": {"block": ...}`)."""
        return self.granularity if self.granularity is not None else \
            default_granularity(self.optimizer, self.shampoo_block)

    @property
    def offloads(self) -> bool:
        return self.offload_optimizer > 0 or self.offload_param

    @property
    def mesh(self) -> ParallelSizes:
        return ParallelSizes(self.world_size, self.tp, self.ep, self.hsdp)

    @property
    def shard_size(self) -> int:
        """Ranks a dense unit is sharded over (dp_shard)."""
        return self.mesh.dp_shard

    @property
    def expert_shard_size(self) -> int:
        """Ranks an expert unit is sharded over (efsdp)."""
        return self.mesh.efsdp

    def group_size(self, unit) -> int:
        return self.expert_shard_size if unit.expert else self.shard_size

    @property
    def reduce(self) -> str:
        return self.reduce_dtype or self.param_dtype

    def traffic(self, gathered: int, reduced: int, group_size: int | None = None,
                groups: tuple | None = None, hpz_elements: int = 0) -> dict:
        """Bytes per rank per optimizer step when each micro-step all-gathers `gathered` and
        reduce-scatters `reduced` elements of a rank's shards over M = `group_size` ranks
        (default: the dense shard group): `all_gather` is what each rank
        receives ((M-1) of M shards, in the param dtype), `reduce_scatter` what it sends ((M-1)
        shards, in the reduce dtype), `all_reduce` (HSDP) what a ring all-reduce of the reduced
        shards over the replicas sends. With `groups` (the quantization groups per shard of
        the gathered and of the reduced elements), the quantized collectives move one byte per
        element and four per group instead. `hpz_elements`: full-buffer elements backward
        gathers inside hpZ groups (`all_gather_hpz`: (N-1)/N of them, in the param dtype)."""
        M = self.shard_size if group_size is None else group_size
        R, n = self.hsdp, self.grad_accum
        pb, rb = DTYPE_BYTES[self.param_dtype], DTYPE_BYTES[self.reduce]
        weights, grads = groups if groups is not None else (None, None)
        out = {"all_gather": n * (M - 1) * (gathered * pb if weights is None or
                                            not self.quantized_weights
                                            else gathered + 4 * weights),
               "reduce_scatter": n * (M - 1) * (reduced * rb if grads is None or
                                                not self.quantized_gradients
                                                else reduced + 4 * grads),
               "all_reduce": n * (2 * (R - 1) * reduced * rb // R if R > 1 else 0)}
        if hpz_elements:
            out["all_gather_hpz"] = n * hpz_elements * (self.hpz - 1) // self.hpz * pb
        return out


def default_granularity(optimizer: str, shampoo_block: int = SHAMPOO_BLOCK) -> str:
    """The granularity the engine shards with for `optimizer` when the config sets none
    (optim.sharding_granularity)."""
    if optimizer == "AdamW8bit":
        return ADAMW8BIT_BLOCK
    if optimizer == "Shampoo":
        return shampoo_granularity_for(shampoo_block)
    return "rows:1"


def add_traffic(*parts: dict) -> dict:
    """The key-wise sum of traffic dicts (one per shard group)."""
    out = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0) + value
    return out


def check_setup(setup: Setup, model: ModelShapes | None = None) -> None:
    """Raise CapacityError (one line) for anything that cannot be estimated."""
    if setup.optimizer not in OPTIMIZERS:
        raise CapacityError(f"unknown optimizer {setup.optimizer!r} (expected one of "
                            f"{', '.join(OPTIMIZERS)})")
    for what, dtype in (("param", setup.param_dtype), ("reduce", setup.reduce)):
        if dtype not in DTYPE_BYTES:
            raise CapacityError(f"unknown {what} dtype {dtype!r} (expected one of "
                                f"{', '.join(DTYPE_BYTES)})")
    for what, value in (("world size", setup.world_size), ("gradient accumulation",
                                                          setup.grad_accum),
                        ("HSDP replicate size", setup.hsdp)):
        if not isinstance(value, int) or value < 1:
            raise CapacityError(f"{what} must be a positive integer, got {value!r}")
    if setup.world_size % setup.hsdp:
        raise CapacityError(f"HSDP replicate size {setup.hsdp} does not divide the world size "
                            f"{setup.world_size}")
    for what, value in (("--tp", setup.tp), ("--ep", setup.ep), ("--tokens", setup.tokens),
                        ("--max-preconditioner-dim", setup.shampoo_block)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CapacityError(f"{what} must be a positive integer, got {value!r}")
    try:
        make_mesh(setup.world_size, setup.tp, setup.ep, setup.hsdp)
    except ValueError as err:
        raise CapacityError(str(err)) from None
    if (setup.tp > 1 or setup.ep > 1) and setup.offloads:
        raise CapacityError("offload is not estimated with --tp or --ep")
    if setup.tp > 1 and setup.optimizer == "Muon":
        raise CapacityError("Muon is not estimated with --tp (it orthogonalizes the TP-global "
                            "matrix: its gathers over the TP group are not modelled)")
    ratio = setup.offload_optimizer
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise CapacityError(f"offload_optimizer ratio must be a number in [0, 1] (0: no "
                            f"offload), got {ratio!r}")
    if not isinstance(setup.offload_param, bool):
        raise CapacityError(f"offload_param must be true or false, got {setup.offload_param!r}")
    if (setup.tp > 1 or setup.ep > 1 or setup.offloads) and setup.optimizer == "Shampoo":
        raise CapacityError("Shampoo is not estimated with --tp or offload (the engine "
                            "refuses both) nor with --ep (the engine runs it; the estimate "
                            "does not model it yet)")
    if setup.offloads and setup.optimizer == "Muon":
        raise CapacityError("offload is not estimated for Muon (its momentum and Newton-Schulz "
                            "traffic are not modelled); use AdamW or AdamW8bit")
    _check_zero_plus_plus(setup)
    try:
        granularity = parse_granularity(setup.layout_granularity)
    except ValueError as err:
        raise CapacityError(str(err)) from None
    if setup.optimizer == "AdamW8bit" and granularity.kind in ("element", "tensor"):
        raise CapacityError(f"AdamW8bit quantizes in blocks of its sharding granularity, and "
                            f"{granularity} is not 8-bit block-wise quantization (one scale per "
                            f"{granularity.kind}): use block:N, rows:K or tile:RxC (default "
                            f"{ADAMW8BIT_BLOCK})")
    if setup.optimizer == "Shampoo" and setup.granularity is not None and model is not None:
        _check_shampoo_granularity(granularity, setup.shampoo_block, model)
    if model is not None and setup.root is not None:
        names = [g.name for g in model.groups]
        unknown = [r for r in setup.root if r not in names]
        if unknown:
            raise CapacityError(f"root group {unknown[0]!r} is not a group of {model.path} "
                                f"(groups: {', '.join(names)})")
        repeated = [g.name for g in model.groups if g.name in setup.root and g.repeat > 1]
        if repeated:
            raise CapacityError(f"root group {repeated[0]!r} repeats: a repeated group is one "
                                "unit per repeat, not part of the root")


def _check_zero_plus_plus(setup: Setup) -> None:
    """The ZeRO++ settings as the engine accepts them (engine/config.py)."""
    for what, value in (("--quantization-group", setup.quantization_group),
                        ("--hpz", setup.hpz)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise CapacityError(f"{what} must be a positive integer, got {value!r}")
    if setup.fp8_matmul and not setup.quantized_weights:
        raise CapacityError("--fp8-matmul computes from weights gathered as FP8: it needs "
                            "--quantized-weights")
    if setup.fp8_matmul and setup.hpz > 1:
        raise CapacityError("--fp8-matmul with --hpz is not supported (the engine refuses "
                            "them together)")
    if setup.hpz > 1:
        if setup.tp > 1 or setup.ep > 1 or setup.hsdp > 1 or setup.offloads:
            raise CapacityError("--hpz is not estimated with --tp, --ep, --hsdp or offload "
                                "(the engine refuses them together)")
        if setup.world_size % setup.hpz:
            raise CapacityError(f"--hpz {setup.hpz} does not divide the world size "
                                f"{setup.world_size}")


def _check_shampoo_granularity(granularity, block: int, model: ModelShapes) -> None:
    """A granularity given with Shampoo must keep every B x B block on one rank, as the engine
    requires (optim/shampoo.py's shampoo_granularity)."""
    for group in model.groups:
        for name, shape in group.tensors:
            try:
                cut = shampoo_block_cut(shape, granularity.block_size(shape), block)
            except ValueError as err:
                raise CapacityError(f"group {group.name!r}, tensor {name!r}: {err}") from None
            if cut is not None:
                raise CapacityError(
                    f"granularity {granularity} would let a shard boundary cut a {block}x{block} "
                    f"Shampoo block of {group.name}/{name} {list(shape)} (at element {cut}; the "
                    f"engine refuses it): use shampoo:{block} (the default with --optimizer "
                    f"Shampoo), rows:{block} or a multiple of it, or matrix")

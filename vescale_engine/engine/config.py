"""Typed engine config built from a validated JSON config: DeepSpeed's keys with DeepSpeed's
meaning, our `vescale` section, and DeepSpeed's batch-size arithmetic. It reads canonical key
names only (the validator maps DeepSpeed's aliases); what depends on the world size is checked
here, everything else by the validator. Top-level keys the validator ignores (as DeepSpeed
does) are logged once per build, on rank 0. No torch import."""
from __future__ import annotations

import logging
import math
import os
import re
import sys
from dataclasses import dataclass, field

from config_schemas.validate import (ConfigError, offload_param_alone,
                                     offload_param_below_stage_3, read_config,
                                     validate_config)

from ..plan.parallel import ParallelSizes  # the rank layout, one torch-free type with the planner
from ..fsdp.faces import ZeRO3Pieces
from ..fsdp.policy import CommunicationPolicy, MemoryPolicy, ShardingPolicy
from ..plan.quantization import DEFAULT_GROUP
from .. import _connect
from . import extensions

__all__ = ["add_config_arguments", "BatchSizes", "resolve_batch_sizes", "ParallelSizes",
           "parallel_sizes", "SaveOnSignal", "WrapSettings", "Precision", "Offload",
           "Checkpointing", "Reporting", "EngineConfig", "build_config"]

LOG = logging.getLogger("vescale_engine")

DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}


def add_config_arguments(parser):
    """DeepSpeed's argument group: --deepspeed_config (alias --config) and --local_rank, which
    the deepspeed launcher inserts; returns the parser."""
    group = parser.add_argument_group("veScale Engine")
    group.add_argument("--deepspeed_config", "--config", dest="deepspeed_config", default=None,
                       metavar="CONFIG.json", help="engine config (DeepSpeed keys + 'vescale')")
    group.add_argument("--deepspeed", action="store_true", help="accepted for compatibility")
    group.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=-1,
                       help="set by the deepspeed launcher")
    return parser


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int


def resolve_batch_sizes(config: dict, data_parallel_size: int,
                        world_size: int | None = None) -> BatchSizes:
    """train_batch_size = micro_batch x accumulation x data-parallel ranks; any two of the three
    keys determine the third (accumulation defaults to 1), and all three must agree. With
    tensor parallelism (`world_size` > `data_parallel_size`) the three given together may also
    count every rank, as DeepSpeed's AutoTP checks them (and Hugging Face fills "auto"): the
    micro-batch and the accumulation say what trains, the TP peers of a rank share its batch."""
    total = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    accum = config.get("gradient_accumulation_steps")
    dp = data_parallel_size
    derived = total is not None and None in (micro, accum)  # total given, a key derived from it
    if total is None and micro is None:
        raise ConfigError(["set train_batch_size or train_micro_batch_size_per_gpu (or both)"])
    if total is not None and micro is not None and accum is not None:
        if world_size and world_size != dp and total == micro * accum * world_size:
            if _rank() == 0:
                LOG.info("train_batch_size %d counts every rank, as DeepSpeed AutoTP does; the "
                         "%d tensor-parallel peers of a rank share its batch: %d samples per "
                         "step", total, world_size // dp, micro * accum * dp)
        elif total != micro * accum * dp:
            every = f" (or x {world_size} ranks = {micro * accum * world_size}, as DeepSpeed " \
                "AutoTP counts)" if world_size and world_size != dp else ""
            raise ConfigError([f"train_batch_size {total} != train_micro_batch_size_per_gpu "
                               f"{micro} x gradient_accumulation_steps {accum} x {dp} "
                               f"data-parallel ranks = {micro * accum * dp}{every}"])
    elif total is not None and micro is not None:
        if total % (micro * dp):
            raise ConfigError([f"train_batch_size {total} is not a multiple of "
                               f"train_micro_batch_size_per_gpu {micro} x {dp} data-parallel "
                               "ranks"])
        accum = total // (micro * dp)
    elif total is not None:
        accum = accum or 1
        if total % (accum * dp):
            raise ConfigError([f"train_batch_size {total} is not a multiple of "
                               f"gradient_accumulation_steps {accum} x {dp} data-parallel "
                               "ranks"])
        micro = total // (accum * dp)
    else:
        accum = accum or 1
        total = micro * accum * dp
    if derived and world_size and world_size != dp and _rank() == 0:
        LOG.warning("train_batch_size %d under tensor parallelism: derived over the %d "
                    "data-parallel ranks (micro-batch %d, accumulation %d); DeepSpeed AutoTP "
                    "derives it over all %d ranks: give all three keys to be explicit",
                    total, dp, micro, accum, world_size)
    return BatchSizes(total, micro, accum)


def parallel_sizes(config: dict, world_size: int, sp: int = 1) -> ParallelSizes:
    """tensor_parallel.autotp_size, expert_parallel, vescale.hsdp_replicate_size and the
    sequence-parallel size `sp` (the groups of the mpu initialize was given) checked against the
    world size; each problem is one ConfigError line naming the keys. The layout is
    plan.parallel's ParallelSizes, the type the planner's --tp/--ep/--sp make (make_mesh)."""
    tp = config.get("tensor_parallel", {}).get("autotp_size", 0) or 1
    _check_sequence_parallel(config, sp, tp, world_size)
    section = config.get("expert_parallel", {})
    ep = section.get("autoep_size", 1) if section.get("enabled", False) else 1
    if section.get("autoep_size", 1) > 1 and ep == 1 and _rank() == 0:
        LOG.warning("expert_parallel.autoep_size %d does nothing: expert_parallel.enabled is "
                    "not true", section["autoep_size"])
    ves = config.get("vescale", {})
    if ves.get("tensor_parallel") and tp == 1:
        raise ConfigError(["vescale.tensor_parallel is a tensor-parallel plan: it needs "
                           "tensor_parallel.autotp_size > 1"])
    if world_size % tp:
        raise ConfigError([f"tensor_parallel.autotp_size {tp} does not divide the world size "
                           f"{world_size}"])
    if tp > 1 and ep > 1:
        raise ConfigError([f"tensor_parallel.autotp_size {tp} with expert_parallel.autoep_size "
                           f"{ep}: tensor and expert parallelism together are not supported "
                           "yet; use one of them"])
    if tp > 1 and (config.get("optimizer") or {}).get("type") == "Shampoo":
        raise ConfigError([f"optimizer Shampoo with tensor_parallel.autotp_size {tp}: tensor "
                           "parallelism splits matrices, and Shampoo's blocks must be the whole "
                           "matrix's; Shampoo supports data and expert parallelism"])
    dp = world_size // tp
    stage = config.get("zero_optimization", {}).get("stage", 3)
    replicas = ves.get("hsdp_replicate_size", 1)
    where = f"the world size {world_size}" if tp == 1 else \
        f"the data-parallel size {dp} (world {world_size} / autotp_size {tp})"
    if dp % replicas:
        raise ConfigError([f"vescale.hsdp_replicate_size {replicas} does not divide {where}"])
    if stage == 0:  # replicate only: no shard dim for EP to borrow from
        if ep > 1:
            raise ConfigError([f"expert_parallel.autoep_size {ep} needs zero_optimization.stage "
                               ">= 1: at stage 0 nothing is sharded for the experts to split"])
        replicas = dp
    shard = dp // replicas
    if shard % ep:
        raise ConfigError([f"expert_parallel.autoep_size {ep} does not divide the data-parallel "
                           f"shard size {shard} (world {world_size} / hsdp_replicate_size "
                           f"{replicas})"])
    if sp > 1 and ep > 1:
        raise ConfigError([f"expert_parallel.autoep_size {ep} with sequence parallelism (groups "
                           f"of {sp}): not supported, as DeepSpeed's ZeRO-3 refuses AutoEP with "
                           "sequence parallelism; use one of them"])
    return ParallelSizes(world_size, tp, ep, replicas, sp)


def _check_sequence_parallel(config: dict, sp: int, tp: int, world_size: int) -> None:
    """The config's sequence_parallel_size against the mpu's groups (`sp`), and what sequence
    parallelism cannot be combined with."""
    given = config.get("sequence_parallel_size", 1)
    if given > 1 and sp == 1:
        raise ConfigError([f"sequence_parallel_size {given} without a sequence-parallel mpu: "
                           "DeepSpeed 0.19.8 then divides only its batch arithmetic by it and "
                           "trains every rank as a data-parallel rank of its own; pass initialize "
                           "the mpu that deepspeed's UlyssesSPAttentionHF.register_with_transformers"
                           " returns (it builds the groups and the attention)"])
    if given > 1 and given != sp:
        raise ConfigError([f"sequence_parallel_size {given}, but the mpu's sequence-parallel "
                           f"groups have {sp} ranks (DeepSpeed would follow the mpu); make them "
                           "agree"])
    if sp > 1 and world_size % sp:
        raise ConfigError([f"sequence-parallel groups of {sp} ranks do not divide the world size "
                           f"{world_size}"])
    if sp > 1 and tp > 1:
        raise ConfigError([f"tensor_parallel.autotp_size {tp} with sequence parallelism (groups "
                           f"of {sp}): not supported together yet; use one of them"])


@dataclass(frozen=True)
class SaveOnSignal:
    """vescale.save_on_signal: the preemption save (engine/preemption.py acts on it)."""
    save_dir: str
    signals: tuple = ("SIGTERM",)
    tag: str = "global_step{global_steps}"

    def tag_at(self, global_steps: int) -> str:
        return self.tag.format(global_steps=global_steps)


def _save_on_signal(spec: dict | None) -> SaveOnSignal | None:
    """The validated section, its tag pattern checked: it must format with {global_steps}
    alone and give a tag save_checkpoint accepts."""
    if spec is None:
        return None
    result = SaveOnSignal(spec["save_dir"], tuple(spec.get("signals", ("SIGTERM",))),
                          spec.get("tag", SaveOnSignal.tag))
    try:
        tag = result.tag_at(0)
    except (KeyError, IndexError, ValueError) as err:
        raise ConfigError([f"vescale.save_on_signal.tag {result.tag!r}: not a pattern with "
                           f"only {{global_steps}} in it ({type(err).__name__}: {err})"]) from None
    if "/" in tag or tag.startswith(".") or tag == "latest":
        raise ConfigError([f"vescale.save_on_signal.tag {result.tag!r} gives {tag!r}: a tag "
                           "has no '/', does not start with '.' and is not 'latest'"])
    return result


@dataclass(frozen=True)
class WrapSettings:
    """Which modules become units and how they shard: vescale.wrap_policy, vescale.granularity,
    zero_optimization.leaf_module, vescale.reshard_after_forward."""
    module_classes: tuple = ()
    min_params: int | None = None
    granularity: str = "rows:1"
    granularity_overrides: dict = field(default_factory=dict)
    # zero_optimization.leaf_module (None: DeepSpeed's default classes), engine/leaf_modules.py
    leaf_module: dict | None = None
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class Precision:
    """The bf16 and fp16 sections and vescale.mixed_precision: compute and reduce dtypes
    (torch's names; None: fp32 / the compute dtype) and fp16's loss-scaling keys."""
    bf16: bool = False
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    fp16: dict = field(default_factory=dict)  # DeepSpeed's fp16 section when enabled, else {}


@dataclass(frozen=True)
class Offload:
    """zero_optimization.offload_optimizer / offload_param with device "cpu"."""
    # {"ratio", "pin_memory", "offload_param"} (offload_param: device "cpu" there too), or None
    optimizer: dict | None = None
    # offload_param (stage 3) without offload_optimizer: the offload initialize applies when
    # there is no optimizer at all (else nothing moves: validate.offload_param_alone)
    param_alone: dict | None = None


@dataclass(frozen=True)
class Checkpointing:
    """What the engine's checkpoints read from the config."""
    import_timeout_s: float = 3 * 3600  # vescale.checkpoint_import_timeout_s (ZeRO imports)
    hf_checkpoint: str | None = None  # vescale.hf_checkpoint: weights initialize loads
    # zero_optimization.stage3_gather_16bit_weights_on_model_save (aliases included): what
    # engine.zero_gather_16bit_weights_on_model_save() answers Trainer and Accelerate
    gather_16bit_weights_on_model_save: bool = False
    save_on_signal: SaveOnSignal | None = None  # the preemption save, when configured
    # checkpoint.writer.decoupled: save_checkpoint returns once the state is staged in host
    # memory; a thread writes it (checkpoint/background.py)
    background_saves: bool = False


@dataclass(frozen=True)
class Reporting:
    steps_per_print: int | float = 10  # math.inf: never (Accelerate writes Infinity)
    wall_clock_breakdown: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """The config as the engine acts on it: DeepSpeed's step semantics as fields, the rest as
    one settings object per concern (fully_shard's policies among them)."""
    raw: dict  # the config as given (DeepSpeed's engine.config); the fields below are canonical
    batch: BatchSizes
    optimizer: dict | None
    scheduler: dict | None
    gradient_clipping: float
    zero_stage: int
    seed: int | None
    local_grad_accumulation: bool = False
    # DeepSpeed's managed_gradient_accumulation: False, every step() call is a boundary
    managed_gradient_accumulation: bool = True
    hsdp_replicate_size: int = 1
    parallel: ParallelSizes | None = None  # the rank layout (None: built without one)
    tensor_parallel_plan: dict = field(default_factory=dict)  # vescale.tensor_parallel
    not_acted_on: tuple = ()
    ignored: tuple = ()  # "key (why)": top-level keys ignored as DeepSpeed ignores them
    canonical: dict = field(default_factory=dict)  # the validated config, canonical names
    wrap: WrapSettings = field(default_factory=WrapSettings)
    precision: Precision = field(default_factory=Precision)
    offload: Offload = field(default_factory=Offload)
    checkpointing: Checkpointing = field(default_factory=Checkpointing)
    reporting: Reporting = field(default_factory=Reporting)
    # how weights and gradients travel: zero_optimization.zero_quantized_weights /
    # zero_quantized_gradients (int8 groups of vescale.quantization_group_size elements),
    # vescale.quantization_format, vescale.fp8_matmul, zero_optimization.zero_hpz_partition_size,
    # vescale.native_collectives (fully_shard's CommunicationPolicy, checked there)
    communication: CommunicationPolicy = field(default_factory=CommunicationPolicy)
    # the planner's buffers and alignment (vescale.planner.max_buffers / align_bytes) and the
    # engine's plain pieces (DeepSpeed ZeRO-3's face); the granularity is set at wrap time,
    # where the optimizer's needs join the config's (engine/wrap.py)
    sharding: ShardingPolicy = field(default_factory=lambda: ShardingPolicy(
        face=ZeRO3Pieces()))
    # zero_optimization.stage3_max_reuse_distance, vescale.grads_in_place
    memory: MemoryPolicy = field(default_factory=MemoryPolicy)


def _offload_optimizer(section: dict | None) -> dict | None:
    """The validated offload_optimizer section as what the engine acts on (None: no offload;
    the schema allows device "none" or "cpu" only)."""
    if not _offloads("zero_optimization.offload_optimizer", section):
        return None
    return {"ratio": float(section.get("ratio", 1.0)),
            "pin_memory": bool(section.get("pin_memory", False))}


def _offloads(name: str, section: dict | None) -> bool:
    """Whether an offload section asks for device "cpu"; with device "none" (or none given)
    any other key it sets is named in a warning: it does nothing."""
    if not section:
        return False
    if section.get("device", "none") != "none":
        return True
    unused = sorted(k for k in section if k != "device")
    if unused and _rank() == 0:
        LOG.warning("%s: device is \"none\", so %s do nothing (set device \"cpu\" to "
                    "offload)", name, ", ".join(unused))
    return False


def _offload_param(zero: dict) -> bool:
    """Whether parameters offload (offload_param device "cpu" at stage 3). Below stage 3 it is
    a warning: DeepSpeed does not read it there, and public stage-2 configs set it. Without
    offload_optimizer a warning too: nothing moves unless there is no optimizer at all."""
    for offload in (offload_param_below_stage_3, offload_param_alone):
        why = offload(zero)
        if why:
            if _rank() == 0:
                LOG.warning("accepted but not acted on: %s", why)
            return offload is offload_param_alone
    return _offloads("zero_optimization.offload_param", zero.get("offload_param"))


def _rank() -> int:
    """This process's rank without importing torch: the process group's if torch.distributed
    is already imported and initialized, else the launcher's RANK, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _reduce_dtype(config: dict, mp: dict, sp: int) -> str | None:
    """vescale.mixed_precision.reduce_dtype; else, with sequence parallelism, DeepSpeed's
    seq_parallel_communication_data_type (default fp32: DeepSpeed's engine reduces gradients in
    it whenever sequence parallelism is on); else None (the compute dtype)."""
    if mp.get("reduce_dtype"):
        return DTYPES[mp["reduce_dtype"]]
    key = "seq_parallel_communication_data_type"
    if sp > 1:
        return DTYPES[config.get(key, "fp32")]
    if key in config and _rank() == 0:
        LOG.warning("%s does nothing without sequence parallelism (DeepSpeed reads it only when "
                    "an mpu makes sequence-parallel groups)", key)
    return None


def build_config(source, world_size: int, sequence_parallel: int = 1) -> EngineConfig:
    """Validate `source` (path or dict) and resolve it for `world_size` ranks in sequence-parallel
    groups of `sequence_parallel` (the mpu's); every problem is a ConfigError raised before any
    collective starts, an "auto" that Hugging Face did not fill in included."""
    _connect()  # an unset key's meaning may be an integration's (gradient_clipping's)
    raw = read_config(source)
    prefix = f"{source}: " if not isinstance(source, dict) else ""
    try:
        config, report = validate_config(raw, allow_auto=False)
    except ConfigError as err:
        raise ConfigError([prefix + m for m in err.messages]) from None
    if report.ignored and _rank() == 0:
        LOG.warning("%sconfig keys ignored, as DeepSpeed ignores them: %s", prefix,
                    "; ".join(report.ignored))
    ves = config.get("vescale", {})
    sizes = parallel_sizes(config, world_size, sequence_parallel)
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 3)
    offload, alone = _offload_settings(zero)
    # unset: DeepSpeed's default where DeepSpeed is installed (its integration's, extensions.py)
    clipping = float(config["gradient_clipping"]) if "gradient_clipping" in config \
        else float(extensions.config_default("gradient_clipping", 0.0))
    return EngineConfig(
        raw=raw,
        # tensor-parallel peers share a batch (the totals may count them, as AutoTP's do);
        # sequence-parallel peers compute one: DeepSpeed counts world / sp, strictly
        batch=resolve_batch_sizes(config, sizes.dp, world_size // sizes.sp),
        optimizer=config.get("optimizer"), scheduler=config.get("scheduler"),
        gradient_clipping=clipping, zero_stage=stage, seed=config.get("seed"),
        local_grad_accumulation=ves.get("local_grad_accumulation", False),
        managed_gradient_accumulation=config.get("managed_gradient_accumulation", True),
        hsdp_replicate_size=ves.get("hsdp_replicate_size", 1), parallel=sizes,
        tensor_parallel_plan=dict(ves.get("tensor_parallel", {})),
        not_acted_on=tuple(report.not_acted_on), ignored=tuple(report.ignored),
        canonical=config, wrap=_wrap_settings(ves, zero, stage),
        precision=_precision(config, ves, sizes.sp), offload=Offload(offload, alone),
        checkpointing=_checkpointing(config, ves, zero), reporting=_reporting(config),
        **_policies(zero, ves, stage, sizes, offload, prefix),
    )


def _wrap_settings(ves: dict, zero: dict, stage: int) -> WrapSettings:
    wrap, granularity = ves.get("wrap_policy", {}), ves.get("granularity", {})
    return WrapSettings(module_classes=tuple(wrap.get("module_classes", ())),
                        min_params=wrap.get("min_params"),
                        granularity=granularity.get("default", "rows:1"),
                        granularity_overrides=dict(granularity.get("overrides", {})),
                        leaf_module=zero.get("leaf_module"),
                        reshard_after_forward=ves.get("reshard_after_forward", stage >= 3))


def _precision(config: dict, ves: dict, sp: int) -> Precision:
    bf16 = config.get("bf16", {}).get("enabled", False)  # both true: the validator's error
    fp16 = config.get("fp16", {}).get("enabled", False)
    mp = ves.get("mixed_precision", {})
    param_dtype = mp.get("param_dtype") or ("bf16" if bf16 else "fp16" if fp16 else None)
    return Precision(bf16=bf16, param_dtype=DTYPES.get(param_dtype) if param_dtype else None,
                     reduce_dtype=_reduce_dtype(config, mp, sp),
                     fp16=dict(config.get("fp16", {})) if fp16 else {})


def _checkpointing(config: dict, ves: dict, zero: dict) -> Checkpointing:
    writer = (config.get("checkpoint") or {}).get("writer") or {}
    return Checkpointing(
        import_timeout_s=float(ves.get("checkpoint_import_timeout_s", 3 * 3600)),
        hf_checkpoint=ves.get("hf_checkpoint"),
        gather_16bit_weights_on_model_save=zero.get("stage3_gather_16bit_weights_on_model_save",
                                                    False),
        save_on_signal=_save_on_signal(ves.get("save_on_signal")),
        background_saves=bool(writer.get("decoupled", False)))


def _reporting(config: dict) -> Reporting:
    steps = config.get("steps_per_print", 10)
    return Reporting(steps_per_print=steps if steps == math.inf else int(steps),
                     wall_clock_breakdown=config.get("wall_clock_breakdown", False))


def _offload_settings(zero: dict) -> tuple:
    """(offload_optimizer settings or None, offload_param alone or None): offload_param joins
    offload_optimizer's host copy where both are set (either one pins), else stands alone."""
    offload = _offload_optimizer(zero.get("offload_optimizer"))
    if not _offload_param(zero):
        return offload, None
    pin = bool((zero.get("offload_param") or {}).get("pin_memory", False))
    if offload is not None:
        return {**offload, "offload_param": True,
                "pin_memory": offload["pin_memory"] or pin}, None
    return None, {"ratio": 1.0, "pin_memory": pin, "offload_param": True}


def _policies(zero: dict, ves: dict, stage: int, sizes, offload, prefix: str) -> dict:
    """fully_shard's policies from the config: how weights and gradients travel, the planner's
    buffers and the engine's plain pieces (DeepSpeed ZeRO-3's face), what stays in memory."""
    planner = ves.get("planner", {})
    return dict(
        communication=_communication(zero, ves, stage, sizes, offload, prefix),
        sharding=ShardingPolicy(max_buffers=planner.get("max_buffers", 4),
                                align_bytes=planner.get("align_bytes", 16), face=ZeRO3Pieces()),
        memory=MemoryPolicy(grads_in_place=ves.get("grads_in_place", True),
                            max_reuse_distance=int(zero.get("stage3_max_reuse_distance", 0))))


# fully_shard's names in CommunicationPolicy's messages -> the config keys that set them
_CONFIG_NAMES = {"quantized_weights": "zero_optimization.zero_quantized_weights",
                 "quantized_gradients": "zero_optimization.zero_quantized_gradients",
                 "quantization_format": "vescale.quantization_format",
                 "fp8_matmul": "vescale.fp8_matmul",
                 "hpz_partition_size": "zero_optimization.zero_hpz_partition_size",
                 "native_collectives": "vescale.native_collectives"}


def _communication(zero: dict, ves: dict, stage: int, sizes: ParallelSizes, offload,
                   prefix: str) -> CommunicationPolicy:
    """The config's communication keys as fully_shard's CommunicationPolicy, which checks
    them together; its error is re-raised naming the config keys."""
    group = int(ves.get("quantization_group_size", DEFAULT_GROUP))
    weights = _quantized(zero, "zero_quantized_weights", stage, sizes, prefix)
    gradients = _quantized(zero, "zero_quantized_gradients", stage, sizes, prefix)
    hpz = _hpz_partition_size(zero, stage, sizes, offload, prefix)  # its own messages
    try:
        return CommunicationPolicy(
            quantized_weights=group if weights else None,
            quantized_gradients=group if gradients else None,
            quantization_format=ves.get("quantization_format", "int8"),
            fp8_matmul=bool(ves.get("fp8_matmul", False)),
            hpz_partition_size=hpz,
            native_collectives=bool(ves.get("native_collectives", False)))
    except ValueError as err:
        message = re.sub(r"\b(" + "|".join(_CONFIG_NAMES) + r")\b",
                         lambda m: _CONFIG_NAMES[m.group(1)], str(err))
        raise ConfigError([prefix + message]) from None


def _hpz_partition_size(zero: dict, stage: int, sizes: ParallelSizes, offload, prefix) -> int:
    """zero_hpz_partition_size when it can act (stage 3, as DeepSpeed; over the world)."""
    size = int(zero.get("zero_hpz_partition_size", 1) or 1)
    if size == 1:
        return 1
    key = f"{prefix}zero_optimization.zero_hpz_partition_size {size}"
    if stage != 3:
        raise ConfigError([f"{key} acts at stage 3 only (DeepSpeed ignores it at stage "
                           f"{stage}): set stage 3 or remove it"])
    others = [name for name, on in (("tensor parallelism", sizes.tp > 1),
                                    ("expert parallelism", sizes.ep > 1),
                                    ("vescale.hsdp_replicate_size", sizes.replicate > 1),
                                    ("offload_optimizer", offload is not None)) if on]
    if others:
        raise ConfigError([f"{key} with {others[0]} is not supported yet (its groups are "
                           "consecutive ranks of a unit sharded over every rank)"])
    if sizes.world % size:
        raise ConfigError([f"{key} does not divide the {sizes.world} ranks"])
    return size


def _quantized(zero: dict, key: str, stage: int, sizes: ParallelSizes, prefix: str) -> bool:
    """Whether ZeRO++'s `key` acts (stage 3, as DeepSpeed; below it an error)."""
    if not zero.get(key, False):
        return False
    if stage != 3:
        raise ConfigError([f"{prefix}zero_optimization.{key} acts at stage 3 only (DeepSpeed "
                           f"ignores it at stage {stage}): set stage 3 or remove it"])
    if sizes.tp > 1 or sizes.ep > 1:
        raise ConfigError([f"{prefix}zero_optimization.{key} with "
                           f"{'tensor' if sizes.tp > 1 else 'expert'} parallelism is not "
                           "supported yet"])
    return True

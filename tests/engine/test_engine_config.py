"""Typed engine config: DeepSpeed's batch-size arithmetic and the vescale section."""
import pytest

from config_schemas.validate import ConfigError
from vescale_engine.engine.config import BatchSizes, Precision, build_config, resolve_batch_sizes


@pytest.mark.parametrize("keys,world,want", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32}, 8, (32, 4, 1)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2, (30, 3, 5)),
    ({"train_micro_batch_size_per_gpu": 3}, 3, (9, 3, 1)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3,
      "gradient_accumulation_steps": 2}, 4, (24, 3, 2)),
])
def test_any_two_of_three(keys, world, want):
    assert resolve_batch_sizes(keys, world) == BatchSizes(*want)


@pytest.mark.parametrize("keys,world,message", [
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, 4, "train_batch_size 24 != train_micro_batch_size_per_gpu"
                                            " 4 x gradient_accumulation_steps 2 x 4"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, 2, "not a multiple"),
    ({"train_batch_size": 10, "gradient_accumulation_steps": 3}, 2, "not a multiple"),
    ({"gradient_accumulation_steps": 3}, 2, "set train_batch_size or"),
])
def test_inconsistent_batch_sizes_fail(keys, world, message):
    with pytest.raises(ConfigError, match=message):
        resolve_batch_sizes(keys, world)


def test_build_config_maps_deepspeed_and_vescale_keys():
    cfg = build_config({
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "overlap_comm": True},
        "vescale": {"granularity": {"default": "rows:16", "overrides": {"*.experts.*": "tensor"}},
                    "planner": {"max_buffers": 2}, "hsdp_replicate_size": 2,
                    "wrap_policy": {"module_classes": ["Block"]}, "grads_in_place": False},
    }, world_size=4)
    assert cfg.batch == BatchSizes(8, 2, 1)
    assert cfg.precision.param_dtype == "bfloat16" and cfg.precision.reduce_dtype is None
    assert cfg.zero_stage == 2 and cfg.wrap.reshard_after_forward is False
    assert cfg.wrap.granularity == "rows:16"
    assert cfg.wrap.granularity_overrides == {"*.experts.*": "tensor"}
    assert cfg.sharding.max_buffers == 2 and cfg.hsdp_replicate_size == 2 and \
        cfg.memory.grads_in_place is False
    assert cfg.wrap.module_classes == ("Block",) and cfg.gradient_clipping == 1.0
    assert [n.split(" (")[0] for n in cfg.not_acted_on] == ["zero_optimization.overlap_comm"]
    assert cfg.memory.max_reuse_distance == 0  # absent: only the last unit stays gathered
    # absent: reduce-scatter every micro-step, gloo's exchanges
    assert cfg.local_grad_accumulation is False
    assert cfg.communication.native_collectives is False
    reuse = build_config({"train_batch_size": 2, "zero_optimization": {
        "stage": 3, "stage3_max_reuse_distance": 1e9}}, world_size=2)
    assert reuse.memory.max_reuse_distance == 10 ** 9 and reuse.not_acted_on == ()
    runtime = build_config({"train_batch_size": 2, "vescale": {
        "local_grad_accumulation": True, "native_collectives": True}}, world_size=2)
    assert runtime.local_grad_accumulation is True
    assert runtime.communication.native_collectives is True
    assert runtime.not_acted_on == () and runtime.managed_gradient_accumulation is True
    unmanaged = build_config({"train_batch_size": 2, "managed_gradient_accumulation": False},
                             world_size=2)
    assert unmanaged.managed_gradient_accumulation is False and unmanaged.not_acted_on == ()


@pytest.mark.parametrize("config,world,message", [
    ({"train_batch_size": 8, "vescale": {"hsdp_replicate_size": 3}}, 4, "does not divide"),
    ({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, 2,
     "fp16.enabled and bf16.enabled are both true: choose one"),
    ({"train_batch_size": 8, "fp16": {"enabled": True},
      "vescale": {"mixed_precision": {"param_dtype": "bf16"}}}, 2,
     "fp16.enabled computes in float16, but vescale.mixed_precision.param_dtype is 'bf16'"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 5}}, 2, "zero_optimization.stage"),
    ({"train_batch_size": 8, "managed_gradient_accumulation": False,
      "vescale": {"local_grad_accumulation": True}}, 2,
     "vescale.local_grad_accumulation needs managed_gradient_accumulation true"),
])
def test_build_config_errors(config, world, message):
    with pytest.raises(ConfigError, match=message):
        build_config(config, world)


def test_fp16_section_sets_float16_compute_and_keeps_the_scaling_keys():
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "hysteresis": 1}
    cfg = build_config({"train_batch_size": 4, "fp16": fp16}, world_size=2)
    assert cfg.precision == Precision(bf16=False, param_dtype="float16", fp16=fp16)
    off = build_config({"train_batch_size": 4, "fp16": {"enabled": False}}, world_size=2)
    assert off.precision.param_dtype is None and off.precision.fp16 == {}


def test_monitor_and_breakdown_keys_are_acted_on():
    cfg = build_config({"train_batch_size": 4, "wall_clock_breakdown": True,
                        "csv_monitor": {"enabled": True, "output_path": "o", "job_name": "j"},
                        "tensorboard": {"enabled": False}}, world_size=1)
    assert cfg.reporting.wall_clock_breakdown and cfg.not_acted_on == ()


def test_add_config_arguments_accepts_deepspeed_launcher_flags():
    import argparse
    from vescale_engine import add_config_arguments
    parser = add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--local_rank=1", "--config", "c.json", "--deepspeed"])
    assert (args.deepspeed_config, args.local_rank, args.deepspeed) == ("c.json", 1, True)
    assert parser.parse_args(["--deepspeed_config", "d.json"]).deepspeed_config == "d.json"


def test_optimizer_section_keeps_deepspeeds_adam_meaning():
    from vescale_engine.engine.from_config import optimizer_spec
    # "Adam" is AdamW unless adam_w_mode is false; weight decay defaults to FusedAdam's 0.
    assert optimizer_spec({"type": "Adam", "params": {"lr": 1e-3}}) == \
        ("AdamW", {"lr": 1e-3, "weight_decay": 0.0})
    assert optimizer_spec({"type": "Adam", "params": {"adam_w_mode": False}}) == \
        ("Adam", {"weight_decay": 0.0})
    assert optimizer_spec({"type": "AdamW", "params": {"adam_w_mode": False}})[0] == "AdamW"
    # torch_adam: torch's class, so torch's default weight decay (our AdamW's too).
    assert optimizer_spec({"type": "AdamW", "params": {"torch_adam": True}}) == ("AdamW", {})
    assert optimizer_spec(None) == ("AdamW", {"weight_decay": 0.0})
    assert optimizer_spec({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}) == \
        ("SGD", {"lr": 0.1, "momentum": 0.9})


@pytest.mark.parametrize("spec,message", [
    ({"type": "AdamW", "params": {"fp32_optimizer_states": True}},
     "optimizer.params.fp32_optimizer_states: not a parameter of AdamW"),
    ({"type": "SGD", "params": {"betas": [0.9, 0.99]}},
     r"optimizer.params.betas: not a parameter of SGD \(accepted: lr, momentum"),
])
def test_optimizer_keys_the_class_does_not_take_are_one_line_errors(spec, message):
    from vescale_engine.engine.from_config import optimizer_spec
    with pytest.raises(ValueError, match=message):
        optimizer_spec(spec)


def test_steps_per_print_infinity_never_prints():
    """Accelerate writes steps_per_print = float("inf") into every config it manages."""
    import math
    from vescale_engine.engine.progress import Progress
    cfg = build_config({"train_batch_size": 2, "steps_per_print": math.inf}, world_size=2)
    assert cfg.reporting.steps_per_print == math.inf
    progress = Progress(cfg.reporting.steps_per_print, rank=0)
    assert not any(progress.due(step) for step in range(1, 10 ** 4))
    assert build_config({"train_batch_size": 2, "steps_per_print": 1e5},
                        world_size=2).reporting.steps_per_print == 100000


def test_checks_that_need_no_world_size_run_in_the_validator_too():
    from config_schemas.validate import check_config
    for config in ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
                   {"train_batch_size": 9, "train_micro_batch_size_per_gpu": 2}):
        assert check_config(config).errors, config
    # a world size is needed to see this one: 8 = 2 x 1 x 4 ranks, not 3
    assert check_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}).errors == []
    with pytest.raises(ConfigError, match="not a multiple of train_micro_batch_size_per_gpu 2 x 3"):
        build_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}, world_size=3)


def test_our_gradient_clipping_default_is_the_installed_deepspeeds():
    """Our copy of DeepSpeed's GRADIENT_CLIPPING_DEFAULT (we do not read their source for it):
    if a DeepSpeed changes it, this says so, naming both."""
    import deepspeed
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    from vescale_engine.integrations.deepspeed.extension import GRADIENT_CLIPPING_DEFAULT as ours
    assert ours == GRADIENT_CLIPPING_DEFAULT, (
        f"vescale_engine.integrations.deepspeed.extension.GRADIENT_CLIPPING_DEFAULT is "
        f"{ours!r} but the installed DeepSpeed "
        f"{deepspeed.__version__}'s deepspeed.runtime.constants.GRADIENT_CLIPPING_DEFAULT is "
        f"{GRADIENT_CLIPPING_DEFAULT!r}: update ours (and docs/config_reference.md)")


def test_unset_gradient_clipping_is_deepspeeds_default():
    """DeepSpeed 0.19 clips at GRADIENT_CLIPPING_DEFAULT (1.0) when a config does not set
    gradient_clipping (LLaVA-NeXT's zero2_offload.json, for one): so does ours, or the same
    config would train differently in silence. Set explicitly, the value is taken."""
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    from vescale_engine.engine.config import build_config
    for config, want in (({"train_batch_size": 2}, GRADIENT_CLIPPING_DEFAULT),
                         ({"train_batch_size": 2, "gradient_clipping": 0.0}, 0.0),
                         ({"train_batch_size": 2, "gradient_clipping": 0.5}, 0.5)):
        assert build_config(config, world_size=1).gradient_clipping == want, config

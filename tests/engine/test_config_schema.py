"""The config schema: every bad config gets a message naming the JSON path, the value and what
is allowed; DeepSpeed configs pass, with the keys we do not act on listed once."""
import json
import subprocess
import sys

import pytest

from config_schemas.validate import ConfigError, check_config, load_schema, validate_config

ZERO3 = "examples/configs/deepspeed_zero3.json"

BAD = [
    ({"train_batch_sise": 8}, "train_batch_sise: unknown key; did you mean 'train_batch_size'?"),
    ({"train_batch_size": 0}, "train_batch_size: 0 is out of range (must be >= 1)"),
    ({"train_batch_size": "8"}, "train_batch_size: expected integer, got '8'"),
    ({"gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps: expected integer"),
    ({"gradient_clipping": -1}, "gradient_clipping: -1 is out of range (must be >= 0)"),
    ({"optimizer": {"type": "Adafactorx"}}, "optimizer.type: 'Adafactorx' is not allowed"),
    ({"optimizer": {"params": {"lr": 1}}}, "optimizer: missing required key 'type'"),
    ({"optimizer": {"type": "AdamW", "param": {}}},
     "optimizer.param: unknown key; did you mean 'params'?"),
    ({"zero_optimization": {"stage": 4}},
     "zero_optimization.stage: 4 is not allowed (allowed: 0, 1, 2, 3)"),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.device: 'nvme' is not allowed (allowed: 'none', "
     "'cpu'); NVMe offload is not supported: device \"cpu\" keeps the sharded parameters"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.device: 'nvme' is not allowed (allowed: 'none', "
     "'cpu'); NVMe offload is not supported"),
    ({"zero_optimization": {"stage3_prefetch_bucket_sise": 1}},
     "did you mean 'stage3_prefetch_bucket_size'?"),
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled: expected boolean, got 'yes'"),
    ({"fp16": {"min_loss_scale": 0}}, "fp16.min_loss_scale: 0 is out of range (must be > 0)"),
    ({"fp16": {"loss_scale": -1}}, "fp16.loss_scale: -1 is out of range (must be >= 0)"),
    ({"fp16": {"initial_scale_power": 65}},
     "fp16.initial_scale_power: 65 is out of range (must be <= 64)"),
    ({"fp16": {"loss_scale_window": 0}},
     "fp16.loss_scale_window: 0 is out of range (must be >= 1)"),
    ({"fp16": {"hysteresis": 0}}, "fp16.hysteresis: 0 is out of range (must be >= 1)"),
    ({"fp16": {"loss_scale_windows": 100}},
     "fp16.loss_scale_windows: unknown key; did you mean 'loss_scale_window'?"),
    ({"fp16": {"fp16_master_weights_and_grads": True}},
     "fp16.fp16_master_weights_and_grads: true is not allowed (allowed: false); master weights "
     "and gradient shards are always fp32"),
    ({"wall_clock_breakdown": "on"}, "wall_clock_breakdown: expected boolean, got 'on'"),
    ({"csv_monitor": {"enabled": True, "output_dir": "x"}},
     "csv_monitor.output_dir: unknown key; did you mean 'output_path'?"),
    ({"tensorboard": {"job_name": 3}}, "tensorboard.job_name: expected string, got 3"),
    ({"bf16": {"enable": True}}, "bf16.enable: unknown key; did you mean 'enabled'?"),
    ({"vescale": {"granularity": {"default": "rows:0"}}},
     "vescale.granularity.default: 'rows:0' is not valid (expected element, block:N, rows:K"),
    ({"vescale": {"granularity": {"overrides": {"*.experts.*": "tile:32"}}}},
     "vescale.granularity.overrides.*.experts.*: 'tile:32' is not valid"),
    ({"vescale": {"mixed_precision": {"param_dtype": "int8"}}},
     "vescale.mixed_precision.param_dtype: 'int8' is not allowed"),
    ({"vescale": {"planner": {"max_buffers": 0}}},
     "vescale.planner.max_buffers: 0 is out of range (must be >= 1)"),
    ({"vescale": {"wrap_policy": {"module_classes": ["Block", "Block"]}}},
     "vescale.wrap_policy.module_classes: items must be unique"),
    ({"vescale": {"hsdp_replicate": 2}}, "did you mean 'hsdp_replicate_size'?"),
    ({"vescale": {"reshard_after_forward": 1}},
     "vescale.reshard_after_forward: expected boolean, got 1"),
    ({"vescale": {"local_grad_accumulation": "yes"}},
     "vescale.local_grad_accumulation: expected boolean, got 'yes'"),
    ({"vescale": {"local_grad_acumulation": True}},
     "did you mean 'local_grad_accumulation'?"),
    ({"vescale": {"native_collectives": 1}}, "vescale.native_collectives: expected boolean, got 1"),
    ({"zero_optimization": {"stage3_max_reuse_distance": -1}},
     "zero_optimization.stage3_max_reuse_distance: -1 is out of range (must be >= 0)"),
    ({"gradient_predivide_factor": "auto"},
     'gradient_predivide_factor: "auto" is not filled in here: Hugging Face Trainer and '
     'Accelerate replace "auto" only in the keys listed under "auto" in '
     'docs/config_reference.md; give a number'),
]


def test_schema_is_valid_draft_2020_12():
    assert load_schema()["$schema"].endswith("2020-12/schema")


@pytest.mark.parametrize("config,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_config_message(config, message):
    report = check_config(config)
    assert any(message in m for m in report.errors), report.errors
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    assert message in "\n".join(err.value.messages)
    assert "\n" not in str(err.value)


def test_fp16_with_deepspeed_keys_is_accepted_and_acted_on():
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
            "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1}
    config, report = validate_config({"train_batch_size": 8, "fp16": fp16,
                                      "wall_clock_breakdown": True,
                                      "csv_monitor": {"enabled": True}})
    assert report.not_acted_on == []


def test_several_problems_all_reported_in_path_order():
    report = check_config({"zero_optimization": {"stage": 9}, "train_batch_size": 0,
                           "steps_per_prnt": 5})
    assert [m.split(":")[0] for m in report.errors] == [
        "steps_per_prnt", "train_batch_size", "zero_optimization.stage"]


def test_deepspeed_zero3_config_passes_and_lists_ignored_keys_once():
    config, report = validate_config(ZERO3)
    assert config["zero_optimization"]["stage"] == 3
    names = [entry.split(" (")[0] for entry in report.not_acted_on]
    assert "zero_optimization.overlap_comm" in names and len(names) == len(set(names))
    assert "optimizer" not in " ".join(names)


def vescale(*args):
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_validate_command(tmp_path):
    ok = vescale("validate", ZERO3)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("valid")
    assert "accepted but not acted on: " in ok.stdout
    assert "zero_optimization.overlap_comm (" in ok.stdout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 4}, "train_batch_sise": 1}))
    out = vescale("validate", str(bad))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{bad}: zero_optimization.stage: 4 is not allowed" in out.stderr
    assert "did you mean 'train_batch_size'?" in out.stderr
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    out = vescale("validate", str(broken))
    assert out.returncode == 2 and "not valid JSON" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_granularity_kinds_the_optimizers_use_are_accepted():
    for kind in ("block:256", "matrix", "tile:32x32", "element", "tensor"):
        assert check_config({"vescale": {"granularity": {"default": kind}}}).errors == [], kind


def test_values_that_are_not_json_get_a_message_not_a_crash():
    from pathlib import Path
    report = check_config({"zero_optimization": {"offload_param": {"nvme_path": Path("/nvme")}}})
    assert report.errors == ["zero_optimization.offload_param.nvme_path: expected string or null, "
                             "got \"PosixPath('/nvme')\""], report.errors


def test_ignored_top_level_keys_are_reported_and_left_out_of_the_config():
    """An unknown top-level key is in report.ignored, not in the config the engine reads (raw
    keeps it); misspellings of acted-on keys are errors: one character off for names of up to
    five characters, two for longer ones."""
    raw = {"train_batch_size": 8, "monitor_config": {"enabled": True},
           "zero_optimization": {"stage": 3},
           "zero_optimization.stage3_prefetch_bucket_size": 10}
    config, report = validate_config(raw)
    assert [entry.split(" (")[0] for entry in report.ignored] == [
        "monitor_config", "zero_optimization.stage3_prefetch_bucket_size"]
    assert "monitor_config" not in config and "monitor_config" in raw
    assert config["zero_optimization"] == {"stage": 3}
    assert check_config({"gradient_accumulation_stpes": 2}).errors == [
        "gradient_accumulation_stpes: unknown key; did you mean 'gradient_accumulation_steps'?"]
    assert check_config({"bf1": {}}).errors == ["bf1: unknown key; did you mean 'bf16'?"]
    assert check_config({"bf": {}}).errors == [] and check_config({"fp8": {}}).errors == []
    assert check_config({"zero_optimisation": {}}).errors[0].startswith(
        "zero_optimisation: unknown key; did you mean 'zero_optimization'?")
    # keys we do not act on: a near-miss changes nothing, so it is ignored like any other
    assert check_config({"zero_allow_untested_optimiser": True}).errors == []


def test_keys_deepspeed_reads_are_never_ignored_as_if_it_did_not():
    """sequence_parallel_size, seq_parallel_communication_data_type and aio are read by
    DeepSpeed (its batch arithmetic and groups; its gradient reduction under sequence
    parallelism; NVMe offload's I/O): never the "ignored, as DeepSpeed ignores it" path. The
    first two are acted on (engine/config.py checks sequence_parallel_size against the mpu);
    aio is reported as not acted on, with why."""
    config, report = validate_config({"train_batch_size": 8, "sequence_parallel_size": 2,
                                      "seq_parallel_communication_data_type": "bf16",
                                      "aio": {"block_size": 1048576}})
    assert config["sequence_parallel_size"] == 2
    assert config["seq_parallel_communication_data_type"] == "bf16"
    assert report.ignored == [] and any(n.startswith("aio (DeepSpeed's asynchronous I/O")
                                        for n in report.not_acted_on), report
    assert not any(n.startswith("seq") for n in report.not_acted_on), report
    with pytest.raises(ConfigError, match="sequence_parallel_size"):
        validate_config({"train_batch_size": 8, "sequence_parallel_size": 0})


def test_zero_and_one_are_booleans_as_deepspeed_reads_them():
    report = check_config({"train_batch_size": 2, "zero_allow_untested_optimizer": 1,
                           "bf16": {"enabled": 1}, "zero_optimization": {
                               "stage": 3, "contiguous_gradients": 0}})
    assert report.errors == []
    assert report.config["bf16"]["enabled"] is True
    assert report.config["zero_optimization"]["contiguous_gradients"] is False
    assert "zero_allow_untested_optimizer 1 (= true; DeepSpeed reads 0 and 1 as booleans)" in \
        report.aliases
    # other numbers are not booleans there either
    assert check_config({"train_batch_size": 2, "bf16": {"enabled": 2}}).errors


def test_config_error_crosses_processes_whole():
    import pickle
    err = pickle.loads(pickle.dumps(ConfigError(["train_batch_size: 0 is out of range"])))
    assert str(err) == "train_batch_size: 0 is out of range" and err.messages == [
        "train_batch_size: 0 is out of range"]

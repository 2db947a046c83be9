"""Configs as users have them: the ZeRO configs public fine-tuning projects ship
(tests/configs_in_the_wild/public/, copied verbatim; sources in its README), configs in the
style of such projects (tests/configs_in_the_wild/, written for these tests) and bad configs,
each with the outcome `vescale validate` must give and the message it must print; each public
config built as Hugging Face Trainer hands it to initialize; TRL's DPO reference-model config;
the "auto" values reaching initialize unresolved; and the tables the validator relies on
checked against the DeepSpeed, transformers and accelerate sources installed (so a new version
that adds a key fails here)."""
import copy
import inspect
import json
import logging
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from config_schemas.validate import ConfigError, aliases, hf_auto, load_schema
from launcher import cli
from vescale_engine.engine.config import build_config

WILD = Path(__file__).resolve().parents[1] / "configs_in_the_wild"

# (fixture, exit status of `vescale validate`, text its output must contain)
FIXTURES = [
    ("hf_trainer_zero3.json", 0, [
        '"auto": train_micro_batch_size_per_gpu (filled in by Hugging Face Trainer: '
        "TrainingArguments.per_device_train_batch_size; Accelerate: the batch_size of the "
        "DataLoader given to prepare())",
        '"auto": optimizer.params.betas (filled in by Hugging Face Trainer: '
        "[TrainingArguments.adam_beta1, adam_beta2])",
        '"auto": scheduler.params.total_num_steps (filled in by Hugging Face Trainer: the '
        "number of training steps it computes",
        '"auto": zero_optimization.stage3_prefetch_bucket_size (filled in by Hugging Face '
        "Trainer and Accelerate: 0.9 x hidden_size x hidden_size of the model's config; not "
        "acted on)",
        '"auto": fp16.enabled (filled in by Hugging Face Trainer: TrainingArguments.fp16',
        "accepted but not acted on: zero_optimization.overlap_comm (",
        'valid, with 17 "auto" value(s) as listed',
    ]),
    ("hf_trainer_zero3_offload.json", 0, [  # offload_optimizer and offload_param both act
        '"auto": train_micro_batch_size_per_gpu (filled in by Hugging Face Trainer',
        'valid, with 15 "auto" value(s) as listed',
    ]),
    ("llava_style_zero3.json", 0, [
        '"auto": gradient_accumulation_steps (filled in by Hugging Face Trainer: '
        "TrainingArguments.gradient_accumulation_steps",
        '"auto": bf16.enabled (filled in by Hugging Face',
        "zero_optimization.stage3_max_live_parameters (the next unit is prefetched",
        'valid, with 8 "auto" value(s)',
    ]),
    ("llava_style_zero3_offload.json", 0, [
        'valid, with 16 "auto" value(s) as listed',
    ]),
    ("alpaca_style_zero3_aliases.json", 0, [
        "alias: bfloat16 (= bf16; DeepSpeed's older name)",
        "alias: zero_optimization.prefetch_bucket_size (= "
        "zero_optimization.stage3_prefetch_bucket_size; DeepSpeed's name without the stage3_ "
        "prefix)",
        "alias: zero_optimization.max_reuse_distance (= "
        "zero_optimization.stage3_max_reuse_distance;",
        "alias: zero_optimization.stage3_gather_fp16_weights_on_model_save (= "
        "zero_optimization.stage3_gather_16bit_weights_on_model_save; deprecated in DeepSpeed)",
        "alias: optimizer.type 'adamw' (= 'AdamW'; DeepSpeed's optimizer names are "
        "case-insensitive)",
        "zero_optimization.param_persistence_threshold (= "
        "zero_optimization.stage3_param_persistence_threshold) (every parameter of a unit is "
        "sharded)",
    ]),
    ("openrlhf_style_zero3.json", 0, [
        '"auto": zero_optimization.stage3_max_reuse_distance (DeepSpeed reads it as its '
        "default, 1000000000)",
        '"auto": zero_optimization.sub_group_size (DeepSpeed reads it as its default; not '
        "acted on)",
        "data_types (gradients accumulate in fp32",
    ]),
    ("deepspeed_chat_style_zero3.json", 0, [
        "zero_optimization.memory_efficient_linear (no patched linear layer is needed)",
        "hybrid_engine.max_out_tokens (no hybrid engine)",
        "prescale_gradients (gradients are averaged after the reduce-scatter)",
    ]),
    ("accelerate_generated_zero3.json", 0, [
        '"auto": train_batch_size (filled in by Hugging Face',
        "zero_optimization.offload_optimizer.nvme_path (no NVMe offload)",
        'valid, with 2 "auto" value(s)',
    ]),
]


def validate(path, capsys):
    """`vescale validate PATH` in this process: (exit status, stdout + stderr)."""
    status = cli.main(["validate", str(path)])
    out = capsys.readouterr()
    return status, out.out + out.err


@pytest.mark.parametrize("name,status,texts", FIXTURES, ids=[f[0] for f in FIXTURES])
def test_configs_in_the_wild(name, status, texts, capsys):
    got, out = validate(WILD / name, capsys)
    assert got == status, out
    for text in texts:
        assert text in out, (text, out)
    assert "Traceback" not in out


BAD = [
    ({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "1e-4"}}},
     "optimizer.params.lr: expected number, got '1e-4' (a string: write the number without "
     "quotes)"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}},
     "optimizer.params.betas: expected exactly 2 items, got 1: [0.9]"),
    ({"optimizer": {"type": "AdamW8bit", "params": {"betas": ["0.9", 0.95]}}},
     "optimizer.params.betas[0]: expected number, got '0.9'"),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": True}}},
     "optimizer.params.momentum: expected number, got true"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
     'optimizer.params.amsgrad: type "Adam" runs AdamW here, as in DeepSpeed (adam_w_mode '
     "defaults to true), which does not take it; set adam_w_mode false for torch.optim.Adam"),
    # Trainer fills betas into any optimizer section: SGD would then fail in initialize.
    ({"optimizer": {"type": "SGD", "params": {"lr": "auto", "betas": "auto"}}},
     "optimizer.params.betas: unknown key (allowed here: dampening,"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type: 'Lamb' is not allowed"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "100"}}},
     "scheduler.params.warmup_num_steps: expected integer, got '100' (a string: write the "
     "number without quotes)"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}},
     "scheduler.params.warmup_num_steps: 0 is out of range (must be >= 1)"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_max_lr": 1e-3}}},
     "scheduler.params: missing required key 'total_num_steps'"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9,
                                                         "warmup_max_lr": 1e-3}}},
     "scheduler.params.warmup_max_lr: unknown key"),
    ({"scheduler": {"type": "LambdaLR"}},
     "scheduler.type: 'LambdaLR' is not allowed (allowed: 'WarmupLR', "),
    ({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "fp16.enabled and bf16.enabled are both true: choose one"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
     "train_batch_size 30 is not a multiple of train_micro_batch_size_per_gpu 4: no number of "
     "data-parallel ranks satisfies"),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 3},
     "train_batch_size 16 is not a multiple of train_micro_batch_size_per_gpu 2 x "
     "gradient_accumulation_steps 3 = 6"),
    ({"train_batch_size": 10, "gradient_accumulation_steps": 4},
     "train_batch_size 10 is not a multiple of gradient_accumulation_steps 4"),
    ({"steps_per_print": 2.5}, "steps_per_print: 2.5 is not a whole number"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": 1000, "prefetch_bucket_size": 2000}},
     "zero_optimization.prefetch_bucket_size 2000 and "
     "zero_optimization.stage3_prefetch_bucket_size 1000 are one setting (DeepSpeed reads "
     "zero_optimization.prefetch_bucket_size as zero_optimization.stage3_prefetch_bucket_size) "
     "with different values: keep one"),
    ({"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True,
                            "stage3_gather_16bit_weights_on_model_save": False}},
     "zero_optimization.stage3_gather_fp16_weights_on_model_save true and "
     "zero_optimization.stage3_gather_16bit_weights_on_model_save false are one setting"),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": False}},
     'bfloat16 {"enabled": false} and bf16 {"enabled": true} are one setting'),
    ({"zero_optimization": {"max_reuse_distance": -1}},
     "zero_optimization.max_reuse_distance: -1 is out of range (must be >= 0)"),
    ({"zero_optimization": {"prefetch_bucket_sise": 1}},
     "zero_optimization.prefetch_bucket_sise: unknown key; did you mean "
     "'prefetch_bucket_size'?"),
    # "auto" where nobody fills it in
    ({"fp16": {"enabled": True, "loss_scale": "auto"}},
     'fp16.loss_scale: "auto" is not filled in here: Hugging Face Trainer and Accelerate '
     'replace "auto" only in the keys listed under "auto" in docs/config_reference.md; give a '
     "number"),
    ({"bfloat16": {"enabled": "auto"}},  # Hugging Face fills bf16.enabled, not this name
     'bfloat16.enabled: "auto" is not filled in here'),
    ({"vescale": {"hsdp_replicate_size": "auto"}},
     'vescale.hsdp_replicate_size: "auto" is not filled in here'),
    ({"zero_optimization": {"stage3_max_reuse_distance": "1e9"}},
     "zero_optimization.stage3_max_reuse_distance: expected number, got '1e9' (a string"),
    # offload: never silently ignored
    ({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}},
     "zero_optimization.offload_param.device: 'nvme' is not allowed (allowed: 'none', "
     "'cpu'); NVMe offload is not supported: device \"cpu\" keeps the sharded parameters"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}},
     "zero_optimization.offload_optimizer.device: 'nvme' is not allowed (allowed: 'none', "
     "'cpu'); NVMe offload is not supported: device \"cpu\" keeps the optimizer state"),
    ({"zero_optimization": {"cpu_offload": True}},
     "zero_optimization.cpu_offload: true is not allowed (allowed: false); deprecated "
     "DeepSpeed name for offload_optimizer with device cpu: write \"offload_optimizer\": "
     "{\"device\": \"cpu\"} instead"),
    ({"amp": {"enabled": True, "opt_level": "O1"}},
     "amp.enabled: true is not allowed (allowed: false); NVIDIA Apex AMP is not supported"),
    ({"torch_autocast": {"enabled": True}},
     "torch_autocast.enabled: true is not allowed (allowed: false); the engine does not run "
     "the model under torch.autocast"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2, "expert_tensor_parallel_size": 2}},
     "expert_parallel.expert_tensor_parallel_size: 2 is not allowed (allowed: 1); no tensor "
     "parallelism inside experts (as DeepSpeed AutoEP under ZeRO-3)"),
    ({"hybrid_engine": {"enabled": True}}, "hybrid_engine.enabled: true is not allowed"),
    # top-level keys the schema does not list: ignored as in DeepSpeed, except where that would
    # train differently from what the config says
    ({"train_batch_size": 8, "gradient_acumulation_steps": 2},  # DeepSpeed: accumulation 1
     "gradient_acumulation_steps: unknown key; did you mean 'gradient_accumulation_steps'?"),
    ({"vescal": {"hsdp_replicate_size": 2}}, "vescal: unknown key; did you mean 'vescale'?"),
    ({"sed": 3}, "sed: unknown key; did you mean 'seed'?"),
    ({"zero_optimization": {"stage": 3}, "zero_optimization.stage": 2},
     "zero_optimization.stage: DeepSpeed ignores a top-level key with a dot (it reads stage "
     "only inside zero_optimization, so it uses zero_optimization's own 3); write stage inside "
     "zero_optimization"),
    ({"zero_optimization.stage3_max_reuse_distance": 0},
     "zero_optimization.stage3_max_reuse_distance: DeepSpeed ignores a top-level key with a dot "
     "(it reads stage3_max_reuse_distance only inside zero_optimization, so it trains with the "
     "default); write stage3_max_reuse_distance inside zero_optimization"),
    ({"pipeline": {"stages": 2}}, "pipeline: not supported: DeepSpeed acts on it (pipeline "
                                  "parallelism), veScale Engine does not; remove it"),
    ({"nebula": {"enabled": True}},
     "nebula: not supported: removed from DeepSpeed (0.19.8 refuses it; 0.19.3 still acted on it); remove it"),
]


@pytest.mark.parametrize("config,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_configs(config, message, tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    status, out = validate(path, capsys)
    assert status == 2, out
    assert f"{path}: {message}" in out, out
    assert "Traceback" not in out


IGNORED = "unknown top-level key: ignored, as DeepSpeed ignores top-level keys it does not read"

# (config, the warnings `vescale validate` must print; it exits 0)
WARNED = [
    ({"train_batch_size": 8, "comms_config": {"verbose": False}},
     [f"warning: ignored: comms_config ({IGNORED})"]),
    ({"train_batch_size": 8, "fp8": {"enabled": True}},  # 2 from fp16, too short to be a typo
     [f"warning: ignored: fp8 ({IGNORED})"]),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 3, "reduce_bucket_size": 5},
      "zero_optimization.reduce_bucket_size": 4096},
     ["warning: ignored: zero_optimization.reduce_bucket_size (top-level key with a dot: "
      "ignored, as in DeepSpeed, which reads reduce_bucket_size only inside zero_optimization; "
      "not acted on there either: one collective per planner buffer, no buckets; "
      "zero_optimization itself gives 5)"]),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 3}, "zero_optimization.stage": 3},
     ["warning: ignored: zero_optimization.stage (top-level key with a dot: ignored, as in "
      "DeepSpeed, which reads stage only inside zero_optimization, where it has the same "
      "value)"]),
    ({"train_batch_size": 8, "zero_optimization.no_such_key": 1},
     ["warning: ignored: zero_optimization.no_such_key (top-level key with a dot: ignored, as "
      "in DeepSpeed; zero_optimization has no key no_such_key either)"]),
]


@pytest.mark.parametrize("config,texts", WARNED, ids=[str(i) for i in range(len(WARNED))])
def test_top_level_keys_deepspeed_ignores_are_warned_about(config, texts, tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    status, out = validate(path, capsys)
    assert status == 0, out
    for text in texts:
        assert f"{path}: {text}" in out, out
    assert out.count("warning: ") == len(texts), out


def test_validate_command_end_to_end():
    """The real command line, once with a config Hugging Face fills in, once with
    offload_param alone (valid: what it does is printed)."""
    def run(name):
        return subprocess.run([sys.executable, "-m", "launcher.cli", "validate",
                               str(WILD / name)], capture_output=True, text=True, timeout=120)
    ok = run("hf_trainer_zero3.json")
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    lines = ok.stdout.splitlines()
    assert sum('"auto": ' in line for line in lines) == 17  # a line per key
    both = run("hf_trainer_zero3_offload.json")
    assert both.returncode == 0 and both.stderr == "", both.stderr
    alone = run("public/axolotl_zero3_bf16_cpuoffload_params.json")
    assert alone.returncode == 0 and alone.stderr == "", alone.stderr
    assert "accepted but not acted on: " in alone.stdout and PARAM_ALONE in alone.stdout, \
        alone.stdout


def _load(name):
    return json.loads((WILD / name).read_text())


def test_auto_reaching_initialize_is_a_one_line_error_naming_who_fills_it():
    with pytest.raises(ConfigError) as err:
        build_config(str(WILD / "hf_trainer_zero3.json"), world_size=2)
    text = str(err.value)  # the first problem, in the config's order, and how many more
    assert "\n" not in text
    assert text == (f"{WILD / 'hf_trainer_zero3.json'}: fp16.enabled: \"auto\" is filled in by "
                    "Hugging Face (Trainer: TrainingArguments.fp16 or fp16_full_eval; "
                    "Accelerate: mixed_precision=\"fp16\") before initialize; a script calling "
                    "initialize itself must give true or false (and 13 more problem(s))"), text
    messages = "\n".join(err.value.messages)
    assert (f"{WILD / 'hf_trainer_zero3.json'}: train_batch_size: \"auto\" is filled in by "
            "Hugging Face (Trainer: world size x TrainingArguments.per_device_train_batch_size "
            "x gradient_accumulation_steps; Accelerate: the DataLoader's batch_size x "
            "gradient_accumulation_steps x processes) before initialize; a script calling "
            "initialize itself must give a number") in err.value.messages
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "gradient_clipping", "optimizer.params.lr", "optimizer.params.betas",
                "scheduler.params.total_num_steps", "fp16.enabled", "bf16.enabled"):
        assert f'{key}: "auto" is filled in by Hugging Face' in messages, key
    # keys we do not act on may stay "auto": DeepSpeed reads them as its default
    assert "reduce_bucket_size" not in messages and "stage3_prefetch" not in messages
    assert 'must give a list of two numbers' in messages  # betas
    assert 'must give true or false' in messages  # fp16.enabled
    with pytest.raises(ConfigError, match='train_batch_size: "auto" is filled in by Hugging '
                                          "Face"):
        build_config(_load("accelerate_generated_zero3.json"), world_size=2)


def test_a_config_hugging_face_filled_in_builds():
    """transformers' own Trainer fill-in (TrainingArguments values, then the model's
    hidden_size and the step count) leaves nothing for initialize to reject."""
    from transformers.integrations.deepspeed import (HfTrainerDeepSpeedConfig,
                                                     unset_hf_deepspeed_config)
    args = SimpleNamespace(world_size=2, per_device_train_batch_size=3,
                           gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=2e-4,
                           adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-7, weight_decay=0.1,
                           save_on_each_node=False, fp16=False, fp16_full_eval=False, bf16=True,
                           bf16_full_eval=False, get_warmup_steps=lambda steps: steps // 10)
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=64))
    try:
        hf = HfTrainerDeepSpeedConfig(_load("hf_trainer_zero3.json"))
        hf.trainer_config_process(args)
        hf.trainer_config_finalize(args, model, num_training_steps=100)
    finally:
        unset_hf_deepspeed_config()  # transformers keeps a global reference
    cfg = build_config(hf.config, world_size=2)
    assert (cfg.batch.train_batch_size, cfg.batch.micro_batch_per_gpu,
            cfg.batch.gradient_accumulation_steps) == (12, 3, 2)
    assert cfg.optimizer == {"type": "AdamW", "params": {
        "lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-7, "weight_decay": 0.1}}
    assert cfg.scheduler["params"]["total_num_steps"] == 100
    assert cfg.scheduler["params"]["warmup_num_steps"] == 10
    assert cfg.precision.bf16 and cfg.precision.param_dtype == "bfloat16"
    assert cfg.precision.fp16 == {} and cfg.gradient_clipping == 0.5
    assert cfg.checkpointing.gather_16bit_weights_on_model_save is True
    assert cfg.raw is hf.config  # engine.config: the dict as given, DeepSpeed's meaning


def test_direct_initialize_configs_build_with_deepspeeds_meaning():
    rlhf = build_config(_load("openrlhf_style_zero3.json"), world_size=4)
    assert rlhf.memory.max_reuse_distance == 10 ** 9  # "auto": DeepSpeed's default
    assert rlhf.batch.gradient_accumulation_steps == 4 and rlhf.precision.bf16
    not_acted = [entry.split(" (")[0] for entry in rlhf.not_acted_on]
    assert "zero_optimization.sub_group_size" in not_acted and "data_types" in not_acted
    chat = build_config(_load("deepspeed_chat_style_zero3.json"), world_size=2)
    assert chat.batch.gradient_accumulation_steps == 4 and chat.precision.param_dtype == "float16"
    assert chat.precision.fp16 == {"enabled": True, "loss_scale_window": 100}
    accel = _load("accelerate_generated_zero3.json")
    accel.update(train_batch_size=4, train_micro_batch_size_per_gpu=2)  # what prepare() writes
    cfg = build_config(accel, world_size=2)
    assert cfg.reporting.steps_per_print == math.inf
    assert cfg.checkpointing.gather_16bit_weights_on_model_save is False


def test_aliases_are_read_as_the_canonical_key():
    cfg = build_config(_load("alpaca_style_zero3_aliases.json") | {
        "train_batch_size": 4, "optimizer": {"type": "adamw", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "train_micro_batch_size_per_gpu": 2}, world_size=2)
    assert cfg.precision.bf16 and cfg.precision.param_dtype == "bfloat16"  # bfloat16 = bf16
    assert cfg.memory.max_reuse_distance == 10 ** 9  # max_reuse_distance = stage3_max_reuse_distance
    assert cfg.checkpointing.gather_16bit_weights_on_model_save is True  # the deprecated fp16 name
    assert cfg.optimizer["type"] == "AdamW"
    assert "bfloat16" in cfg.raw and "bf16" not in cfg.raw  # raw stays as given
    short = build_config({"train_batch_size": 2, "zero_optimization": {
        "gather_16bit_weights_on_model_save": True}}, world_size=2)
    assert short.checkpointing.gather_16bit_weights_on_model_save is True


# ---- the configs public projects ship (tests/configs_in_the_wild/public/, sources in README) --

PUBLIC = WILD / "public"
PARAM_ALONE = ("zero_optimization.offload_param without offload_optimizer (DeepSpeed then moves "
               "only its 16-bit copy of the parameter shards to host memory")
# The ones offloading parameters without the optimizer: valid, `vescale validate` says what
# that does (ours has no 16-bit copy to move: the device holds what DeepSpeed's does).
PARAM_ALONE_CONFIGS = {"axolotl_zero3_bf16_cpuoffload_params.json", "msswift_zero3_offload.json"}
# The ones refused (transformers' bf16 test config: bfloat16 "auto", below)
REFUSED = {"transformers_tests_ds_config_zero3_bf16.json"}
# The ones offloading the optimizer (device "cpu"): valid, and the engine offloads; the
# value: pin_memory as written, and whether offload_param (device "cpu") comes with it.
OPTIMIZER_OFFLOADING = {"axolotl_zero2.json": (False, False),
                        "llamafactory_ds_z2_offload_config.json": (True, False),
                        # offload_param at stage 2: not read there (DeepSpeed does not either)
                        "llava_next_zero2_offload.json": (True, False),
                        "transformers_tests_ds_config_zero2.json": (True, False),
                        "axolotl_zero3_bf16_cpuoffload_all.json": (True, True),
                        "llamafactory_ds_z3_offload_config.json": (True, True),
                        "llava_zero3_offload.json": (True, True),
                        "transformers_docs_zero3.json": (True, True),
                        "transformers_tests_ds_config_zero3.json": (True, True)}
# Other errors: transformers' own bf16 test config writes DeepSpeed's older name with "auto",
# which Trainer does not fill in (it fills bf16.enabled) and DeepSpeed reads as its default,
# false: bf16 would silently stay off under DeepSpeed.
ALSO_REFUSED = {"transformers_tests_ds_config_zero3_bf16.json": [
    'bfloat16.enabled: "auto" is not filled in here: Hugging Face Trainer and Accelerate '
    'replace "auto" only in']}
STAGE_2_PARAM = ("zero_optimization.offload_param (read at ZeRO stage 3 only, as DeepSpeed does; "
                 "zero_optimization.stage is 2: parameters are not sharded)")
# what `vescale validate` must print for the valid ones beyond "valid"
PUBLIC_TEXTS = {
    "llamafactory_ds_z3_config.json": [f"warning: ignored: comms_config ({IGNORED})",
                                       f"warning: ignored: monitor_config ({IGNORED})"],
    "axolotl_zero1_torch_compile.json": ["accepted but not acted on: ", "compile (DeepSpeed "
                                         "compiles only when the script calls engine.compile()"],
    "openrlhf_get_train_ds_config_zero3.json": ["compile (DeepSpeed compiles only"],
    # LLaVA-NeXT's zero2_offload.json: offload_param at stage 2, which DeepSpeed does not read
    "llava_next_zero2_offload.json": ["accepted but not acted on: ", STAGE_2_PARAM],
    **{name: ["accepted but not acted on: ", PARAM_ALONE] for name in PARAM_ALONE_CONFIGS},
}
PUBLIC_JSON = sorted(p.name for p in PUBLIC.glob("*.json"))
DIRECT = {"openrlhf_get_train_ds_config_zero3.json"}  # given to initialize as written


def test_every_public_config_is_listed_with_its_source():
    readme = (PUBLIC / "README.md").read_text()
    files = sorted(p.name for p in PUBLIC.iterdir() if p.name != "README.md")
    assert len(files) >= 20
    for name in files:
        assert f"`{name}`" in readme, name
    assert REFUSED | PARAM_ALONE_CONFIGS | set(OPTIMIZER_OFFLOADING) <= set(PUBLIC_JSON)


@pytest.mark.parametrize("name", PUBLIC_JSON)
def test_public_config_validates(name, capsys):
    status, out = validate(PUBLIC / name, capsys)
    assert "Traceback" not in out
    if name in REFUSED:
        assert status == 2, out
        for text in ALSO_REFUSED[name]:
            assert text in out, out
        assert "device: 'cpu' is not allowed" not in out, out
        assert f"{PUBLIC / name}: {len(ALSO_REFUSED[name])} problem(s)" in out, out
        return
    assert status == 0, out
    assert any(line.startswith(f"{PUBLIC / name}: valid") for line in out.splitlines()), out
    for text in PUBLIC_TEXTS.get(name, []):
        assert text in out, (text, out)
    if name not in PUBLIC_TEXTS or "warning" not in PUBLIC_TEXTS[name][0]:
        assert "warning: " not in out, out


def _trainer_filled(config, world_size=2):
    """`config` with "auto" filled in as transformers' Trainer does (TrainingArguments values,
    the model's hidden_size, the step count) before it calls initialize."""
    from transformers.integrations.deepspeed import (HfTrainerDeepSpeedConfig,
                                                     unset_hf_deepspeed_config)
    args = SimpleNamespace(world_size=world_size, per_device_train_batch_size=3,
                           gradient_accumulation_steps=2, max_grad_norm=0.5, learning_rate=2e-4,
                           adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-7, weight_decay=0.1,
                           save_on_each_node=False, fp16=False, fp16_full_eval=False, bf16=True,
                           bf16_full_eval=False, get_warmup_steps=lambda steps: steps // 10)
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=64))
    try:
        hf = HfTrainerDeepSpeedConfig(config)
        hf.trainer_config_process(args)
        hf.trainer_config_finalize(args, model, num_training_steps=100)
    finally:
        unset_hf_deepspeed_config()  # transformers keeps a global reference
    return hf.config


@pytest.mark.parametrize("name", PUBLIC_JSON)
def test_public_config_builds_as_trainer_hands_it_over(name, caplog):
    """With "vescale": {} added, as a user switching would: the config Trainer passes to
    initialize builds (the offloading ones fail on offload, naming what to change)."""
    written = _load(f"public/{name}") | {"vescale": {}}
    if name == "transformers_docs_zero3.json":  # the docs print its zero_optimization block
        written |= {key: "auto" for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                            "gradient_accumulation_steps")}
    config = written if name in DIRECT else _trainer_filled(written)
    if name in REFUSED:
        with pytest.raises(ConfigError) as err:
            build_config(config, world_size=2)
        messages = "\n".join(err.value.messages)
        assert "device: 'cpu' is not allowed" not in messages
        for text in ALSO_REFUSED[name]:
            assert text in messages
        return
    with caplog.at_level(logging.WARNING, logger="vescale_engine"):
        cfg = build_config(config, world_size=2)
    assert cfg.zero_stage == written["zero_optimization"]["stage"]
    if name in DIRECT:
        assert (cfg.batch.train_batch_size, cfg.batch.gradient_accumulation_steps) == (8, 4)
    else:
        assert (cfg.batch.train_batch_size, cfg.batch.micro_batch_per_gpu,
                cfg.batch.gradient_accumulation_steps) == (12, 3, 2)
        from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
        assert cfg.gradient_clipping == (0.5 if "gradient_clipping" in written else
                                         GRADIENT_CLIPPING_DEFAULT)
    if name in ("transformers_tests_ds_config_zero2.json", "transformers_tests_ds_config_zero3"
                ".json", "transformers_docs_zero3.json"):  # fp16 "auto" only: Trainer's fp16
        assert not cfg.precision.bf16 and cfg.precision.param_dtype is None  # False: fp32
        assert cfg.precision.fp16 == {}
    else:
        assert cfg.precision.bf16 and cfg.precision.param_dtype == "bfloat16"
    pin, param = OPTIMIZER_OFFLOADING.get(name, (None, False))
    assert cfg.offload.optimizer == (
        None if pin is None else
        {"ratio": 1.0, "pin_memory": pin, **({"offload_param": True} if param else {})})
    assert (cfg.offload.param_alone is not None) == (name in PARAM_ALONE_CONFIGS)
    alone = [r.getMessage() for r in caplog.records if PARAM_ALONE in r.getMessage()]
    assert len(alone) == (name in PARAM_ALONE_CONFIGS), alone
    stage_2 = [r.getMessage() for r in caplog.records if "offload_param (read at" in
               r.getMessage()]
    assert stage_2 == ([f"accepted but not acted on: {STAGE_2_PARAM}"]
                       if name == "llava_next_zero2_offload.json" else []), stage_2
    warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    if name == "llamafactory_ds_z3_config.json":
        assert [e.split(" (")[0] for e in cfg.ignored] == ["comms_config", "monitor_config"]
        assert warnings == ["config keys ignored, as DeepSpeed ignores them: comms_config "
                            f"({IGNORED}); monitor_config ({IGNORED})"], warnings
    else:
        assert cfg.ignored == () and warnings == []


def test_ignored_keys_are_logged_on_rank_0_only(caplog, monkeypatch):
    config = _load("public/llamafactory_ds_z3_config.json")
    config = _trainer_filled(config | {"vescale": {}})
    for rank, logged in (("1", 0), ("0", 1)):
        monkeypatch.setenv("RANK", rank)  # no process group here: the launcher's RANK decides
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vescale_engine"):
            cfg = build_config(config, world_size=2)
        assert len(cfg.ignored) == 2  # every rank knows; rank 0 says it
        assert len([r for r in caplog.records if "ignored" in r.getMessage()]) == logged, rank


def _trl_prepare_deepspeed_config(accelerate_config, hidden_size):
    """The config trl.models.utils.prepare_deepspeed (trl 1.16.0) gives deepspeed.initialize
    for a DPO reference model: the Accelerator's config plus three top-level dotted keys for
    ZeRO-3, without optimizer, scheduler and offload_optimizer (stage 0 below ZeRO-3)."""
    config = copy.deepcopy(accelerate_config)
    stage = config["zero_optimization"]["stage"]
    if stage == 3:
        config.update({
            "zero_optimization.reduce_bucket_size": hidden_size * hidden_size,
            "zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size,
            "zero_optimization.stage3_prefetch_bucket_size": 0.9 * hidden_size * hidden_size})
    config.pop("optimizer", None)
    config.pop("scheduler", None)
    config["zero_optimization"].pop("offload_optimizer", None)
    if stage != 3:
        config["zero_optimization"]["stage"] = 0
    return config


def test_trl_prepare_deepspeed_source_is_what_the_test_copies():
    """The copy above follows trl's code: the same three keys with the same values."""
    from trl.models import utils
    source = inspect.getsource(utils.prepare_deepspeed)
    for line in ('"zero_optimization.reduce_bucket_size": hidden_size * hidden_size',
                 '"zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size',
                 '"zero_optimization.stage3_prefetch_bucket_size": 0.9 * hidden_size * '
                 "hidden_size", 'config_kwargs.pop("optimizer", None)',
                 'config_kwargs.pop("scheduler", None)',
                 'config_kwargs["zero_optimization"].pop("offload_optimizer", None)'):
        assert line in source, line


def test_dpo_reference_model_config_from_trl_builds():
    """TRL's DPO reference model: from the config Trainer filled in (LLaMA-Factory's ZeRO-3 one,
    and TRL's own accelerate ZeRO-3 yaml through accelerate's DeepSpeedPlugin)."""
    import yaml
    from accelerate.utils.dataclasses import DeepSpeedPlugin
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    filled = _trainer_filled(_load("public/llamafactory_ds_z3_config.json") | {"vescale": {}})
    plugin_args = yaml.safe_load((PUBLIC / "trl_deepspeed_zero3.yaml").read_text())
    try:
        plugin = DeepSpeedPlugin(**{k: v for k, v in plugin_args["deepspeed_config"].items()
                                    if k != "deepspeed_multinode_launcher"})
    finally:
        unset_hf_deepspeed_config()
    from_yaml = plugin.deepspeed_config | {  # what Accelerator._prepare_deepspeed fills in
        "train_batch_size": 6, "train_micro_batch_size_per_gpu": 3, "gradient_clipping": 1.0,
        "bf16": {"enabled": True}, "vescale": {}}
    built = []
    for accelerate_config in (filled, from_yaml):
        ref = _trl_prepare_deepspeed_config(accelerate_config, hidden_size=64)
        cfg = build_config(ref, world_size=2)
        built.append(cfg)
        assert cfg.zero_stage == 3 and cfg.optimizer is None and cfg.scheduler is None
        dotted = [e.split(" (")[0] for e in cfg.ignored if e.startswith("zero_optimization.")]
        assert dotted == [
            "zero_optimization.reduce_bucket_size",
            "zero_optimization.stage3_param_persistence_threshold",
            "zero_optimization.stage3_prefetch_bucket_size"]
        assert all("ignored, as in DeepSpeed" in e for e in cfg.ignored if "." in e)
    # Trainer filled the section's prefetch size as int(0.9 * 64 * 64); TRL writes 3686.4: the
    # warning says which value the section holds (the yaml's section has none)
    assert built[0].ignored[-1].endswith("zero_optimization itself gives 3686)"), built[0]
    assert "itself gives" not in " ".join(built[1].ignored)
    assert [e.split(" (")[0] for e in built[0].ignored][:2] == ["comms_config",
                                                                "monitor_config"]


def test_deepspeed_ignores_dotted_and_unknown_top_level_keys():
    """What the warnings claim, checked on the installed DeepSpeed: its config reads the
    section's value, not the dotted key, and accepts LLaMA-Factory's unknown keys."""
    from deepspeed.runtime.config import DeepSpeedConfig
    ds = DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {
        "stage": 3, "reduce_bucket_size": 7}, "zero_optimization.reduce_bucket_size": 5,
        "zero_optimization.stage": 1, "comms_config": {"verbose": False},
        "monitor_config": {"enabled": True}})
    assert ds.zero_config.reduce_bucket_size == 7 and ds.zero_optimization_stage == 3


def _top_level_keys_deepspeed_reads(monkeypatch):
    """Every top-level key the installed DeepSpeedConfig looks up while reading a config: by
    item, `get`, `in` and `in config.keys()` (how it finds "aio"), with deepspeed.comm
    answering as an initialized 1-rank group does (DeepSpeed reads "sequence_parallel_size"
    only then, for its batch arithmetic: world / sp)."""
    import deepspeed.runtime.config as ds_config
    from deepspeed.runtime.config import DeepSpeedConfig
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: 1)
    seen = set()

    class Keys:
        def __init__(self, owner):
            self.owner = owner

        def __contains__(self, key):
            seen.add(key)
            return dict.__contains__(self.owner, key)

        def __iter__(self):
            return iter(dict.keys(self.owner))

    class Recording(dict):
        def keys(self):
            return Keys(self)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

        def get(self, key, default=None):
            seen.add(key)
            return super().get(key, default)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

        def __copy__(self):
            return self

    DeepSpeedConfig(Recording({"train_batch_size": 1}))
    return seen


def test_every_top_level_key_deepspeed_reads_is_in_the_schema(monkeypatch):
    """So an unlisted top-level key really is one DeepSpeed ignores: each key DeepSpeed reads
    is a schema key, an alias, or an x-deepspeed-only error (and nothing else is there)."""
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS
    schema = load_schema()
    reads = _top_level_keys_deepspeed_reads(monkeypatch)
    assert {"aio", "sequence_parallel_size", "zero_optimization"} <= reads, sorted(reads)
    listed = set(schema["properties"]) | {w for w in aliases() if "." not in w}
    assert reads - listed == set(schema["x-deepspeed-only"]), \
        reads - listed ^ set(schema["x-deepspeed-only"])
    removed = {k for k, why in schema["x-deepspeed-only"].items() if why.startswith("removed")}
    assert removed == set(_REMOVED_TOP_LEVEL_CONFIG_KEYS) - set(schema["properties"])


# ---- the tables, checked against the installed DeepSpeed / transformers / accelerate --------

def _schema_keys(path):
    node = load_schema()
    for part in path.split("."):
        node = node["properties"][part]
        if "$ref" in node:
            node = load_schema()["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    return set(node["properties"]) | {w.rsplit(".", 1)[-1] for w in aliases()
                                      if w.rsplit(".", 1)[0] == path}


def _deepspeed_sections():
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)
    return [("zero_optimization", DeepSpeedZeroConfig),
            ("zero_optimization.offload_param", DeepSpeedZeroOffloadParamConfig),
            ("zero_optimization.offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig),
            ("fp16", DeepSpeedFP16Config), ("bf16", DeepSpeedBF16Config),
            ("tensorboard", TensorBoardConfig), ("csv_monitor", CSVConfig),
            ("wandb", WandbConfig), ("comet", CometConfig), ("hybrid_engine", HybridEngineConfig)]


def test_every_key_deepspeeds_config_models_accept_is_accepted():
    """DeepSpeed's pydantic sections accept each field by its name and by its alias: both are
    in our schema (as the key or in x-aliases), and nothing else is."""
    for path, model in _deepspeed_sections():
        theirs = set(model.model_fields) | {f.alias for f in model.model_fields.values()
                                            if f.alias}
        assert _schema_keys(path) == theirs, (path, theirs ^ _schema_keys(path))


def test_aliases_mean_what_they_mean_in_deepspeed():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    fields = DeepSpeedZeroConfig.model_fields
    by_alias = {f.alias: name for name, f in fields.items() if f.alias}
    for written, alias in aliases().items():
        parent, key = written.rsplit(".", 1) if "." in written else ("", written)
        assert alias["of"].rsplit(".", 1)[0] == parent or "." not in alias["of"], written
        canonical = alias["of"].rsplit(".", 1)[-1]
        if parent != "zero_optimization":
            assert (written, alias["of"]) == ("bfloat16", "bf16")
            continue
        extra = fields[key].json_schema_extra or {}
        if extra.get("deprecated"):  # DeepSpeed moves the value to the new field
            assert by_alias[canonical] == extra["new_param"], written
        else:  # the field's name; its alias is the JSON key DeepSpeed documents
            assert fields[key].alias == canonical, written
    from deepspeed.runtime.precision_config import BFLOAT16, BFLOAT16_OLD
    assert (BFLOAT16_OLD, BFLOAT16) == ("bfloat16", "bf16")


def test_auto_table_is_what_trainer_and_accelerate_fill_in():
    """Every key our x-hf-auto lists is one transformers' HfTrainerDeepSpeedConfig, accelerate's
    DeepSpeedPlugin or Accelerator._prepare_deepspeed fills in, and every key they fill is
    listed."""
    from accelerate.accelerator import Accelerator
    from accelerate.utils.dataclasses import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
    key = re.compile(r'"((?:zero_optimization|optimizer|scheduler|fp16|bf16)\.[\w.]+|'
                     r"train_batch_size|train_micro_batch_size_per_gpu|"
                     r'gradient_accumulation_steps|gradient_clipping)"')
    filled = set()
    for source in (HfTrainerDeepSpeedConfig, DeepSpeedPlugin, Accelerator._prepare_deepspeed):
        filled |= set(key.findall(inspect.getsource(source)))
    assert filled == set(hf_auto()), filled ^ set(hf_auto())


def _optimizer_tables():
    own = load_schema()["properties"]["optimizer"]
    return {b["if"]["properties"]["type"]["const"]: b["then"]["properties"]["params"]
            for b in own["allOf"]}


def _accepted(cls, skip=("self", "params", "optimizer")):
    return {name for name, p in inspect.signature(cls.__init__).parameters.items()
            if name not in skip and p.kind is not p.VAR_KEYWORD}


def test_optimizer_param_tables_match_the_classes():
    """optimizer.params per type = what initialize's optimizer_spec passes the class (plus
    DeepSpeed's Adam switches, which it consumes)."""
    import torch
    from vescale_engine import optim
    tables = _optimizer_tables()
    assert set(tables) == set(load_schema()["properties"]["optimizer"]["properties"]["type"]
                              ["enum"])
    switches = {"torch_adam", "adam_w_mode"}
    for name, table in tables.items():
        keys = set(table["properties"])
        if name == "AdamW":
            want = _accepted(optim.OURS["AdamW"]) | switches
        elif name == "Adam":  # AdamW unless adam_w_mode is false, then torch.optim.Adam
            want = _accepted(optim.OURS["AdamW"]) | _accepted(torch.optim.Adam) | switches
        else:
            want = _accepted(optim.OURS.get(name) or getattr(torch.optim, name))
        assert keys == want, (name, keys ^ want)


def test_scheduler_param_tables_match_the_classes():
    import torch
    from deepspeed.runtime import lr_schedules
    own = load_schema()["properties"]["scheduler"]
    for branch in own["allOf"]:
        name = branch["if"]["properties"]["type"]["const"]
        table = branch["then"]["properties"]["params"]
        cls = getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name)
        signature = inspect.signature(cls.__init__).parameters
        callables = {"scale_fn"}  # CyclicLR's: not expressible in JSON
        want = _accepted(cls) - callables
        assert set(table["properties"]) == want, (name, set(table["properties"]) ^ want)
        required = {n for n in want if signature[n].default is inspect.Parameter.empty}
        assert set(table.get("required", [])) == required, name

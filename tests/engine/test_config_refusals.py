"""Every refusal `build_config` makes beyond the JSON Schema's (those need the world size, the
sequence-parallel groups or several keys at once; the schema's own are
tests/engine/test_config_schema.py's), in one table: each row is a config that must be refused
with its one-line message, the key the message names first, and what docs/config_reference.md
says of that key (the rule the user reads before meeting the error).

Checked: each row raises a ConfigError of one line starting as the row says; the rows reach
every `raise ConfigError` of engine/config.py (a new refusal without a row fails here); and the
reference documents each row's rule at its key.
"""
import ast
import re
import traceback
from pathlib import Path

import pytest

from config_schemas.validate import ConfigError
from vescale_engine.engine import config as engine_config
from vescale_engine.engine.config import build_config

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = (ROOT / "docs" / "config_reference.md").read_text()
BATCH = {"train_batch_size": 8}
ZERO3 = {"zero_optimization": {"stage": 3}}

# id: (config, world size, sequence-parallel size, message start (regex), key, the reference's
# words for the rule at that key)
REFUSALS = {
    "no batch size": ({}, 2, 1, r"set train_batch_size or train_micro_batch_size_per_gpu",
                      "train_batch_size", "micro-batch x accumulation steps x data-parallel"),
    "batch product": ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
                       "gradient_accumulation_steps": 2}, 2, 1,
                      r"train_batch_size 8 != train_micro_batch_size_per_gpu 1 x "
                      r"gradient_accumulation_steps 2 x 2 data-parallel ranks = 4",
                      "train_batch_size", "micro-batch x accumulation steps x data-parallel"),
    "batch over micro": ({"train_batch_size": 6, "train_micro_batch_size_per_gpu": 3}, 4, 1,
                         r"train_batch_size 6 is not a multiple of train_micro_batch_size_per_gpu"
                         r" 3 x 4 data-parallel ranks", "train_batch_size",
                         "micro-batch x accumulation steps x data-parallel"),
    "batch over accumulation": ({"train_batch_size": 6, "gradient_accumulation_steps": 3}, 4,
                                1, r"train_batch_size 6 is not a multiple of "
                                r"gradient_accumulation_steps 3 x 4 data-parallel ranks",
                                "train_batch_size",
                                "micro-batch x accumulation steps x data-parallel"),
    "tp plan without tp": ({**BATCH, "vescale": {"tensor_parallel": {"*.fc": "colwise"}}}, 2,
                           1, r"vescale.tensor_parallel is a tensor-parallel plan: it needs "
                           r"tensor_parallel.autotp_size > 1", "vescale.tensor_parallel",
                           "needs tensor_parallel.autotp_size > 1"),
    "tp divides world": ({**BATCH, "tensor_parallel": {"autotp_size": 3}}, 4, 1,
                         r"tensor_parallel.autotp_size 3 does not divide the world size 4",
                         "tensor_parallel.autotp_size", "must divide the world size"),
    "tp with ep": ({**BATCH, "tensor_parallel": {"autotp_size": 2},
                    "expert_parallel": {"enabled": True, "autoep_size": 2}}, 4, 1,
                   r"tensor_parallel.autotp_size 2 with expert_parallel.autoep_size 2: tensor "
                   r"and expert parallelism together are not supported",
                   "tensor_parallel.autotp_size", "not with expert parallelism"),
    "tp with shampoo": ({**BATCH, "tensor_parallel": {"autotp_size": 2},
                         "optimizer": {"type": "Shampoo"}}, 4, 1,
                        r"optimizer Shampoo with tensor_parallel.autotp_size 2",
                        "tensor_parallel.autotp_size", "not with Shampoo"),
    "hsdp divides dp": ({**BATCH, "vescale": {"hsdp_replicate_size": 3}}, 4, 1,
                        r"vescale.hsdp_replicate_size 3 does not divide the world size 4",
                        "vescale.hsdp_replicate_size", "must divide the data-parallel size"),
    "ep at stage 0": ({**BATCH, "zero_optimization": {"stage": 0},
                       "expert_parallel": {"enabled": True, "autoep_size": 2}}, 4, 1,
                      r"expert_parallel.autoep_size 2 needs zero_optimization.stage >= 1",
                      "expert_parallel.autoep_size", "needs ZeRO stage 1 or above"),
    "ep divides shard": ({**BATCH, "expert_parallel": {"enabled": True, "autoep_size": 3}}, 4,
                         1, r"expert_parallel.autoep_size 3 does not divide the data-parallel "
                         r"shard size 4", "expert_parallel.autoep_size",
                         "must divide the data-parallel shard size"),
    "ep with sp": ({**BATCH, "sequence_parallel_size": 2,
                    "expert_parallel": {"enabled": True, "autoep_size": 2}}, 4, 2,
                   r"expert_parallel.autoep_size 2 with sequence parallelism \(groups of 2\)",
                   "expert_parallel.autoep_size", "not with sequence parallelism"),
    "sp without mpu": ({**BATCH, "sequence_parallel_size": 2}, 4, 1,
                       r"sequence_parallel_size 2 without a sequence-parallel mpu",
                       "sequence_parallel_size", "Above 1 without such an mpu it is refused"),
    "sp not the mpu's": ({**BATCH, "sequence_parallel_size": 2}, 8, 4,
                         r"sequence_parallel_size 2, but the mpu's sequence-parallel groups "
                         r"have 4 ranks", "sequence_parallel_size",
                         "must equal the size of the sequence-parallel groups"),
    "sp divides world": ({"train_micro_batch_size_per_gpu": 1}, 6, 4,
                         r"sequence-parallel groups of 4 ranks do not divide the world size 6",
                         "sequence_parallel_size", "The groups must divide the world size"),
    "tp with sp": ({**BATCH, "tensor_parallel": {"autotp_size": 2},
                    "sequence_parallel_size": 2}, 4, 2,
                   r"tensor_parallel.autotp_size 2 with sequence parallelism \(groups of 2\)",
                   "tensor_parallel.autotp_size", "not with sequence parallelism"),
    "signal tag pattern": ({**BATCH, "vescale": {"save_on_signal": {
        "save_dir": "ckpt", "tag": "step{step}"}}}, 2, 1,
        r"vescale.save_on_signal.tag 'step\{step\}': not a pattern with only \{global_steps\}",
        "vescale.save_on_signal.tag", "only `{global_steps}` in it"),
    "signal tag value": ({**BATCH, "vescale": {"save_on_signal": {
        "save_dir": "ckpt", "tag": "latest"}}}, 2, 1,
        r"vescale.save_on_signal.tag 'latest' gives 'latest': a tag has no '/'",
        "vescale.save_on_signal.tag", "a tag save_checkpoint accepts"),
    "qwZ below stage 3": ({**BATCH, "zero_optimization": {
        "stage": 2, "zero_quantized_weights": True}}, 2, 1,
        r"zero_optimization.zero_quantized_weights acts at stage 3 only",
        "zero_optimization.zero_quantized_weights", "(stage 3"),
    "qgZ with tp": ({**BATCH, "tensor_parallel": {"autotp_size": 2}, "zero_optimization": {
        "stage": 3, "zero_quantized_gradients": True}}, 4, 1,
        r"zero_optimization.zero_quantized_gradients with tensor parallelism is not supported",
        "zero_optimization.zero_quantized_gradients", "Not with tensor or expert parallelism"),
    "hpZ below stage 3": ({**BATCH, "zero_optimization": {
        "stage": 2, "zero_hpz_partition_size": 2}}, 4, 1,
        r"zero_optimization.zero_hpz_partition_size 2 acts at stage 3 only",
        "zero_optimization.zero_hpz_partition_size", "(stage 3"),
    "hpZ with hsdp": ({**BATCH, **ZERO3, "vescale": {"hsdp_replicate_size": 2},
                       "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, 4, 1,
                      r"zero_optimization.zero_hpz_partition_size 2 with "
                      r"vescale.hsdp_replicate_size is not supported yet",
                      "zero_optimization.zero_hpz_partition_size",
                      "not with tensor or expert parallelism, HSDP or optimizer offload"),
    "hpZ divides world": ({**BATCH, "zero_optimization": {
        "stage": 3, "zero_hpz_partition_size": 3}}, 4, 1,
        r"zero_optimization.zero_hpz_partition_size 3 does not divide the 4 ranks",
        "zero_optimization.zero_hpz_partition_size", "Must divide the world size"),
    "fp8 format without qwZ": ({**BATCH, **ZERO3, "vescale": {
        "quantization_format": "fp8_e4m3"}}, 2, 1,
        r"vescale.quantization_format='fp8_e4m3' is what the weights travel as: set "
        r"zero_optimization.zero_quantized_weights too", "vescale.quantization_format",
        "What zero_quantized_weights sends"),
    "fp8_matmul without fp8": ({**BATCH, "zero_optimization": {
        "stage": 3, "zero_quantized_weights": True}, "vescale": {"fp8_matmul": True}}, 2, 1,
        r"vescale.fp8_matmul=True computes from weights gathered as FP8 tiles",
        "vescale.fp8_matmul", "With quantization_format fp8_e4m3"),
    "fp8_matmul with hpZ": ({**BATCH, "zero_optimization": {
        "stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2},
        "vescale": {"fp8_matmul": True, "quantization_format": "fp8_e4m3"}}, 2, 1,
        r"vescale.fp8_matmul=True with zero_optimization.zero_hpz_partition_size > 1 is not "
        r"supported", "vescale.fp8_matmul", "Not with zero_hpz_partition_size"),
}


def _refusal(row):
    config, world, sp = row[:3]
    with pytest.raises(ConfigError) as info:
        build_config(config, world_size=world, sequence_parallel=sp)
    return info.value


@pytest.mark.parametrize("name", REFUSALS)
def test_each_refusal_is_one_line_naming_the_keys(name):
    row = REFUSALS[name]
    err = _refusal(row)
    assert len(err.messages) == 1 and "\n" not in err.messages[0], err.messages
    assert re.match(row[3], err.messages[0]), (err.messages[0], row[3])


def _raise_lines() -> set:
    """The lines of engine/config.py that raise a ConfigError of their own (not the
    validator's messages passed on)."""
    tree = ast.parse(Path(engine_config.__file__).read_text())
    return {node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
            and ast.unparse(node.exc.func) == "ConfigError"
            and "err.messages" not in ast.unparse(node.exc)}


def test_the_rows_reach_every_refusal_of_build_config():
    reached = set()
    for row in REFUSALS.values():
        frames = traceback.extract_tb(_refusal(row).__traceback__)
        reached |= {f.lineno for f in frames if f.filename == engine_config.__file__}
    missing = sorted(_raise_lines() - reached)
    assert not missing, f"refusals of engine/config.py without a row here: lines {missing}"


@pytest.mark.parametrize("name", REFUSALS)
def test_the_reference_states_each_rule_at_its_key(name):
    key, words = REFUSALS[name][4:]
    rows = [line for line in REFERENCE.splitlines() if line.startswith(f"| `{key}` |")]
    assert rows, f"docs/config_reference.md has no row for {key}"
    assert any(words in line for line in rows), (
        f"docs/config_reference.md's {key} does not say {words!r} (the rule behind the "
        f"refusal {name!r}): add it to the schema's description and regenerate the reference "
        "(python -m config_schemas.make_reference)")

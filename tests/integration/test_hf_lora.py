"""PEFT LoRA through Hugging Face Trainer, on 2 gloo ranks: the same script once with DeepSpeed
ZeRO-3 and once after the one-line migration (`patch_deepspeed()` plus a "vescale" section).

Under the ZeRO-3 config `from_pretrained` builds the model on meta (zero_init, hf_zero_init)
and `get_peft_model` then adds the adapters. They must keep PEFT's init (kaiming A, zero B),
the base weights — renamed by PEFT to `...q_proj.base_layer.weight` under `base_model.model.`
— must load from the checkpoint, and a `modules_to_save` copy must load its original's values.
Compared: per-step loss and grad norm (1e-6 relative), the frozen base weights against the
checkpoint's tensors (exactly), and the adapter Trainer saves: same names and shapes, tensors
to 1e-3 relative, and its logits loaded onto the base with PEFT to 1e-5.
"""
from __future__ import annotations

import os

import pytest
import torch

from test_hf_trainer import (LR, MICRO, TokenDataset, _close, _recorder,  # noqa: F401
                             _reset_global_state, _start_script, config, model_dir, pool,
                             probe_input)

STEPS = 4
# Weight decay on: the frozen base weights share DBuffers with the adapters, and the optimizer
# must leave them alone as DeepSpeed's does (the frozen-weights check below).
WEIGHT_DECAY = 0.01
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def lora_trainer_rank(rank, world, model_dir, out_dir, cfg, lora, peft_options=None):
    """A user's LoRA script: from_pretrained, get_peft_model, Trainer.train, save_model.
    Returns the logged steps and, from rank 0, the trained model's base weights as the engine
    gathers them for saving."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    _start_script(rank, cfg)
    args = TrainingArguments(
        output_dir=out_dir, deepspeed=cfg, per_device_train_batch_size=MICRO,
        max_steps=STEPS, learning_rate=LR, warmup_steps=1, weight_decay=WEIGHT_DECAY,
        adam_beta2=0.95, max_grad_norm=0.5, logging_steps=1, save_strategy="no",
        report_to="none", seed=0, disable_tqdm=True)
    torch.manual_seed(0)  # seeded before the model (and PEFT's adapter init)
    model = LlamaForCausalLM.from_pretrained(model_dir)  # inside zero.Init at stage 3
    model = get_peft_model(model, LoraConfig(**lora), **(peft_options or {}))
    recorder = _recorder()
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(),
                      callbacks=[recorder])
    trainer.train()
    trainer.save_model(os.path.join(out_dir, "adapter"))
    full = trainer.model_wrapped._zero3_consolidated_16bit_state_dict() or {}  # rank 0
    base = {k: v for k, v in full.items() if "lora_" not in k and "modules_to_save" not in k}
    result = {"engine": type(trainer.model_wrapped).__name__, "train": recorder.train,
              "base": base, "modules_to_save": {k: v for k, v in full.items()
                                                if "modules_to_save" in k}}
    _reset_global_state()
    return result


def lora_error_rank(rank, world, model_dir, out_dir, cfg, lora, peft_options):
    """The LoRA script expected to stop: the error each rank gets (None if it trained) names
    an adapter made on meta."""
    try:
        lora_trainer_rank(rank, world, model_dir, out_dir, cfg, lora, peft_options)
    except Exception as err:  # which error it is: checked below
        _reset_global_state()
        error = f"{type(err).__name__}: {err}"
    else:
        error = None
    assert error is not None and "lora_A" in error and "no known value" in error, error


CASES = {"lora": LORA, "modules_to_save": {**LORA, "modules_to_save": ["lm_head"]}}


@pytest.fixture(scope="module")
def lora_runs(pool, model_dir, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora"))
    done = {}

    def get(engine, case):
        if (engine, case) not in done:
            out = os.path.join(root, f"{engine}-{case}")
            done[engine, case] = (out, pool.run(lora_trainer_rank, model_dir, out,
                                                config(engine, scheduler=False), CASES[case],
                                                timeout=300))
        return done[engine, case]
    return get


def _checkpoint(model_dir) -> dict:
    from safetensors.torch import load_file
    return load_file(os.path.join(model_dir, "model.safetensors"))


def _logits_with_adapter(model_dir, adapter_dir):
    from peft import PeftModel
    from transformers import LlamaForCausalLM
    base = LlamaForCausalLM.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=probe_input()).logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_trainer_same_as_deepspeed(lora_runs, model_dir, case):
    from safetensors.torch import load_file

    ds_dir, ds = lora_runs("deepspeed", case)
    ours_dir, ours = lora_runs("vescale", case)
    assert ds[0]["engine"] == "DeepSpeedEngine" and ours[0]["engine"] == "VeScaleEngine"
    assert sorted(ds[0]["train"]) == list(range(1, STEPS + 1)), ds[0]["train"]
    first, last = ds[0]["train"][1][0], ds[0]["train"][STEPS][0]
    assert last < first * (1 - 1e-3), (first, last)  # it trained
    for rank in range(2):
        for step, (loss, norm, _lr) in ds[rank]["train"].items():
            got = ours[rank]["train"][step]
            for what, a, b in (("loss", got[0], loss), ("grad norm", got[1], norm)):
                assert _close(a, b), f"rank {rank} step {step} {what}: veScale {a} vs " \
                    f"DeepSpeed {b}"

    # The frozen base weights are the checkpoint's, exactly (not re-initialized), on both
    checkpoint = _checkpoint(model_dir)
    for engine, result in (("deepspeed", ds), ("vescale", ours)):
        base = {k.removeprefix("base_model.model.").replace(".base_layer", "")
                .replace(".original_module", ""): v
                for k, v in result[0]["base"].items()}
        assert sorted(base) == sorted(checkpoint), (engine, sorted(set(base) ^ set(checkpoint)))
        for key, value in checkpoint.items():
            assert torch.equal(base[key], value), f"{engine}: {key} is not the checkpoint's"
    if case == "modules_to_save":  # the copy trained from the checkpoint's lm_head
        for engine, result in (("deepspeed", ds), ("vescale", ours)):
            (name, copy), = result[0]["modules_to_save"].items()
            assert name.endswith("lm_head.modules_to_save.default.weight"), name
            assert not torch.equal(copy, checkpoint["lm_head.weight"]), engine  # it trained
        torch.testing.assert_close(ours[0]["modules_to_save"], ds[0]["modules_to_save"],
                                   rtol=1e-3, atol=1e-6)

    # The adapter Trainer saved: same names, shapes and (Adam's round-off aside) values
    saved = {engine: load_file(os.path.join(d, "adapter", "adapter_model.safetensors"))
             for engine, d in (("deepspeed", ds_dir), ("vescale", ours_dir))}
    assert sorted(saved["vescale"]) == sorted(saved["deepspeed"])
    assert any("lora_B" in k for k in saved["vescale"]), sorted(saved["vescale"])
    for key, value in saved["deepspeed"].items():
        assert saved["vescale"][key].shape == value.shape, key
        torch.testing.assert_close(saved["vescale"][key], value, rtol=1e-3, atol=1e-6)
    logits = {engine: _logits_with_adapter(model_dir, os.path.join(d, "adapter"))
              for engine, d in (("deepspeed", ds_dir), ("vescale", ours_dir))}
    torch.testing.assert_close(logits["vescale"], logits["deepspeed"], rtol=1e-5, atol=1e-5)


def test_adapters_made_on_meta_are_an_error(pool, model_dir, tmp_path):
    """get_peft_model(low_cpu_mem_usage=True) makes the adapters on meta, without values:
    initialize stops naming one instead of initializing it with the model's init."""
    pool.run(lora_error_rank, model_dir, str(tmp_path), config("vescale"), LORA,
             {"low_cpu_mem_usage": True}, timeout=300)


def quantized_rank(rank, world, model_dir, cfg):
    """QLoRA's first line under the vescale config: the error from_pretrained gives."""
    from transformers import BitsAndBytesConfig, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    _start_script(rank, cfg)
    keep = HfDeepSpeedConfig(cfg)  # noqa: F841 (transformers holds a weak reference)
    try:
        LlamaForCausalLM.from_pretrained(
            model_dir, quantization_config=BitsAndBytesConfig(load_in_4bit=True))
        error = None
    except Exception as err:  # which error it is: checked below
        error = f"{type(err).__name__}: {err}"
    finally:
        _reset_global_state()
    assert error is not None and "\n" not in error.strip(), error
    assert "bitsandbytes" in error or "quantization" in error, error


def test_quantized_base_is_a_clear_error(pool, model_dir):
    """bitsandbytes needs CUDA (and is not installed here): a 4-bit base under the vescale
    config stops at from_pretrained with one line naming the cause, never trains."""
    pool.run(quantized_rank, model_dir, config("vescale"))

"""TRL's trainers (SFT, DPO, GRPO; full and LoRA) unchanged on 2 gloo ranks: the same script
once with DeepSpeed ZeRO-3 (a config without a "vescale" section) and once after the one-line
migration (`vescale_engine.patch_deepspeed()` plus a "vescale" section in the same config).

Each script builds its trainer as TRL's docs do: the model given by its path (TRL calls
`from_pretrained` after the TRL config exists, so at stage 3 inside `deepspeed.zero.Init`),
LoRA as a peft `LoraConfig` passed as `peft_config`, a tiny in-memory `datasets.Dataset`, a
tokenizer built locally with the `tokenizers` library. TRL's DeepSpeed paths in play:
DPO's reference model goes through `trl.models.utils.prepare_deepspeed` (a second
`deepspeed.initialize`, with top-level dotted "zero_optimization.*" keys); DPO+LoRA's reference
is the policy with its adapter disabled (`disable_adapter()` between forward and backward);
DPO's fused LM head and GRPO's loss read the head's weight through
`trl.trainer.utils.maybe_gather_lm_head_ctx` (`ds_status`, `GatheredParameters`); GRPO
generates inside `unwrap_model_for_generation` with its default `ds3_gather_for_generation`
(`deepspeed.zero.GatheredParameters(model.parameters())`).

Compared: per optimizer step the loss, grad norm and learning rate Trainer logs (1e-6
relative, as in test_hf_trainer.py); the saved model or adapter (same tensor names and shapes,
each tensor within 1e-4 of DeepSpeed's, relative in norm; not element by element: Adam
amplifies round-off where a gradient is near zero, and on AMD EPYC cores one GRPO weight of 2048
ends 1.4e-5 to 4.4e-5 apart from run to run, with the code before and after the
reentrant-checkpointing work alike), loaded in this process without DeepSpeed, gives the same logits
(1e-5); for GRPO the same generated completion ids on every step.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from test_hf_trainer import (_recorder, _reset_global_state, _start_script, config,
                             pool)  # noqa: F401  (pool: its fixture, the ranks started once)

WORLD = 2
VOCAB = 128
STEPS = 4
MICRO = 2
TOLERANCE = 1e-6
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]

# The TRL config each case changes; the rest is common (TRL_ARGS).
CASES = {
    "sft_full": ("sft", False), "sft_lora": ("sft", True),
    "dpo_full": ("dpo", False), "dpo_lora": ("dpo", True),
    "grpo_full": ("grpo", False),
    "sft_lora_reentrant": ("sft", True),
}
# Cases run with more of TRL's own defaults: gradient checkpointing, reentrant (what TRL and
# the recipe projects turn on for PEFT), around each decoder layer's whole call.
CASE_ARGS = {"sft_lora_reentrant": dict(gradient_checkpointing=True,
                                        gradient_checkpointing_kwargs={"use_reentrant": True})}
# What keeps TRL small and on CPU: fp32 (TRL defaults bf16 to True), no gradient
# checkpointing (TRL's default is on), no vLLM (its default is off), short sequences.
TRL_ARGS = dict(per_device_train_batch_size=MICRO, max_steps=STEPS, learning_rate=1e-2,
                warmup_steps=0, weight_decay=0.01, max_grad_norm=0.5, logging_steps=1,
                save_strategy="no", report_to="none", seed=0, disable_tqdm=True, bf16=False,
                gradient_checkpointing=False)
LR_LORA = 5e-2  # LoRA's adapters start at B = 0: a larger step moves the loss in 4 steps


def _word(i):
    return f"w{i}"


def _progression(start, stride, n):
    """n words of an arithmetic progression over the words of the vocabulary (learnable)."""
    words = VOCAB - len(SPECIAL_TOKENS)
    return " ".join(_word((start + stride * k) % words) for k in range(n))


def build_tokenizer():
    """A word-level tokenizer over "w0".."w123" and four special tokens: VOCAB ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [_word(i) for i in range(VOCAB - len(SPECIAL_TOKENS))]
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def dataset(kind):
    """The tiny in-memory dataset each trainer takes, in TRL's standard (not conversational)
    formats: language modeling text, preference triples, prompts."""
    from datasets import Dataset

    rows = range(16)
    if kind == "sft":
        return Dataset.from_dict({"text": [_progression(3 * i, 1 + i % 3, 10) for i in rows]})
    if kind == "dpo":
        return Dataset.from_dict({
            "prompt": [_progression(5 * i, 1 + i % 3, 4) for i in rows],
            "chosen": [_progression(5 * i + 4 * (1 + i % 3), 1 + i % 3, 3) for i in rows],
            "rejected": [_progression(7 * i + 11, 2 + i % 2, 3) for i in rows]})
    return Dataset.from_dict({"prompt": [_progression(9 * i, 1 + i % 4, 4) for i in rows]})


def lora_config():
    from peft import LoraConfig
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM")


def probe_input():
    ids = build_tokenizer()(_progression(2, 3, 8) + " " + _progression(40, 1, 8))["input_ids"]
    return torch.tensor([ids])


# ----------------------------------------------------------------------------- in the ranks

def trl_rank(rank, world, model_dir, out_dir, cfg, case):
    """A user's TRL script for `case`; `cfg` picks DeepSpeed or veScale. Returns the per-step
    (loss, grad norm, lr), the trainer's engine and, for GRPO, every completion's token ids in
    the order the reward function saw them. Saves the trained model (adapter) to out_dir."""
    import transformers
    import trl

    kind, lora = CASES[case]
    _start_script(rank, cfg)
    transformers.set_seed(0)  # before the model (and the LoRA adapters) is built
    options = dict(TRL_ARGS, output_dir=out_dir, deepspeed=cfg, **CASE_ARGS.get(case, {}))
    if lora:
        options["learning_rate"] = LR_LORA
    recorder = _recorder()
    common = dict(model=model_dir, processing_class=build_tokenizer(),
                  train_dataset=dataset(kind), callbacks=[recorder],
                  peft_config=lora_config() if lora else None)
    completions = []
    if kind == "sft":
        trainer = trl.SFTTrainer(args=trl.SFTConfig(max_length=16, **options), **common)
    elif kind == "dpo":
        trainer = trl.DPOTrainer(args=trl.DPOConfig(max_length=16, **options), **common)
    else:
        def reward(completions, completion_ids, **kwargs):
            """A simple reward with a spread between the two completions of a prompt: the
            mean token id of the completion. Records what was generated."""
            completions_seen = [list(ids) for ids in completion_ids]
            record.extend(completions_seen)
            return [sum(ids) / (len(ids) * VOCAB) if ids else 0.0 for ids in completions_seen]

        record = completions
        trainer = trl.GRPOTrainer(
            args=trl.GRPOConfig(num_generations=2, max_completion_length=4, **options),
            reward_funcs=reward, **common)
    trainer.train()
    trainer.save_model(out_dir)
    result = {"engine": type(trainer.model_wrapped).__name__, "train": recorder.train,
              "global_step": trainer.state.global_step, "completions": completions,
              "ref_engine": type(getattr(trainer, "ref_model", None)).__name__}
    _reset_global_state()
    return result


# ----------------------------------------------------------------------------- the runs

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The smallest Llama (hidden 32, 2 layers, VOCAB) and its tokenizer, saved once."""
    from transformers import LlamaConfig, LlamaForCausalLM
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    llama = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, tie_word_embeddings=False,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(llama).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


class Runs:
    """Each script run once per module, on demand; a failed run is remembered and its error
    raised by every test that needs it."""

    def __init__(self, pool, model_dir, root):
        self.pool, self.model_dir, self.root = pool, model_dir, root
        self._done = {}

    def out_dir(self, engine, case):
        return os.path.join(self.root, f"{engine}-{case}")

    def get(self, engine, case):
        key = (engine, case)
        if key not in self._done:
            try:
                self._done[key] = (True, self.pool.run(
                    trl_rank, self.model_dir, self.out_dir(engine, case),
                    config(engine, optimizer=True, scheduler=False), case, timeout=300))
            except AssertionError as err:
                self._done[key] = (False, str(err))
        ok, value = self._done[key]
        if not ok:
            raise AssertionError(f"the run {key} failed:\n{value[-6000:]}")
        return value


@pytest.fixture(scope="module")
def runs(pool, model_dir, tmp_path_factory):
    return Runs(pool, model_dir, str(tmp_path_factory.mktemp("runs")))


# ----------------------------------------------------------------------------- the checks

def _close(a, b, scale=0.0):
    """Within TOLERANCE relative to the larger of |a|, |b| and `scale`; a missing value (None)
    never is."""
    if a is None or b is None:
        return False
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b), scale)


def _saved_tensors(path):
    from safetensors.torch import load_file
    name = next(n for n in ("adapter_model.safetensors", "model.safetensors")
                if os.path.exists(os.path.join(path, n)))
    return name, load_file(os.path.join(path, name))


def _saved_logits(model_dir, path, lora):
    """The saved model (the base plus the saved adapter for LoRA) loaded in this process."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(model_dir if lora else path)
    if lora:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, path)
    with torch.no_grad():
        return model.eval()(input_ids=probe_input()).logits


def _require_trl_trainer(case: str) -> None:
    """Skip a case whose TRL trainer cannot be imported with the installed libraries: trl 0.24
    (LLaMA-Factory 0.9.5's pin) with transformers 5 takes the `(False, None)` that
    transformers 5's `_is_package_available` returns for "available", so its DPO and GRPO
    modules import mergekit and fail. DeepSpeed's run cannot import them either; the SFT cases
    run at every version."""
    import importlib

    import transformers
    import trl
    kind = CASES[case][0]
    try:
        importlib.import_module(f"trl.trainer.{kind}_trainer")
    except Exception as err:  # TRL's own import, whatever it raises
        pytest.skip(f"trl {trl.__version__} cannot import trl.trainer.{kind}_trainer with "
                    f"transformers {transformers.__version__}: {type(err).__name__}: "
                    f"{str(err).splitlines()[-1]}")


def _assert_trained(train: dict, case: str):
    """The DeepSpeed run is a sane reference: STEPS logged steps, each with its own nonzero
    gradient (the model changed every step); DPO starts at loss log 2 (the policy is its
    reference before the first update: a copy, or the LoRA model with lora_B = 0)."""
    assert sorted(train) == list(range(1, STEPS + 1)), train
    grad_norms = [train[step][1] for step in sorted(train)]
    assert all(g > 0 for g in grad_norms) and len(set(grad_norms)) == STEPS, grad_norms
    if case.startswith("dpo"):
        assert abs(train[1][0] - math.log(2)) < 1e-6, train[1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_trl_same_steps_as_deepspeed(runs, case):
    _require_trl_trainer(case)
    ds = runs.get("deepspeed", case)
    assert all(r["engine"] == "DeepSpeedEngine" for r in ds), ds[0]["engine"]
    _assert_trained(ds[0]["train"], case)
    if case == "dpo_full":
        assert ds[0]["ref_engine"] == "DeepSpeedEngine"  # TRL's prepare_deepspeed
    ours = runs.get("vescale", case)
    assert all(r["engine"] == "VeScaleEngine" for r in ours), ours[0]["engine"]
    # GRPO's loss with one iteration per generation is zero but for round-off (the ratio is 1
    # and a group's advantages sum to 0): compare it on the scale of its terms (advantages
    # are O(1)); its gradient (the grad norm) is not zero and is compared relative.
    loss_scale = 1.0 if case.startswith("grpo") else 0.0
    for rank in range(WORLD):
        assert ours[rank]["global_step"] == ds[rank]["global_step"] == STEPS
        assert sorted(ours[rank]["train"]) == sorted(ds[rank]["train"])
        for step in sorted(ds[rank]["train"]):
            for name, a, b, scale in zip(("loss", "grad_norm", "learning_rate"),
                                         ours[rank]["train"][step], ds[rank]["train"][step],
                                         (loss_scale, 0.0, 0.0)):
                assert _close(a, b, scale), f"{case} rank {rank} step {step} {name}: veScale {a!r}, " \
                    f"DeepSpeed {b!r}"
        assert ours[rank]["completions"] == ds[rank]["completions"], rank
    if case.startswith("grpo"):
        # every step generated MICRO completions per rank, some of them not empty
        assert len(ds[0]["completions"]) == STEPS * MICRO, ds[0]["completions"]
        assert any(ds[0]["completions"]), ds[0]["completions"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_trl_saved_model_same_as_deepspeed(runs, model_dir, case):
    _require_trl_trainer(case)
    lora = CASES[case][1]
    saved = {}
    for engine in ("deepspeed", "vescale"):
        runs.get(engine, case)
        path = runs.out_dir(engine, case)
        saved[engine] = _saved_tensors(path), _saved_logits(model_dir, path, lora)
    (ds_file, ds_tensors), ds_logits = saved["deepspeed"]
    (our_file, our_tensors), our_logits = saved["vescale"]
    assert our_file == ds_file == ("adapter_model.safetensors" if lora else "model.safetensors")
    assert {n: t.shape for n, t in our_tensors.items()} == \
        {n: t.shape for n, t in ds_tensors.items()}
    for name, tensor in ds_tensors.items():
        gap = ((our_tensors[name] - tensor).norm() / tensor.norm().clamp_min(1e-30)).item()
        assert gap < 1e-4, f"{case} {name}: {gap:.2e} relative to DeepSpeed's"
    torch.testing.assert_close(our_logits, ds_logits, rtol=1e-5, atol=1e-5)

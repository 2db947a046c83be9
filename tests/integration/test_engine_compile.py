"""engine.compile() on 2 gloo ranks: each innermost unit's forward through torch.compile
(inductor on CPU), equal to the eager engine over 5 steps (the example-style GPT in fp32, bf16
and with accumulation; a Hugging Face Llama through Trainer's torch_compile=True, which reaches
engine.compile through Accelerate as DeepSpeed's does); DeepCompile's options refused in one
line; a unit the compiler refuses runs eagerly with one warning; graph breaks reported once."""
import copy
import logging

import pytest
import torch

import fsdp_models as fm

WORLD, GLOBAL, STEPS = 2, 12, 5
TOLERANCE = 1e-5
# bf16 compute: inductor fuses the casts eager rounds after each op, so losses (bf16 values)
# part by about one bf16 step (2^-7 relative); a wrong gradient moves them far more
BF16_TOLERANCE = 1e-2


def config(bf16=False, accumulation=1, compile_section=None):
    cfg = {"train_batch_size": GLOBAL, "gradient_accumulation_steps": accumulation,
           "gradient_clipping": 1.0, "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "vescale": {"wrap_policy": {"module_classes": ["Block"]}}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if compile_section is not None:
        cfg["compile"] = compile_section
    return cfg


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def gpt_rank(rank, world, compiled, cfg, kwargs=None, breaking=False):
    """The GPT trained STEPS optimizer steps, compiled or not; the world's mean losses and the
    engine's warnings."""
    import torch.distributed as dist
    from vescale_engine import initialize
    records = _Records()
    logging.getLogger("vescale_engine").addHandler(records)
    try:
        torch.manual_seed(0)
        model = fm.make("gpt")
        if breaking:  # a block forward with a graph break in it
            for block in model.blocks:
                forward = block.forward

                def broken(x, forward=forward):
                    torch._dynamo.graph_break()
                    return forward(x)
                block.forward = broken
        engine, *_ = initialize(model=model, config=copy.deepcopy(cfg))
        if compiled:
            engine.compile(backend="inductor", compile_kwargs=kwargs or {})
        losses = []
        accumulation = engine.gradient_accumulation_steps()
        micro = GLOBAL // accumulation
        for step in range(STEPS):
            for m in range(accumulation):
                idx, tgt = fm.batch("gpt", step * accumulation + m, micro)
                part = slice(rank * micro // world, (rank + 1) * micro // world)
                loss = engine(idx[part], tgt[part])
                engine.backward(loss)
                engine.step()
                total = loss.detach().float().clone()
                dist.all_reduce(total)
                losses.append(total.item() / world)
        result = {"losses": losses, "compiled": engine.is_compiled, "warnings": records.lines}
        engine.destroy()
        return result
    finally:
        logging.getLogger("vescale_engine").removeHandler(records)
        torch._dynamo.reset()


POOL_WORLD = WORLD
POOL_ENV = {"DS_ACCELERATOR": "cpu"}


def _assert_close(got, want, what, tolerance=TOLERANCE):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= tolerance * max(abs(b), 1), f"{what}: step {i}: {a} != eager {b}"


@pytest.mark.parametrize("name,cfg", [("fp32", config()), ("bf16", config(bf16=True)),
                                      ("accumulation", config(accumulation=2))])
def test_compiled_units_train_as_eager(pool, name, cfg):
    eager = pool.run(gpt_rank, False, cfg)[0]
    compiled = pool.run(gpt_rank, True, cfg)[0]
    assert compiled["compiled"] and not eager["compiled"]
    _assert_close(compiled["losses"], eager["losses"], name,
                  BF16_TOLERANCE if name == "bf16" else TOLERANCE)
    assert any("4 unit(s) compiled" in w for w in compiled["warnings"]), compiled["warnings"]


def test_a_unit_the_compiler_refuses_runs_eagerly_and_graph_breaks_are_reported(pool):
    eager = pool.run(gpt_rank, False, config(), None, True)[0]
    refused = pool.run(gpt_rank, True, config(), {"fullgraph": True}, True)[0]
    _assert_close(refused["losses"], eager["losses"], "refused")
    named = [w for w in refused["warnings"] if "runs eagerly" in w]
    assert len(named) == 4 and "blocks.0 runs eagerly" in named[0], refused["warnings"]
    broken = pool.run(gpt_rank, True, config(), None, True)[0]
    _assert_close(broken["losses"], eager["losses"], "graph breaks")
    reported = [w for w in broken["warnings"] if "graph break" in w]
    assert len(reported) == 1, broken["warnings"]


def deepcompile_rank(rank, world):
    from vescale_engine import initialize
    records = _Records()
    logging.getLogger("vescale_engine").addHandler(records)
    errors = []
    try:
        engine, *_ = initialize(model=fm.make("gpt"),
                                config=config(compile_section={"deepcompile": True,
                                                               "offload_activation": True}))
        for kwargs in ({"schedule": [(0, [])]}, {"compiled_autograd_enabled": True}):
            try:
                engine.compile(**kwargs)
            except ValueError as err:
                errors.append(str(err))
        engine.compile(backend="inductor", compile_kwargs={"backend": "eager"})
        engine.compile()  # a second call does nothing, as DeepSpeed's
        return errors, records.lines, engine.is_compiled
    finally:
        logging.getLogger("vescale_engine").removeHandler(records)
        torch._dynamo.reset()


def test_deepcompile_options_are_refused_or_named(pool):
    errors, warnings, compiled = pool.run(deepcompile_rank)[0]
    assert compiled and len(errors) == 2 and all("\n" not in e for e in errors), errors
    assert "schedule" in errors[0] and "compiled autograd" in errors[1]
    assert any("compile.deepcompile, compile.offload_activation ask for DeepSpeed's DeepCompile"
               in w for w in warnings), warnings
    assert any("backend in compile_kwargs is overridden" in w for w in warnings), warnings
    assert sum("unit(s) compiled" in w for w in warnings) == 1, warnings


# -- Hugging Face Trainer with torch_compile=True ------------------------------------------------

def trainer_compile_rank(rank, world, model_dir, out_dir, compiled):
    from test_hf_trainer import config as trainer_config
    from test_hf_trainer import trainer_rank
    try:
        return trainer_rank(rank, world, model_dir, out_dir,
                            trainer_config("vescale", optimizer=True, scheduler=False),
                            {"torch_compile": True} if compiled else {})
    finally:
        torch._dynamo.reset()


def test_trainer_torch_compile_reaches_engine_compile_and_trains_as_eager(pool, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from test_hf_trainer import VOCAB
    torch.manual_seed(0)
    model_dir = str(tmp_path / "tiny_llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(model_dir)
    eager = pool.run(trainer_compile_rank, model_dir, str(tmp_path / "eager"), False,
                     timeout=600)[0]
    compiled = pool.run(trainer_compile_rank, model_dir, str(tmp_path / "compiled"), True,
                        timeout=600)[0]
    assert compiled["engine"] == "VeScaleEngine" and compiled["compiled"]
    assert not eager["compiled"]
    assert sorted(compiled["train"]) == sorted(eager["train"])
    for step, (loss, norm, lr) in eager["train"].items():
        got = compiled["train"][step]
        assert abs(got[0] - loss) <= TOLERANCE * loss and abs(got[1] - norm) <= 1e-4 * norm \
            and got[2] == lr, (step, got, (loss, norm, lr))

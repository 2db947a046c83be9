"""initialize + VeScaleEngine on 2 and 3 gloo ranks: DeepSpeed-style training (accumulation,
clipping, DeepSpeed's WarmupLR) equals single-process training of the same global batch."""

import re

import pytest
import torch

import fsdp_models as fm
from dist_harness import engine_log_messages, free_port, value_errors
from vescale_engine import initialize
from vescale_engine.fsdp import full_state_dict, unit_of

MICRO, ACCUM, STEPS = 3, 2, 3
OPT = {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01}
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
    "gradient_clipping": 0.5, "optimizer": {"type": "AdamW", "params": OPT},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                 "warmup_num_steps": 4,
                                                 "warmup_type": "linear"}},
    "vescale": {"wrap_policy": {"module_classes": ["Block"]}, "granularity": {"default": "rows:16"}},
}


POOL_WORLDS = [2, 3]  # (conftest.py's `pool`, once per size)


def engine_rank(rank, world, local_accumulation):
    from deepspeed.runtime.lr_schedules import WarmupLR
    from vescale_engine.shard.stats import STATS
    reference = fm.make("gpt")
    ref_opt = torch.optim.AdamW(reference.parameters(), **OPT)
    ref_sched = WarmupLR(ref_opt, **CONFIG["scheduler"]["params"])
    engine, opt, _, sched = initialize(model=fm.make("gpt"), config={
        **CONFIG, "vescale": {**CONFIG["vescale"],
                              "local_grad_accumulation": local_accumulation}})
    scatters, copied = STATS.reduce_scatters, STATS.bytes_copied
    assert engine.train_batch_size() == MICRO * ACCUM * world
    gaps, lrs = [], []
    for step in range(STEPS):
        idx, tgt = fm.batch("gpt", step, MICRO * ACCUM * world)
        loss = reference(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
        mine = idx[rank * MICRO * ACCUM:(rank + 1) * MICRO * ACCUM]
        theirs = tgt[rank * MICRO * ACCUM:(rank + 1) * MICRO * ACCUM]
        total = torch.zeros(())
        for k in range(ACCUM):
            boundary = engine.is_gradient_accumulation_boundary()
            assert boundary == (k == ACCUM - 1)
            out = engine(mine[k * MICRO:(k + 1) * MICRO], theirs[k * MICRO:(k + 1) * MICRO])
            engine.backward(out)
            engine.step()
            total += out.detach() / ACCUM
        torch.distributed.all_reduce(total)
        gaps.append(abs(total.item() / world - loss.item()) / loss.item())
        lrs.append((engine.get_lr()[0], ref_opt.param_groups[0]["lr"]))
    scatters, copied = STATS.reduce_scatters - scatters, STATS.bytes_copied - copied
    buffers = sum(len(unit_of(m).buffers) for m in engine.module.modules() if unit_of(m))
    full, ref = full_state_dict(engine.module), reference.state_dict()
    diff = torch.cat([(full[k] - ref[k]).flatten() for k in ref]).norm()
    whole = (diff / torch.cat([ref[k].flatten() for k in ref]).norm()).item()
    return (max(gaps), whole, lrs, engine.global_steps, engine.global_samples,
            scatters / (buffers * STEPS), copied)


@pytest.mark.parametrize("local", [False, True], ids=["reduce_every_micro_step", "local"])
def test_engine_matches_single_process(pool, local):
    """Both accumulation modes train like one process; the default reduce-scatters every
    micro-step, vescale.local_grad_accumulation only at the boundary."""
    gap, whole, lrs, steps, samples, scatters_per_buffer_step, copied = \
        pool.run(engine_rank, local)[0]
    assert gap < 1e-6 and whole < 1e-6, (gap, whole)
    assert scatters_per_buffer_step == (1 if local else ACCUM)
    assert copied == 0  # accumulating into the shard is an add, not a copy
    assert all(abs(a - b) < 1e-12 for a, b in lrs) and lrs[0][0] < lrs[-1][0]
    assert steps == STEPS and samples == STEPS * ACCUM * MICRO * pool.world_size


def bad_engine_rank(rank, world):
    model = fm.make("gpt")
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(*fm.batch("gpt", 0, 2)).backward()
    stepped.step()
    other = torch.optim.SGD(fm.make("gpt").parameters(), lr=0.1)
    return value_errors(
        lambda kwargs=kwargs: initialize(**{"model": fm.make("gpt"), **kwargs})
        for kwargs in (dict(config={**CONFIG, "vescale": {"wrap_policy": {"module_classes":
                                                                           ["Nope"]}}}),
                       dict(config=CONFIG, optimizer=other),
                       dict(config={**CONFIG, "train_batch_size": 7}),
                       dict(config=None),
                       dict(model=model, config=CONFIG, optimizer=stepped),
                       dict(config=CONFIG,
                            lr_scheduler=torch.optim.lr_scheduler.StepLR(other, 1))))


def test_engine_bad_input(pool):
    errors = pool.run(bad_engine_rank)[0]
    assert "match no module" in errors[0]
    assert errors[1] == ("the SGD passed to initialize holds a tensor of shape [96, 64] that is "
                         "not a parameter of the model")
    assert "train_batch_size 7" in errors[2]
    assert "no config" in errors[3]
    assert "SGD passed to initialize already holds state for" in errors[4]
    assert "(it has stepped)" in errors[4]
    assert errors[5].startswith("lr_scheduler StepLR steps an optimizer that is not the "
                                "engine's (none passed to initialize"), errors[5]


def patched_rank(rank, world):
    import deepspeed
    import vescale_engine
    from vescale_engine.engine.engine import VeScaleEngine
    original = deepspeed.initialize
    vescale_engine.patch_deepspeed()
    vescale_engine.patch_deepspeed()  # idempotent
    try:
        assert deepspeed.initialize.__vescale_original__ is original
        engine, *_ = deepspeed.initialize(model=fm.make("gpt"), config=CONFIG)
        idx, tgt = fm.batch("gpt", 0, MICRO)
        engine.backward(engine(idx, tgt))
        is_ours, micro_steps = isinstance(engine, VeScaleEngine), engine.micro_steps
        assert is_ours and micro_steps == 0
    finally:
        deepspeed.initialize = original


def test_patch_deepspeed_routes_vescale_configs(pool):
    pool.run(patched_rank)


def test_patch_deepspeed_leaves_other_configs_to_deepspeed(monkeypatch):
    import deepspeed
    from vescale_engine import patch_deepspeed
    calls = []
    monkeypatch.setattr(deepspeed, "initialize", lambda **kw: calls.append(kw) or "deepspeed")
    patch_deepspeed()
    plain = {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
    assert deepspeed.initialize(model="m", config=plain, distributed_port=1) == "deepspeed"
    assert calls == [{"model": "m", "config": plain, "distributed_port": 1}]


def logging_rank(rank, world):
    with engine_log_messages() as messages:
        engine, *_ = initialize(model=fm.make("gpt"), config={**CONFIG, "steps_per_print": 2})
        for step in range(4 * ACCUM):
            idx, tgt = fm.batch("gpt", step, MICRO)
            engine.backward(engine(idx, tgt))
            engine.step()
    return messages


def test_progress_lines_on_rank_zero_every_steps_per_print(pool):
    lines = pool.run(logging_rank)
    assert lines[1:] == [[]] * (pool.world_size - 1)
    assert lines[0][0].startswith("wrap policy: vescale.wrap_policy.module_classes (Block)")
    progress = lines[0][1:]
    assert [line.split(" | ")[0] for line in progress] == ["step 2", "step 4"]
    for field in ("loss ", "lr ", "grad norm ", "samples/s", "tokens/s", "peak mem "):
        assert field in progress[0], progress[0]


def tiny_llama(seed=0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{
        "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
        **overrides}))


def llama_default_wrap_rank(rank, world, vescale_section):
    """A tiny LlamaForCausalLM with no wrap_policy: its decoder layers become the units, and
    it trains like one process."""
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 100,
              "gradient_clipping": 0.0,  # the reference does not clip
              "optimizer": {"type": "AdamW", "params": OPT},
              "zero_optimization": {"stage": 3}, **vescale_section}
    reference = tiny_llama()
    ref_opt = torch.optim.AdamW(reference.parameters(), **OPT)
    with engine_log_messages() as messages:
        engine, *_ = initialize(model=tiny_llama(), config=config)
    model = engine.module
    units = [type(m).__name__ for m in model.modules() if unit_of(m)]
    wrapped_layers = all(unit_of(layer) for layer in model.model.layers)
    gaps = []
    for step in range(3):
        idx, _ = fm.batch("gpt", step, MICRO * world)
        loss = reference(input_ids=idx, labels=idx).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = idx[rank * MICRO:(rank + 1) * MICRO]
        out = engine(input_ids=mine, labels=mine).loss
        engine.backward(out)
        engine.step()
        total = out.detach().clone()
        torch.distributed.all_reduce(total)
        gaps.append(abs(total.item() / world - loss.item()) / loss.item())
    full, ref = full_state_dict(engine.module), reference.state_dict()
    diff = max((full[k] - ref[k]).abs().max().item() for k in ref)
    return units, wrapped_layers, max(gaps), diff, messages


def test_llama_default_wrap_policy_trains_like_one_process(pool):
    """`"vescale": {}` (test_wrap_policy.py checks that no section picks the same units): the
    units are the model's declared LlamaDecoderLayer, rank 0 says so in one line, others log
    nothing, and training equals one process's."""
    results = pool.run(llama_default_wrap_rank, {"vescale": {}})
    units, wrapped_layers, gap, diff, messages = results[0]
    assert units == ["LlamaForCausalLM"] + ["LlamaDecoderLayer"] * 3 and wrapped_layers
    assert gap < 1e-6 and diff < 1e-6, (gap, diff)
    model = tiny_llama()
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert len(messages) == 1 and re.fullmatch(re.escape(
        "wrap policy: the model's _no_split_modules (LlamaDecoderLayer) -> 4 FSDP units "
        f"(3 + the root); largest LlamaDecoderLayer with {layer:,} parameters of "
        f"{sum(p.numel() for p in model.parameters()):,}; padding ") + r"\d+\.\d%",
        messages[0]), messages
    assert all(r[4] == [] for r in results[1:])


def test_a_rank_that_never_joins_is_a_clear_error(tmp_path):
    """Rank 0 of 2 starts alone: a one-line error after the configured timeout, no hang."""
    import os
    import subprocess
    import sys
    port = free_port()
    script = ("import sys; sys.path.insert(0, 'tests'); import fsdp_models as fm, vescale_engine\n"
              "vescale_engine.initialize(model=fm.make('gpt'), config={"
              "'train_batch_size': 2, 'vescale': {'process_group_timeout_s': 3}})\n")
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "LaunchError: rank 0 of 2 (torchrun/deepspeed)" in last
    assert "did not form within 3 s" in last


# -- accumulation memory, as rank 0 of a large fake world ------------------------------------------

FAKE_WORLD = 64


@pytest.fixture
def fake_world(monkeypatch):
    """This process as rank 0 of FAKE_WORLD ranks on PyTorch's fake process group (collectives
    return at once and move nothing), as benchmarks/fake_pg_memory.py measures."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    for name, value in (("RANK", "0"), ("WORLD_SIZE", str(FAKE_WORLD)), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_WORLD)
    try:
        yield FAKE_WORLD
    finally:
        dist.destroy_process_group()


def accumulation_memory(local):
    """Per unit: bytes of full-size storage (parameters and gradients) held after wrapping and
    after each micro-step of one accumulation window, and its full gradient's size."""
    accum = 4
    engine, *_ = initialize(model=fm.make("gpt"), config={
        **CONFIG, "gradient_accumulation_steps": accum, "steps_per_print": 100,
        "vescale": {**CONFIG["vescale"], "local_grad_accumulation": local}})
    units = [unit_of(m) for m in engine.module.modules() if unit_of(m)]
    # wrapping made no full-size tensor at all (not even one freed right away)
    unmade = all(b.full is None and b.unreduced.full_grad is None for u in units for b in u.buffers)

    def held():
        return {u.name: sum(b.full_bytes_held for b in u.buffers) for u in units}
    after = [held()]
    for k in range(accum):
        idx, tgt = fm.batch("gpt", k, MICRO)
        engine.backward(engine(idx, tgt))
        engine.step()
        after.append(held())
    full_grad = {u.name: sum(b._full_bytes for b in u.buffers if any(
        p.buffer is b for p in u.params if p.requires_grad)) for u in units}
    return after, full_grad, engine.global_steps, unmade


@pytest.mark.parametrize("local", [False, True], ids=["default", "local_grad_accumulation"])
def test_no_unit_holds_a_full_gradient_between_micro_steps(fake_world, local):
    after, full_grad, steps, unmade = accumulation_memory(local)
    assert steps == 1 and all(size > 0 for size in full_grad.values()) and unmade
    assert after[0] == dict.fromkeys(full_grad, 0)  # wrapping allocates nothing full-size
    for k in (1, 2, 3):  # after each non-boundary micro-step
        # default: only the gradient shard (ZeRO-3); opt-in: every unit's whole gradient
        assert after[k] == (full_grad if local else dict.fromkeys(full_grad, 0)), (k, after[k])
    assert after[4] == dict.fromkeys(full_grad, 0)  # the boundary reduced everything


# -- communication timing ----------------------------------------------------------------------

def test_communication_time_comes_from_device_events_on_accelerators(monkeypatch):
    """On an accelerator wait() only enqueues a stream wait: the breakdown's communication is
    the stall timed by events recorded around it on the compute stream (an injected event
    factory here), not host time; on CPU it is host time inside wait(), labelled as such."""
    from vescale_engine.engine import timers
    from vescale_engine.shard.stats import STATS, TimedWork
    log = []

    class Event:  # what torch.Event(device, enable_timing=True) offers
        def __init__(self, device):
            self.device = device

        def record(self):
            log.append("record")

        def elapsed_time(self, end):
            return 7.0  # milliseconds, as the device measured them

    class Work:
        def wait(self):
            log.append("wait")

    monkeypatch.setattr(STATS, "time_device_waits", False)
    STATS.reset()
    TimedWork(Work(), torch.device("cuda", 0), Event).wait()
    assert log == ["wait"] and not STATS.pending_device_waits  # not timing: no events
    breakdown = timers.WallClockBreakdown(True)
    assert STATS.time_device_waits
    log.clear()
    for _ in range(2):
        TimedWork(Work(), torch.device("cuda", 0), Event).wait()
    assert log == ["record", "wait", "record"] * 2 and STATS.wait_s == 0.0
    line = breakdown.line()
    assert "communication 14.0 ms" in line and "host wait" not in line, line
    TimedWork(Work(), torch.device("cpu"), Event).wait()
    assert log[-1] == "wait" and STATS.wait_s > 0  # CPU: host time, no events
    assert timers.HOST_WAIT_LABEL + " " in breakdown.line()
    STATS.reset()


# -- fp16 with loss scaling -------------------------------------------------------------------

FP16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1, "loss_scale_window": 2}


def _local_params(engine):
    return [p.detach().clone() for p in engine.module.parameters()]


def _train_step(engine, rank, step, poison=False):
    """One optimizer step over ACCUM micro-batches of this rank's slice; `poison` puts an inf
    into one gradient element on rank 0 only, before the boundary step."""
    idx, tgt = fm.batch("gpt", step, MICRO * ACCUM * engine.world_size)
    idx, tgt = (t[rank * MICRO * ACCUM:(rank + 1) * MICRO * ACCUM] for t in (idx, tgt))
    losses = []
    for k in range(ACCUM):
        loss = engine(idx[k * MICRO:(k + 1) * MICRO], tgt[k * MICRO:(k + 1) * MICRO])
        engine.backward(loss)
        losses.append(loss.float().item())
        if poison and k == ACCUM - 1 and rank == 0:
            from torch.distributed.tensor import DTensor
            pieces = (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                      for p in engine.module.parameters() if p.grad is not None)
            grad = next(g for g in pieces if g.numel())  # a gradient piece this rank holds
            grad[0] = float("inf")
        engine.step()
    return sum(losses) / len(losses)


def fp16_overflow_rank(rank, world):
    with engine_log_messages() as messages:
        engine, *_ = initialize(model=fm.make("gpt"), config={**CONFIG, "fp16": FP16,
                                                              "steps_per_print": 100})
        assert engine.fp16_enabled()
        assert engine.module.blocks[0].qkv.weight.dtype == torch.float32
        before, lr_before = _local_params(engine), engine.get_lr()[0]
        _train_step(engine, rank, 0, poison=True)  # only rank 0's gradients overflow
        after = _local_params(engine)
        skipped = dict(unchanged=all(torch.equal(a, b) for a, b in zip(before, after)),
                       scale=engine.loss_scaler.loss_scale, skipped=engine.skipped_steps,
                       steps=engine.global_steps, lr_kept=engine.get_lr()[0] == lr_before,
                       overflow=engine.optimizer.overflow)  # what Accelerate reads
        losses = [_train_step(engine, rank, step) for step in range(1, 4)]
        now = _local_params(engine)
        trained = dict(changed=not all(torch.equal(a, b) for a, b in zip(after, now)),
                       scale=engine.loss_scaler.loss_scale, skipped=engine.skipped_steps,
                       steps=engine.global_steps, lr_moved=engine.get_lr()[0] > lr_before,
                       finite=all(abs(x) < 1e4 for x in losses),
                       overflow=engine.optimizer.overflow)
        # The scale can also start too high: 2**40 makes the fp16 loss gradient itself inf.
        high, *_ = initialize(model=fm.make("gpt"), config={
            **CONFIG, "fp16": {"enabled": True, "initial_scale_power": 40}})
        high_before = _local_params(high)
        _train_step(high, rank, 0)
        first = (high.loss_scaler.loss_scale, high.skipped_steps,
                 all(torch.equal(a, b) for a, b in zip(high_before, _local_params(high))))
        _train_step(high, rank, 1)  # hysteresis 2 (the default): the second overflow lowers it
        second = (high.loss_scaler.loss_scale, high.skipped_steps, high.global_steps)
    return skipped, trained, first, second, messages


def test_fp16_overflow_skips_the_step_on_every_rank_and_lowers_the_scale(pool):
    results = pool.run(fp16_overflow_rank)
    for skipped, trained, first, second, _ in results:
        assert skipped == dict(unchanged=True, scale=128.0, skipped=1, steps=1, lr_kept=True,
                               overflow=True)
        # window 2, DeepSpeed's counting: raised on the third good step after the overflow
        assert trained == dict(changed=True, scale=256.0, skipped=1, steps=4, lr_moved=True,
                               finite=True, overflow=False)
        assert first == (2.0 ** 40, 1, True)
        assert second == (2.0 ** 39, 2, 2)
    messages = results[0][4]
    assert "step 1: fp16 overflow: step skipped, loss scale 256 -> 128" in messages
    assert any("loss scale 128 -> 256" in m for m in messages), messages
    assert any("hysteresis left 1" in m for m in messages), messages
    assert all(r[4] == [] for r in results[1:])


def fp16_vs_fp32_rank(rank, world):
    curves = {}
    for name, extra in (("fp32", {}), ("fp16", {"fp16": {"enabled": True,
                                                          "initial_scale_power": 12}})):
        engine, *_ = initialize(model=fm.make("gpt"), config={**CONFIG, **extra,
                                                              "steps_per_print": 100})
        curve = [_train_step(engine, rank, step) for step in range(6)]
        total = torch.tensor(curve)
        torch.distributed.all_reduce(total)
        curves[name] = (total / world).tolist()
        curves[name + "_skipped"] = engine.skipped_steps
    return curves


def test_fp16_training_tracks_fp32(pool):
    curves = pool.run(fp16_vs_fp32_rank)[0]
    assert curves["fp16_skipped"] == 0 and curves["fp32_skipped"] == 0
    gaps = [abs(a - b) / b for a, b in zip(curves["fp16"], curves["fp32"])]
    assert max(gaps) < 5e-3, (gaps, curves)
    assert curves["fp16"][-1] < curves["fp16"][0]


# -- plain loss.backward() ---------------------------------------------------------------------

def backward_styles_rank(rank, world, extra):
    results = {}
    for style in ("engine", "plain"):
        engine, *_ = initialize(model=fm.make("gpt"), config={**CONFIG, **extra,
                                                              "steps_per_print": 100})
        losses = []
        for step in range(3):
            idx, tgt = fm.batch("gpt", step, MICRO * ACCUM * world)
            idx, tgt = (t[rank * MICRO * ACCUM:(rank + 1) * MICRO * ACCUM] for t in (idx, tgt))
            for k in range(ACCUM):
                loss = engine(idx[k * MICRO:(k + 1) * MICRO], tgt[k * MICRO:(k + 1) * MICRO])
                if style == "engine":
                    engine.backward(loss)
                else:
                    loss.backward()
                engine.step()
                losses.append(loss.item())
        results[style] = (losses, full_state_dict(engine.module), engine.global_steps,
                          engine.get_global_grad_norm())
    (l1, s1, g1, n1), (l2, s2, g2, n2) = results["engine"], results["plain"]
    worst = max((s1[k] - s2[k]).abs().max().item() for k in s1)
    in_place = {unit_of(m).switches.grads_in_place for m in engine.module.modules() if unit_of(m)}
    want = {extra.get("vescale", {}).get("grads_in_place", True)}
    assert l1 == l2 and worst == 0.0 and g1 == g2 == 3 and n1 == n2, (worst,)
    assert in_place == want


@pytest.mark.parametrize("extra", [
    {}, {"fp16": {"enabled": True, "initial_scale_power": 10},
         "vescale": {**CONFIG["vescale"], "grads_in_place": False}}], ids=["fp32", "fp16"])
def test_plain_loss_backward_equals_engine_backward(pool, extra):
    pool.run(backward_styles_rank, extra)


# -- model_parameters -----------------------------------------------------------------------------

def model_parameters_rank(rank, world):
    reference = fm.make("gpt")
    model = fm.make("gpt")

    def groups(m):
        named = [(n, p) for n, p in m.named_parameters() if not n.startswith("wpe")]  # frozen
        decay = [p for n, p in named if p.dim() == 2]
        rest = [p for n, p in named if p.dim() != 2]
        return [{"params": decay, "weight_decay": 0.1},
                {"params": rest, "weight_decay": 0.0, "lr": 5e-4}]

    ref_opt = torch.optim.AdamW(groups(reference), lr=1e-3, eps=1e-6)
    engine, opt, _, _ = initialize(model=model, model_parameters=groups(model), config={
        "train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 100, "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-6}},
        "vescale": {"wrap_policy": {"module_classes": ["Block"]}}})
    wpe_before = full_state_dict(engine.module)["wpe.weight"]
    for step in range(2):
        idx, tgt = fm.batch("gpt", step, MICRO * world)
        reference(idx, tgt).backward()
        # the norm covers only the optimized parameters (wpe has a gradient but is not stepped)
        torch.nn.utils.clip_grad_norm_([p for g in ref_opt.param_groups for p in g["params"]],
                                       0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        engine.backward(engine(idx[rank * MICRO:(rank + 1) * MICRO],
                               tgt[rank * MICRO:(rank + 1) * MICRO]))
        engine.step()
    full, ref = full_state_dict(engine.module), reference.state_dict()
    diff = torch.cat([(full[k] - ref[k]).flatten() for k in ref]).norm()
    worst = (diff / torch.cat([ref[k].flatten() for k in ref]).norm()).item()
    plain_model = fm.make("gpt")
    plain, plain_opt, _, _ = initialize(model=plain_model, config=CONFIG, model_parameters=(
        p for p in plain_model.parameters() if p.requires_grad))  # a generator, as scripts pass
    plain_ok = (len(plain_opt.param_groups) == 1 and
                [id(p) for p in plain_opt.param_groups[0]["params"]] ==
                [id(p) for p in plain.module.parameters()])
    errors = []
    for bad in ([torch.nn.Parameter(torch.zeros(3))], [{"lr": 1.0}]):
        try:
            initialize(model=fm.make("gpt"), model_parameters=bad, config=CONFIG)
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return (worst, torch.equal(full["wpe.weight"], wpe_before),
            [g["lr"] for g in opt.param_groups], plain_ok, errors)


def test_model_parameters_and_param_groups_as_deepspeed(pool):
    worst, wpe_frozen, lrs, plain_ok, errors = pool.run(model_parameters_rank)[0]
    assert worst < 1e-6 and wpe_frozen and lrs == [1e-3, 5e-4] and plain_ok, (worst, lrs)
    assert "not a parameter of the model" in errors[0]
    assert "needs a 'params' key" in errors[1]


# -- wall-clock breakdown, monitors ---------------------------------------------------------------

def breakdown_rank(rank, world, out_dir):
    with engine_log_messages() as messages:
        monitor = {"enabled": True, "output_path": out_dir, "job_name": "job"}
        engine, *_ = initialize(model=fm.make("gpt"), config={
            **CONFIG, "steps_per_print": 2, "wall_clock_breakdown": True,
            "fp16": {"enabled": True, "initial_scale_power": 10},
            "csv_monitor": monitor, "tensorboard": monitor})
        losses = [_train_step(engine, rank, step) for step in range(2)]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            losses.append(_train_step(engine, rank, 2))
    ranges = {e.name.split(" (")[0] for e in prof.events() if e.name.startswith("vescale::")}
    assert {"vescale::optimizer_step", "vescale::all_gather",
            "vescale::reduce_scatter"} <= ranges, ranges
    return messages, losses, engine.global_samples, engine.get_lr()[0]


def test_wall_clock_breakdown_and_csv_monitor(pool, tmp_path):
    import csv
    results = pool.run(breakdown_rank, str(tmp_path))
    lines, losses, samples, last_lr = results[0]
    progress = [m for m in lines if m.startswith("step 2 |")]
    assert len(progress) == 1, lines
    parts = dict(p.rsplit(" ", 2)[:2] for p in progress[0].split(" | ") if p.endswith(" ms"))
    # on CPU the communication figure is host time inside wait(), and says so
    assert set(parts) == {"forward", "backward", "communication (host wait)", "optimizer"}, \
        progress
    assert all(float(v) > 0 for v in parts.values()), parts
    assert "loss scale 1024" in progress[0] and "skipped 0" in progress[0]
    try:
        import torch.utils.tensorboard  # noqa: F401
        tensorboard = True
    except ImportError:
        tensorboard = False
    warned = [m for m in lines if "torch.utils.tensorboard does not import" in m]
    assert len(warned) == (0 if tensorboard else 1)
    assert all(r[0] == [] for r in results[1:])  # ranks other than 0 log nothing
    job = tmp_path / "job"
    names = {"train_loss", "lr", "grad_norm", "loss_scale"}
    csvs = sorted(p.name for p in job.glob("*.csv"))
    assert csvs == sorted(f"Train_Samples_{n}.csv" for n in names), csvs
    step_samples = [str(MICRO * ACCUM * pool.world_size * k) for k in (1, 2, 3)]
    for name in names:
        rows = list(csv.reader(open(job / f"Train_Samples_{name}.csv")))
        assert rows[0] == ["step", name] and [r[0] for r in rows[1:]] == step_samples, rows
    rows = list(csv.reader(open(job / "Train_Samples_train_loss.csv")))
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses, rel=1e-6)  # rank 0's mean
    rows = list(csv.reader(open(job / "Train_Samples_lr.csv")))
    assert float(rows[-1][1]) == pytest.approx(last_lr) and samples == int(step_samples[-1])
    if tensorboard:  # read the event file back: the same scalars at the same steps as the CSVs
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        events = EventAccumulator(str(job))
        events.Reload()
        for name in names:
            rows = list(csv.reader(open(job / f"Train_Samples_{name}.csv")))[1:]
            scalars = events.Scalars(f"Train/Samples/{name}")
            assert [s.step for s in scalars] == [int(r[0]) for r in rows], name
            assert [s.value for s in scalars] == pytest.approx([float(r[1]) for r in rows],
                                                               rel=1e-6), name


def test_tensorboard_monitor_hands_every_scalar_to_the_summary_writer(tmp_path, monkeypatch):
    """The TensorBoard monitor without TensorBoard installed (as in CI): a recording writer
    in place of torch.utils.tensorboard.SummaryWriter sees each event, a flush per batch of
    events and the close; ranks other than 0 make no writer."""
    from vescale_engine.engine import monitor
    calls = []

    class RecordingWriter:
        def __init__(self, log_dir):
            calls.append(("open", log_dir))

        def add_scalar(self, name, value, step):
            calls.append((name, value, step))

        def flush(self):
            calls.append("flush")

        def close(self):
            calls.append("close")

    monkeypatch.setattr(monitor, "_summary_writer_cls", lambda: RecordingWriter)
    config = {"tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}}
    assert not monitor.Monitors(config, rank=1).enabled and calls == []
    monitors = monitor.Monitors(config, rank=0)
    monitors.write_events([("Train/Samples/train_loss", 2.5, 8), ("Train/Samples/lr", 1e-3, 8)])
    monitors.write_events([("Train/Samples/train_loss", 2.25, 16)])
    monitors.close()
    assert calls == [("open", str(tmp_path / "j")), ("Train/Samples/train_loss", 2.5, 8),
                     ("Train/Samples/lr", 1e-3, 8), "flush", ("Train/Samples/train_loss", 2.25, 16),
                     "flush", "close"]


# -- train / eval / destroy ----------------------------------------------------------------------

def lifecycle_rank(rank, world):
    engine, *_ = initialize(model=fm.make("gpt"), config={**CONFIG, "steps_per_print": 100})
    _train_step(engine, rank, 0)
    engine.eval()
    modes = [not any(m.training for m in engine.module.modules())]
    with torch.no_grad():
        idx, tgt = fm.batch("gpt", 9, MICRO)
        eval_loss = engine(idx, tgt).item()
    engine.train()
    modes.append(all(m.training for m in engine.module.modules()))
    same_loss_with_grad = engine(idx, tgt).item() == eval_loss  # a forward without backward
    _train_step(engine, rank, 1)
    module = engine.module
    engine.destroy()
    released = (engine.optimizer.state == {} and engine.process_group is None
                and all(not hasattr(m, "_vescale_unit") for m in module.modules())
                and all(not m._forward_pre_hooks and not m._forward_hooks
                        for m in module.modules())
                and all(p.grad is None for p in module.parameters()))
    errors = []
    for call in (lambda: engine(idx, tgt), engine.step, engine.train,
                 lambda: engine.backward(torch.zeros((), requires_grad=True))):
        try:
            call()
            errors.append(None)
        except RuntimeError as err:
            errors.append(str(err))
    engine.destroy()  # a second destroy is harmless
    again, *_ = initialize(model=fm.make("gpt"), config={**CONFIG, "steps_per_print": 100})
    loss = _train_step(again, rank, 0)
    assert modes == [True, True] and same_loss_with_grad and released
    assert all(e and "was destroyed" in e for e in errors), errors
    assert 0 < loss < 100


def test_train_eval_destroy(pool):
    pool.run(lifecycle_rank)


# -- loss scaler alone ---------------------------------------------------------------------------

def test_loss_scaler_follows_deepspeed_dynamic_scaling():
    from vescale_engine.engine.loss_scaler import LossScaler, from_config
    scaler = from_config({"enabled": True, "initial_scale_power": 4, "loss_scale_window": 3,
                          "hysteresis": 2, "min_loss_scale": 4})
    assert scaler.loss_scale == 16
    assert "hysteresis left 1" in scaler.update(True) and scaler.loss_scale == 16
    assert scaler.update(True).endswith("16 -> 8") and scaler.loss_scale == 8
    assert [scaler.update(False) for _ in range(3)] == [None] * 3
    assert scaler.update(False).endswith("loss scale 8 -> 16")  # 4th good step: stable interval 3
    state = scaler.state_dict()
    scaler.update(True)  # hysteresis restored by the raise: kept once
    assert scaler.loss_scale == 16
    assert scaler.update(True).endswith("16 -> 8")
    assert scaler.update(True).endswith("8 -> 4")
    with pytest.raises(FloatingPointError, match="minimum loss scale 4"):
        scaler.update(True)
    restored = LossScaler(1.0)
    restored.load_state_dict(state)
    assert restored.loss_scale == 16 and restored.state_dict() == state
    with pytest.raises(ValueError, match="lacks"):
        restored.load_state_dict({"cur_scale": 2.0})
    consecutive = LossScaler(8, hysteresis=2, consecutive_hysteresis=True)
    for _ in range(3):  # an overflow, then a good step: hysteresis restored, scale kept
        consecutive.update(True)
        consecutive.update(False)
    assert consecutive.loss_scale == 8
    static = from_config({"enabled": True, "loss_scale": 128})
    assert "static loss scale 128 kept" in static.update(True) and static.loss_scale == 128
    assert from_config({"enabled": False}) is None

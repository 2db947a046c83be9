"""initialize + VeScaleEngine on 2 and 3 gloo ranks: DeepSpeed-style training (accumulation,
clipping, DeepSpeed's WarmupLR) equals single-process training of the same global batch."""
import pytest
import torch

import fsdp_models as fm
from dist_harness import RankPool
from vescale_engine import initialize
from vescale_engine.fsdp import full_state_dict

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


@pytest.fixture(scope="module", params=[2, 3])
def pool(request):
    pool = RankPool(request.param)
    yield pool
    pool.close()


def engine_rank(rank, world):
    from deepspeed.runtime.lr_schedules import WarmupLR
    reference = fm.make("gpt")
    ref_opt = torch.optim.AdamW(reference.parameters(), **OPT)
    ref_sched = WarmupLR(ref_opt, **CONFIG["scheduler"]["params"])
    engine, opt, _, sched = initialize(model=fm.make("gpt"), config=CONFIG)
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
    full, ref = full_state_dict(engine.module), reference.state_dict()
    diff = torch.cat([(full[k] - ref[k]).flatten() for k in ref]).norm()
    whole = (diff / torch.cat([ref[k].flatten() for k in ref]).norm()).item()
    return max(gaps), whole, lrs, engine.global_steps, engine.global_samples


def test_engine_matches_single_process(pool):
    gap, whole, lrs, steps, samples = pool.run(engine_rank)[0]
    assert gap < 1e-6 and whole < 1e-6, (gap, whole)
    assert all(abs(a - b) < 1e-12 for a, b in lrs) and lrs[0][0] < lrs[-1][0]
    assert steps == STEPS and samples == STEPS * ACCUM * MICRO * pool.world_size


def bad_engine_rank(rank, world):
    errors = []
    for kwargs in (dict(config={**CONFIG, "vescale": {"wrap_policy": {"module_classes": ["Nope"]}}}),
                   dict(config=CONFIG, optimizer=torch.optim.SGD(fm.make("gpt").parameters(),
                                                                 lr=0.1)),
                   dict(config={**CONFIG, "train_batch_size": 7}),
                   dict(config=None)):
        try:
            initialize(model=fm.make("gpt"), **kwargs)
            errors.append(None)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_engine_bad_input(pool):
    errors = pool.run(bad_engine_rank)[0]
    assert "match no module" in errors[0]
    assert "not an instance" in errors[1]
    assert "train_batch_size 7" in errors[2]
    assert "no config" in errors[3]


def patched_rank(rank, world):
    import deepspeed
    import vescale_engine
    from vescale_engine.engine import VeScaleEngine
    original = deepspeed.initialize
    vescale_engine.patch_deepspeed()
    vescale_engine.patch_deepspeed()  # idempotent
    try:
        assert deepspeed.initialize.__vescale_original__ is original
        engine, *_ = deepspeed.initialize(model=fm.make("gpt"), config=CONFIG)
        idx, tgt = fm.batch("gpt", 0, MICRO)
        engine.backward(engine(idx, tgt))
        return isinstance(engine, VeScaleEngine), engine.micro_steps
    finally:
        deepspeed.initialize = original


def test_patch_deepspeed_routes_vescale_configs(pool):
    is_ours, micro_steps = pool.run(patched_rank)[0]
    assert is_ours and micro_steps == 0


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
    import logging
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("vescale_engine").addHandler(handler)
    logging.getLogger("vescale_engine").setLevel(logging.INFO)
    engine, *_ = initialize(model=fm.make("gpt"), config={**CONFIG, "steps_per_print": 2})
    for step in range(4 * ACCUM):
        idx, tgt = fm.batch("gpt", step, MICRO)
        engine.backward(engine(idx, tgt))
        engine.step()
    return [r.getMessage() for r in records]


def test_progress_lines_on_rank_zero_every_steps_per_print(pool):
    lines = pool.run(logging_rank)
    assert lines[1:] == [[]] * (pool.world_size - 1)
    assert [line.split(" | ")[0] for line in lines[0]] == ["step 2", "step 4"]
    for field in ("loss ", "lr ", "grad norm ", "samples/s", "tokens/s", "peak mem "):
        assert field in lines[0][0], lines[0][0]


def test_a_rank_that_never_joins_is_a_clear_error(tmp_path):
    """Rank 0 of 2 starts alone: a one-line error after the configured timeout, no hang."""
    import os
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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

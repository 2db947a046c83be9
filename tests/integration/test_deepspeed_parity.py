"""The same DeepSpeed training script on 2 gloo ranks, run by real DeepSpeed ZeRO-3 and, after
the one-line migration (`vescale_engine.patch_deepspeed()` plus a "vescale" section), by our
engine: losses and final parameters equal each other and single-process training of the same
global batch, with gradient accumulation 2, global-norm clipping and DeepSpeed's WarmupLR.
Our engine also resumes from DeepSpeed's ZeRO-3 checkpoint and continues with DeepSpeed's losses.

Tolerance: 1e-5 relative. The three runs do the same fp32 arithmetic in different orders (one
backward over the global batch vs per-rank micro-batches whose gradients are summed by an
all-reduce or reduce-scatter, and gradient norms summed per shard), so they differ by float32
round-off (~1e-7 per operation); AdamW divides by sqrt(v) + eps, which magnifies round-off of
near-zero gradients, so after a few steps the parameters differ by up to ~1e-6 relative. A
wrong scaling (accumulation, averaging over ranks, clipping) or a wrong optimizer moves them by
far more than 1e-3. Measured here: losses within 2e-7, parameters within 1e-8 relative.
"""
import os

import torch

from compare import relative_state
import fsdp_models as fm

MICRO, ACCUM, STEPS, CLIP = 3, 2, 4, 0.5
TOLERANCE = 1e-5
OPT = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.01}
SCHED = {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3,
         "warmup_type": "linear"}
DEEPSPEED_CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
    "gradient_clipping": CLIP, "steps_per_print": 1000,
    # DeepSpeed's "AdamW" is its FusedAdam (or DeepSpeedCPUAdam) unless torch_adam is set:
    # torch_adam makes it build torch.optim.AdamW, the same update as ours and the reference.
    "optimizer": {"type": "AdamW", "params": {**OPT, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": SCHED},
    "zero_optimization": {"stage": 3},
}
# The migrated config: DeepSpeed's keys unchanged (torch_adam included: it picks DeepSpeed's
# kernel, and ours computes the same update), plus a vescale section.
VESCALE_CONFIG = {
    **DEEPSPEED_CONFIG,
    "vescale": {"wrap_policy": {"module_classes": ["Block"]},
                "granularity": {"default": "rows:16"}},
}


# DeepSpeed picks its CPU accelerator from DS_ACCELERATOR (no CUDA here) and wants the
# LOCAL_RANK a launcher sets; the pool's ranks set it themselves (see _train).
POOL_ENV = {"DS_ACCELERATOR": "cpu"}


def _my_micro_batches(step, rank, world):
    return fm.rank_micro_batches("gpt", step, rank, world, MICRO, ACCUM)


def _train(rank, world, config):
    """An unmodified DeepSpeed ZeRO-3 training loop; returns the global mean loss per step,
    this rank's micro-batch losses and the engine class."""
    import deepspeed
    os.environ.setdefault("LOCAL_RANK", str(rank))  # what the deepspeed launcher sets
    deepspeed.init_distributed(dist_backend="gloo")  # the pool's group already exists: reused
    model = fm.make("gpt")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    step_losses, micro_losses = [], []
    for step in range(STEPS):
        total = torch.zeros(())
        for idx, tgt in _my_micro_batches(step, rank, world):
            loss = engine(idx, tgt)
            engine.backward(loss)
            engine.step()
            micro_losses.append(loss.item())
            total += loss.detach() / ACCUM
        torch.distributed.all_reduce(total)
        step_losses.append(total.item() / world)
    return step_losses, micro_losses, engine


def _single_process(world):
    """The reference: one process, the whole global batch, torch AdamW, torch clipping."""
    from deepspeed.runtime.lr_schedules import WarmupLR
    model = fm.make("gpt")
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    sched = WarmupLR(opt, **SCHED)
    losses = []
    for step in range(STEPS):
        idx, tgt = fm.batch("gpt", step, MICRO * ACCUM * world)
        loss = model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def deepspeed_vs_vescale_rank(rank, world):
    import deepspeed
    import vescale_engine
    from vescale_engine.engine.engine import VeScaleEngine
    from vescale_engine.fsdp import full_state_dict
    ref_losses, ref_state = _single_process(world)

    ds_steps, ds_micro, ds_engine = _train(rank, world, DEEPSPEED_CONFIG)
    assert type(ds_engine).__name__ == "DeepSpeedEngine", type(ds_engine)
    assert ds_engine.zero_optimization_stage() == 3
    assert type(ds_engine.optimizer.optimizer) is torch.optim.AdamW  # torch_adam took effect
    with deepspeed.zero.GatheredParameters(list(ds_engine.module.parameters())):
        ds_state = {k: v.detach().clone() for k, v in ds_engine.module.state_dict().items()}
    ds_engine.destroy()

    original = deepspeed.initialize
    vescale_engine.patch_deepspeed()  # the one-line migration
    try:
        ves_steps, ves_micro, ves_engine = _train(rank, world, VESCALE_CONFIG)
    finally:
        deepspeed.initialize = original
    assert isinstance(ves_engine, VeScaleEngine)
    ves_state = full_state_dict(ves_engine.module)
    return dict(ref_losses=ref_losses, ds_steps=ds_steps, ves_steps=ves_steps,
                ds_micro=ds_micro, ves_micro=ves_micro,
                ds_vs_ref=relative_state(ds_state, ref_state),
                ves_vs_ref=relative_state(ves_state, ref_state),
                ves_vs_ds=relative_state(ves_state, ds_state))


def _close(a, b):
    return all(abs(x - y) <= TOLERANCE * abs(y) for x, y in zip(a, b, strict=True))


def test_deepspeed_zero3_and_vescale_train_the_same(pool):
    results = pool.run(deepspeed_vs_vescale_rank, timeout=600)
    for rank, r in enumerate(results):
        # Training happened: the loss moved well beyond the tolerance.
        assert abs(r["ref_losses"][-1] - r["ref_losses"][0]) > 100 * TOLERANCE * \
            r["ref_losses"][0], r["ref_losses"]
        assert _close(r["ds_steps"], r["ref_losses"]), (rank, r["ds_steps"], r["ref_losses"])
        assert _close(r["ves_steps"], r["ref_losses"]), (rank, r["ves_steps"], r["ref_losses"])
        assert _close(r["ves_micro"], r["ds_micro"]), (rank, r["ves_micro"], r["ds_micro"])
        assert len(r["ves_micro"]) == STEPS * ACCUM
        for key in ("ds_vs_ref", "ves_vs_ref", "ves_vs_ds"):
            assert r[key] < TOLERANCE, (rank, key, r[key])
    # Each rank saw its own data: the micro-batch losses differ between ranks.
    assert results[0]["ves_micro"] != results[1]["ves_micro"]


RESUME_CONFIG = {k: v for k, v in DEEPSPEED_CONFIG.items() if k != "scheduler"}  # constant lr


def resume_from_deepspeed_rank(rank, world, save_dir):
    """DeepSpeed trains STEPS steps and saves a ZeRO-3 checkpoint, then trains STEPS more; our
    engine loads that checkpoint (imported from DeepSpeed's files) and trains the same STEPS
    more: the same losses."""
    import deepspeed
    import vescale_engine
    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")

    def run(engine, first_step):
        losses = []
        for step in range(first_step, first_step + STEPS):
            for idx, tgt in _my_micro_batches(step, rank, world):
                loss = engine(idx, tgt)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        return losses

    model = fm.make("gpt")
    ds_engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                         config=RESUME_CONFIG)
    run(ds_engine, 0)
    ds_engine.save_checkpoint(save_dir, tag="ds")
    ds_after = run(ds_engine, STEPS)
    ds_engine.destroy()

    config = {**RESUME_CONFIG, "optimizer": {"type": "AdamW", "params": OPT},
              "vescale": VESCALE_CONFIG["vescale"]}
    engine, *_ = vescale_engine.initialize(model=fm.make("gpt", seed=1), config=config)
    engine.load_checkpoint(save_dir)  # DeepSpeed's save dir, as a DeepSpeed script passes it
    resumed_at = engine.global_steps
    ours = run(engine, STEPS)
    assert resumed_at == STEPS, resumed_at
    assert _close(ours, ds_after), (rank, ours, ds_after)


def test_resume_a_deepspeed_zero3_checkpoint(pool, tmp_path):
    pool.run(resume_from_deepspeed_rank, str(tmp_path), timeout=600)

"""ZeRO-Offload of the optimizer (zero_optimization.offload_optimizer, device "cpu") on 2 gloo
ranks: with ratio 1 and 0.5, AdamW and AdamW8bit, clipping, accumulation 2, fp32, bf16 and
fp16, the losses and parameters equal the run without offload bitwise (the host step runs the
same kernels on the same values); the offloaded state is separate host memory; the bytes copied each way are
the expected ones; checkpoints cross between offload and no offload exactly; what is not yet
supported is one line naming what works."""
import os
import shutil

import pytest
import torch

import fsdp_models as fm
from dist_harness import rank_pools, scratch_dir, value_errors

GLOBAL, MICRO, ACCUM, STEPS = 12, 3, 2, 3
CLIP = 0.05  # below the norms of these steps: every step clips


def config(offload=None, dtype="fp32", optimizer="AdamW"):
    cfg = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": MICRO,
           "gradient_accumulation_steps": ACCUM, "gradient_clipping": CLIP,
           "optimizer": {"type": optimizer, "params": {"lr": 3e-3, "eps": 1e-6,
                                                       "weight_decay": 0.01}},
           "vescale": {"wrap_policy": {"module_classes": ["Block"]},
                       "granularity": {"default": "rows:16"}}}
    if optimizer == "Muon":
        cfg["optimizer"]["params"] = {"lr": 0.02}
    elif optimizer == "AdamW8bit":  # its blocks become the shard blocks
        cfg["optimizer"]["params"]["block"] = "block:64"
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":  # dynamic loss scaling: overflow check and unscale before the step
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    if offload is not None:
        cfg["zero_optimization"] = {"stage": 3, "offload_optimizer": {
            "device": "cpu", "pin_memory": True, **offload}}
    return cfg


def make_engine(cfg):
    from vescale_engine import initialize
    engine, *_ = initialize(model=fm.make("gpt"), config=cfg)
    return engine


def train(engine, rank, world, steps):
    """`steps` optimizer steps of ACCUM micro-batches each; per step the world's mean loss and
    the global gradient norm (before clipping)."""
    import torch.distributed as dist
    out = []
    for _ in range(steps):
        total = torch.zeros(())
        for idx, tgt in fm.rank_micro_batches("gpt", engine.global_steps, rank, world, MICRO,
                                              ACCUM):
            loss = engine(idx, tgt)
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        dist.all_reduce(total)
        out.append((total.item() / (world * ACCUM), engine.get_global_grad_norm()))
    return out


def shards(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def buffers_of(engine):
    return [b for b, *_ in engine.optimizer._buffers]


def run_parity(rank, world, dtype, optimizer="AdamW"):
    """The same training without offload, with ratio 1 and with 0.5: what each gives."""
    results = {}
    for ratio in (None, 1.0, 0.5):
        engine = make_engine(config(None if ratio is None else {"ratio": ratio}, dtype,
                                    optimizer))
        steps = train(engine, rank, world, STEPS)
        info = {"steps": steps, "shards": shards(engine)}
        if ratio is not None:
            off = engine.optimizer.offload
            bufs = buffers_of(engine)
            chosen = [b for b in bufs if off.offloads(b)]
            elems = sum(b.shard_size for b in chosen)
            info["chosen"] = [b.shard_size for b in chosen]
            info["all"] = [b.shard_size for b in bufs]
            info["bytes"] = (off.stats.bytes_to_host, off.stats.bytes_to_device,
                             off.stats.host_steps)
            info["expected"] = (STEPS * 8 * elems, STEPS * 4 * elems, STEPS * len(chosen))
            separate = []
            for buf in bufs:
                state = engine.optimizer.state[buf.master]
                host = off._hosts.get(id(buf))
                first = "exp_avg" if "exp_avg" in state else "exp_avg_codes"  # AdamW8bit's
                ptr = state[first].untyped_storage().data_ptr()
                separate.append((off.offloads(buf), host is not None and
                                 ptr == host.storage.untyped_storage().data_ptr(),
                                 ptr != buf.master.untyped_storage().data_ptr(),
                                 state["step"].device.type, float(state["step"])))
            info["separate"] = separate
        results[ratio] = info
        engine.destroy()
    return results


def run_groups_and_frozen(rank, world):
    """Trainer's two weight-decay groups (a per-element decay inside a buffer, kept on the host
    for offloaded buffers) and a frozen tensor (its buffer stepped over the others' ranges only):
    the same as without offload."""
    from vescale_engine import initialize
    out = []
    for offload in (None, {"ratio": 1.0}):
        model = fm.make("gpt")
        model.wpe.weight.requires_grad_(False)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in trainable if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for n, p in trainable if p.dim() < 2], "weight_decay": 0.0}]
        engine, *_ = initialize(model=model, model_parameters=groups, config=config(offload))
        assert type(engine.optimizer).__module__ == "vescale_engine.optim.adamw"
        decays = [d for _, _, d, _ in engine.optimizer._buffers if isinstance(d, torch.Tensor)]
        out.append((train(engine, rank, world, 2), shards(engine), len(decays),
                    None if offload is None else engine.optimizer.offload.stats.host_steps))
        engine.destroy()
    return out


def test_weight_decay_groups_and_frozen_tensors_match(pools):
    for (want, want_shards, decays, _), (got, got_shards, _, host_steps) in \
            pools(2).run(run_groups_and_frozen):
        assert decays > 0 and host_steps > 0  # the per-element decay path ran, on the host
        assert got == want
        assert all(torch.equal(got_shards[n], v) for n, v in want_shards.items())


@pytest.fixture(scope="module")
def pools():
    with rank_pools() as get:
        yield get


@pytest.mark.parametrize("dtype,optimizer", [("fp32", "AdamW"), ("bf16", "AdamW"),
                                             ("fp16", "AdamW"), ("bf16", "AdamW8bit")])
def test_offload_matches_no_offload_bitwise(pools, dtype, optimizer):
    for rank, results in enumerate(pools(2).run(run_parity, dtype, optimizer)):
        plain = results[None]
        assert all(norm > CLIP for _, norm in plain["steps"])  # clipping acted every step
        for ratio in (1.0, 0.5):
            got = results[ratio]
            assert got["steps"] == plain["steps"], (rank, ratio)
            for name, value in plain["shards"].items():
                assert torch.equal(got["shards"][name], value), (rank, ratio, name)
            assert got["bytes"] == got["expected"], (rank, ratio)
            total = sum(got["all"])
            if ratio == 1.0:
                assert got["chosen"] == got["all"]
            else:  # whole buffers, largest first, just reaching half the bytes
                assert 0 < len(got["chosen"]) < len(got["all"])
                assert got["chosen"] == sorted(got["all"], reverse=True)[:len(got["chosen"])]
                assert sum(got["chosen"]) >= total / 2 > sum(got["chosen"][:-1])
            for offloaded, in_host, apart, device, step in got["separate"]:
                # offloaded: state in the buffer's host allocation, apart from the device's
                assert (in_host, device) == ((True, "cpu") if offloaded else (False, "cpu"))
                assert apart and step == STEPS


def run_checkpoint_cross(rank, world, root, dtype, optimizer):
    """Offload saves, no offload resumes; no offload saves, offload resumes: each resumed run
    continues exactly as the run that saved."""
    out = []
    for saver, loader in (({"ratio": 1.0}, None), (None, {"ratio": 1.0})):
        path = os.path.join(root, f"from_{'offload' if saver else 'plain'}_{dtype}_{optimizer}")
        engine = make_engine(config(saver, dtype, optimizer))
        train(engine, rank, world, 2)
        engine.save_checkpoint(path)
        after = train(engine, rank, world, 2)
        expected = shards(engine)
        engine.destroy()
        resumed = make_engine(config(loader, dtype, optimizer))
        resumed.load_checkpoint(path)
        got = train(resumed, rank, world, 2)
        out.append((after == got, all(torch.equal(expected[n], v)
                                      for n, v in shards(resumed).items()), after, got))
        resumed.destroy()
    return out


@pytest.mark.parametrize("dtype,optimizer", [("fp32", "AdamW"), ("bf16", "AdamW"),
                                             ("fp32", "AdamW8bit")])
def test_checkpoint_crosses_offload_exactly(pools, dtype, optimizer):
    root = scratch_dir()
    try:
        for rank, results in enumerate(pools(2).run(run_checkpoint_cross, root, dtype, optimizer)):
            for same_losses, same_shards, after, got in results:
                assert same_losses, (rank, after, got)
                assert same_shards, rank
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_refusals(rank, world):
    from vescale_engine import initialize
    attempts = [lambda: make_engine(config({"ratio": 1.0}, optimizer="Muon")),
                lambda: initialize(model=fm.make("gpt"), config=config({"ratio": 1.0}),
                                   optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))]
    return value_errors(attempts)


def test_not_yet_supported_is_one_line_naming_what_works(pools):
    for errors in pools(2).run(run_refusals):
        muon, client = errors
        for message, name in ((muon, "Muon"), (client, "torch.optim.adamw.AdamW")):
            assert message == (f"zero_optimization.offload_optimizer: optimizer {name} is not "
                               "yet supported with offload; offload works with optimizer types "
                               "AdamW and AdamW8bit (ours, over whole flat buffers)")


def test_nvme_and_offload_param_are_one_line_naming_what_works():
    from config_schemas.validate import ConfigError
    from vescale_engine.engine.config import build_config
    with pytest.raises(ConfigError) as err:
        build_config({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, 2)
    assert str(err.value) == (
        "zero_optimization.offload_optimizer.device: 'nvme' is not allowed (allowed: 'none', "
        "'cpu'); NVMe offload is not supported: device \"cpu\" keeps the optimizer state (and "
        "the master copy the step updates) in host memory and steps it there")
    with pytest.raises(ConfigError) as err:
        build_config({"zero_optimization": {"offload_param": {"device": "cpu"}}}, 2)
    text = str(err.value)
    assert "\n" not in text and text.startswith(
        "zero_optimization.offload_param.device: 'cpu' is not allowed (allowed: 'none'); "
        "offload_param is not yet supported") and \
        'zero_optimization.offload_optimizer with device "cpu"' in text
    cfg = build_config(config({"ratio": 0.25}), 2)
    assert cfg.offload_optimizer == {"ratio": 0.25, "pin_memory": True}
    assert build_config(config(), 2).offload_optimizer is None
    with pytest.raises(ConfigError, match="ratio: 1.5 is out of range"):
        build_config(config({"ratio": 1.5}), 2)

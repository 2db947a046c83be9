"""Checkpoints on gloo ranks: save on 2, load on 1, 3 and 4 (other granularity) and continue with
the uninterrupted run's losses; plain-model, consolidate and FSDP2 loading; DeepSpeed ZeRO-3
import; a save killed by SIGKILL; bad input."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import warnings
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fsdp_models as fm
from dist_harness import free_port, scratch_dir
from vescale_engine.shard.ragged_dtensor import local_of

GLOBAL, SAVE_AT, AFTER = 12, 2, 2
# the repository: tests/<tier>/ is two folders down
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPT = {"lr": 3e-3, "eps": 1e-6, "weight_decay": 0.01}
KINDS = ("ours", "torch", "sgd", "adamw8bit", "muon")  # every optimizer we ship, and torch's


def config(world, granularity="rows:16", scheduler=True):
    cfg = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": GLOBAL // world,
            "gradient_clipping": 0.0,  # (unset: DeepSpeed's default, 1.0)
            "optimizer": {"type": "AdamW", "params": OPT},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                         "warmup_num_steps": 6}},
            "vescale": {"wrap_policy": {"module_classes": ["Block", "MoELayer"]},
                        "granularity": {"default": granularity}}}
    if not scheduler:
        del cfg["scheduler"]
    return cfg


def make_engine(world, opt_kind, granularity="rows:16", model=None, scheduler=True, hsdp=1,
                quantization=("block:64", "dynamic")):
    from vescale_engine import initialize
    optimizer = None
    if opt_kind == "torch":
        optimizer = lambda params: torch.optim.AdamW(params, **OPT)  # noqa: E731
    elif opt_kind == "sgd":
        optimizer = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)  # noqa: E731
    cfg = config(world, granularity, scheduler)
    cfg["vescale"]["hsdp_replicate_size"] = hsdp
    if opt_kind == "adamw8bit":  # its quantization blocks become the shard blocks
        block, quant_map = quantization
        cfg["optimizer"] = {"type": "AdamW8bit",
                            "params": {**OPT, "block": block, "quant_map": quant_map}}
    elif opt_kind == "muon":
        cfg["optimizer"] = {"type": "Muon", "params": {"lr": 0.02, "ns_dtype": "fp32"}}
    engine, *_ = initialize(model=model or fm.make("gpt"), optimizer=optimizer, config=cfg)
    return engine


def train(engine, rank, world, steps):
    return fm.train_steps(engine, rank, world, steps, GLOBAL)


def full_weights(engine):
    from vescale_engine.fsdp import full_state_dict
    return full_state_dict(engine.module)


def save_and_continue(rank, world, root, opt_kind, hsdp=1):
    engine = make_engine(world, opt_kind, hsdp=hsdp)
    train(engine, rank, world, SAVE_AT)
    torch.manual_seed(100 + rank)  # per-rank RNG must come back on load
    path = engine.save_checkpoint(root, client_state={"epoch": 3, "note": "hi"})
    weights = full_weights(engine)
    rng_draw = torch.rand(3)
    losses = train(engine, rank, world, AFTER)
    with open(os.path.join(root, "latest")) as f:
        latest = f.read()
    return path, latest, losses, weights if rank == 0 else None, rng_draw


def load_and_continue(rank, world, root, opt_kind, granularity):
    engine = make_engine(world, opt_kind, granularity)
    path, client = engine.load_checkpoint(root)
    rng_draw = torch.rand(3)
    counters = (engine.global_steps, engine.global_samples, engine.lr_scheduler.last_batch_iteration)
    return path, client, counters, train(engine, rank, world, AFTER), rng_draw


@pytest.fixture(scope="module")
def root():
    path = scratch_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def saved(root, pools):
    """Two-rank runs with our AdamW, torch's AdamW and SGD: checkpoint at step 2, then 2 more."""
    out = {}
    for kind in KINDS:
        out[kind] = pools(2).run(save_and_continue, os.path.join(root, kind), kind)
    out["fsdp2"] = pools(2).run(fsdp2_load, os.path.join(root, "ours", "global_step2"))
    return out


def test_save_layout_and_latest(saved, root):
    path, latest, losses, weights, _ = saved["ours"][0]
    assert path == os.path.join(root, "ours", "global_step2")
    assert latest == "global_step2"  # the tag alone, as DeepSpeed writes it (its tools read it)
    with open(os.path.join(root, "ours", "latest.crc32")) as f:
        assert f.read() == f"crc32:{zlib.crc32(b'global_step2'):08x}\n"  # the tag's checksum
    names = sorted(os.listdir(path))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "vescale_state.json"], names
    assert not [n for n in os.listdir(os.path.join(root, "ours")) if n.startswith(".")]
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert tuple(md["model.wte.weight"].size) == (96, 64)          # true shapes
    assert tuple(md["optim.state.blocks.0.fc.weight.exp_avg"].size) == (256, 64)
    assert len(md["model.blocks.0.fc.weight"].chunks) >= 2           # every rank wrote a piece


@pytest.mark.parametrize("world,granularity", [(1, "rows:1"), (3, "rows:16"), (4, "tile:8x8")])
@pytest.mark.parametrize("kind", KINDS)
def test_resume_on_other_world_sizes_matches_uninterrupted(saved, root, pools, world, granularity,
                                                          kind):
    expected = saved[kind][0][2]
    results = pools(world).run(load_and_continue, os.path.join(root, kind), kind, granularity)
    path, client, counters, losses, rng_draw = results[0]
    assert path.endswith("global_step2") and client == {"epoch": 3, "note": "hi"}
    assert counters == (SAVE_AT, SAVE_AT * GLOBAL, SAVE_AT - 1)
    gap = max(abs(a - b) / b for a, b in zip(losses, expected))
    assert gap < 1e-5, (losses, expected)
    for r in range(min(world, 2)):  # ranks that existed at save time get their generator back
        assert torch.equal(results[r][4], saved[kind][r][4])




# -- other readers ---------------------------------------------------------------------------------

def plain_dcp_load(rank, world, path):
    import torch.distributed.checkpoint as dcp
    model = fm.make("gpt", seed=7)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_plain_model_loads_engine_checkpoint_via_dcp(saved, root, pools):
    weights = saved["ours"][0][3]
    loaded = pools(1).run(plain_dcp_load, os.path.join(root, "ours", "global_step2"))[0]
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_consolidate_python_and_cli(saved, root, tmp_path):
    from vescale_engine.checkpoint.sharded import consolidate
    weights = saved["torch"][0][3]
    full = consolidate(os.path.join(root, "torch"))
    assert all(torch.equal(full[k], weights[k]) for k in weights) and full.keys() == weights.keys()
    out = tmp_path / "model.pt"
    cli = subprocess.run([sys.executable, "-m", "launcher.cli", "consolidate",
                          os.path.join(root, "torch"), str(out), "--dtype", "bf16"],
                         capture_output=True, text=True, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr
    model = fm.make("gpt", seed=5)
    model.load_state_dict(torch.load(out, weights_only=True))  # plain, strict
    assert model.wte.weight.dtype == torch.float32  # load_state_dict casts bf16 back
    assert torch.equal(model.wte.weight, weights["wte.weight"].bfloat16().float())
    # .safetensors, written by our own writer: read back by the format's spec (and by the
    # safetensors package when it is installed), then loaded into a plain model, strict.
    from vescale_engine.checkpoint.sharded import consolidate as again
    from vescale_engine.checkpoint.safetensors_format import load_file
    st = tmp_path / "model.safetensors"
    again(os.path.join(root, "torch"), str(st))
    blob = st.read_bytes()
    header_len = int.from_bytes(blob[:8], "little")
    assert (8 + header_len) % 8 == 0 and b'"dtype":"F32"' in blob[8:8 + header_len]
    read = load_file(str(st))
    assert read.keys() == weights.keys() and all(torch.equal(read[k], weights[k]) for k in read)
    try:
        from safetensors.torch import load_file as reference_load
    except ImportError:
        reference_load = None
    if reference_load is not None:
        assert all(torch.equal(v, read[k]) for k, v in reference_load(str(st)).items())
    plain = fm.make("gpt", seed=6)
    plain.load_state_dict(read)
    assert torch.equal(plain.wte.weight, weights["wte.weight"])


def fsdp2_load(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    model = fm.make("gpt", seed=9)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def test_fsdp2_model_loads_engine_checkpoint_via_dcp(saved):
    weights = saved["ours"][0][3]
    loaded = saved["fsdp2"][0]
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)


# -- I/O: CRCs without a second read, device loads through host staging ---------------------------

def io_once(rank, world, root):
    """Save and load with a spy on the whole-file CRC (a full read of a file), then load again
    with every box forced through the host-staging path that CUDA targets take."""
    import vescale_engine.checkpoint.sharded as ck
    import vescale_engine.checkpoint.dcp as cd
    real_crc, real_stage, real_wait, real_slice = (ck.crc32, cd._stage_through_host,
                                                  cd._wait_for_host_copies, cd.SafeReader._slice_file)
    reads, waits, boxes = [], [], []
    ck.crc32 = lambda file: (reads.append(os.path.basename(file)), real_crc(file))[1]
    try:
        engine = make_engine(world, "ours")
        train(engine, rank, world, 1)
        path = engine.save_checkpoint(root)
        save_reads, reads[:] = list(reads), []
        plain = make_engine(world, "ours")
        plain.load_checkpoint(root)
        load_reads = list(reads)
        cd._stage_through_host = lambda device: True
        cd._wait_for_host_copies = lambda device: waits.append(str(device))
        cd.SafeReader._slice_file = lambda self, f, info: (boxes.append(info.relative_path),
                                                            real_slice(self, f, info))[1]
        staged = make_engine(world, "ours")
        staged.load_checkpoint(root)
    finally:
        ck.crc32, cd._stage_through_host, cd._wait_for_host_copies = real_crc, real_stage, real_wait
        cd.SafeReader._slice_file = real_slice
    with open(os.path.join(path, "vescale_state.json")) as f:
        files = json.load(f)["files"]
    recorded = {name: (info["bytes"], info["crc32"]) == (
        os.path.getsize(os.path.join(path, name)), real_crc(os.path.join(path, name)))
        for name, info in files.items()}
    same = all(torch.equal(a, b) for a, b in zip(full_weights(plain).values(),
                                                 full_weights(staged).values()))
    after = train(plain, rank, world, 1), train(staged, rank, world, 1)
    n_files = len(set(boxes))  # the data files the boxes were read from
    assert save_reads == []  # the CRCs were taken while writing
    assert load_reads == [".metadata"]  # data files: each item checked as it is read
    assert recorded and all(recorded.values()), recorded
    assert waits == ["cpu"] * n_files and len(boxes) > n_files  # one wait per file, not per box
    assert same and after[0] == after[1]


def test_checkpoint_io_reads_each_byte_once_and_stages_device_loads(pools, tmp_path):
    pools(2).run(io_once, str(tmp_path / "io"))


# -- bad input -------------------------------------------------------------------------------------

def bad_loads(rank, world, root, scratch):
    from vescale_engine.checkpoint.sharded import CheckpointError
    good = os.path.join(root, "ours", "global_step2")
    out = {}

    def attempt(name, engine, *args, **kwargs):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = engine.load_checkpoint(*args, **kwargs)
            out[name] = ("ok", result[0], [str(w.message) for w in caught])
        except (CheckpointError, FileNotFoundError) as err:
            out[name] = ("error", str(err), None)

    engine = make_engine(world, "ours")
    attempt("missing dir", engine, os.path.join(scratch, "nope"))
    attempt("missing dir, tag", engine, os.path.join(scratch, "nope"), tag="global_step2")
    os.makedirs(os.path.join(scratch, "empty"), exist_ok=True)
    attempt("nothing to load", engine, os.path.join(scratch, "empty"))
    attempt("missing tag", engine, os.path.join(root, "ours"), tag="global_step9")
    for damage in ("truncated", "corrupted"):
        copy = os.path.join(scratch, damage, "global_step2")
        if rank == 0:
            shutil.copytree(good, copy)
            shard = os.path.join(copy, "__1_0.distcp")
            size = os.path.getsize(shard)
            with open(shard, "r+b") as f:
                if damage == "truncated":
                    f.truncate(size // 2)
                else:
                    f.seek(size // 2)
                    byte = f.read(1)
                    f.seek(size // 2)
                    f.write(bytes([byte[0] ^ 0xFF]))
        torch.distributed.barrier()
        attempt(damage, engine, copy)
    attempt("other model", make_engine(world, "ours", model=fm.MoE()), good)
    attempt("missing keys", make_engine(world, "ours", model=fm.GPT(layers=5)), good)
    attempt("shapes", make_engine(world, "ours", model=fm.GPT(vocab=80)), good)
    lenient = make_engine(world, "ours", model=fm.GPT(layers=5))
    attempt("lenient", lenient, good, load_module_strict=False)
    loaded = full_weights(lenient)
    return out, loaded["blocks.4.fc.weight"].abs().sum().item() > 0


def test_bad_input_is_one_clear_line(saved, root, pools):
    scratch = scratch_dir()
    results = pools(2).run(bad_loads, root, scratch)
    out, kept = results[0]
    assert results[1][0]["missing dir"][:2] == ("ok", None)  # on every rank
    shard = os.path.join(scratch, "{}", "global_step2", "__1_0.distcp")
    assert out["missing dir"][:2] == ("ok", None)  # DeepSpeed 0.19.8: a warning, (None, None)
    assert "nope/latest not found, nothing to load" in out["missing dir"][2][0]
    assert out["missing dir, tag"][0] == "error" and "nope does not exist" in \
        out["missing dir, tag"][1]
    assert out["nothing to load"][:2] == ("ok", None)
    assert "nothing to load" in out["nothing to load"][2][0]
    assert "'global_step9' not found" in out["missing tag"][1]
    assert out["truncated"][1].startswith(shard.format("truncated") + " is truncated")
    assert out["corrupted"][1] == shard.format("corrupted") + " is corrupted: CRC32 mismatch"
    assert "another model" in out["other model"][1] and "missing keys 'embed.weight'" \
        in out["other model"][1]
    assert "missing keys 'blocks.4.fc.bias'" in out["missing keys"][1]
    assert "'model.head.weight' has shape [96, 64], the model's is [80, 64]" in out["shapes"][1]
    status, path, messages = out["lenient"]
    assert status == "ok", out["lenient"]
    assert any("skipped missing ['blocks.4.fc.bias'" in m for m in messages)
    assert kept  # the skipped layer keeps its initial weights
    for v in out.values():
        assert "\n" not in str(v[1])
    shutil.rmtree(scratch, ignore_errors=True)


# -- atomicity -------------------------------------------------------------------------------------

KILL_SCRIPT = r"""
import os, sys, time
import torch, fsdp_models as fm
import torch.distributed.checkpoint.filesystem as fs
from test_checkpoint import make_engine, train
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])
engine = make_engine(1, "ours")
train(engine, 0, 1, 1)
engine.save_checkpoint(sys.argv[1])
train(engine, 0, 1, 1)
real = os.fsync
def stall(fd):  # the second save: stop mid-write and wait to be killed
    real(fd)
    print("WRITING", flush=True)
    time.sleep(120)
os.fsync = stall
engine.save_checkpoint(sys.argv[1])
"""


def test_sigkill_mid_save_leaves_previous_checkpoint(tmp_path, pools):
    port = free_port()
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(root), str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT,  # the test folders on the path, as the ranks have them
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    seen = []
    for line in proc.stdout:  # until the second save stalls inside its write
        seen.append(line)
        if line.strip() == "WRITING":
            break
    assert seen and seen[-1].strip() == "WRITING", "".join(seen[-20:])
    assert os.path.isdir(root / ".global_step2.partial")  # killed while writing step 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    assert (root / "latest").read_text().splitlines()[0] == "global_step1"
    assert not (root / "global_step2").exists()
    path, _ = pools(1).run(load_only, str(root))[0]
    assert path == str(root / "global_step1")
    # the next save clears the debris and publishes normally
    assert pools(1).run(save_again, str(root))[0] == "global_step2"
    assert not (root / ".global_step2.partial").exists()


def load_only(rank, world, root):
    engine = make_engine(world, "ours")
    return engine.load_checkpoint(root)


def save_again(rank, world, root):
    engine = make_engine(world, "ours")
    engine.load_checkpoint(root)
    train(engine, rank, world, 1)
    engine.save_checkpoint(root)
    with open(os.path.join(root, "latest")) as f:
        return f.read().splitlines()[0]


# -- frozen parameters left out (DeepSpeed's exclude_frozen_parameters) ---------------------------

def _with_wpe_frozen(model, wpe_from=0):
    """`model` with wpe.weight frozen and taken from the model of seed `wpe_from`."""
    with torch.no_grad():
        model.wpe.weight.copy_(fm.make("gpt", seed=wpe_from).wpe.weight)
    model.wpe.weight.requires_grad_(False)
    return model


def frozen_excluded(rank, world, root):
    """save_checkpoint(exclude_frozen_parameters=True), as Trainer saves a PEFT model: the
    frozen parameter is not written; loading keeps the model's own value for it, here through
    Trainer's resume (deepspeed_load_checkpoint: a directory of global_step* tags and
    `latest`), and continues as the uninterrupted run; a model where it is trainable refuses."""
    import inspect
    from transformers.integrations.deepspeed import deepspeed_load_checkpoint
    from vescale_engine.checkpoint.sharded import CheckpointError, read_metadata, read_state
    engine = make_engine(world, "ours", model=_with_wpe_frozen(fm.make("gpt")))
    train(engine, rank, world, SAVE_AT)
    path = engine.save_checkpoint(root, exclude_frozen_parameters=True)
    after = train(engine, rank, world, AFTER)
    fresh = make_engine(world, "ours", model=_with_wpe_frozen(fm.make("gpt", seed=1)))
    deepspeed_load_checkpoint(fresh, root)
    resumed = train(fresh, rank, world, AFTER)
    try:
        make_engine(world, "ours", model=fm.make("gpt", seed=1)).load_checkpoint(root)
        refused = None
    except CheckpointError as err:
        refused = str(err)
    saved = sorted(k for k in read_metadata(path).state_dict_metadata if k.startswith("model."))
    return dict(signature="exclude_frozen_parameters" in inspect.signature(
        engine.save_checkpoint).parameters, saved=saved, after=after, resumed=resumed,
        flag=read_state(path).get("excludes_frozen_parameters"), refused=refused,
        path=os.path.basename(path))


def test_frozen_parameters_left_out_of_the_checkpoint(pools, tmp_path):
    r = pools(2).run(frozen_excluded, str(tmp_path))[0]
    assert r["signature"] and r["flag"] is True and r["path"] == f"global_step{SAVE_AT}"
    expected = sorted(f"model.{k}" for k in fm.make("gpt").state_dict() if k != "wpe.weight")
    assert r["saved"] == expected
    gap = max(abs(a - b) / b for a, b in zip(r["resumed"], r["after"], strict=True))
    assert gap < 1e-6, (r["resumed"], r["after"])
    assert "missing keys 'wpe.weight'" in r["refused"], r["refused"]


# -- DeepSpeed ZeRO import -------------------------------------------------------------------------

def deepspeed_train_and_save(rank, world, ds_dir, stage, freeze=(), exclude_frozen=False):
    """Real DeepSpeed ZeRO (torch AdamW) on these ranks: 2 steps, save, 2 more steps."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    model = fm.make("gpt")
    for name, p in model.named_parameters():
        p.requires_grad_(name not in freeze)
    ds_config = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": GLOBAL // world,
                 "optimizer": {"type": "AdamW", "params": {**OPT, "torch_adam": True}},
                 "zero_optimization": {"stage": stage}, "steps_per_print": 10 ** 6,
                 "gradient_clipping": 0.0}  # DeepSpeed 0.19 clips at 1.0 unless told
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config)
    train(engine, rank, world, SAVE_AT)
    engine.save_checkpoint(ds_dir, exclude_frozen_parameters=exclude_frozen)
    weights, moments = {}, {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:  # frozen: no fp32 master, no optimizer state
            with deepspeed.zero.GatheredParameters([p]):
                weights[name] = p.detach().float().clone()
            continue
        weights[name] = safe_get_full_fp32_param(p).clone()
        moments[name] = {k: safe_get_full_optimizer_state(p, k).clone()
                         for k in ("exp_avg", "exp_avg_sq")}
    losses = train(engine, rank, world, AFTER)
    return weights, moments, losses


def resume_from_deepspeed(rank, world, ds_dir):
    from vescale_engine.fsdp import sharded_state_dict
    from vescale_engine.shard.ragged import ragged_to_replicate
    engine = make_engine(world, "torch", scheduler=False)
    path, client = engine.load_checkpoint(ds_dir)  # a ZeRO directory, imported on the fly
    weights = full_weights(engine)
    moments = {}
    params = dict(engine.module.named_parameters())
    for fqn, (local, spec) in sharded_state_dict(engine.module).items():
        state = engine.optimizer.state[params[fqn]]
        moments[fqn] = {k: ragged_to_replicate(local_of(state[k]), spec)
                        for k in ("exp_avg", "exp_avg_sq")}
    steps = engine.global_steps
    return path, weights, moments, steps, train(engine, rank, world, AFTER)


def test_deepspeed_zero3_checkpoint_converts_and_resumes(pools, tmp_path):
    ds_dir = str(tmp_path / "ds")
    weights, moments, losses = pools(2).run(deepspeed_train_and_save, ds_dir, 3)[0]
    assert sorted(os.listdir(os.path.join(ds_dir, "global_step2"))) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    path, mine, my_moments, steps, my_losses = pools(3).run(resume_from_deepspeed, ds_dir)[0]
    assert path.endswith(os.path.join(".global_step2.vescale", "global_step2")) and steps == SAVE_AT
    for name in weights:
        assert torch.equal(mine[name], weights[name]), name
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(my_moments[name][k], moments[name][k]), (name, k)
    assert mine["head.weight"] is not None and torch.equal(mine["head.weight"], mine["wte.weight"])
    gap = max(abs(a - b) / b for a, b in zip(my_losses, losses))
    assert gap < 1e-5, (my_losses, losses)
    # the command line makes the same checkpoint, loadable anywhere
    out = tmp_path / "converted"
    cli = subprocess.run([sys.executable, "-m", "launcher.cli", "convert-zero", ds_dir, str(out)],
                         capture_output=True, text=True, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr
    from vescale_engine.checkpoint.sharded import consolidate
    full = consolidate(str(out))
    assert all(torch.equal(full[k], weights[k]) for k in weights)
    # rank 0 converting for longer than a collective may wait, and rank 0 failing
    results = pools(2).run(slow_and_failing_imports, ds_dir, str(tmp_path / "again"))
    slow, failed = [r[0] for r in results], [r[1] for r in results]
    for rank in (0, 1):
        assert slow[rank][0].endswith(os.path.join(".global_step2.vescale", "global_step2"))
        assert torch.equal(slow[rank][1], slow[0][1]) and slow[rank][2] == SAVE_AT
    assert failed[0] == failed[1]
    assert os.path.join("truncated", "global_step2", "zero_pp_rank_1_mp_rank_00_optim_states.pt: "
                        "cannot read DeepSpeed checkpoint file (RuntimeError: PytorchStreamReader "
                        "failed") in failed[0]["truncated"], failed[0]
    assert all("\n" not in message for message in failed[0].values())
    assert failed[0]["crashed"].endswith("global_step2: importing the DeepSpeed checkpoint failed "
                                         "(KeyError: 'fp32_flat_groups')"), failed[0]


IMPORT_SLEEP_S, SHORT_TIMEOUT_S = 6, 2


def slow_and_failing_imports(rank, world, ds_dir, scratch):
    """Imports on fresh copies of the ZeRO tag with the process group's timeout cut to
    SHORT_TIMEOUT_S: a conversion that sleeps IMPORT_SLEEP_S first still loads (nobody waits
    in a collective), and a failing one is the same one-line error on every rank."""
    import time
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    import vescale_engine.checkpoint.zero as zero
    from dist_harness import DEFAULT_TIMEOUT_S
    from vescale_engine.checkpoint.sharded import CheckpointError

    def fresh(name, damage=None):
        copy = os.path.join(scratch, name)
        if rank == 0:  # without the import an earlier load kept next to the tag
            shutil.copytree(ds_dir, copy, ignore=shutil.ignore_patterns(".*.vescale"))
            if damage:
                damage(os.path.join(copy, "global_step2"))
        torch.distributed.barrier()
        return copy

    def truncate(copy):
        shard = os.path.join(copy, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)

    real, engine = zero.convert_zero, make_engine(world, "torch", scheduler=False)
    paths = {name: fresh(name, damage) for name, damage in
             (("slow", None), ("truncated", truncate), ("crashed", None))}
    failed = {}
    _set_pg_timeout(timedelta(seconds=SHORT_TIMEOUT_S))
    try:
        zero.convert_zero = lambda *a, **k: (time.sleep(IMPORT_SLEEP_S), real(*a, **k))[1]
        path, _ = engine.load_checkpoint(paths["slow"])
        slow = (path, full_weights(engine)["wte.weight"], engine.global_steps)
        zero.convert_zero = real
        try:
            engine.load_checkpoint(paths["truncated"])
        except CheckpointError as err:
            failed["truncated"] = str(err)

        def crash(*args, **kwargs):  # not a ValueError/OSError: still reaches every rank
            raise KeyError("fp32_flat_groups")
        zero.convert_zero = crash
        try:
            engine.load_checkpoint(paths["crashed"])
        except CheckpointError as err:
            failed["crashed"] = str(err)
    finally:
        zero.convert_zero = real
        _set_pg_timeout(timedelta(seconds=DEFAULT_TIMEOUT_S))
    return slow, failed


def test_convert_zero_bad_input_names_the_file(tmp_path):
    from vescale_engine.checkpoint.sharded import CheckpointError
    from vescale_engine.checkpoint.zero import convert_zero
    tag = tmp_path / "ds" / "global_step1"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states.pt: cannot read"):
        convert_zero(str(tag), str(tmp_path / "out"))
    with pytest.raises(CheckpointError, match=r"no 'latest' file"):
        convert_zero(str(tmp_path), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stage,freeze,exclude", [
    (1, (), False), (2, (), False), (2, ("wpe.weight",), False),
    (3, ("wpe.weight", "blocks.1.fc.bias"), False), (3, ("wpe.weight",), True)])
def test_deepspeed_zero_checkpoints_convert(pools, tmp_path, stage, freeze, exclude):
    """ZeRO-1 and 2, and frozen parameters (kept outside the optimizer files) at 2 and 3, or
    left out by save_checkpoint(exclude_frozen_parameters=True): then the import says so."""
    from vescale_engine.checkpoint.sharded import consolidate, read_state
    from vescale_engine.checkpoint.zero import convert_zero
    ds_dir = str(tmp_path / "ds")
    weights, moments, _ = pools(2).run(deepspeed_train_and_save, ds_dir, stage, freeze,
                                       exclude)[0]
    model_file = "zero_pp_rank_1_mp_rank_00_model_states.pt" if stage == 3 else \
        "mp_rank_00_model_states.pt"
    frozen = torch.load(os.path.join(ds_dir, "global_step2", model_file), weights_only=True)
    assert sorted(frozen["frozen_param_shapes"] or {}) == ([] if exclude else sorted(freeze))
    path = convert_zero(ds_dir, str(tmp_path / "out"))
    full = consolidate(path)
    assert read_state(path).get("excludes_frozen_parameters", False) is exclude
    if exclude:
        assert not set(full) & set(freeze)
        weights = {k: v for k, v in weights.items() if k not in freeze}
    for name in weights:
        assert torch.equal(full[name], weights[name]), name
    state = {f"optim.state.{n}.{k}": torch.empty(weights[n].shape)
             for n in weights if n not in freeze for k in ("exp_avg", "exp_avg_sq")}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    for name in moments:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[f"optim.state.{name}.{k}"], moments[name][k]), (name, k)


def fp16_and_partial_loads(rank, world, root):
    """fp16: the loss scaler and skipped-step count come back. load_module_only and
    load_optimizer_states=False leave the other state alone."""
    cfg = {**config(world), "fp16": {"enabled": True, "initial_scale_power": 40, "hysteresis": 1}}
    from vescale_engine import initialize
    engine, *_ = initialize(model=fm.make("gpt"), config=cfg)
    train(engine, rank, world, 2)  # 2**40 overflows: the first step is skipped, the scale drops
    saved_scaler, skipped = engine.loss_scaler.state_dict(), engine.skipped_steps
    engine.save_checkpoint(root, tag="fp16")
    fresh, *_ = initialize(model=fm.make("gpt"), config=cfg)
    fresh.load_checkpoint(root, tag="fp16")
    fp16 = (fresh.loss_scaler.state_dict() == saved_scaler, fresh.skipped_steps == skipped,
            skipped >= 1)
    weights = full_weights(engine)

    module_only = make_engine(world, "ours")
    module_only.load_checkpoint(root, tag="fp16", load_module_only=True)
    loaded = full_weights(module_only)
    only = (all(torch.equal(loaded[k], weights[k]) for k in weights),
            module_only.global_steps == 0, not module_only.optimizer.state)
    no_optim = make_engine(world, "ours")
    no_optim.load_checkpoint(root, tag="fp16", load_optimizer_states=False)
    return fp16, only, (no_optim.global_steps == 2, not no_optim.optimizer.state)


def test_fp16_scaler_and_partial_loads(pools, tmp_path):
    fp16, only, no_optim = pools(2).run(fp16_and_partial_loads, str(tmp_path))[0]
    assert fp16 == (True, True, True)
    assert only == (True, True, True)
    assert no_optim == (True, True)


def test_cli_bad_input_is_one_line(saved, root, tmp_path, capsys):
    from launcher.cli import main
    good = os.path.join(root, "ours")
    cases = {
        ("consolidate", str(tmp_path / "nope"), str(tmp_path / "m.pt")): "nope does not exist",
        ("consolidate", good, str(tmp_path / "m.txt")): "must end in .pt, .pth, .bin or .safetensors",
        ("convert-zero", str(tmp_path / "nope"), str(tmp_path / "o")): "nope does not exist",
        ("convert-zero", good, str(tmp_path / "o")): "not a DeepSpeed ZeRO checkpoint",
    }
    for argv, expected in cases.items():
        assert main(list(argv)) == 2, argv
        err = capsys.readouterr().err.strip()
        assert expected in err and "\n" not in err, (argv, err)
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob("m.*"))


def test_hsdp_checkpoint_written_once_per_shard_and_reshards(root, pools):
    """4 ranks as 2 replicas x 2 shards: replicas hold the same pieces and DCP writes each box
    once; the checkpoint resumes on 3 plain-sharded ranks with the uninterrupted losses."""
    where = os.path.join(root, "hsdp")
    expected = pools(4).run(save_and_continue, where, "ours", 2)[0][2]
    md = dcp.FileSystemReader(os.path.join(where, "global_step2")).read_metadata()
    chunks = md.state_dict_metadata["model.blocks.0.fc.weight"].chunks
    assert sum(math.prod(c.sizes) for c in chunks) == 256 * 64  # no box twice
    losses = pools(3).run(load_and_continue, where, "ours", "rows:1")[0][3]
    assert max(abs(a - b) / b for a, b in zip(losses, expected)) < 1e-5, (losses, expected)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_doctored_metadata_is_refused_without_running_it(saved, root, tmp_path):
    """Even with sizes and CRCs rewritten to match, DCP's pickled .metadata is read with an
    allow-list: a payload is an error, never executed."""
    import json
    import pickle
    import zlib
    from vescale_engine.checkpoint.entries import write_checked_json
    from vescale_engine.checkpoint.sharded import CheckpointError, consolidate
    copy = tmp_path / "global_step2"
    shutil.copytree(os.path.join(root, "ours", "global_step2"), copy)
    marker = tmp_path / "pwned"
    data = pickle.dumps(_Payload(str(marker)))
    (copy / ".metadata").write_bytes(data)
    state = json.loads((copy / "vescale_state.json").read_text())
    state["files"][".metadata"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    write_checked_json(str(copy / "vescale_state.json"), state)  # its own checksum rewritten too
    with pytest.raises(CheckpointError, match=r"\.metadata: not DCP metadata \(posix\.mkdir is "
                                              r"not allowed"):
        consolidate(str(copy))
    assert not marker.exists()


# -- AdamW8bit: its codes and scales are the checkpoint -------------------------------------------

def resave_and_continue(rank, world, root, out, quantization):
    """Load (possibly with other quantization blocks or tables), save again before any step,
    then train the same steps as the uninterrupted run."""
    engine = make_engine(world, "adamw8bit", quantization=quantization)
    engine.load_checkpoint(root)
    engine.save_checkpoint(out, tag="resaved")
    return train(engine, rank, world, AFTER)


def optim_entries(path):
    """Every optim.state entry of a checkpoint, whole, read in this process with plain DCP."""
    from vescale_engine.checkpoint.dcp import LoadPlanner, SafeReader
    md = SafeReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.items()
          if k.startswith("optim.state.")}
    dcp.load(sd, storage_reader=SafeReader(path), planner=LoadPlanner(), no_dist=True)
    return sd


def restored_moments(path):
    """{entry: (fp32 moment, per-element scale, block)}: a checkpoint's 8-bit moments restored
    here, from its codes, its scales and the block and tables its vescale_state.json records."""
    import json
    from vescale_engine.plan.granularity import parse_granularity
    from vescale_engine.optim.quantize import code_table
    with open(os.path.join(path, "vescale_state.json")) as f:
        record = json.load(f)["optimizer"]["checkpoint_info"]["quantized_moments"]
    entries, out = optim_entries(path), {}
    for key, codes in entries.items():
        for moment, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            if key.endswith(f".{moment}_codes"):
                block = parse_granularity(record["block"]).block_size(codes.shape)
                scales = entries[key.replace("_codes", "_scales")]
                assert scales.numel() == -(-codes.numel() // block), key
                spread = scales.repeat_interleave(block)[:codes.numel()]
                table = code_table(record["quant_map"], signed)
                index = codes.reshape(-1).long() + (127 if signed else 0)
                out[key[:-len("_codes")]] = (table[index] * spread, spread, block)
    return record, out


@pytest.mark.parametrize("world", [1, 3, 4])
def test_adamw8bit_codes_and_scales_reload_bit_exact_on_any_world_size(saved, root, pools,
                                                                       world):
    """Saved on 2 ranks; loaded on 1, 3, 4 and saved again at once: every code and scale is
    bit-identical to the saved ones, and training continues with the uninterrupted losses."""
    out = os.path.join(root, f"adamw8bit-resaved-{world}")
    original = os.path.join(root, "adamw8bit", "global_step2")
    losses = pools(world).run(resave_and_continue, os.path.join(root, "adamw8bit"), out,
                              ("block:64", "dynamic"))[0]
    before, after = optim_entries(original), optim_entries(os.path.join(out, "resaved"))
    assert before.keys() == after.keys() and len(before) > 20
    differ = [k for k in before if before[k].dtype != after[k].dtype
              or not torch.equal(before[k], after[k])]
    assert differ == [], differ
    expected = saved["adamw8bit"][0][2]
    assert max(abs(a - b) / b for a, b in zip(losses, expected)) < 1e-5, (losses, expected)


def test_adamw8bit_checkpoint_stores_codes_a_quarter_of_fp32(saved, root):
    """The moments are saved as 1-byte codes in the parameter's shape plus one fp32 scale per
    64-element block: the bytes DCP wrote for them are ~1/4 of fp32 AdamW's for the same model."""
    from vescale_engine.checkpoint.dcp import SafeReader
    path = os.path.join(root, "adamw8bit", "global_step2")
    md = SafeReader(path).read_metadata()
    sdm = md.state_dict_metadata
    fc = "optim.state.blocks.0.fc.weight."
    assert sdm[fc + "exp_avg_codes"].properties.dtype == torch.int8
    assert sdm[fc + "exp_avg_sq_codes"].properties.dtype == torch.uint8
    assert tuple(sdm[fc + "exp_avg_codes"].size) == (256, 64)      # the parameter's true shape
    assert tuple(sdm[fc + "exp_avg_sq_scales"].size) == (256 * 64 // 64,)
    assert sdm[fc + "exp_avg_scales"].properties.dtype == torch.float32
    assert not [k for k in sdm if k.endswith((".exp_avg", ".exp_avg_sq"))]  # no fp32 moments
    with open(os.path.join(path, "vescale_state.json")) as f:
        import json
        info = json.load(f)["optimizer"]["checkpoint_info"]
    assert info == {"quantized_moments": {"block": "block:64", "quant_map": "dynamic"}}

    def payload(md, suffixes):  # numel x element size, from DCP's metadata
        return sum(math.prod(m.size) * m.properties.dtype.itemsize
                   for k, m in md.state_dict_metadata.items()
                   if k.startswith("optim.state.") and k.endswith(suffixes))

    ours = SafeReader(os.path.join(root, "ours", "global_step2")).read_metadata()
    fp32, quantized = payload(ours, (".exp_avg", ".exp_avg_sq")), payload(md, ("_codes", "_scales"))
    numel = sum(math.prod(sdm[k].size) for k in sdm if k.endswith("exp_avg_codes"))
    assert fp32 == 8 * numel and quantized == 2 * numel + 8 * sum(
        sdm[k].size[0] for k in sdm if k.endswith("exp_avg_scales"))
    assert quantized < 0.27 * fp32, (quantized, fp32)  # 2 + 8/64 bytes an element, vs 8
    # The files hold exactly that: each chunk's bytes are its payload plus torch.save's framing
    # (< 2 KiB per chunk, which is why a small test model's files do not show the full 4x).
    for index, stored in md.storage_data.items():
        if index.fqn.startswith("optim.state.") and index.fqn.endswith(("_codes", "_scales")):
            entry = sdm[index.fqn]
            chunk = next(c for c in entry.chunks if c.offsets == index.offset)
            extra = stored.length - math.prod(chunk.sizes) * entry.properties.dtype.itemsize
            assert 0 < extra < 2048, (index, stored.length)


@pytest.mark.parametrize("world,quantization", [(3, ("block:256", "dynamic")),
                                                (1, ("tile:16x16", "linear"))])
def test_adamw8bit_loads_into_other_blocks_lossy(saved, root, pools, world, quantization):
    """Another block size or code table: the saved codes are restored with the saved blocks and
    quantized again with the new ones. Lossy: every moment moves by at most 2% of its new block's
    maximum (one quantization step), and training continues close to the uninterrupted run."""
    out = os.path.join(root, f"adamw8bit-converted-{world}")
    losses = pools(world).run(resave_and_continue, os.path.join(root, "adamw8bit"), out,
                              quantization)[0]
    old_record, before = restored_moments(os.path.join(root, "adamw8bit", "global_step2"))
    record, after = restored_moments(os.path.join(out, "resaved"))
    assert record == {"block": quantization[0], "quant_map": quantization[1]}
    assert before.keys() == after.keys()
    converted = []
    for key, (old, _, old_block) in before.items():
        new, new_scale, block = after[key]
        assert ((new - old).abs() <= 0.02 * new_scale + 1e-12).all(), key
        if block == old_block and record["quant_map"] == old_record["quant_map"]:
            assert torch.equal(new, old), key  # same blocks and tables: loaded as saved
        else:
            converted.append(not torch.equal(new, old))
    assert len(converted) >= 30 and all(converted)  # really converted: every such moment moved
    expected = saved["adamw8bit"][0][2]
    gap = max(abs(a - b) / b for a, b in zip(losses, expected))
    assert 0 < gap < 1e-2, (losses, expected)


def test_adamw8bit_bad_quantization_record_is_one_line(saved, root, pools, tmp_path):
    import json

    from vescale_engine.checkpoint.entries import write_checked_json
    copy = tmp_path / "global_step2"
    shutil.copytree(os.path.join(root, "adamw8bit", "global_step2"), copy)
    state = json.loads((copy / "vescale_state.json").read_text())
    state["optimizer"]["checkpoint_info"]["quantized_moments"]["quant_map"] = "log"
    write_checked_json(str(copy / "vescale_state.json"), state)  # with a checksum that matches
    error = pools(1).run(load_error, str(copy))[0]
    assert error.startswith("AdamW8bit checkpoint: quant_map 'log' is not one of"), error
    assert "\n" not in error


def load_error(rank, world, path):
    from vescale_engine.checkpoint.sharded import CheckpointError
    engine = make_engine(world, "adamw8bit")
    try:
        engine.load_checkpoint(path)
    except CheckpointError as err:
        return str(err)
    return None


def test_adamw8bit_loads_an_fp32_adamw_checkpoint(saved, root, pools):
    """A checkpoint with fp32 moments and no quantization record (our AdamW's; a DeepSpeed
    import's) loads into AdamW8bit: the moments are quantized with its blocks (lossy)."""
    out = os.path.join(root, "adamw-into-8bit")
    losses = pools(3).run(resave_and_continue, os.path.join(root, "ours"), out,
                          ("block:64", "dynamic"))[0]
    fp32 = optim_entries(os.path.join(root, "ours", "global_step2"))
    _, after = restored_moments(os.path.join(out, "resaved"))
    assert len(after) >= 60 and all(k in fp32 for k in after)
    for key, (new, new_scale, _) in after.items():
        old = fp32[key].reshape(-1)
        assert ((new - old).abs() <= 0.02 * new_scale + 1e-12).all(), key
        assert new_scale.max() == old.abs().max(), key  # scales: the blocks' maxima
    expected = saved["ours"][0][2]
    gap = max(abs(a - b) / b for a, b in zip(losses, expected))
    assert gap < 1e-2, (losses, expected)


def test_safetensors_format_round_trip(tmp_path):
    """Our writer and reader agree for every dtype a state dict holds (the layout follows the
    safetensors spec: u64 header length, JSON header padded to 8 bytes, raw little-endian)."""
    from vescale_engine.checkpoint.safetensors_format import load_file, save_file
    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).bfloat16(),
               "f16": torch.randn(2, 2).half(), "i64": torch.arange(6).reshape(2, 3),
               "u8": torch.arange(4, dtype=torch.uint8), "empty": torch.empty(0, 4),
               "view": torch.randn(4, 6)[:, 1:3]}  # non-contiguous: written contiguous
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    assert n % 8 == 0 and header["__metadata__"] == {"format": "pt"}
    assert header["bf16"] == {"dtype": "BF16", "shape": [7], "data_offsets": [60, 74]}
    read = load_file(str(path))
    assert read.keys() == tensors.keys()
    assert all(torch.equal(read[k], tensors[k]) and read[k].dtype == tensors[k].dtype
               for k in tensors)
    path.write_bytes(blob[:-3])
    with pytest.raises(ValueError, match="t.safetensors"):
        load_file(str(path))


# -- moving a sharded model ------------------------------------------------------------------------

def moves_after_initialize(rank, world):
    """Every nn.Module move or cast after initialize: the no-ops run, the rest raise one line and
    leave every parameter a view of its DBuffer's master shard."""
    engine = make_engine(world, "ours")
    model = engine.module

    def attached():
        return all(local_of(sp.sharded).untyped_storage().data_ptr() ==
                   sp.buffer.master.untyped_storage().data_ptr()
                   for sp in (p._vescale for p in model.parameters()))
    noops = {"to(same)": lambda: model.to(torch.device("cpu"), torch.float32),
             "float": model.float, "cpu": model.cpu, "train/eval": lambda: model.eval().train()}
    moves = {"engine.cuda": engine.cuda, "cuda": model.cuda, "to(meta)": lambda: model.to("meta"),
             "half": model.half, "to(bf16)": lambda: model.to(torch.bfloat16),
             "block.double": model.blocks[0].double,
             "to_empty": lambda: model.to_empty(device="cpu")}
    out = {}
    for name, call in {**noops, **moves}.items():
        try:
            call()
            out[name] = ("ok", attached())
        except RuntimeError as err:
            out[name] = (str(err), attached())
    losses = train(engine, rank, world, 1)  # still trains after all of it
    return out, losses


def test_moves_and_casts_after_initialize_raise_one_line(pools):
    out, losses = pools(2).run(moves_after_initialize)[0]
    assert all(attached for _, attached in out.values()), out
    for name in ("to(same)", "float", "cpu", "train/eval"):
        assert out[name][0] == "ok", (name, out[name])
    detach = "(...) on a module sharded by fully_shard would detach its parameters from their " \
             "sharded buffers: "
    move = "build or move the model before fully_shard/initialize (initialize puts it on the " \
           "rank's device)"
    cast = "the fp32 master stays fp32; set the compute dtype with MixedPrecisionPolicy " \
           "(param_dtype) or the bf16/fp16 config"
    assert out["engine.cuda"][0] == "GPT.cuda" + detach + move
    assert out["cuda"][0] == "GPT.cuda" + detach + move
    assert out["to(meta)"][0] == "GPT.to" + detach + move
    assert out["half"][0] == "GPT.half" + detach + cast
    assert out["to(bf16)"][0] == "GPT.to" + detach + cast
    assert out["block.double"][0] == "Block.double" + detach + cast
    assert out["to_empty"][0].startswith("GPT.to_empty" + detach + "for a model built on the "
                                         "meta device call vescale_engine.materialize(model)")
    assert all("\n" not in message for message, _ in out.values())
    assert math.isfinite(losses[0])

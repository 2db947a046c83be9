"""RL colocation (`engine.offload_states` / `engine.reload_states`, DeepSpeed's API) on 2 gloo
ranks: the round trip is bitwise exact for every parameter, master shard, gradient shard and
optimizer state tensor (AdamW fp32 and bf16, AdamW8bit, Muon, and AdamW with offload_optimizer)
and training goes on with the losses of a run without it; while offloaded the included states
hold no device storage (on CPU the device is the host: the bytes live in separate buffers) and
a partial include moves only its own; the call forms DeepSpeed documents and OpenRLHF uses,
with DeepSpeed's enums; every misuse is one line."""
import inspect
import re

import pytest
import torch

import fsdp_models as fm
from dist_harness import scratch_dir

GLOBAL, MICRO, ACCUM = 12, 3, 2


def config(optimizer="AdamW", dtype="fp32", offload_optimizer=False):
    cfg = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": MICRO,
           "gradient_accumulation_steps": ACCUM, "gradient_clipping": 0.05,
           "optimizer": {"type": optimizer, "params": {"lr": 3e-3, "eps": 1e-6,
                                                       "weight_decay": 0.01}},
           "vescale": {"wrap_policy": {"module_classes": ["Block"]},
                       "granularity": {"default": "rows:16"}}}
    if optimizer == "Muon":
        cfg["optimizer"]["params"] = {"lr": 0.02}
    elif optimizer == "AdamW8bit":
        cfg["optimizer"]["params"]["block"] = "block:64"
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if offload_optimizer:
        cfg["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    return cfg


def make_engine(cfg):
    from vescale_engine import initialize
    engine, *_ = initialize(model=fm.make("gpt"), config=cfg)
    return engine


def micro_step(engine, rank, world, k):
    """Micro-batch k of the current step's window: forward, backward, step(); its loss."""
    idx, tgt = fm.rank_micro_batches("gpt", engine.global_steps, rank, world, MICRO, ACCUM)[k]
    loss = engine(idx, tgt)
    engine.backward(loss)
    engine.step()
    return loss.detach().float().item()


def buffers(engine):
    from vescale_engine.fsdp.lookup import units_under
    return [buf for unit in units_under(engine.module) for buf in unit.buffers]


def held_tensors(engine):
    """By name, every tensor the engine keeps between micro-steps, found independently of
    colocation.py: the parameters and their gradients, each buffer's master and gradient shard,
    every optimizer state tensor."""
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"param {name}"] = p
        if p.grad is not None:
            out[f"grad {name}"] = p.grad
    for i, buf in enumerate(buffers(engine)):
        out[f"master {buf.name}"] = buf.master
        if buf.has_grad:
            out[f"grad shard {buf.name}"] = buf.grad
    for i, state in enumerate(engine.optimizer.state.values()):
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"state {i} {key}"] = value
    return out


def bits(t):
    return t.detach().reshape(-1).view(torch.uint8).clone()


def bytes_of(kind, engine):
    """Device bytes held now, per kind, counted from the tensors themselves."""
    if kind == "hp_params":
        return sum(b.master.untyped_storage().nbytes() for b in buffers(engine))
    if kind == "lp_grads":
        return sum(b.grad.untyped_storage().nbytes() for b in buffers(engine))
    return sum(v.untyped_storage().nbytes() for s in engine.optimizer.state.values()
               for v in s.values() if isinstance(v, torch.Tensor))


# -- round trip -------------------------------------------------------------------------------

def run_round_trip(rank, world, optimizer, dtype, offload_optimizer):
    """Two engines trained alike: 2 optimizer steps, then the first micro-batch of step 3 (its
    gradient shards held); the second offloads everything there and reloads. Then both finish
    step 3 and take 2 more."""
    losses, info = {}, {}
    for round_trip in (False, True):
        engine = make_engine(config(optimizer, dtype, offload_optimizer))
        seen = [micro_step(engine, rank, world, k % ACCUM) for k in range(2 * ACCUM + 1)]
        if round_trip:
            held = held_tensors(engine)
            before = {name: bits(t) for name, t in held.items()}
            # offload_optimizer (ratio 1): every buffer's master, gradient shard and optimizer
            # state are in host memory (the faces and their .grad view them); the device keeps
            # each buffer's compute shard, which offload_states moves
            host_resident = set(held) if offload_optimizer else set()
            engine.offload_states()
            info["compute_freed"] = all(b.compute.tensor.untyped_storage().nbytes() == 0
                                        for b in buffers(engine)) if offload_optimizer else None
            info["offloaded"] = {name: t.untyped_storage().nbytes() for name, t in held.items()}
            info["host_resident"] = sorted(host_resident)
            info["device_bytes"] = engine._colocation.device_bytes()
            info["bytes_offloaded"] = engine._colocation.bytes_offloaded
            info["grads_held"] = sum(name.startswith("grad shard") for name in held)
            engine.reload_states()
            info["same_objects"] = all(held_tensors(engine)[n] is t for n, t in held.items())
            info["changed"] = sorted(n for n, t in held.items() if not torch.equal(bits(t),
                                                                                   before[n]))
        seen.append(micro_step(engine, rank, world, 1))
        seen += [micro_step(engine, rank, world, k % ACCUM) for k in range(2 * ACCUM)]
        losses[round_trip] = seen
        info["final" if round_trip else "final_plain"] = {
            n: bits(p) for n, p in engine.module.named_parameters()}
        engine.destroy()
    assert info["grads_held"] > 0  # offloaded mid-window: gradient shards were held
    # while offloaded: every device storage is empty but the host-resident optimizer state
    full = [n for n, nbytes in info["offloaded"].items()
            if nbytes and n not in info["host_resident"]]
    assert not full, (rank, full[:5])
    assert info["device_bytes"] == 0
    assert info["bytes_offloaded"] > 0
    if offload_optimizer:  # its state stays in host memory, untouched
        assert info["host_resident"]
        assert all(info["offloaded"][n] > 0 for n in info["host_resident"])
        assert info["compute_freed"], rank
    else:
        assert not info["host_resident"]
    assert info["same_objects"]
    assert info["changed"] == [], (rank, info["changed"][:5])
    assert losses[True] == losses[False], rank
    plain, trip = info["final_plain"], info["final"]
    assert all(torch.equal(plain[n], trip[n]) for n in plain), rank




@pytest.mark.parametrize("optimizer,dtype,offload_optimizer", [
    ("AdamW", "fp32", False), ("AdamW", "bf16", False), ("AdamW8bit", "fp32", False),
    ("Muon", "fp32", False), ("AdamW", "fp32", True)])
def test_round_trip_is_exact_and_training_goes_on(pools, optimizer, dtype, offload_optimizer):
    pools(2).run(run_round_trip, optimizer, dtype, offload_optimizer)


def run_decay_groups(rank, world, optimizer):
    """Trainer's decay / no-decay groups share buffers, so ours keeps a per-element weight decay
    on the device beside the state: offload_states frees it too, and the run goes on as one
    without the round trip."""
    from vescale_engine import initialize
    out = []
    for round_trip in (False, True):
        model = fm.make("gpt")
        named = list(model.named_parameters())
        groups = [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
        engine, *_ = initialize(model=model, model_parameters=groups,
                                config=config(optimizer))
        seen = [micro_step(engine, rank, world, k % ACCUM) for k in range(ACCUM)]
        decays = engine.optimizer.held_tensors()
        freed = None
        if round_trip:
            engine.offload_states()
            freed = [d.untyped_storage().nbytes() for d in decays]
            engine.reload_states()
        seen += [micro_step(engine, rank, world, k % ACCUM) for k in range(2 * ACCUM)]
        out.append((seen, len(decays), freed, engine._colocation.device_bytes() > 0))
        engine.destroy()
    (plain, decays, _, _), (trip, _, freed, held_after) = out
    assert decays > 0 and freed == [0] * decays
    assert held_after and trip == plain


@pytest.mark.parametrize("optimizer", ["AdamW", "AdamW8bit"])
def test_per_element_weight_decay_moves_with_the_state(pools, optimizer):
    pools(2).run(run_decay_groups, optimizer)


# -- partial include, and what each name moves --------------------------------------------------

def run_partial(rank, world):
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as S
    engine = make_engine(config())
    for k in range(ACCUM + 1):  # one step, then a micro-batch: gradient shards held
        micro_step(engine, rank, world, k % ACCUM)
    kinds = ("optim_states", "hp_params", "lp_grads")
    full = {kind: bytes_of(kind, engine) for kind in kinds}
    out = {"full": full, "cases": []}
    for include in ([S.optim_states], [S.hp_params], ["lp_grads"], "lp_grads",
                    [S.lp_params, S.contiguous_grad_buffer], {S.optim_states, S.lp_grads}):
        engine.offload_states(include=include)
        out["cases"].append((repr(include), {kind: bytes_of(kind, engine) for kind in kinds},
                             engine._colocation.bytes_offloaded))
        engine.reload_states()
    out["after"] = {kind: bytes_of(kind, engine) for kind in kinds}
    micro_step(engine, rank, world, 1)  # the window finishes
    engine.destroy()
    assert all(full.values()), full
    moved = {
        "[<OffloadStateTypeEnum.optim_states: 'optim_states'>]": {"optim_states"},
        "[<OffloadStateTypeEnum.hp_params: 'hp_params'>]": {"hp_params"},
        "['lp_grads']": {"lp_grads"}, "'lp_grads'": {"lp_grads"},
        # no compute-dtype shard in these buffers, and the full gradient buffers are
        # free between steps: nothing to move
        "[<OffloadStateTypeEnum.lp_params: 'lp_params'>, "
        "<OffloadStateTypeEnum.contiguous_grad_buffer: 'contiguous_grad_buffer'>]": set()}
    for include, held, offloaded in out["cases"]:
        expect = moved.get(include, {"optim_states", "lp_grads"})  # the set
        assert held == {k: 0 if k in expect else full[k] for k in full}, include
        assert offloaded == sum(full[k] for k in expect), include
    assert out["after"] == full


def test_partial_include_moves_only_its_own(pools):
    pools(2).run(run_partial)


# -- the call forms in the wild -----------------------------------------------------------------

def test_signatures_are_deepspeeds():
    from deepspeed.runtime.engine import DeepSpeedEngine
    from vescale_engine.engine.engine import VeScaleEngine
    for name in ("offload_states", "reload_states"):
        ours = inspect.signature(getattr(VeScaleEngine, name)).parameters
        theirs = inspect.signature(getattr(DeepSpeedEngine, name)).parameters
        assert list(ours) == list(theirs), name
        assert [p.default for p in ours.values()] == [p.default for p in theirs.values()], name


def run_call_forms(rank, world):
    """As they are written: DeepSpeed's docs and its PR's example (a set of enum members,
    OffloadDeviceEnum.cpu), OpenRLHF's offload_deepspeed_states list and its
    reload_states(non_blocking=True), the bare calls; the engine from deepspeed.initialize
    after patch_deepspeed."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    import vescale_engine
    vescale_engine.patch_deepspeed()
    model = fm.make("gpt")
    cfg = config()  # OpenRLHF's configs name the optimizer offload device ("none" here)
    cfg["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "none"}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    moved = []
    micro_step(engine, rank, world, 0)
    micro_step(engine, rank, world, 1)
    # DeepSpeed's PR 6011 / docs
    engine.offload_states(include=set([OffloadStateTypeEnum.hp_params,
                                       OffloadStateTypeEnum.optim_states]),
                          device=OffloadDeviceEnum.cpu)
    moved.append(engine._colocation.bytes_offloaded)
    engine.reload_states()
    # OpenRLHF's offload_deepspeed_states / reload_deepspeed_states (openrlhf/utils/deepspeed/
    # deepspeed_utils.py) as written, less torch.cuda.synchronize() (no CUDA here)
    model = engine
    zero_stage = model.zero_optimization_stage()
    adam_offload = model.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert zero_stage == 3 and not adam_offload
    offload_state_types = [OffloadStateTypeEnum.optim_states,
                           OffloadStateTypeEnum.contiguous_grad_buffer,
                           OffloadStateTypeEnum.hp_params]
    offload_state_types += [OffloadStateTypeEnum.lp_grads]
    model.optimizer.offload_states(include=offload_state_types, device=OffloadDeviceEnum.cpu,
                                   pin_memory=True, non_blocking=True)
    model.empty_partition_cache()
    torch.cuda.empty_cache()
    dist.barrier()
    moved.append(engine._colocation.bytes_offloaded)
    moved.append(engine._colocation.device_bytes())
    model.reload_states(non_blocking=True)
    torch.cuda.empty_cache()
    dist.barrier()
    engine.offload_states()  # everything
    moved.append(engine._colocation.bytes_offloaded)
    engine.reload_states()
    losses = [micro_step(engine, rank, world, k % ACCUM) for k in range(ACCUM)]
    ours = type(engine).__name__
    optimizer = engine.optimizer
    engine.destroy()
    ours = (ours, hasattr(optimizer, "offload_states"))  # destroy takes them off again
    plain = make_engine(config())
    expected = [micro_step(plain, rank, world, k % ACCUM) for k in range(2 * ACCUM)][ACCUM:]
    plain.destroy()
    assert ours == ("VeScaleEngine", False)
    # the gradient shards dropped at the step are freed, not moved: the same bytes
    assert moved[0] > 0 and moved[0] == moved[1] == moved[3], moved
    assert moved[2] == 0  # nothing left on the device while offloaded
    assert losses == expected


def test_call_forms_of_deepspeed_and_openrlhf(pools):
    pools(2).run(run_call_forms)


# -- misuse: one line each ----------------------------------------------------------------------

def _message(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def run_refusals(rank, world, root):
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from vescale_engine.integrations.deepspeed.params import GatheredShards
    engine = make_engine(config())
    micro_step(engine, rank, world, 0)
    micro_step(engine, rank, world, 1)
    idx, tgt = fm.rank_micro_batches("gpt", engine.global_steps, rank, world, MICRO, ACCUM)[0]
    out = {}
    out["reload first"] = _message(engine.reload_states)
    out["unknown"] = _message(lambda: engine.offload_states(include=["optim_states", "grads"]))
    out["not a collection"] = _message(lambda: engine.offload_states(include=3))
    out["nvme"] = _message(lambda: engine.offload_states(device=OffloadDeviceEnum.nvme))
    out["none"] = _message(lambda: engine.offload_states(device="none"))
    with GatheredShards(list(engine.module.parameters())):
        out["gathered"] = _message(engine.offload_states)
    with engine.no_sync():
        engine.backward(engine(idx, tgt))
        out["no_sync"] = _message(engine.offload_states)
    engine.step()  # not a boundary: the window goes on
    loss = engine(idx, tgt)
    out["before backward"] = _message(engine.offload_states)
    engine.backward(loss)
    engine.step()  # the boundary: gradients reduced and stepped
    out["refusals left it as it was"] = (engine._colocation.offloaded, engine.global_steps)
    engine.offload_states(include=["optim_states"])
    out["twice"] = _message(engine.offload_states)
    out["forward"] = _message(lambda: engine(idx, tgt))
    out["module forward"] = _message(lambda: engine.module(idx, tgt))
    out["backward"] = _message(lambda: engine.backward(torch.zeros((), requires_grad=True)))
    out["step"] = _message(engine.step)
    out["zero_grad"] = _message(engine.zero_grad)
    out["save"] = _message(lambda: engine.save_checkpoint(root))
    engine.reload_states()
    out["trains after"] = micro_step(engine, rank, world, 0)
    values = {n: bits(p) for n, p in engine.module.named_parameters()}
    engine.offload_states()
    engine.destroy()  # reloads first: the module keeps its parameters
    out["destroy keeps the parameters"] = all(
        torch.equal(bits(p), values[n]) for n, p in engine.module.named_parameters())
    return out


def test_misuse_is_one_line(pools):
    root = scratch_dir()
    while_off = ("while the engine's states are offloaded (optim_states): call reload_states() "
                 "first")
    for out in pools(2).run(run_refusals, root):
        assert out["reload first"] == ("RuntimeError: reload_states: nothing is offloaded; call "
                                       "offload_states() first")
        assert out["unknown"] == (
            "ValueError: offload_states: unknown include grads; DeepSpeed's state types are "
            "optim_states, hp_params, lp_params, lp_grads, contiguous_grad_buffer")
        assert out["not a collection"] == (
            "ValueError: offload_states: include must be None or a collection of DeepSpeed's "
            "state types (optim_states, hp_params, lp_params, lp_grads, contiguous_grad_buffer), "
            "got 3")
        for key, name in (("nvme", "nvme"), ("none", "none")):
            assert out[key] == (f"ValueError: offload_states: device {name} is not supported; "
                                "offload to \"cpu\" (OffloadDeviceEnum.cpu)")
        assert out["gathered"].startswith("RuntimeError: offload_states: unit ")
        assert out["gathered"].endswith(
            " holds its full parameters (inside deepspeed.zero.GatheredParameters or a forward "
            "that keeps them): offload between steps, outside it")
        unit_named = re.compile(r"unit \S+ ")  # a forward's last unit waits for backward
        assert unit_named.sub("", out["before backward"]) == unit_named.sub("", out["gathered"])
        assert out["no_sync"].startswith("RuntimeError: offload_states: unit ")
        assert out["no_sync"].endswith(
            " holds unreduced full gradients (engine.no_sync or "
            "vescale.local_grad_accumulation): offload after the accumulation boundary's step")
        assert out["refusals left it as it was"] == (None, 2)
        assert out["twice"] == ("RuntimeError: offload_states: already offloaded (optim_states); "
                                "call reload_states() first")
        assert out["forward"] == f"RuntimeError: engine forward {while_off}"
        assert out["module forward"] == f"RuntimeError: forward of GPT {while_off}"
        for key in ("backward", "step", "zero_grad"):
            assert out[key] == f"RuntimeError: engine.{key} {while_off}", key
        assert out["save"] == f"RuntimeError: engine.save_checkpoint {while_off}"
        assert isinstance(out["trains after"], float)
        assert out["destroy keeps the parameters"] is True
        assert all("\n" not in v for v in out.values() if isinstance(v, str))

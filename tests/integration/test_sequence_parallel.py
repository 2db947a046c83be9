"""DeepSpeed's Ulysses sequence parallelism (ALST) through the one line, on 4 gloo ranks
(data-parallel 2 x sequence-parallel 2, a tiny Llama with sdpa attention, sequences of 64).

The script is DeepSpeed's tutorial recipe: `UlyssesSPAttentionHF.register_with_transformers`
makes the groups and the attention and returns the mpu; `deepspeed.initialize(..., mpu=mpu)`
with "sequence_parallel_size" in the config; `UlyssesSPDataLoaderAdapter` around a loader that
gives every rank its own samples; the tutorial's differentiable loss aggregation over the SP
group. It runs under DeepSpeed ZeRO-3 and, after `vescale_engine.patch_deepspeed()`, under
ours, and is compared step by step (every SP group's loss, the gradient norm) with one process
training on the same global batch, and the final parameters too.

TEST WORKAROUND, applied to every run alike: on gloo, the backward of torch's
`torch.distributed.nn.functional.all_gather` scatters from the group rank where torch expects
the global rank, which fails on the second SP group. The loss aggregation uses a differentiable
all-gather whose backward is an all-reduce (`gather_for_loss`), the same sum of gradients.
And DeepSpeed 0.19.3's UlyssesSPDataLoaderAdapter all-gathers a 0-dim sequence length into
1-element tensors, which gloo refuses (0.19.8 sends 1 element): its all-gathers get 0-dim
tensors as 1-element ones (`gloo_safe_adapter`). Both, and the activation count, are
benchmarks/sequence_parallel.py's, shared.
"""
from __future__ import annotations

import copy
import math
import os
import sys

import pytest
import torch


# the workarounds and the activation count the benchmark uses (module docstring)
# the repository: tests/<tier>/ is two folders down
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from sequence_parallel import (gather_for_loss, gloo_safe_adapter,  # noqa: E402
                               saved_activation_bytes)

WORLD, SP = 4, 2
DP = WORLD // SP
SEQ, VOCAB, MICRO, STEPS = 64, 128, 1, 4
LR = 1e-4  # small: Adam's first steps would magnify round-off into the comparison
TOLERANCE = 1e-6
BF16_TOLERANCE = (2e-4, 1e-3)  # (loss, grad norm) relative; measured 3.7e-5, 1.2e-4

BASE = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "sequence_parallel_size": SP,
    "steps_per_print": 1000,
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0,
                                              "torch_adam": True}},
    "zero_optimization": {"stage": 3},
}


def config(engine: str, **changes) -> dict:
    cfg = copy.deepcopy(BASE)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    if engine == "vescale":
        cfg["vescale"] = cfg.get("vescale", {})
    else:
        cfg.pop("vescale", None)
    return cfg


def build_model(seed=0, tiled_mlp=False):
    """The tiny Llama; `tiled_mlp`: its MLPs computed by DeepSpeed's TiledMLP in 4 tiles along
    the sequence, as ALST's recipe patches LlamaMLP.forward (on this model only)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, attn_implementation="sdpa"))
    if tiled_mlp:
        import types

        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        def mlp_forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        def tiled_forward(self, x):
            params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
            return TiledMLP.apply(mlp_forward, self, x, 4, params)

        for layer in model.model.layers:
            layer.mlp.forward = types.MethodType(tiled_forward, layer.mlp)
    return model


def tokens(samples=64):
    return torch.randint(0, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(1))


class Samples(torch.utils.data.Dataset):
    """Token sequences with their positions (Ulysses needs position_ids in every batch)."""

    def __init__(self):
        self.ids = tokens()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i], "position_ids": torch.arange(SEQ)}


# ----------------------------------------------------------------------------- in the ranks

def sp_loss(logits, shift_labels, group):
    """The tutorial's differentiable weighted per-shard loss aggregation over the SP group."""
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                             shift_labels.reshape(-1), ignore_index=-100)
    good = (shift_labels != -100).reshape(-1).sum().float()
    losses, goods = gather_for_loss(group, loss), gather_for_loss(group, good)
    total = sum(losses[r] * goods[r] for r in range(len(losses)))
    return total / max(sum(goods), 1)


def _fresh_sequence_parallel_state():
    """What a new script starts without: DeepSpeed's SP groups, the Ulysses wrapper in
    transformers' attention table, DeepSpeed's process-wide mpu."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    parallel_state_sp._SEQUENCE_PARALLEL_GROUP = None
    parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP = None
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa_attention_forward
    groups.mpu = None
    gloo_safe_adapter()


def _full_parameters(engine):
    import deepspeed
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: p.detach().clone() for name, p in params.items()}


def alst_rank(rank, world, engine_name, changes, options):
    """DeepSpeed's tutorial script. `options`: gas (accumulation steps), checkpointing
    ("reentrant" / "non_reentrant"), divisor (ours: the gradient divide factor set by hand:
    the negative control), save_to / load_from (a checkpoint directory), sp (1: no sequence
    parallelism, plain data parallelism over every rank), steps, skip (micro-batches drawn and
    not trained on first: where a resumed run starts), tiled_mlp (DeepSpeed's TiledMLP)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (UlyssesSPAttentionHF,
                                                                 UlyssesSPDataLoaderAdapter)
    _fresh_sequence_parallel_state()
    if engine_name == "vescale":
        import vescale_engine
        vescale_engine.patch_deepspeed()  # the one added line
    os.environ["LOCAL_RANK"] = str(rank)  # what every launcher sets
    deepspeed.init_distributed(dist_backend="gloo")  # the tutorial's first call
    sp = options.get("sp", SP)
    gas = options.get("gas", 1)
    steps = options.get("steps", STEPS)
    model = build_model(tiled_mlp=options.get("tiled_mlp", False))
    if options.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": options["checkpointing"] == "reentrant"})
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
        micro_batch_size=MICRO, seq_length=SEQ, seq_length_is_variable=True)
    cfg = config(engine_name, gradient_accumulation_steps=gas, **changes)
    if sp == 1:
        cfg.pop("sequence_parallel_size", None)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=cfg, mpu=mpu)
    if options.get("divisor") is not None:
        for module in engine.module.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(float(options["divisor"]))
    if options.get("load_from"):
        engine.load_checkpoint(options["load_from"])
    from deepspeed.utils import groups  # the engine gave DeepSpeed's groups the mpu
    group = groups._get_sequence_parallel_group() if sp > 1 else None
    sampler = torch.utils.data.distributed.DistributedSampler(
        Samples(), num_replicas=world, rank=rank, shuffle=False)
    loader = torch.utils.data.DataLoader(Samples(), batch_size=MICRO, sampler=sampler)
    if sp > 1:
        loader = UlyssesSPDataLoaderAdapter(
            loader, sp_rank=groups._get_sequence_parallel_rank(), sp_group=group,
            sp_world_size=groups._get_sequence_parallel_world_size(), device=engine.device)
    losses, norms, activations = [], [], []
    batches = iter(loader)
    for _ in range(options.get("skip", 0)):  # the micro-steps a resumed run has done
        next(batches)
    for _ in range(steps * gas):
        batch = next(batches)
        def forward():
            if sp > 1:
                out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
                return sp_loss(out.logits, batch["shift_labels"], group)
            return engine(input_ids=batch["input_ids"], labels=batch["labels"]).loss

        bytes_kept, loss = saved_activation_bytes(forward, engine.module)
        activations.append(bytes_kept)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        losses.append(loss.item())
        if boundary:
            norms.append(float(engine.get_global_grad_norm()))
    params = _full_parameters(engine)  # collective: every rank
    result = {"losses": losses, "norms": norms, "engine": type(engine).__name__,
              "activations": activations,
              "dp_world_size": engine.dp_world_size, "train_batch_size": engine.train_batch_size(),
              "params": params if rank == 0 else None}
    if engine_name == "vescale":
        result["sp_group"] = None if engine.get_sequence_parallel_group() is None else \
            dist.get_process_group_ranks(engine.get_sequence_parallel_group())
        result["published"] = groups.mpu is mpu
    if options.get("save_to"):
        engine.save_checkpoint(options["save_to"], tag="sp")
    if engine_name == "vescale":
        engine.destroy()
    _fresh_sequence_parallel_state()
    return result


def _gloo_safe_all_gather(tensor, group=None):
    """The module docstring's workaround, for code that calls torch's function by name."""
    import torch.distributed as dist
    return gather_for_loss(group if group is not None else dist.group.WORLD, tensor)


def trainer_rank(rank, world, engine_name, model_dir, out_dir):
    """A Hugging Face Trainer script with TrainingArguments(parallelism_config=
    ParallelismConfig(sp_backend="deepspeed", sp_size=2)): Accelerate registers the Ulysses
    attention, passes the mpu to deepspeed.initialize and wraps the loader; Trainer computes
    the loss with transformers' deepspeed_sp_compute_loss. Returns the logged steps."""
    import torch.distributed.nn.functional as dist_fn
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    from test_hf_trainer import _recorder, _reset_global_state, _start_script
    from test_hf_trainer import config as trainer_config
    _fresh_sequence_parallel_state()
    cfg = trainer_config(engine_name, optimizer=True, scheduler=False)
    _start_script(rank, cfg)  # LOCAL_RANK, Accelerate's CPU shim, and for ours the one line
    original_all_gather = dist_fn.all_gather
    dist_fn.all_gather = _gloo_safe_all_gather
    try:
        pc = ParallelismConfig(sp_backend="deepspeed", sp_size=SP, dp_shard_size=DP,
                               sp_handler=DeepSpeedSequenceParallelConfig(
                                   sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))
        args = TrainingArguments(
            output_dir=out_dir, deepspeed=cfg, parallelism_config=pc,
            per_device_train_batch_size=MICRO, max_steps=STEPS, learning_rate=LR,
            weight_decay=0.0, lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1,
            save_strategy="no", report_to="none", seed=0, disable_tqdm=True)
        model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa")
        recorder = _recorder()
        trainer = Trainer(model=model, args=args, train_dataset=Samples(), callbacks=[recorder])
        trainer.train()
        return {"engine": type(trainer.model_wrapped).__name__, "train": recorder.train,
                "sp": trainer.model_wrapped.sequence_parallel_size}
    finally:
        dist_fn.all_gather = original_all_gather
        _reset_global_state()
        _fresh_sequence_parallel_state()


# ------------------------------------------------------------------------- the reference

def reference(steps=STEPS, gas=1):
    """One process, no sharding, the same global batches: at micro-step i, SP group g computes
    the sample its rank g*SP + i % SP drew ((i // SP)-th of a sampler over all ranks). Returns
    each micro-step's per-group losses, each step's gradient norm, the final parameters."""
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data = tokens()
    losses, norms = [], []
    for step in range(steps):
        for micro in range(gas):
            i = step * gas + micro
            batch = data[[g * SP + i % SP + WORLD * (i // SP) for g in range(DP)]]
            per_group = [model(input_ids=batch[g:g + 1], labels=batch[g:g + 1]).loss
                         for g in range(DP)]
            (torch.stack(per_group).mean() / gas).backward()
            losses.append([loss.item() for loss in per_group])
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# ------------------------------------------------------------------------------- the tests

POOL_WORLD = WORLD
POOL_ENV = {"DS_ACCELERATOR": "cpu"}


_RUNS = {}


def run(pool, engine, changes=None, **options):
    """One script run (cached per module: several tests read the same run)."""
    key = (engine, repr(sorted((changes or {}).items())), repr(sorted(options.items())))
    if key not in _RUNS:
        _RUNS[key] = pool.run(alst_rank, engine, changes or {}, options, timeout=300)
    return _RUNS[key]


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def assert_matches_reference(results, ref, tolerance=TOLERANCE, what="run"):
    """Every SP rank's loss is its group's one-process loss; every rank's gradient norm the
    one-process norm; the final parameters the one-process parameters."""
    for rank, result in enumerate(results):
        group = rank // SP
        for i, (got, want) in enumerate(zip(result["losses"], ref["losses"])):
            assert _rel(got, want[group]) < tolerance, \
                f"{what}: rank {rank} micro-step {i}: loss {got} != one process {want[group]}"
        assert len(result["norms"]) == len(ref["norms"])
        for i, (got, want) in enumerate(zip(result["norms"], ref["norms"])):
            assert _rel(got, want) < tolerance, \
                f"{what}: rank {rank} step {i}: grad norm {got} != one process {want}"
    for name, want in ref["params"].items():
        got = results[0]["params"][name]
        assert torch.allclose(got, want, rtol=0, atol=1e-6), \
            f"{what}: {name} differs from one process by {(got - want).abs().max():.3g}"


def test_alst_recipe_under_deepspeed_equals_one_process(pool):
    """The reference the one line must meet: DeepSpeed's own run of the recipe."""
    assert_matches_reference(run(pool, "deepspeed"), reference(), what="DeepSpeed")


def test_alst_recipe_with_the_one_line_equals_deepspeed_and_one_process(pool):
    ours, theirs = run(pool, "vescale"), run(pool, "deepspeed")
    assert {r["engine"] for r in ours} == {"VeScaleEngine"}
    assert_matches_reference(ours, reference(), what="ours")
    for mine, ds in zip(ours, theirs):
        for got, want in zip(mine["losses"] + mine["norms"], ds["losses"] + ds["norms"]):
            assert _rel(got, want) < TOLERANCE
    # DeepSpeed's batch arithmetic (world / sp data-parallel ranks), its groups, its accessor
    assert [r["dp_world_size"] for r in ours] == [DP] * WORLD
    assert [r["train_batch_size"] for r in ours] == [MICRO * DP] * WORLD
    assert [r["sp_group"] for r in ours] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(r["published"] for r in ours)


def test_the_wrong_divisor_is_caught(pool):
    """Negative control: dividing the summed gradients by the data-parallel size (world / sp)
    instead of the world size doubles them; the comparison must see it."""
    results = run(pool, "vescale", divisor=DP)
    with pytest.raises(AssertionError, match="grad norm"):
        assert_matches_reference(results, reference(), what="wrong divisor")


@pytest.mark.parametrize("name,changes,options", [
    ("hsdp", {"vescale": {"hsdp_replicate_size": 2}}, {}),
    ("accumulation", {}, {"gas": 2}),
    ("reentrant_checkpointing", {}, {"checkpointing": "reentrant"}),
    ("checkpointing", {}, {"checkpointing": "non_reentrant"}),
    ("offload", {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, {}),
    ("tiled_mlp", {}, {"tiled_mlp": True}),
])
def test_sequence_parallelism_composes(pool, name, changes, options):
    results = run(pool, "vescale", changes, **options)
    assert_matches_reference(results, reference(gas=options.get("gas", 1)), what=name)


def test_bf16_equals_deepspeed(pool):
    """bf16 compute, gradients reduced in fp32 under sequence parallelism by both engines
    (DeepSpeed's seq_parallel_communication_data_type defaults to fp32)."""
    changes = {"bf16": {"enabled": True}}
    ours, theirs = run(pool, "vescale", changes), run(pool, "deepspeed", changes)
    for mine, ds in zip(ours, theirs):
        for got, want in zip(mine["losses"], ds["losses"]):
            assert _rel(got, want) < BF16_TOLERANCE[0]
        for got, want in zip(mine["norms"], ds["norms"]):
            assert _rel(got, want) < BF16_TOLERANCE[1]


def test_checkpoint_moves_between_sequence_and_data_parallelism(pool, tmp_path):
    """Saved at (dp 2, sp 2), loaded at (dp 4, sp 1) and saved again, loaded at (dp 2, sp 2):
    the parameters survive both moves bitwise, and the next step equals the uninterrupted
    run's."""
    first, back = str(tmp_path / "sp"), str(tmp_path / "dp")
    uninterrupted = run(pool, "vescale", steps=3)
    saved = pool.run(alst_rank, "vescale", {}, {"steps": 2, "save_to": first})
    plain = pool.run(alst_rank, "vescale", {}, {"steps": 0, "sp": 1, "load_from": first,
                                                "save_to": back})
    for name, value in saved[0]["params"].items():
        assert torch.equal(plain[0]["params"][name], value), name
    resumed = pool.run(alst_rank, "vescale", {}, {"steps": 1, "skip": 2, "load_from": back})
    for rank in range(WORLD):
        assert resumed[rank]["losses"][0] == uninterrupted[rank]["losses"][2]
        assert resumed[rank]["norms"][0] == uninterrupted[rank]["norms"][2]


def _accelerate_has_deepspeed_sequence_parallelism() -> bool:
    import inspect

    from accelerate.utils import ParallelismConfig
    return "sp_backend" in inspect.signature(ParallelismConfig).parameters


@pytest.mark.skipif(not _accelerate_has_deepspeed_sequence_parallelism(),
                    reason="this Accelerate has no ParallelismConfig(sp_backend=...) (1.12 added "
                           "DeepSpeed sequence parallelism)")
def test_trainer_with_parallelism_config_equals_deepspeed(pool, tmp_path):
    model_dir = str(tmp_path / "tiny_llama")
    build_model().save_pretrained(model_dir)
    ours = pool.run(trainer_rank, "vescale", model_dir, str(tmp_path / "ours"), timeout=300)
    theirs = pool.run(trainer_rank, "deepspeed", model_dir, str(tmp_path / "ds"), timeout=300)
    assert ours[0]["engine"] == "VeScaleEngine" and theirs[0]["engine"] == "DeepSpeedEngine"
    assert [r["sp"] for r in ours + theirs] == [SP] * 2 * WORLD
    for mine, ds in zip(ours, theirs):
        assert sorted(mine["train"]) == sorted(ds["train"]) == list(range(1, STEPS + 1))
        for step, (loss, norm, lr) in ds["train"].items():
            got = mine["train"][step]
            assert _rel(got[0], loss) < TOLERANCE and _rel(got[1], norm) < TOLERANCE and \
                got[2] == lr, (step, got, (loss, norm, lr))


def _dims():
    from vescale_engine.plan.activations import DecoderDims
    model = build_model()
    return DecoderDims.from_hf_config(model.config.to_dict())


def test_the_planners_activation_estimate_is_what_autograd_keeps(pool):
    """plan/activations.py against the bytes autograd saves (parameters excluded): one
    process (fp32, bf16, TiledMLP) and each rank of the recipe at sp 2 and sp 1 (the engine's
    forward). Within 0.5%: at sp 2 DeepSpeed's loader adapter leaves each rank's ids and
    labels views of the whole sequence, 16 bytes per token the estimate does not count."""
    from vescale_engine.plan.activations import activation_bytes
    dims, ids = _dims(), tokens(1)
    for dtype, tiled in (("fp32", False), ("bf16", False), ("fp32", True)):
        model = build_model(tiled_mlp=tiled)
        if dtype == "bf16":
            model = model.to(torch.bfloat16)
        measured, _ = saved_activation_bytes(
            lambda: model(input_ids=ids, labels=ids, position_ids=torch.arange(SEQ)[None]).loss,
            model)
        want = activation_bytes(dims, SEQ, sp=1, dtype=dtype, tiled_mlp=tiled)
        assert abs(measured - want) <= 64, (dtype, tiled, measured, want)
    for sp, result in ((SP, run(pool, "vescale")), (1, run(pool, "vescale", sp=1, steps=1))):
        want = activation_bytes(dims, SEQ, sp=sp, dtype="fp32")
        for rank in result:
            assert abs(rank["activations"][0] / want - 1) < 0.005, (sp, rank["activations"],
                                                                  want)


def test_the_benchmark_runs_both_systems(tmp_path):
    """benchmarks/sequence_parallel.py's smoke run: both systems, sp 1 and 2, a report whose
    measured activations equal the planner's estimate (each row's last two columns)."""
    import subprocess
    root = ROOT
    out = tmp_path / "sp.md"
    done = subprocess.run([sys.executable, "benchmarks/sequence_parallel.py", "--seqs", "128",
                           "--rounds", "1", "--steps", "1", "--out", str(out)], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines()
            if line.startswith("| 128 |")]
    assert {(r[1].strip(), r[2].strip()) for r in rows} == {
        (sp, system) for sp in ("1", "2") for system in ("veScale Engine", "DeepSpeed ZeRO-3")}
    for row in rows:
        measured, estimate = float(row[5]), float(row[6])
        assert abs(measured / estimate - 1) < 0.01, row


# ------------------------------------------------- the config, without a process group

def _build(world=WORLD, sp=SP, **changes):
    from vescale_engine.engine.config import build_config
    return build_config(config("vescale", **changes), world, sp)


def test_batch_arithmetic_counts_world_over_sp_as_deepspeed_does():
    cfg = _build()
    assert (cfg.parallel.dp, cfg.parallel.dp_shard, cfg.batch.train_batch_size) == (DP, WORLD,
                                                                                   MICRO * DP)
    from config_schemas.validate import ConfigError
    with pytest.raises(ConfigError, match=f"x {DP} data-parallel ranks"):  # every rank: no
        _build(train_batch_size=MICRO * WORLD)


@pytest.mark.parametrize("world,sp,changes,message", [
    (4, 1, {}, "sequence_parallel_size 2 without a sequence-parallel mpu: DeepSpeed 0.19.8 "
               "then divides only its batch arithmetic"),
    (4, 4, {}, "sequence_parallel_size 2, but the mpu's sequence-parallel groups have 4 ranks"),
    (4, 2, {"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size 2 with "
                                                    "sequence parallelism"),
    (4, 2, {"expert_parallel": {"enabled": True, "autoep_size": 2}},
     "expert_parallel.autoep_size 2 with sequence parallelism"),
])
def test_what_sequence_parallelism_cannot_be_given_is_one_line(world, sp, changes, message):
    from config_schemas.validate import ConfigError
    with pytest.raises(ConfigError) as err:
        _build(world, sp, **changes)
    assert len(err.value.messages) == 1 and message in err.value.messages[0], err.value.messages


def test_gradients_reduce_in_deepspeeds_sequence_parallel_dtype():
    """DeepSpeed's engine reduces gradients in seq_parallel_communication_data_type (default
    fp32) whenever sequence parallelism is on; vescale.mixed_precision.reduce_dtype wins."""
    bf16 = {"bf16": {"enabled": True}}
    assert _build(**bf16).precision.reduce_dtype == "float32"
    assert _build(**bf16, seq_parallel_communication_data_type="bf16").precision.reduce_dtype == \
        "bfloat16"
    assert _build(**bf16, vescale={"mixed_precision": {"reduce_dtype": "bf16"}}).precision.reduce_dtype \
        == "bfloat16"
    assert _build(sp=1, sequence_parallel_size=None, **bf16).precision.reduce_dtype is None


def test_an_mpu_that_is_not_deepspeeds_sequence_parallel_one_is_refused():
    import types

    from vescale_engine.engine.sequence_parallel import sequence_parallel_size
    megatron = types.SimpleNamespace(get_model_parallel_world_size=lambda: 2,
                                     get_data_parallel_world_size=lambda: 2)
    with pytest.raises(ValueError, match="only DeepSpeed's sequence-parallel mpu"):
        sequence_parallel_size(megatron)
    assert sequence_parallel_size(None) == 1

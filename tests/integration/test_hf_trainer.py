"""Hugging Face Trainer and Accelerate scripts, unchanged, on 2 gloo ranks: once with DeepSpeed
ZeRO-3 (a config without a "vescale" section) and once after the one-line migration
(`vescale_engine.patch_deepspeed()` plus a "vescale" section). Every run loads the same tiny
Llama with `from_pretrained` inside the `TrainingArguments(deepspeed=...)` /
`Accelerator(deepspeed_plugin=...)` context, as users' scripts do (for stage 3, transformers
then builds it inside `deepspeed.zero.Init`).

Compared per optimizer step: the loss, the gradient norm and the learning rate Trainer logs
(or the Accelerate script reads), within 1e-6 relative. Both engines run the same fp32
arithmetic (torch's AdamW: "torch_adam" in the config, Trainer's own optimizer otherwise);
only the order of the cross-rank sums differs, which moves these values by float32 round-off
(~1e-7). A missed optimizer step, a wrong gradient scale, a scheduler that does not reach the
optimizer or restarts on resume moves them by far more.

The public offload configs (LLaVA's, LLaMA-Factory's, axolotl's; tests/configs_in_the_wild/
public/) run through the same Trainer script under DeepSpeed ZeRO with its CPU offload
(DeepSpeedCPUAdam, JIT-built on first use: about a minute on an idle machine, then cached) and
under our one line, compared the same way; axolotl's writes bf16 true, whose compute the two
engines round differently (BF16_TOLERANCE).

Ranks are started once (RankPool); each check runs a whole script in them, so Trainer's and
Accelerate's process-wide state is reset before every run (`_reset_global_state`).
"""
from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

from dist_harness import build_cpu_adam

WORLD = 2
SEQ = 16
VOCAB = 128
STEPS = 6
MICRO = 2
LR = 1e-2
TOLERANCE = 1e-6
# bf16 compute, rounded differently by DeepSpeed and ours: (loss, grad norm, lr) relative;
# measured 1.9e-4 and 1.6e-3 (lr equal); a missed step moves the loss by ~2e-3
BF16_TOLERANCE = (1e-3, 1e-2, TOLERANCE)
PUBLIC = Path(__file__).resolve().parents[1] / "configs_in_the_wild" / "public"

# A Trainer config as Hugging Face's DeepSpeed docs write it (their ds_config_zero3.json):
# "auto" wherever Trainer fills the value in from TrainingArguments. "torch_adam": DeepSpeed on
# CPU has no FusedAdam; it makes DeepSpeed build torch.optim.AdamW.
ZERO3_AUTO = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto", "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                             "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
        "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
# The migration: the same config plus this section (the default wrap policy: one
# LlamaDecoderLayer per unit).
VESCALE_SECTION = {}


def accelerate_config(engine: str, optimizer=True, scheduler=True) -> dict:
    """An Accelerate user's config: Accelerate fills "auto" in the batch sizes, the
    accumulation and optimizer.params lr and weight_decay, not in betas or eps."""
    cfg = config(engine, optimizer, scheduler)
    if optimizer:
        cfg["optimizer"]["params"].update(betas=[0.9, 0.95], eps=1e-8)
    cfg["gradient_clipping"] = 0.5
    return cfg


def config(engine: str, optimizer=True, scheduler=True) -> dict:
    """ZERO3_AUTO for `engine` ("deepspeed" or "vescale"); without the optimizer (scheduler)
    section Trainer and Accelerate scripts bring their own."""
    cfg = copy.deepcopy(ZERO3_AUTO)
    if not optimizer:
        del cfg["optimizer"]
    if not scheduler:
        del cfg["scheduler"]
    if engine == "vescale":
        cfg["vescale"] = copy.deepcopy(VESCALE_SECTION)
    return cfg


# ----------------------------------------------------------------------------- in the ranks

def _accelerate_on_cpu_shim():
    """TEST SHIM, not product code: Accelerate turns DeepSpeed on only when it finds an
    accelerator (CUDA, XPU, ...). On this CPU machine, make PartialState pick gloo for a
    launched rank (LOCAL_RANK set), so that TrainingArguments(deepspeed=...) and
    Accelerator(deepspeed_plugin=...) take their DeepSpeed path as they do on GPUs."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if getattr(PartialState._prepare_backend, "test_shim", False):
        return
    original = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        if not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_CPU
        return original(self, cpu, sagemaker_dp, backend)

    prepare_backend.test_shim = True
    PartialState._prepare_backend = prepare_backend


def _reset_global_state():
    """What a fresh script starts without: Accelerate's shared state (the DeepSpeed plugin,
    the distributed type) and transformers' reference to the DeepSpeed config in play."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    unset_hf_deepspeed_config()


def _start_script(rank, cfg):
    """The top of a user's script as a launcher starts it."""
    os.environ["LOCAL_RANK"] = str(rank)  # what every launcher sets
    _accelerate_on_cpu_shim()
    _reset_global_state()
    if "vescale" in cfg:
        import vescale_engine
        vescale_engine.patch_deepspeed()  # the one added line


class TokenDataset(torch.utils.data.Dataset):
    """Fixed token sequences a model can learn: arithmetic progressions modulo VOCAB with
    strides 1..4. Labels are the inputs (the model shifts them)."""

    def __init__(self, samples=64, seed=0):
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (samples, 1), generator=gen)
        stride = torch.randint(1, 5, (samples, 1), generator=gen)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def probe_input():
    return TokenDataset(4, seed=2).ids


def _recorder():
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        """Per optimizer step: the logged loss, grad norm and learning rate; eval losses; the
        learning rates of every group of the optimizer that steps (the engine's, behind
        Accelerate's wrapper), read just before it steps, and its class."""

        def __init__(self):
            self.train, self.eval, self.stepped_lrs = {}, {}, {}
            self.stepping = None

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            stepping = optimizer.optimizer  # DeepSpeedOptimizerWrapper(the engine's optimizer)
            self.stepping = f"{type(stepping).__module__}.{type(stepping).__name__}"
            self.stepped_lrs[state.global_step + 1] = [g["lr"] for g in stepping.param_groups]

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                self.train[state.global_step] = (logs["loss"], logs.get("grad_norm"),
                                                 logs["learning_rate"])
            if "eval_loss" in logs:
                self.eval[state.global_step] = logs["eval_loss"]

    return Recorder()


def trainer_rank(rank, world, model_dir, out_dir, cfg, options):
    """A user's Trainer script; `cfg` picks DeepSpeed or veScale, `options` are the
    TrainingArguments the scenario changes, plus `resume_from_checkpoint` and
    `save_model_to` (then the trained model's logits on `probe_input()` come back too)."""
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    _start_script(rank, cfg)
    options = dict(options)
    resume = options.pop("resume_from_checkpoint", None)
    save_model_to = options.pop("save_model_to", None)
    args = TrainingArguments(**{
        "output_dir": out_dir, "deepspeed": cfg, "per_device_train_batch_size": MICRO,
        "per_device_eval_batch_size": MICRO, "max_steps": STEPS, "learning_rate": LR,
        "warmup_steps": 2, "weight_decay": 0.01, "adam_beta2": 0.95, "max_grad_norm": 0.5,
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "seed": 0,
        "disable_tqdm": True, **options})
    model = LlamaForCausalLM.from_pretrained(model_dir)  # inside zero.Init at stage 3
    recorder = _recorder()
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(),
                      eval_dataset=TokenDataset(8, seed=1), callbacks=[recorder])
    trainer.train(resume_from_checkpoint=resume)
    result = {"engine": type(trainer.model_wrapped).__name__, "train": recorder.train,
              "eval": recorder.eval, "global_step": trainer.state.global_step,
              "gradient_checkpointing": trainer.model.is_gradient_checkpointing,
              "stepped_lrs": recorder.stepped_lrs, "stepping": recorder.stepping,
              "bf16": trainer.model_wrapped.bfloat16_enabled(),
              "compiled": bool(getattr(trainer.model_wrapped, "is_compiled", False))}
    if result["engine"] == "VeScaleEngine":  # parameters that are TP/EP pieces
        from vescale_engine.fsdp.lookup import sharded_parameters
        result["split"] = sum(sp.dtensor_spec is not None
                              for _, sp in sharded_parameters(trainer.model_wrapped.module))
        from deepspeed.runtime.tensor_parallel import init_utils  # DeepSpeed's AutoTP record:
        result["ds_autotp_recorded"] = init_utils._TP_MODEL_INIT_ARGS is not None  # untouched
    offload = getattr(trainer.model_wrapped.optimizer, "offload", None)  # ours, offloading
    if offload is not None:
        result["host_steps"] = offload.stats.host_steps
    if save_model_to:
        trainer.save_model(save_model_to)
        with torch.no_grad():
            result["logits"] = trainer.model_wrapped(input_ids=probe_input()).logits
    _reset_global_state()
    return result


def trainer_offload_rank(rank, world, model_dir, out_dir, optimizer_section, force_ds_cpu=True):
    """The Trainer script with optimizer offload in the vescale config (the accum1 scenario's
    config, with or without its optimizer section; `force_ds_cpu` false writes
    zero_force_ds_cpu_optimizer false, so that Accelerate passes Trainer's torch AdamW itself
    instead of the DeepSpeedCPUAdam it makes of it)."""
    cfg = config("vescale", optimizer=optimizer_section, scheduler=False)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if not force_ds_cpu:
        cfg["zero_force_ds_cpu_optimizer"] = False
    return trainer_rank(rank, world, model_dir, out_dir, cfg, {})


def trainer_public_config_rank(rank, world, model_dir, out_dir, name, engine, options):
    """The Trainer script with a public config as written (plus "vescale": {} for ours) and
    `options` for TrainingArguments: (the run's result or None, the error this rank got or
    None)."""
    import json

    import transformers.training_args as training_args
    cfg = json.loads((PUBLIC / name).read_text())
    if engine == "vescale":
        cfg["vescale"] = {}
    # TEST SHIM, not product code: TrainingArguments(bf16=True) wants a GPU, or use_cpu, which
    # takes Accelerate off its DeepSpeed path. These CPU ranks compute bf16 themselves.
    bf16_check = training_args.is_torch_bf16_gpu_available
    training_args.is_torch_bf16_gpu_available = lambda: True
    try:
        return trainer_rank(rank, world, model_dir, out_dir, cfg, options), None
    except Exception as err:  # the test checks which error it is
        _reset_global_state()
        return None, f"{type(err).__name__}: {err}"
    finally:
        training_args.is_torch_bf16_gpu_available = bf16_check


def accelerate_rank(rank, world, model_dir, out_dir, cfg, accum):
    """A user's Accelerate script (the shape of accelerate's DeepSpeed examples). With an
    optimizer section in `cfg` it passes DummyOptim/DummyScheduler, else its own torch AdamW
    and a linear warmup schedule. Returns this rank's micro-batch losses, and per optimizer
    step the grad norm and the learning rates of the schedule and of the optimizer; the
    trained model's logits on `probe_input()`."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler
    from transformers import LlamaForCausalLM, get_linear_schedule_with_warmup

    _start_script(rank, cfg)
    accelerator = Accelerator(gradient_accumulation_steps=accum,
                              deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    model = LlamaForCausalLM.from_pretrained(model_dir)  # inside zero.Init at stage 3
    loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=MICRO)
    if "optimizer" in cfg:
        optimizer = DummyOptim(model.parameters(), lr=LR, weight_decay=0.01)
        # Accelerate divides total_num_steps by the number of processes
        scheduler = DummyScheduler(optimizer, total_num_steps=STEPS * world,
                                   warmup_num_steps=2)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95),
                                      weight_decay=0.01)
        scheduler = get_linear_schedule_with_warmup(optimizer, 2, STEPS)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                              scheduler)
    losses, steps = [], []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                # the schedule's lr, and the lr the engine's optimizer holds
                steps.append((grad_norm, scheduler.get_last_lr()[0],
                              optimizer.param_groups[0]["lr"]))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if len(steps) == STEPS:
            break
    state_dict = accelerator.get_state_dict(model)
    # DeepSpeed's is None off rank 0 (ours is {}); transformers before 5.15 then writes that
    # rank's own state_dict(), its empty ZeRO-3 partitions, over rank 0's file: a race in the
    # reference, so a rank with None does not save
    if state_dict is not None:
        accelerator.unwrap_model(model).save_pretrained(
            out_dir, is_main_process=accelerator.is_main_process, state_dict=state_dict)
    accelerator.wait_for_everyone()
    with torch.no_grad():
        logits = model(input_ids=probe_input()).logits
    result = {"engine": type(model).__name__, "losses": losses, "steps": steps,
              "unwrapped": type(accelerator.unwrap_model(model)).__name__, "logits": logits}
    _reset_global_state()
    return result


def client_adamw_offload_rank(rank, world):
    """initialize with offload and a client optimizer instance, as deepspeed.initialize gets
    one from Trainer or a script: Trainer's torch AdamW (decay / no-decay groups) with a
    scheduler object built on it, trained 3 steps; then, for each optimizer that cannot become
    ours, the error."""
    import fsdp_models as fm
    from vescale_engine import initialize
    cfg = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
           "vescale": {"wrap_policy": {"module_classes": ["Block"]}}}

    def trainer_groups(model, **kwargs):  # Trainer's create_optimizer: no decay on 1-D ones
        params = list(model.parameters())
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, **kwargs}]

    model = fm.make("gpt")
    client = torch.optim.AdamW(trainer_groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-7)
    schedule = torch.optim.lr_scheduler.LambdaLR(client, lambda step: 1 / (1 + step))
    engine, opt, _, sched = initialize(model=model, optimizer=client, lr_scheduler=schedule,
                                       config=cfg)
    hyper = [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in opt.param_groups]
    used = []
    for step in range(3):
        idx, tgt = fm.rank_micro_batches("gpt", step, rank, world, 2, 1)[0]
        used.append([g["lr"] for g in engine.optimizer.param_groups])
        engine.backward(engine(idx, tgt))
        engine.step()
    got = {"class": f"{type(opt).__module__}.{type(opt).__name__}",
           "engine_has_it": engine.optimizer is opt, "sched_is_client": sched is schedule,
           "shared_groups": all(a is b for a, b in zip(opt.param_groups, client.param_groups,
                                                      strict=True)),
           "hyper": hyper,
           "used_lrs": used, "host_steps": opt.offload.stats.host_steps,
           "buffers": len(opt._buffers)}
    engine.destroy()

    class MyAdamW(torch.optim.AdamW):
        pass

    def cpu_adam_l2(params):
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(params, adamw_mode=False)

    def split_buffer_lr(params):  # Block 0's LayerNorms at another lr than its matrices
        decay, no_decay = params
        return torch.optim.AdamW([decay, {**no_decay, "lr": 5e-3}], lr=1e-2)

    cases = {"sgd": lambda groups: torch.optim.SGD(groups, lr=0.1),
             "subclass": lambda groups: MyAdamW(groups),
             "amsgrad": lambda groups: torch.optim.AdamW(groups, amsgrad=True),
             "maximize": lambda groups: torch.optim.AdamW(groups, maximize=True),
             "deepspeed_cpu_adam_l2": cpu_adam_l2, "split_buffer_lr": split_buffer_lr}
    errors = {}
    for case, make in cases.items():
        model = fm.make("gpt")
        try:
            initialize(model=model, optimizer=make(trainer_groups(model)), config=cfg)
            errors[case] = None
        except ValueError as err:
            errors[case] = str(err)
    assert got["class"] == OURS and got["engine_has_it"] and got["sched_is_client"], got
    assert got["shared_groups"], got
    assert got["hyper"] == [(1e-2, (0.9, 0.95), 1e-7, 0.01), (1e-2, (0.9, 0.95), 1e-7, 0.0)]
    assert got["used_lrs"] == [[1e-2 * (1 / (1 + s))] * 2 for s in range(3)], got
    assert got["host_steps"] == 3 * got["buffers"], got
    head = "zero_optimization.offload_optimizer: the "
    what = 'add an "optimizer" section (type AdamW, AdamW8bit or Muon) to the config, or ' \
        "pass torch.optim.AdamW or vescale_engine.optim.AdamW"
    only = "only torch.optim.AdamW itself, or the DeepSpeedCPUAdam Accelerate makes of " \
        "it, is rebuilt as ours"
    want = {
        "sgd": f"{head}torch.optim.sgd.SGD passed to initialize cannot be stepped on the "
               f"host ({only}); offload works with our AdamW, AdamW8bit and Muon: {what}",
        "subclass": f"{head}{__name__}.MyAdamW passed to initialize cannot be stepped on "
                    f"the host ({only}); offload works with our AdamW, AdamW8bit and Muon: "
                    f"{what}",
        "amsgrad": f"{head}torch.optim.adamw.AdamW passed to initialize cannot be stepped "
                   "on the host (param_groups[0] has amsgrad=True); offload works with our "
                   f"AdamW, AdamW8bit and Muon: {what}",
        "maximize": f"{head}torch.optim.adamw.AdamW passed to initialize cannot be "
                    "stepped on the host (param_groups[0] has maximize=True); offload "
                    f"works with our AdamW, AdamW8bit and Muon: {what}",
        "deepspeed_cpu_adam_l2": f"{head}deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam "
                                 "passed to initialize cannot be stepped on the host "
                                 "(adamw_mode is false: Adam with L2 decay, not AdamW); "
                                 f"offload works with our AdamW, AdamW8bit and Muon: {what}",
    }
    for case, message in want.items():
        assert errors[case] == message, (case, errors[case])
    split = errors["split_buffer_lr"]
    assert split.startswith(f"{head}torch.optim.adamw.AdamW passed to initialize cannot "
                            "be stepped on the host as our AdamW (parameter "), split
    assert "lr differs (" in split and split.endswith(
        'add an "optimizer" section (type AdamW) to the config so that the engine '
        "builds it"), split
    assert all("\n" not in e for e in errors.values()), errors


# ----------------------------------------------------------------------------- the runs

# DeepSpeed's CPUAdam op (its ZeRO-Offload optimizer), JIT-built in its own process before any
# rank starts, so that no rank's timeout includes the build (minutes from cold on 2 cores, once
# per machine). torch's build lock waits forever on a lock that a killed build left: one older
# than any build is removed first.
@pytest.fixture(scope="module")
def pool(pools):
    build_cpu_adam()  # found built when the suite built it up front (conftest.py)
    return pools(WORLD, DS_ACCELERATOR="cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama saved once (safetensors); every run starts from these weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    llama = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(llama).save_pretrained(path)
    return str(path)


# The Trainer scenarios: accumulation 1 and 2, each of the four ways the optimizer and the
# scheduler come (config section or Trainer's own), eval, gradient checkpointing, label
# smoothing. "accum1" also saves checkpoints (resumed below) and the final model.
SCENARIOS = {
    "accum1": (dict(optimizer=True, scheduler=False),
               dict(save_strategy="steps", save_steps=3)),
    "accum2_eval_checkpointing": (dict(optimizer=True, scheduler=True),
                                  dict(gradient_accumulation_steps=2, eval_strategy="steps",
                                       eval_steps=3, gradient_checkpointing=True)),
    "accum2_trainer_optimizer": (dict(optimizer=False, scheduler=False),
                                 dict(gradient_accumulation_steps=2)),
    "label_smoothing": (dict(optimizer=False, scheduler=True),
                        dict(label_smoothing_factor=0.1)),
}
# LLaMA-Factory's and axolotl's default: each decoder layer under a reentrant checkpoint (its
# whole call, hooks inside, before transformers 5.x; its forward after), and the embeddings'
# output made to require grad. Run in a module of its own,
# tests/integration/test_hf_trainer_reentrant.py: at the lowest versions (transformers 5.6,
# accelerate 1.11, deepspeed 0.19.3) DeepSpeed's own Accelerate run below saved empty tensors when
# it ran after this scenario in the same module (cause not found).
LAST_SCENARIOS = {
    "reentrant_checkpointing": (dict(optimizer=True, scheduler=False),
                                dict(gradient_checkpointing=True,
                                     gradient_checkpointing_kwargs={"use_reentrant": True})),
}
RESUME_AT = 3


class Runs:
    """Each script run once per module, on demand; a failed run is remembered and its error
    raised by every test that needs it (the other engine's runs still go ahead)."""

    def __init__(self, pool, model_dir, root):
        self.pool, self.model_dir, self.root = pool, model_dir, root
        self._done = {}

    def out_dir(self, *key):
        return os.path.join(self.root, "-".join(key))

    def get(self, fn, key, *args):
        key = (fn.__name__, *key)
        if key not in self._done:
            try:
                self._done[key] = (True, self.pool.run(fn, *args, timeout=300))
            except AssertionError as err:
                self._done[key] = (False, str(err))
        ok, value = self._done[key]
        if not ok:
            raise AssertionError(f"the run {key} failed:\n{value}")
        return value

    def trainer(self, engine, scenario):
        cfg_kw, options = {**SCENARIOS, **LAST_SCENARIOS}[scenario]
        options = dict(options)
        if scenario == "accum1":
            options["save_model_to"] = self.out_dir("saved", engine)
        return self.get(trainer_rank, (engine, scenario), self.model_dir,
                        self.out_dir(engine, scenario), config(engine, **cfg_kw), options)

    def resume(self, engine, from_engine):
        """`engine` resumes "accum1" from `from_engine`'s checkpoint of step RESUME_AT."""
        self.trainer(from_engine, "accum1")  # the run that wrote the checkpoint
        cfg_kw, options = SCENARIOS["accum1"]
        checkpoint = os.path.join(self.out_dir(from_engine, "accum1"),
                                  f"checkpoint-{RESUME_AT}")
        return self.get(trainer_rank, ("resume", engine, from_engine), self.model_dir,
                        self.out_dir("resume", engine, from_engine),
                        config(engine, **cfg_kw), {**options, "resume_from_checkpoint":
                                                   checkpoint})

    def accelerate(self, engine, accum):
        own = accum == 2  # accumulation 2: the script's own optimizer and scheduler
        return self.get(accelerate_rank, (engine, str(accum)), self.model_dir,
                        self.out_dir("accelerate", engine, str(accum)),
                        accelerate_config(engine, optimizer=not own, scheduler=not own), accum)


@pytest.fixture(scope="module")
def runs(pool, model_dir, tmp_path_factory):
    return Runs(pool, model_dir, str(tmp_path_factory.mktemp("runs")))


# ----------------------------------------------------------------------------- the checks

def _close(a, b):
    """Within TOLERANCE relative; a missing value (None) never is."""
    if a is None or b is None:
        return False
    return abs(a - b) <= TOLERANCE * max(abs(a), abs(b))


def _assert_steps_equal(ours: dict, theirs: dict, what: str):
    """Per step: (loss, grad norm, learning rate) within TOLERANCE relative."""
    assert sorted(ours) == sorted(theirs), (what, sorted(ours), sorted(theirs))
    for step in sorted(theirs):
        for name, a, b in zip(("loss", "grad_norm", "learning_rate"), ours[step],
                              theirs[step]):
            assert _close(a, b), f"{what}: step {step} {name}: veScale {a!r}, DeepSpeed {b!r}"


def _assert_trained(train: dict):
    """The run did STEPS optimizer steps that changed the model (the comparison is not
    between two idle runs): the loss fell well beyond the tolerance."""
    assert sorted(train) == list(range(1, STEPS + 1)), sorted(train)
    first, last = train[1][0], train[STEPS][0]
    assert last < first * (1 - 1e3 * TOLERANCE), (first, last)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_trainer_same_steps_as_deepspeed(runs, scenario):
    options = {**SCENARIOS, **LAST_SCENARIOS}[scenario][1]
    ds = runs.trainer("deepspeed", scenario)
    assert all(r["engine"] == "DeepSpeedEngine" for r in ds), ds[0]["engine"]
    _assert_trained(ds[0]["train"])
    if "eval_strategy" in options:
        assert sorted(ds[0]["eval"]) == [3, 6], ds[0]["eval"]
    ours = runs.trainer("vescale", scenario)
    assert all(r["engine"] == "VeScaleEngine" for r in ours), ours[0]["engine"]
    for rank in range(WORLD):
        _assert_steps_equal(ours[rank]["train"], ds[rank]["train"], f"{scenario} rank {rank}")
        assert ours[rank]["global_step"] == ds[rank]["global_step"] == STEPS
        assert ours[rank]["gradient_checkpointing"] == ds[rank]["gradient_checkpointing"] == \
            options.get("gradient_checkpointing", False)
        assert sorted(ours[rank]["eval"]) == sorted(ds[rank]["eval"]), ours[rank]["eval"]
        for step, loss in ds[rank]["eval"].items():
            assert _close(ours[rank]["eval"][step], loss), (step, ours[rank]["eval"], loss)


def test_trainer_save_model_loads_with_from_pretrained(runs):
    """trainer.save_model writes a Hugging Face model; from_pretrained in one process (this
    one, no DeepSpeed config in play) gives the trained model's logits."""
    from transformers import LlamaForCausalLM
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    assert not is_deepspeed_zero3_enabled()
    logits = {}
    for engine in ("deepspeed", "vescale"):
        trained = runs.trainer(engine, "accum1")
        model = LlamaForCausalLM.from_pretrained(runs.out_dir("saved", engine)).eval()
        with torch.no_grad():
            logits[engine] = model(input_ids=probe_input()).logits
        for rank in range(WORLD):
            torch.testing.assert_close(trained[rank]["logits"], logits[engine],
                                       rtol=TOLERANCE, atol=TOLERANCE)
    torch.testing.assert_close(logits["vescale"], logits["deepspeed"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("from_engine", ["vescale", "deepspeed"])
def test_trainer_resume_equals_uninterrupted(runs, from_engine):
    """Trainer(resume_from_checkpoint=checkpoint-3) with our engine, from our checkpoint and
    from DeepSpeed's: steps 4..6 as the uninterrupted run (the scheduler continues)."""
    uninterrupted = runs.trainer("deepspeed", "accum1")
    resumed = runs.resume("vescale", from_engine)
    for rank in range(WORLD):
        after = {s: v for s, v in uninterrupted[rank]["train"].items() if s > RESUME_AT}
        _assert_steps_equal(resumed[rank]["train"], after, f"resumed from {from_engine}")
        assert resumed[rank]["global_step"] == STEPS


OURS = "vescale_engine.optim.adamw.AdamW"


def _assert_close_steps(ours: dict, theirs: dict, what: str, tolerance=(TOLERANCE,) * 3):
    """Per step: (loss, grad norm, learning rate) each within its `tolerance` relative."""
    assert sorted(ours) == sorted(theirs) == list(range(1, STEPS + 1)), (what, sorted(ours))
    for step in theirs:
        for name, a, b, tol in zip(("loss", "grad_norm", "learning_rate"), ours[step],
                                   theirs[step], tolerance, strict=True):
            assert a is not None and b is not None and \
                abs(a - b) <= tol * max(abs(a), abs(b)), \
                f"{what}: step {step} {name}: {a!r} vs {b!r}"


def _assert_scheduler_drove_the_stepping_optimizer(result, groups):
    """At every step each group of the optimizer that stepped held the lr Trainer logged for
    that step (its scheduler's), and that lr changed over the run (warmup)."""
    assert sorted(result["stepped_lrs"]) == list(range(1, STEPS + 1)), result["stepped_lrs"]
    for step, lrs in result["stepped_lrs"].items():
        assert len(lrs) == groups and all(lr == result["train"][step][2] for lr in lrs), \
            (step, lrs, result["train"][step])
    assert len({lrs[0] for lrs in result["stepped_lrs"].values()}) >= 2, result["stepped_lrs"]


def test_trainer_with_optimizer_offload_trains_as_without(runs, pool, model_dir, tmp_path):
    """Optimizer offload through Trainer: the same losses, grad norms and learning rates per
    step as the run without it, with the config's optimizer section and without one. Without
    it Trainer passes its own torch AdamW (two groups: decay / no decay; here with
    zero_force_ds_cpu_optimizer false, else Accelerate passes the DeepSpeedCPUAdam it makes of
    it: test_public_offload_configs_through_trainer), which the engine rebuilds as ours (the
    host step) with the same groups and hyperparameters. Trainer's scheduler, made after
    initialize on the optimizer initialize returned, drives that optimizer."""
    plain = runs.trainer("vescale", "accum1")
    with_section = pool.run(trainer_offload_rank, model_dir, str(tmp_path / "with"), True,
                            timeout=300)
    own = pool.run(trainer_rank, model_dir, str(tmp_path / "own"),
                   config("vescale", optimizer=False, scheduler=False), {}, timeout=300)
    torch_adamw = pool.run(trainer_offload_rank, model_dir, str(tmp_path / "torch"), False,
                           False, timeout=300)
    for rank in range(WORLD):
        assert with_section[rank]["stepping"] == OURS
        assert with_section[rank]["host_steps"] > 0
        _assert_close_steps(with_section[rank]["train"], plain[rank]["train"],
                            f"rank {rank}: with the optimizer section")
        _assert_scheduler_drove_the_stepping_optimizer(with_section[rank], groups=1)
        # without offload Trainer's torch AdamW stays itself (rebuilt in place)
        assert own[rank]["stepping"] == "torch.optim.adamw.AdamW"
        _assert_trained(own[rank]["train"])
        assert torch_adamw[rank]["stepping"] == OURS, torch_adamw[rank]["stepping"]
        assert torch_adamw[rank]["host_steps"] > 0
        _assert_close_steps(torch_adamw[rank]["train"], own[rank]["train"],
                            f"rank {rank}: Trainer's AdamW with offload")
        _assert_scheduler_drove_the_stepping_optimizer(torch_adamw[rank], groups=2)


def test_trainer_with_autotp_size_trains_as_data_parallel_on_the_same_batch(pool, model_dir,
                                                                           tmp_path):
    """DeepSpeed AutoTP's key through Trainer: Hugging Face fills train_batch_size counting
    every rank (as DeepSpeed checks it), Accelerate hands the TP peers one batch, the engine
    applies the model's TP plan. (dp 1, tp 2) with micro-batch 2 trains as dp 2 with 1.
    A transformers without the API that applies the model's plan: one line saying so."""
    from transformers import PreTrainedModel
    cfg = config("vescale")
    cfg["tensor_parallel"] = {"autotp_size": 2}
    if not hasattr(PreTrainedModel, "_expand_parallel_plan"):  # transformers before 5.23
        with pytest.raises(AssertionError, match=r"ValueError: tensor_parallel.autotp_size 2: "
                           r"the model's base_model_tp_plan is applied with transformers' "
                           r"PreTrainedModel._expand_parallel_plan \(transformers 5.23 and "
                           r"later\), which transformers 5\.\d+\.\d+ does not have: give the "
                           r"plan in vescale.tensor_parallel or upgrade transformers\n"):
            pool.run(trainer_rank, model_dir, str(tmp_path / "tp"), cfg, {}, timeout=300)
        return
    tp = pool.run(trainer_rank, model_dir, str(tmp_path / "tp"), cfg, {}, timeout=300)
    dp = pool.run(trainer_rank, model_dir, str(tmp_path / "dp"), config("vescale"),
                  {"per_device_train_batch_size": 1}, timeout=300)
    for rank in range(WORLD):
        assert tp[rank]["split"] > 0 and dp[rank]["split"] == 0, (tp[rank]["split"],
                                                                  dp[rank]["split"])
        # Trainer's deepspeed.tp_model_init left to us: nothing recorded for DeepSpeed's
        # engines that later runs in these processes start
        assert not tp[rank]["ds_autotp_recorded"], rank
        _assert_trained(tp[rank]["train"])
        _assert_close_steps(tp[rank]["train"], dp[rank]["train"], f"rank {rank}: tp 2")


def test_client_adamw_with_offload_is_rebuilt_as_ours_or_refused_in_one_line(pool):
    """initialize(optimizer=torch AdamW, lr_scheduler=a scheduler built on it) with offload:
    ours steps on the host with the client's groups and hyperparameters, and the client's
    scheduler sets the lr ours uses. What cannot become ours with the same math is one line
    naming what to add."""
    pool.run(client_adamw_offload_rank, timeout=300)


# The public offload configs (tests/configs_in_the_wild/public/, sources in its README), each
# as written through the same Trainer script: under DeepSpeed ZeRO (its CPU offload runs on CPU:
# DeepSpeedCPUAdam, JIT-built once) and under our one line, the same losses, grad norms and
# learning rates per step; or, where ours does not run the config, this one line on every rank.
# Per config: the refusal (None: it runs), the TrainingArguments it needs, the optimizer's
# parameter groups (1: the config's optimizer section over all parameters; 2: Trainer's
# AdamW, decay / no decay) and the relative tolerances (fp32: measured ~1e-7).
PUBLIC_OFFLOAD = {
    # no optimizer or scheduler section: Trainer's AdamW (as DeepSpeedCPUAdam) and schedule
    "llamafactory_ds_z2_offload_config.json": (None, {}, 2, (TOLERANCE,) * 3),
    # offload_param at stage 2, which DeepSpeed does not read (nor do we: a warning);
    # Trainer's AdamW (as DeepSpeedCPUAdam) and schedule. It sets no gradient_clipping:
    # DeepSpeed's default (1.0) clips, and so does ours (unclipped, ours drifted 5e-4 by step 5)
    "llava_next_zero2_offload.json": (None, {}, 2, (TOLERANCE,) * 3),
    # both offloads; optimizer AdamW and WarmupLR from the config
    "llava_zero3_offload.json": (None, {}, 1, (TOLERANCE,) * 3),
    # both offloads; Trainer's AdamW (as DeepSpeedCPUAdam) and schedule
    "llamafactory_ds_z3_offload_config.json": (None, {}, 2, (TOLERANCE,) * 3),
    # both offloads, bf16 written as true (Trainer then needs bf16=True), Trainer's torch AdamW
    # passed as it is (zero_force_ds_cpu_optimizer false). bf16: DeepSpeed and ours round the
    # compute differently, so the tolerance is bf16's
    "axolotl_zero3_bf16_cpuoffload_all.json": (None, {"bf16": True}, 2, BF16_TOLERANCE),
}


@pytest.mark.parametrize("name", sorted(PUBLIC_OFFLOAD))
def test_public_offload_configs_through_trainer(runs, name):
    refusal, options, groups, tolerance = PUBLIC_OFFLOAD[name]
    ours = runs.get(trainer_public_config_rank, (name, "vescale"), runs.model_dir,
                    runs.out_dir("public", name, "vescale"), name, "vescale", options)
    if refusal is not None:
        assert [error for _, error in ours] == [refusal] * WORLD, ours
        return
    ds = runs.get(trainer_public_config_rank, (name, "deepspeed"), runs.model_dir,
                  runs.out_dir("public", name, "deepspeed"), name, "deepspeed", options)
    for rank in range(WORLD):
        (result, error), (ds_result, ds_error) = ours[rank], ds[rank]
        assert error is None and ds_error is None, (error, ds_error)
        assert ds_result["engine"] == "DeepSpeedEngine"
        assert ds_result["stepping"].startswith("deepspeed.runtime.zero."), ds_result
        _assert_trained(ds_result["train"])
        assert result["engine"] == "VeScaleEngine" and result["stepping"] == OURS, result
        assert result["host_steps"] > 0
        assert result["bf16"] == ds_result["bf16"] == options.get("bf16", False)
        _assert_close_steps(result["train"], ds_result["train"], f"{name} rank {rank}",
                            tolerance)
        assert result["stepped_lrs"] == ds_result["stepped_lrs"]
        _assert_scheduler_drove_the_stepping_optimizer(result, groups)


@pytest.mark.parametrize("accum", [1, 2])
def test_accelerate_same_steps_as_deepspeed(runs, accum):
    ds = runs.accelerate("deepspeed", accum)
    assert ds[0]["engine"] == "DeepSpeedEngine"
    assert len(ds[0]["steps"]) == STEPS and len(ds[0]["losses"]) == STEPS * accum
    first, last = (sum(ds[0]["losses"][k * accum:(k + 1) * accum]) for k in (0, STEPS - 1))
    assert last < first * (1 - 1e3 * TOLERANCE), ds[0]["losses"]  # it trained
    ours = runs.accelerate("vescale", accum)
    assert ours[0]["engine"] == "VeScaleEngine"
    assert ours[0]["unwrapped"] == "LlamaForCausalLM"
    for rank in range(WORLD):
        for micro, (a, b) in enumerate(zip(ours[rank]["losses"], ds[rank]["losses"],
                                           strict=True)):
            assert _close(a, b), f"rank {rank} micro-batch {micro}: loss veScale {a}, " \
                f"DeepSpeed {b}"
        for step, (values, ds_values) in enumerate(zip(ours[rank]["steps"], ds[rank]["steps"],
                                                       strict=True), 1):
            assert all(_close(a, b) for a, b in zip(values, ds_values)), \
                f"rank {rank} step {step}: (grad norm, scheduler lr, optimizer lr) veScale " \
                f"{values}, DeepSpeed {ds_values}"
        torch.testing.assert_close(ours[rank]["logits"], ds[rank]["logits"], rtol=1e-5,
                                   atol=1e-5)
    # unwrap_model(model).save_pretrained(state_dict=get_state_dict(model)) wrote a Hugging
    # Face model with the trained weights: loaded in this process, the same logits
    from transformers import LlamaForCausalLM
    for engine, result in (("deepspeed", ds), ("vescale", ours)):
        saved = LlamaForCausalLM.from_pretrained(runs.out_dir("accelerate", engine, str(accum)))
        with torch.no_grad():
            logits = saved.eval()(input_ids=probe_input()).logits
        torch.testing.assert_close(logits, result[0]["logits"], rtol=TOLERANCE, atol=TOLERANCE)


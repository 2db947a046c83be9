"""Accelerate's FSDP2 path and Trainer with `fsdp_version: 2`, one line, equal to torch FSDP2.

The same user scripts run twice on 2 gloo ranks: as they are (Accelerate wraps with torch's
`fully_shard`) and with one added line, `vescale_engine.patch_fsdp2()` (Accelerate wraps with
ours). The scripts are an Accelerate loop (`FullyShardedDataParallelPlugin(fsdp_version=2)`,
the transformer-based wrap policy, `accumulate`, `clip_grad_norm_`, `get_state_dict`,
`save_model`) and a Trainer run (`TrainingArguments(fsdp="full_shard auto_wrap",
fsdp_config={"fsdp_version": 2, ...})`, `save_model`), both on a tiny Llama loaded with
`from_pretrained`.

Compared: per-rank losses of every micro-batch, gradient norms and learning rates per optimizer
step, the trained parameters and the full state dict Accelerate gathers (`get_state_dict`, and
the file `save_model` writes). Measured (torch 2.13.0; accelerate 1.16.0 / transformers 5.24.0
and accelerate 1.11.0 / transformers 5.6.0): learning rates bitwise equal; losses bitwise but
for one scenario at the lowest versions (1e-7 relative); gradient norms within 1.4e-7
relative; parameters, state dicts and saved files within 1.2e-7 (bitwise in most scenarios).
The gradient norms cannot be bitwise: torch cuts each tensor by rows evenly over the ranks, we
cut the unit's flat buffer where the planner says, so each rank's partial sum of squares holds
other elements and rounds differently; the clip coefficient carries that into the update. The
asserted bound is 1e-6 (relative for losses and norms, absolute for parameters, which are O(1)).
Each run also reports which `fully_shard` made its units, so without the line (or with a line
that does nothing) the "ours" run fails here, however equal its numbers.

`cpu_ram_efficient_loading` (rank 0 loads, the model is sharded on meta, Accelerate's
`fsdp2_load_full_state_dict` broadcasts, `distribute_tensor`s and `load_state_dict(...,
assign=True)`s) is a scenario: the line also teaches torch's `distribute_tensor` our placement
(integrations/torch.py). Not compared here, for want of a reference: `CPUOffloadPolicy`
(torch's FSDP2 pins host memory, which needs an accelerator: _fsdp_param.py `pin_memory()`;
ours runs, tests/core/fsdp/test_fsdp_module.py).

TEST SHIM, not product code (`_accelerate_fsdp_on_cpu_shim`): Accelerate takes its FSDP path
only on an accelerator. Without one, `PartialState` picks no backend for a launched rank (so no
distributed run at all without `cpu=True`), and with `cpu=True` it is MULTI_CPU, and
`AcceleratorState` sets `DistributedType.FSDP` (and keeps the plugin) only for the MULTI_GPU-like
types (accelerate/state.py, 1.16.0: 947-977; 1.11.0: 981-1007), so the plugin is dropped and the
model gets DDP. The shim makes a launched rank gloo/MULTI_CPU (as
tests/integration/test_hf_trainer.py does for DeepSpeed) and then does what AcceleratorState does on
a GPU: FSDP, the plugin kept, its mixed precision set. Both runs of a comparison go through the same
shim; torch's FSDP2 itself runs on gloo/CPU (tests/core/fsdp/test_fsdp2_idioms.py).
"""
from __future__ import annotations

import os

import pytest
import torch


WORLD = 2
SEQ = 16
VOCAB = 128
STEPS = 4
MICRO = 2
LR = 1e-2
TOLERANCE = 1e-6
# Accelerate's and Trainer's FSDP2 options the scripts set (as users' FSDP2 configs write them)
WRAP = ["LlamaDecoderLayer"]
# The Accelerate script's scenarios: accumulation steps, more FullyShardedDataParallelPlugin
# options, more Accelerator options, tied embeddings (Accelerate then puts the embedding in the
# tail unit with the final norm and lm_head).
SCENARIOS = {
    "accum1": (1, {}, {}, False),
    "accum2": (2, {}, {}, False),
    "tied_embeddings": (1, {}, {}, True),
    "bf16_activation_checkpointing": (1, {"activation_checkpointing": True},
                                      {"mixed_precision": "bf16"}, False),
    # rank 0 loads, the model goes to meta, is sharded, and rank 0's weights are broadcast
    # (fsdp2_load_full_state_dict: distribute_tensor, then load_state_dict(assign=True))
    "cpu_ram_efficient_loading": (1, {"cpu_ram_efficient_loading": True}, {}, False),
}


# ----------------------------------------------------------------------------- in the ranks

def _accelerate_fsdp_on_cpu_shim():
    """TEST SHIM, not product code: see the module docstring."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    if getattr(PartialState._prepare_backend, "test_shim", False):
        return
    prepare_backend_original = PartialState._prepare_backend
    state_init_original = AcceleratorState.__init__

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        if not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_CPU
        return prepare_backend_original(self, cpu, sagemaker_dp, backend)

    def state_init(self, *args, fsdp_plugin=None, **kwargs):
        fresh = not AcceleratorState._shared_state
        state_init_original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fresh and fsdp_plugin is not None and \
                self.distributed_type == DistributedType.MULTI_CPU:
            # what AcceleratorState.__init__ does for a MULTI_GPU rank with an FSDP plugin
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    prepare_backend.test_shim = True
    PartialState._prepare_backend = prepare_backend
    AcceleratorState.__init__ = state_init


def _reset_global_state():
    """What a fresh script starts without: Accelerate's shared state."""
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _start_script(rank, ours):
    """The top of a user's script as a launcher starts it; `ours`: plus the one line."""
    os.environ["LOCAL_RANK"] = str(rank)  # what every launcher sets
    _accelerate_fsdp_on_cpu_shim()
    _reset_global_state()
    if ours:
        import vescale_engine
        vescale_engine.patch_fsdp2()  # the one added line


def _end_script(ours):
    """The next script in this rank starts from an unpatched process."""
    if ours:
        import vescale_engine
        vescale_engine.unpatch()
    _reset_global_state()


class TokenDataset(torch.utils.data.Dataset):
    """Fixed token sequences a model can learn (arithmetic progressions modulo VOCAB); the
    labels are the inputs (the model shifts them)."""

    def __init__(self, samples=64, seed=0):
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (samples, 1), generator=gen)
        stride = torch.randint(1, 5, (samples, 1), generator=gen)
        self.ids = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _units(model) -> dict:
    """{module name: "vescale" or "torch"} for every FSDPModule under `model`: whose
    fully_shard made it (ours leaves a unit we can look up; torch's leaves none)."""
    from torch.distributed.fsdp import FSDPModule

    from vescale_engine.fsdp import unit_of
    return {name: "vescale" if unit_of(module) is not None else "torch"
            for name, module in model.named_modules() if isinstance(module, FSDPModule)}


def _full_parameters(model) -> dict:
    """Every parameter whole (a collective on every rank), under the names a saved state
    dict has (a tied one under each name, activation checkpointing's wrapper left out); the
    tensors on rank 0 only."""
    from torch.distributed.tensor import DTensor
    full = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        whole = param.full_tensor() if isinstance(param, DTensor) else param
        full[name.replace("._checkpoint_wrapped_module", "")] = whole.detach().clone()
    return full if torch.distributed.get_rank() == 0 else {}


def _saved(directory) -> dict:
    """The tensors of the safetensors files `save_model` wrote (rank 0 reads them)."""
    import glob

    from safetensors.torch import load_file
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    assert files, f"save_model wrote no safetensors file in {directory}: {os.listdir(directory)}"
    out = {}
    for path in files:
        out.update(load_file(path))
    return out


def accelerate_rank(rank, world, model_dir, out_dir, ours, scenario):
    """A user's Accelerate FSDP2 script: the plugin as `accelerate config` writes it for
    FSDP2 (transformer-based wrap of the decoder layers, full state dict), its own torch AdamW
    and warmup schedule, `accumulate`, `clip_grad_norm_`; then `get_state_dict` and
    `save_model`. Returns this rank's micro-batch losses, per optimizer step (grad norm, lr),
    the units' makers, and on rank 0 the trained parameters, state dict and saved file."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import LlamaForCausalLM, get_linear_schedule_with_warmup

    accum, plugin_options, accelerator_options, tied = SCENARIOS[scenario]
    _start_script(rank, ours)
    try:
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=WRAP, state_dict_type="FULL_STATE_DICT",
            reshard_after_forward=True, **{"cpu_ram_efficient_loading": False,
                                           **plugin_options})
        accelerator = Accelerator(gradient_accumulation_steps=accum, fsdp_plugin=plugin,
                                  **accelerator_options)
        assert accelerator.is_fsdp2, accelerator.distributed_type  # the shim did its part
        model = LlamaForCausalLM.from_pretrained(model_dir + ("-tied" if tied else ""))
        # as training scripts do: transformers 5.6 otherwise fills a KV cache in training, and
        # activation checkpointing's recompute then sees it twice (torch's run fails as ours)
        model.config.use_cache = False
        loader = torch.utils.data.DataLoader(TokenDataset(), batch_size=MICRO)
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
                    steps.append((float(grad_norm), scheduler.get_last_lr()[0]))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.item())
            if len(steps) == STEPS:
                break
        state_dict = accelerator.get_state_dict(model)
        accelerator.save_model(model, out_dir)
        accelerator.wait_for_everyone()
        import torch.distributed.fsdp as torch_fsdp
        from torch.distributed.fsdp._fully_shard import fully_shard as torchs
        result = {"units": _units(model), "losses": losses, "steps": steps,
                  "parameters": _full_parameters(model),
                  # the line switches Accelerate's call only: torch's name is torch's again
                  "torch_name_kept": torch_fsdp.fully_shard is torchs}
        if rank == 0:
            result["state_dict"] = {k: v.detach().clone() for k, v in state_dict.items()}
            result["saved"] = _saved(out_dir)
        return result
    finally:
        _end_script(ours)


def _recorder():
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        """Per optimizer step: the logged loss, grad norm and learning rate."""

        def __init__(self):
            self.train = {}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "loss" in logs:
                self.train[state.global_step] = (logs["loss"], logs.get("grad_norm"),
                                                 logs["learning_rate"])

    return Recorder()


def trainer_rank(rank, world, model_dir, out_dir, ours, options):
    """A user's Trainer script with an FSDP2 config (Hugging Face's FSDP docs' shape); returns
    what Trainer logs per step, the units' makers, and on rank 0 the trained parameters and
    the file `save_model` wrote."""
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    _start_script(rank, ours)
    # what `accelerate launch --fsdp_state_dict_type FULL_STATE_DICT` sets: transformers 5.6
    # does not pass fsdp_config's state_dict_type on (5.24 does), and with Accelerate's FSDP2
    # default, SHARDED_STATE_DICT, Trainer.save_model writes no model file
    os.environ["FSDP_STATE_DICT_TYPE"] = "FULL_STATE_DICT"
    try:
        args = TrainingArguments(**{
            "output_dir": out_dir, "fsdp": "full_shard auto_wrap",
            "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": WRAP,
                            "reshard_after_forward": True,
                            "state_dict_type": "FULL_STATE_DICT"},
            "per_device_train_batch_size": MICRO, "max_steps": STEPS, "learning_rate": LR,
            "warmup_steps": 2, "weight_decay": 0.01, "adam_beta2": 0.95,
            "max_grad_norm": 0.5, "logging_steps": 1, "save_strategy": "no",
            "report_to": "none", "seed": 0, "disable_tqdm": True, **options})
        model = LlamaForCausalLM.from_pretrained(model_dir)
        recorder = _recorder()
        trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(),
                          callbacks=[recorder])
        assert trainer.accelerator.is_fsdp2, trainer.accelerator.distributed_type
        trainer.train()
        saved_to = os.path.join(out_dir, "final")
        trainer.save_model(saved_to)
        trainer.accelerator.wait_for_everyone()
        result = {"units": _units(trainer.model_wrapped), "train": recorder.train,
                  "global_step": trainer.state.global_step,
                  "parameters": _full_parameters(trainer.model_wrapped)}
        if rank == 0:
            result["saved"] = _saved(saved_to)
        return result
    finally:
        os.environ.pop("FSDP_STATE_DICT_TYPE")
        _end_script(ours)


# ----------------------------------------------------------------------------- the runs

POOL_WORLD = WORLD


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama saved once (safetensors), and beside it (`-tied`) one with tied
    embeddings; every run starts from these weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    path = str(tmp_path_factory.mktemp("tiny_llama") / "llama")
    for tied in (False, True):
        torch.manual_seed(0)
        llama = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=64, tie_word_embeddings=tied)
        LlamaForCausalLM(llama).save_pretrained(path + ("-tied" if tied else ""))
    return path


def _run_both(pool, fn, model_dir, tmp_path, option):
    """(torch's run, ours), each a list per rank."""
    return tuple(pool.run(fn, model_dir, str(tmp_path / kind), kind == "vescale", option,
                          timeout=300)
                 for kind in ("torch", "vescale"))


# ----------------------------------------------------------------------------- the checks

def _close(a, b, what):
    assert a is not None and b is not None, what
    assert abs(a - b) <= TOLERANCE * max(abs(a), abs(b)), f"{what}: veScale {a!r}, torch {b!r}"


def _assert_units(theirs, ours):
    """The same modules wrapped, torch's units in the reference and ours after the line."""
    assert sorted(ours) == sorted(theirs), (ours, theirs)
    assert set(theirs.values()) == {"torch"}, theirs
    assert set(ours.values()) == {"vescale"}, f"the one line did not switch the units: {ours}"
    # the decoder layers and the root (Accelerate 1.12 and later also give the embedding and
    # [final norm, lm_head] units of their own)
    assert {"", "model.layers.0", "model.layers.1"} <= set(ours), ours


def _assert_tensors_equal(ours: dict, theirs: dict, what: str):
    assert sorted(ours) == sorted(theirs), (what, sorted(ours), sorted(theirs))
    assert ours, f"{what}: empty"
    for name in theirs:
        a, b = ours[name], theirs[name]
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name, a.shape, b.shape)
        diff = (a.float() - b.float()).abs().max().item()
        assert diff <= TOLERANCE, f"{what}: {name} differs by {diff}"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_accelerate_fsdp2_script_with_one_line_equals_torch_fsdp2(pool, model_dir, tmp_path,
                                                                 scenario):
    accum = SCENARIOS[scenario][0]
    theirs, ours = _run_both(pool, accelerate_rank, model_dir, tmp_path, scenario)
    for rank in range(WORLD):
        _assert_units(theirs[rank]["units"], ours[rank]["units"])
        a, b = ours[rank], theirs[rank]
        assert a["torch_name_kept"] and b["torch_name_kept"]
        assert len(a["losses"]) == len(b["losses"]) == STEPS * accum, (a["losses"], b["losses"])
        for i, (x, y) in enumerate(zip(a["losses"], b["losses"])):
            _close(x, y, f"rank {rank} micro-batch {i} loss")
        assert len(a["steps"]) == len(b["steps"]) == STEPS
        for step, ((norm, lr), (norm_t, lr_t)) in enumerate(zip(a["steps"], b["steps"])):
            _close(norm, norm_t, f"rank {rank} step {step} grad norm")
            assert lr == lr_t, (step, lr, lr_t)
    _assert_tensors_equal(ours[0]["parameters"], theirs[0]["parameters"], "trained parameters")
    _assert_tensors_equal(ours[0]["state_dict"], theirs[0]["state_dict"],
                          "accelerator.get_state_dict")
    _assert_tensors_equal(ours[0]["saved"], theirs[0]["saved"], "accelerator.save_model")
    _assert_tensors_equal(ours[0]["saved"], ours[0]["parameters"], "saved vs trained")


def test_trainer_fsdp_version_2_with_one_line_equals_torch_fsdp2(pool, model_dir, tmp_path):
    theirs, ours = _run_both(pool, trainer_rank, model_dir, tmp_path,
                             {"gradient_accumulation_steps": 2})
    for rank in range(WORLD):
        _assert_units(theirs[rank]["units"], ours[rank]["units"])
        a, b = ours[rank], theirs[rank]
        assert a["global_step"] == b["global_step"] == STEPS
        assert sorted(a["train"]) == sorted(b["train"]) == list(range(1, STEPS + 1)), \
            (a["train"], b["train"])
        for step in b["train"]:
            for name, x, y in zip(("loss", "grad_norm", "learning_rate"), a["train"][step],
                                  b["train"][step]):
                _close(x, y, f"rank {rank} step {step} {name}")
    _assert_tensors_equal(ours[0]["parameters"], theirs[0]["parameters"], "trained parameters")
    _assert_tensors_equal(ours[0]["saved"], theirs[0]["saved"], "Trainer.save_model")
    _assert_tensors_equal(ours[0]["saved"], ours[0]["parameters"], "saved vs trained")


# ----------------------------------------------------------------------------- the line itself

_LINE = """
import json
import accelerate, accelerate.accelerator, accelerate.utils
import accelerate.utils.fsdp_utils as fsdp_utils
import torch.distributed.fsdp as torch_fsdp
import vescale_engine
from vescale_engine import integrations
holders = (fsdp_utils, accelerate.utils, accelerate.accelerator)
original, torchs = fsdp_utils.fsdp2_prepare_model, torch_fsdp.fully_shard
vescale_engine.patch_fsdp2()
vescale_engine.patch_fsdp2()  # idempotent
names = integrations.installed()
wrapped = [m.fsdp2_prepare_model.__vescale_original__ is original for m in holders]
torch_kept = torch_fsdp.fully_shard is torchs
vescale_engine.unpatch()
restored = [m.fsdp2_prepare_model is original for m in holders]
del fsdp_utils.fsdp2_prepare_model  # an Accelerate that moved it
try:
    vescale_engine.patch_fsdp2()
    message = None
except ImportError as err:
    message = str(err)
print(json.dumps(dict(names=names, wrapped=wrapped, torch_kept=torch_kept, restored=restored,
                      message=message, left=integrations.installed(),
                      version=accelerate.__version__)))
"""


def test_the_line_patches_accelerates_call_only_and_unpatch_restores_it():
    """patch_fsdp2() wraps Accelerate's fsdp2_prepare_model wherever Accelerate holds it (and,
    of torch, only distribute_tensor for our placement: torch's fully_shard stays), twice is once, unpatch() puts the originals
    back, and an Accelerate without the function is one line naming it, nothing left."""
    import json
    import subprocess
    import sys

    from vescale_engine.versions import supported_range
    # the repository: tests/<tier>/ is two folders down
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _LINE], capture_output=True, text=True,
                         env=env, timeout=300, cwd=root)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["names"] == ["accelerate.accelerator.fsdp2_prepare_model",
                            "accelerate.utils.fsdp2_prepare_model",
                            "accelerate.utils.fsdp_utils.fsdp2_prepare_model",
                            # for cpu_ram_efficient_loading (integrations/torch.py)
                            "torch.distributed._state_dict_utils._distribute_tensors",
                            "torch.distributed._state_dict_utils.distribute_tensor",
                            "torch.distributed.tensor._api.distribute_tensor",
                            "torch.distributed.tensor.distribute_tensor"], got["names"]
    assert got["wrapped"] == [True] * 3 and got["torch_kept"], got
    assert got["restored"] == [True] * 3 and got["left"] == [], got
    assert got["message"] == (
        f"accelerate {got['version']} has no accelerate.utils.fsdp_utils.fsdp2_prepare_model "
        f"(vescale_engine.integrations.accelerate supports accelerate"
        f"{supported_range('accelerate')}): vescale_engine.patch_fsdp2() cannot make "
        "Accelerate's FSDP2 path use our fully_shard"), got["message"]

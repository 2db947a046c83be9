"""vescale_engine/integrations/: patches are explicit and reversible.

- After `patch_deepspeed()` and `unpatch()`, DeepSpeed ZeRO-3 trains bitwise as it does in a
  process that was never patched (2 gloo ranks, one process each: the same 2 steps before and
  after), and every patched name holds its original again.
- The order of imports does not matter: transformers, PEFT and TRL imported before or after
  `patch_deepspeed()` end with the same names patched (subprocesses), and after `unpatch()`
  importing them patches nothing.
- A name DeepSpeed no longer has is one line naming the library, its version and the name,
  and nothing of that patch_deepspeed() call stays patched.
"""
import json
import os
import subprocess
import sys

import torch

import fsdp_models as fm

# the repository: tests/<tier>/ is two folders down
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MICRO, STEPS = 2, 2
DS_CONFIG = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
             "steps_per_print": 1000, "zero_optimization": {"stage": 3},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


POOL_ENV = {"DS_ACCELERATOR": "cpu"}


def _train_deepspeed(rank, world):
    """DeepSpeed's own ZeRO-3 engine, 2 steps: (losses, this rank's parameter partitions)."""
    import deepspeed
    model = fm.make("gpt")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=DS_CONFIG)
    losses = []
    for step in range(STEPS):
        idx, tgt = fm.rank_micro_batches("gpt", step, rank, world, MICRO, 1)[0]
        loss = engine(idx, tgt)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    params = [p.ds_tensor.detach().clone() for p in engine.module.parameters()]
    engine.destroy()
    return losses, params


def _originals():
    import deepspeed
    from deepspeed import checkpointing, zero
    return {"initialize": deepspeed.initialize, "tp_model_init": deepspeed.tp_model_init,
            "configure": checkpointing.configure, "Init": zero.Init,
            "GatheredParameters": zero.GatheredParameters,
            "ds_status": torch.nn.Parameter.__dict__.get("ds_status"),
            "ds_shape": torch.nn.Parameter.__dict__.get("ds_shape")}


def unpatched_rank(rank, world):
    import deepspeed
    import vescale_engine
    from vescale_engine import integrations
    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    before = _originals()
    fresh = _train_deepspeed(rank, world)
    vescale_engine.patch_deepspeed()
    patched = integrations.installed()
    changed = sorted(k for k, v in _originals().items() if v is not before[k])
    vescale_engine.unpatch()
    restored = sorted(k for k, v in _originals().items() if v is not before[k])
    again = _train_deepspeed(rank, world)
    same = all(torch.equal(a, b) for a, b in zip(fresh[0] + fresh[1], again[0] + again[1],
                                                  strict=True))
    r = dict(patched=patched, changed=changed, restored=restored, left=integrations.installed(),
             same=same, count=len(fresh[1]))
    assert r["changed"] == sorted(["initialize", "tp_model_init", "configure", "Init",
                                   "GatheredParameters", "ds_status", "ds_shape"]), r
    assert "deepspeed.initialize" in r["patched"] and \
        "torch.nn.parameter.Parameter.ds_status" in r["patched"], r["patched"]
    assert r["restored"] == [] and r["left"] == [], r
    assert r["same"] and r["count"] > 0, r


def test_after_unpatch_deepspeed_zero3_trains_bitwise_as_in_a_fresh_process(pool):
    pool.run(unpatched_rank, timeout=600)


def missing_name_rank(rank, world):
    import deepspeed
    from vescale_engine import integrations
    from vescale_engine.versions import supported_range
    original = deepspeed.tp_model_init
    del deepspeed.tp_model_init
    message = left = None
    try:
        integrations.patch_deepspeed()
    except ImportError as err:
        message, left = str(err), integrations.installed()  # nothing of the call stays
    finally:
        deepspeed.tp_model_init = original
        integrations.unpatch()
    version = deepspeed.__version__
    assert left == [], left
    assert message == (f"deepspeed {version} has no deepspeed.tp_model_init "
                       "(vescale_engine.integrations.deepspeed supports "
                       f"deepspeed{supported_range('deepspeed')})"), message


def test_a_name_deepspeed_moved_is_one_line_naming_library_version_and_name(pool):
    pool.run(missing_name_rank)


# -- the order of imports ------------------------------------------------------------------------

_LATE = "import peft, trl.models.utils, transformers.modeling_utils\n"
_SCRIPT = """
import json, sys
import vescale_engine
from vescale_engine import integrations
{before}vescale_engine.patch_deepspeed()
{after}names = integrations.installed()
import accelerate.utils.other as other
unwrap = other.extract_model_from_parallel  # ours, in every module that imported it by name
stale = sorted(name for name, m in list(sys.modules.items())
               if callable(getattr(m, "__dict__", {{}}).get("extract_model_from_parallel"))
               and m.__dict__["extract_model_from_parallel"] is not unwrap)
import deepspeed, peft.tuners.lora.model as lora, trl.models.utils as trl_utils
from transformers.modeling_utils import PreTrainedModel
watched = lambda: (deepspeed.initialize, lora.LoraModel.__dict__["_replace_module"],
                   trl_utils.remove_hooks, PreTrainedModel.__dict__["_load_pretrained_model"])
patched = watched()
vescale_engine.unpatch()
restored = [p.__vescale_original__ is now for p, now in
            zip([patched[0], patched[1], patched[2], patched[3].__func__], watched())]
restored[3] = isinstance(watched()[3], staticmethod) and \\
    watched()[3].__func__ is patched[3].__func__.__vescale_original__
print(json.dumps(dict(names=names, stale=stale, left=integrations.installed(), restored=restored,
                      hooks=[type(f).__name__ for f in sys.meta_path])))
"""
_UNPATCHED_THEN_IMPORTED = """
import json, vescale_engine
from vescale_engine import integrations
vescale_engine.patch_deepspeed()
vescale_engine.unpatch()
import peft, trl.models.utils, transformers.modeling_utils
print(json.dumps(integrations.installed()))
"""


def _run(code):
    env = {**os.environ, "PYTHONPATH": ROOT, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# DeepSpeed's safe_* accessors, patched where scripts import them from
_SAFE_ACCESSORS = [f"safe_{verb}_{scope}_{what}" for verb in ("get", "set")
                   for scope in ("full", "local")
                   for what in ("fp32_param", "grad", "optimizer_state")] + \
    ["safe_update_full_grad_vectorized"]


def test_the_patches_are_the_same_whatever_was_imported_first():
    first = _run(_SCRIPT.format(before=_LATE, after=""))
    later = _run(_SCRIPT.format(before="", after=_LATE))
    # Accelerate's function is re-bound in the modules that imported it by name before the
    # patch (more of them when transformers came first); those imported later import ours.
    def own(names):
        return [n for n in names if not n.endswith(".extract_model_from_parallel")]
    assert own(first["names"]) == own(later["names"]) == sorted([
        "accelerate.accelerator.Accelerator.get_state_dict", "deepspeed.initialize",
        "deepspeed.runtime.activation_checkpointing.checkpointing.configure",
        "deepspeed.runtime.zero.GatheredParameters", "deepspeed.runtime.zero.Init",
        "deepspeed.tp_model_init", *(f"deepspeed.utils.{module}{name}"
                                     for module in ("", "tensor_fragment.")
                                     for name in _SAFE_ACCESSORS),
        "peft.tuners.lora.model.LoraModel._replace_module",
        "peft.tuners.tuners_utils.BaseTuner._replace_module",
        "peft.tuners.tuners_utils.BaseTunerLayer._move_adapter_to_device_of_base_layer",
        "torch.nn.parameter.Parameter.ds_shape", "torch.nn.parameter.Parameter.ds_status",
        "transformers.integrations.deepspeed.initialize_weights_zero3",
        "transformers.modeling_utils.PreTrainedModel._initialize_missing_keys",
        "transformers.modeling_utils.PreTrainedModel._load_pretrained_model",
        "trl.models.utils.add_hooks", "trl.models.utils.remove_hooks"]), (first, later)
    for run in (first, later):
        assert "accelerate.utils.other.extract_model_from_parallel" in run["names"], run
        assert run["stale"] == [], run["stale"]
        assert run["left"] == [] and all(run["restored"]), run
        assert "_Finder" not in run["hooks"], run["hooks"]
    assert _run(_UNPATCHED_THEN_IMPORTED) == []

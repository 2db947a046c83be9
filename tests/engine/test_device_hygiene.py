"""Every tensor the library creates is created on the device of what it serves, never on torch's
default device. The check: build the model and the engine normally, then switch the default
device to `meta` (so a tensor made without `device=` is a meta tensor and any use of it fails),
and train on 2 gloo ranks with every optimizer we ship (and torch's fused AdamW as a client
optimizer), gradient clipping, mixed precision, gradient accumulation and a checkpoint save +
load. Losses and parameters must equal those of
the same run with the default device left alone, bit for bit, and no operation may produce a
meta tensor."""
import functools
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import fsdp_models as fm
from dist_harness import scratch_dir
from vescale_engine import initialize
from vescale_engine.checkpoint.sharded import torch_state_target

MICRO, ACCUM, STEPS, SAVE_AFTER = 2, 2, 3, 2
OPTIMIZERS = {
    "AdamW": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "AdamW8bit": {"type": "AdamW8bit", "params": {"lr": 1e-3, "block": "block:64"}},
    "Muon": {"type": "Muon", "params": {"lr": 0.02, "adamw_lr": 1e-3}},
}
OFFLOADED = "AdamW offload_optimizer ratio 0.5"  # host state made at the first step
BOTH_OFFLOADED = "AdamW offload_optimizer + offload_param"  # compute shards on the host too
TORCH_FUSED = "torch.optim.AdamW(fused=True)"  # a client optimizer: its `step` state is torch's
PRECISION = {"bf16": {"bf16": {"enabled": True}},  # bf16 parameters, fp32 master and reduction
             "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}  # + loss scaler


class NoMetaTensors(TorchDispatchMode):
    """Fails the first operation that produces a meta tensor, naming it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_flatten(out)[0]):
            raise AssertionError(f"{func} made a tensor on the default device (meta)")
        return out


def train(rank, world, optimizer, precision, directory, meta):
    """Losses of STEPS optimizer steps, then of the last step again after loading the
    checkpoint saved after SAVE_AFTER; and this rank's parameter shards at the end."""
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
              "gradient_clipping": 0.5, **PRECISION[precision],
              "vescale": {"wrap_policy": {"module_classes": ["Block"]}}}
    client = None
    if optimizer == TORCH_FUSED:
        client = functools.partial(torch.optim.AdamW, lr=1e-3, fused=True)
    elif optimizer == OFFLOADED:
        config["optimizer"] = OPTIMIZERS["AdamW"]
        config["zero_optimization"] = {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}
    elif optimizer == BOTH_OFFLOADED:
        config["optimizer"] = OPTIMIZERS["AdamW"]
        config["zero_optimization"] = {"stage": 3,
                                       "offload_optimizer": {"device": "cpu", "ratio": 1.0},
                                       "offload_param": {"device": "cpu", "pin_memory": True}}
    else:
        config["optimizer"] = OPTIMIZERS[optimizer]
    engine, *_ = initialize(model=fm.make("gpt"), optimizer=client, config=config)
    batches = [fm.batch("gpt", step, MICRO * ACCUM * world) for step in range(STEPS)]

    def optimizer_step(step):
        idx, tgt = (t[rank * MICRO * ACCUM:(rank + 1) * MICRO * ACCUM] for t in batches[step])
        losses = []
        for k in range(ACCUM):
            loss = engine(idx[k * MICRO:(k + 1) * MICRO], tgt[k * MICRO:(k + 1) * MICRO])
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        return losses + [engine.get_global_grad_norm()]

    if meta:
        torch.set_default_device("meta")
        guard = NoMetaTensors()
        guard.__enter__()
    try:
        losses = []
        for step in range(STEPS):
            if step == SAVE_AFTER:
                engine.save_checkpoint(directory, tag="hygiene")
            losses.append(optimizer_step(step))
        engine.load_checkpoint(directory, tag="hygiene")
        losses.append(optimizer_step(STEPS - 1))  # the last step again, from the checkpoint
    finally:
        if meta:
            guard.__exit__(None, None, None)
            torch.set_default_device(None)
    losses = [[float(x) for x in step] for step in losses]
    return losses, [p.detach().clone() for p in engine.module.parameters()]


def hygiene_rank(rank, world, optimizer, precision, directory):
    from vescale_engine.optim import quantize
    for cached in (quantize._code_table, quantize._midpoints, quantize._nearest_code_lookup):
        cached.cache_clear()  # tables too are made under the meta default device
    got, got_params = train(rank, world, optimizer, precision, f"{directory}/meta", meta=True)
    want, want_params = train(rank, world, optimizer, precision, f"{directory}/ref", meta=False)
    same_params = len(got_params) == len(want_params) and all(
        torch.equal(a, b) for a, b in zip(got_params, want_params))
    assert got == want, (got, want)
    assert same_params
    flat = [x for step in got for x in step]
    assert all(x == x and abs(x) != float("inf") for x in flat), got
    assert got[-1] == got[STEPS - 1]  # resumed from the checkpoint: the same last step


CASES = [(name, "bf16") for name in [*OPTIMIZERS, TORCH_FUSED, OFFLOADED, BOTH_OFFLOADED]] + \
    [("AdamW", "fp16")]


@pytest.mark.parametrize("optimizer,precision", CASES)
def test_training_never_uses_the_default_device(pool, optimizer, precision):
    pool.run(hygiene_rank, optimizer, precision, scratch_dir())


def test_torch_optimizer_state_loads_where_its_kernel_reads_it():
    """A torch optimizer's `step` loads on the parameter's device when the group is fused or
    capturable (the kernel reads it there), else on the host as torch keeps it; a meta
    parameter stands in for a GPU one."""
    p = torch.empty(6, device="meta")
    step = SimpleNamespace(size=torch.Size([]), properties=SimpleNamespace(dtype=torch.float32))
    moment = SimpleNamespace(size=torch.Size([6]), properties=SimpleNamespace(dtype=torch.float32))
    for group, device in (({"fused": True}, "meta"), ({"capturable": True}, "meta"),
                          ({"fused": None, "capturable": False}, "cpu"), ({}, "cpu")):
        assert torch_state_target(p, group, step).device.type == device, group
        assert torch_state_target(p, group, moment).device.type == "meta"

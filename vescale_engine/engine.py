"""`initialize` and `VeScaleEngine`: glue between the config, fully_shard, the optimizer and
the scheduler, with DeepSpeed's signature and step semantics."""
from __future__ import annotations

import atexit
import contextlib
import logging
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

from . import fsdp
from . import loss_scaler as scaling
from .clip import clip_grad_norm_, global_grad_norm
from .config import EngineConfig, build_config
from .monitor import Monitors
from . import optim
from .optim import AdamW
from .progress import Progress
from .timers import WallClockBreakdown

LOG = logging.getLogger("vescale_engine")

DEFAULT_TIMEOUT_S = 600


def _init_distributed(timeout_s: float):
    """Join the process group the launcher describes (gloo on CPU, NCCL with CUDA); a rank
    that never joins is a clear error after `timeout_s`, not an endless hang."""
    if dist.is_initialized():
        return
    from launcher.env import LaunchError, discover
    where = discover()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if where.world_size > 1 and (where.master_addr is None or where.master_port is None):
        raise LaunchError(f"{where.launcher} launch without MASTER_ADDR/MASTER_PORT: set them "
                          "or start with `vescale run`, torchrun or the deepspeed launcher")
    address = f"{where.master_addr}:{where.master_port}"
    try:
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=where.rank,
                                world_size=where.world_size,
                                timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistError) as err:
        raise LaunchError(f"rank {where.rank} of {where.world_size} ({where.launcher}): the "
                          f"process group at {address} did not form within {timeout_s:g} s "
                          f"({type(err).__name__}); check that every rank started and can "
                          "reach MASTER_ADDR") from None
    if backend == "nccl":
        torch.cuda.set_device(where.local_rank)
    atexit.register(_leave_process_group)


def _leave_process_group():
    """At exit, wait (briefly) for the other ranks, then tear the group down: a gloo rank that
    exits while a peer still talks to it aborts ("terminate called without an active
    exception")."""
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=30))
        dist.destroy_process_group()
    except (RuntimeError, dist.DistError):
        pass  # a peer is gone: nothing left to coordinate with


def _wrap(model: nn.Module, cfg: EngineConfig, mesh):
    """Units by the wrap policy (class names, or the smallest subtrees with min_params
    parameters), innermost first, then the root."""
    granularity = optim.sharding_granularity(  # the granularity the optimizer needs
        cfg.optimizer, {"default": cfg.granularity, "overrides": cfg.granularity_overrides}, model)
    kwargs = dict(mesh=mesh, reshard_after_forward=cfg.reshard_after_forward,
                  granularity=granularity,
                  max_buffers=cfg.max_buffers, align_bytes=cfg.align_bytes,
                  mp_policy=fsdp.MixedPrecisionPolicy(
                      param_dtype=getattr(torch, cfg.param_dtype) if cfg.param_dtype else None,
                      reduce_dtype=getattr(torch, cfg.reduce_dtype) if cfg.reduce_dtype else None))
    wrapped = set()

    def visit(module):  # post-order: children become units before their parents
        unmanaged = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            unmanaged += visit(child)
        if module is model:
            return unmanaged
        wanted = type(module).__name__ in cfg.module_classes if cfg.module_classes else (
            cfg.min_params is not None and unmanaged >= cfg.min_params)
        if wanted and unmanaged:
            fsdp.fully_shard(module, **kwargs)
            wrapped.add(module)
            return 0
        return unmanaged

    visit(model)
    if cfg.module_classes and not wrapped:
        raise ValueError(f"vescale.wrap_policy.module_classes {list(cfg.module_classes)} match "
                         "no module of the model")
    return fsdp.fully_shard(model, **kwargs)


# Config optimizer names served by our own classes; every other name is torch.optim's.
OWN_OPTIMIZERS = {"AdamW": AdamW}


def _optimizer(spec, client, params):
    if client is not None:
        if isinstance(client, torch.optim.Optimizer):
            raise ValueError("pass the optimizer class or a callable(params), not an instance: "
                             "its parameters are replaced by their shards here")
        return client(params)
    spec = spec or {"type": "AdamW", "params": {}}
    name, kwargs = spec["type"], dict(spec.get("params", {}))
    own = OWN_OPTIMIZERS.get(name)
    if own is AdamW:
        try:
            return AdamW(params, **kwargs)
        except ValueError as err:
            if "hyperparameters" in str(err):
                raise
            # Groups that split a flat buffer (a subset of parameters, or different lr/betas
            # in one buffer): torch's AdamW does the same math per parameter.
            LOG.info("optimizer AdamW: per-buffer AdamW cannot step these parameter groups "
                     "(%s); using torch.optim.AdamW", err)
            return torch.optim.AdamW(params, **kwargs)
    if name in optim.OURS:  # AdamW8bit, Muon: JSON lists become the tuples they take
        return optim.build_optimizer(name, params, kwargs)
    cls = own or getattr(torch.optim, name)
    return cls(params, **kwargs)


def _named_model_parameters(model_parameters, model):
    """DeepSpeed's model_parameters (parameters, or param-group dicts) as parameter names,
    checked before wrapping: wrapping replaces every parameter object, names stay."""
    names = {id(p): name for name, p in model.named_parameters()}

    def name_of(p):
        if id(p) not in names:
            raise ValueError(f"model_parameters holds a tensor of shape {list(p.shape)} that "
                             "is not a parameter of the model")
        return names[id(p)]

    groups, any_dict = [], False
    for item in model_parameters:
        if isinstance(item, dict):
            any_dict = True
            if "params" not in item:
                raise ValueError("a model_parameters group dict needs a 'params' key")
            params = item["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            groups.append({**item, "params": [name_of(p) for p in params]})
        else:
            groups.append({"params": [name_of(item)]})
    if not any_dict:  # plain parameters: one group, as torch makes of them
        return [{"params": [n for g in groups for n in g["params"]]}]
    return groups


def _resolve_named_parameters(groups, module):
    """The wrapped module's parameters for the names `_named_model_parameters` returned."""
    by_name = dict(module.named_parameters())
    return [{**g, "params": [by_name[n] for n in g["params"]]} for g in groups]


def _scheduler(spec, client, optimizer):
    if client is not None:
        return client(optimizer) if callable(client) and not hasattr(client, "step") else client
    if spec is None:
        return None
    name, kwargs = spec["type"], dict(spec.get("params", {}))
    try:
        from deepspeed.runtime import lr_schedules
        cls = getattr(lr_schedules, name, None)
    except ImportError:
        cls = None
    cls = cls or getattr(torch.optim.lr_scheduler, name, None)
    if cls is None:
        raise ValueError(f"scheduler.type {name!r} is neither a DeepSpeed nor a torch scheduler")
    return cls(optimizer, **kwargs)


class VeScaleEngine(nn.Module):
    """What DeepSpeed scripts call: engine(...), backward (or plain loss.backward()), step,
    no_sync, train/eval, destroy, counters."""

    def __init__(self, module, config: EngineConfig, optimizer, lr_scheduler):
        super().__init__()
        self.module = module
        self.config = config
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.process_group = dist.group.WORLD
        self.world_size = dist.get_world_size()
        self.global_rank = dist.get_rank()
        from launcher.env import discover
        self.local_rank = discover().local_rank
        self.loss_scaler = scaling.from_config(config.fp16)  # None unless fp16
        self.timers = WallClockBreakdown(config.wall_clock_breakdown)
        self.monitor = Monitors(config.raw, self.global_rank)
        self.progress = Progress(config.steps_per_print, self.global_rank)
        self._grad_norm = None
        self._tokens = None
        self._output_loss = None     # the last forward's output, when it is a scalar loss
        self._window_losses = []     # this accumulation window's micro-batch losses
        self._backward_graph = None  # autograd graph task the backward prologue ran for
        self._in_engine_backward = False
        self._user_no_sync = 0
        self._sync_context = None
        self._destroyed = False

    # -- forward and backward ------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        self._check_alive()
        first = args[0] if args else None  # token ids [batch, sequence] give tokens/s
        self._tokens = first.numel() if isinstance(first, torch.Tensor) and \
            not first.is_floating_point() else None
        self.timers.start("forward")
        out = self.module(*args, **kwargs)
        self.timers.stop("forward")
        self._output_loss = out.detach() if isinstance(out, torch.Tensor) and out.dim() == 0 \
            and out.is_floating_point() else None
        if torch.is_grad_enabled():
            self._hook_outputs(out)
        return out

    def _hook_outputs(self, out):
        """Plain `loss.backward()` (no engine.backward) must train exactly as engine.backward:
        the gradient reaching the model's outputs is scaled here (1/accumulation steps, times
        the fp16 loss scale), and the first one to arrive runs the backward prologue."""
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._output_grad_hook)

    def _output_grad_hook(self, grad):
        if self._in_engine_backward:  # engine.backward scaled the loss and ran the prologue
            return grad
        graph = torch._C._current_graph_task_id()
        if graph != self._backward_graph:
            self._backward_graph = graph
            self._backward_prologue(self._output_loss)
            Variable._execution_engine.queue_callback(self._backward_epilogue)
        factor = self._gradient_factor()
        return grad if factor == 1.0 else grad * factor

    def _gradient_factor(self) -> float:
        scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        return scale / self.gradient_accumulation_steps()

    def _backward_prologue(self, loss):
        """Once per backward: note the loss, and make only the boundary micro-step
        reduce-scatter (earlier ones accumulate full gradients locally)."""
        self._check_alive()
        if loss is not None:
            self._window_losses.append(loss.float())
        self.timers.start("backward")
        self._sync_context = None
        if self._user_no_sync or not self.is_gradient_accumulation_boundary():
            self._sync_context = fsdp.no_sync(self.module)
            self._sync_context.__enter__()

    def _backward_epilogue(self):
        if self._sync_context is not None:
            self._sync_context.__exit__(None, None, None)
            self._sync_context = None
        self.timers.stop("backward")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """DeepSpeed's backward: divide by the accumulation steps (and multiply by the fp16 loss
        scale), then backpropagate. Returns the loss divided by the accumulation steps."""
        self._check_alive()
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError("engine.backward needs a scalar loss tensor")
        gas = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        self._backward_prologue(loss.detach())
        self._in_engine_backward = True
        try:
            # Multiplied in fp32: an fp16 loss times the scale would overflow before backward.
            scaled = loss if scale == gas == 1 else loss.float() * (scale / gas)
            scaled.backward(retain_graph=retain_graph)
        finally:
            self._in_engine_backward = False
            self._backward_epilogue()
        return loss / gas

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, without communication."""
        self._check_alive()
        self._user_no_sync += 1
        try:
            yield
        finally:
            self._user_no_sync -= 1

    # -- the optimizer step --------------------------------------------------------------------

    def step(self, lr_kwargs=None):
        """At the accumulation boundary: (fp16: overflow check and unscale), clip, optimizer
        step, scheduler step, zero gradients. A step whose gradients overflowed is skipped on
        every rank but still counts in global_steps, as in DeepSpeed."""
        self._check_alive()
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self.timers.start("optimizer")
            self._take_model_step(lr_kwargs)
            self.timers.stop("optimizer")
            self.timers.optimizer_step_done()
        self.micro_steps += 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.world_size
        self.progress.micro_step(self.train_micro_batch_size_per_gpu() * self.world_size,
                                 self._tokens and self._tokens * self.world_size)
        if boundary:
            self._report()

    def _take_model_step(self, lr_kwargs):
        # Norm, clipping and overflow over what the optimizer steps (model_parameters may be
        # a subset), as DeepSpeed's ZeRO does.
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        clip = self.config.gradient_clipping
        overflow = False
        if self.loss_scaler is not None:
            overflow, self._grad_norm = scaling.unscale_and_clip_(
                params, self.loss_scaler.loss_scale, clip)
            message = self.loss_scaler.update(overflow)
            if message and self.global_rank == 0:
                LOG.info("step %d: %s", self.global_steps + 1, message)
        elif clip > 0:
            self._grad_norm = clip_grad_norm_(params, clip)
        else:
            self._grad_norm = global_grad_norm(params)
        if overflow:
            self.skipped_steps += 1
        else:
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        self.optimizer.zero_grad()
        self.module.zero_grad(set_to_none=True)  # parameters outside the optimizer too
        self.global_steps += 1

    def _report(self):
        """Rank 0's progress line and monitor events for the optimizer step just taken."""
        losses, self._window_losses = self._window_losses, []
        loss = torch.stack(losses).mean() if losses else None
        extra = []
        if self.loss_scaler is not None:
            extra += [f"loss scale {self.loss_scaler.loss_scale:g}",
                      f"skipped {self.skipped_steps}"]
        if self.progress.due(self.global_steps):
            breakdown = self.timers.line()
            extra += [breakdown] if breakdown else []
        self.progress.optimizer_step(self.global_steps, loss, self.get_lr()[0], self._grad_norm,
                                     extra)
        if self.monitor.enabled:
            events = [("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
            if loss is not None:
                events.insert(0, ("Train/Samples/train_loss", float(loss), self.global_samples))
            if self._grad_norm is not None:
                events.append(("Train/Samples/grad_norm", float(self._grad_norm),
                               self.global_samples))
            if self.loss_scaler is not None:
                events.append(("Train/Samples/loss_scale", self.loss_scaler.loss_scale,
                               self.global_samples))
            self.monitor.write_events(events)

    # -- DeepSpeed's accessors -----------------------------------------------------------------

    def train_batch_size(self) -> int:
        return self.config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.batch.micro_batch_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.batch.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def zero_grad(self):
        self._check_alive()
        self.optimizer.zero_grad()

    def get_lr(self):
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        return None if self._grad_norm is None else float(self._grad_norm)

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True):
        from .checkpoint import save_checkpoint
        return save_checkpoint(self, save_dir, tag, client_state, save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False):
        from .checkpoint import load_checkpoint
        return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only)

    def fp16_enabled(self) -> bool:
        return self.loss_scaler is not None

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16

    def train(self, mode: bool = True):
        self._check_alive()
        self.module.train(mode)
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    # -- teardown ------------------------------------------------------------------------------

    def destroy(self):
        """Release what the engine holds: the units' hooks and full/gradient buffers, the
        optimizer state, the monitors, the process group reference. Any later call is a clear
        error. The module keeps its (sharded) parameters."""
        if self._destroyed:
            return
        release_units(self.module)
        if isinstance(getattr(self.optimizer, "state", None), dict):  # torch optimizers
            self.optimizer.state.clear()
        self.monitor.close()
        self._window_losses = []
        self.process_group = None
        self._destroyed = True

    def _check_alive(self):
        if self._destroyed:
            raise RuntimeError("this VeScaleEngine was destroyed (engine.destroy()); build a new "
                               "one with initialize()")


def release_units(module: nn.Module) -> None:
    """Undo fully_shard's runtime on every unit under `module`: reshard, free gradient and full
    buffers, and remove the forward hooks, so nothing of the engine runs or stays allocated."""
    for sub in module.modules():
        unit = fsdp.unit_of(sub)
        if unit is None:
            continue
        unit.reshard()
        for buf in unit.buffers:
            buf.release_grad()
            buf.full_grad.untyped_storage().resize_(0)
            buf.full_grad_live = False
        for p in unit.params:
            p.sharded.grad = None
        for hooks, fn in ((sub._forward_pre_hooks, unit.pre_forward),
                          (sub._forward_hooks, unit.post_forward)):
            for handle_id, hook in list(hooks.items()):
                if hook == fn:
                    del hooks[handle_id]
                    sub._forward_pre_hooks_with_kwargs.pop(handle_id, None)
        del sub._vescale_unit


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, config_params=None):
    """DeepSpeed's initialize: returns (engine, optimizer, training_dataloader, lr_scheduler)."""
    if model is None:
        raise ValueError("initialize needs a model")
    if mpu is not None:
        raise ValueError("model parallel units (mpu) are not supported")
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None) or getattr(args, "config", None)
    if source is None:
        raise ValueError("no config: pass config=, config_params= or args.deepspeed_config")
    from config_schemas.validate import read_config
    raw = read_config(source)
    if dist_init_required is not False:
        timeout = raw.get("vescale", {}).get("process_group_timeout_s", DEFAULT_TIMEOUT_S) \
            if isinstance(raw, dict) else DEFAULT_TIMEOUT_S
        _init_distributed(float(timeout) if isinstance(timeout, (int, float)) else
                          DEFAULT_TIMEOUT_S)
    cfg = build_config(raw, dist.get_world_size())  # every config error before wrapping
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    mesh = None
    if cfg.hsdp_replicate_size > 1 or cfg.zero_stage == 0:
        from torch.distributed.device_mesh import init_device_mesh
        replicas = dist.get_world_size() if cfg.zero_stage == 0 else cfg.hsdp_replicate_size
        device = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device, (replicas, dist.get_world_size() // replicas),
                                mesh_dim_names=("replicate", "shard"))
    chosen = None if model_parameters is None else \
        _named_model_parameters(model_parameters, model)  # only these are optimized
    module = _wrap(model, cfg, mesh)
    if chosen is None:
        params = [p for p in module.parameters() if p.requires_grad]
    else:
        params = _resolve_named_parameters(chosen, module)
    opt = _optimizer(cfg.optimizer, optimizer, params)
    sched = _scheduler(cfg.scheduler, lr_scheduler, opt)
    engine = VeScaleEngine(module, cfg, opt, sched)
    loader = None
    if training_data is not None:
        sampler = torch.utils.data.distributed.DistributedSampler(training_data)
        loader = torch.utils.data.DataLoader(training_data, batch_size=cfg.batch.micro_batch_per_gpu,
                                             sampler=sampler, collate_fn=collate_fn)
    return engine, opt, loader, sched

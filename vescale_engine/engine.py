"""`initialize` and `VeScaleEngine`: glue between the config, fully_shard, the optimizer and
the scheduler, with DeepSpeed's signature and step semantics."""
from __future__ import annotations

import atexit
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from . import fsdp
from .clip import clip_grad_norm_, global_grad_norm
from .config import EngineConfig, build_config
from .optim import AdamW
from .progress import Progress

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
    kwargs = dict(mesh=mesh, reshard_after_forward=cfg.reshard_after_forward,
                  granularity={"default": cfg.granularity,
                               "overrides": cfg.granularity_overrides},
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


def _optimizer(spec, client, params):
    if client is not None:
        if isinstance(client, torch.optim.Optimizer):
            raise ValueError("pass the optimizer class or a callable(params), not an instance: "
                             "its parameters are replaced by their shards here")
        return client(params)
    spec = spec or {"type": "AdamW", "params": {}}
    name, kwargs = spec["type"], dict(spec.get("params", {}))
    cls = AdamW if name == "AdamW" else getattr(torch.optim, name)
    return cls(params, **kwargs)


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
    """What DeepSpeed scripts call: engine(...), backward, step, no_sync, counters."""

    def __init__(self, module, config: EngineConfig, optimizer, lr_scheduler):
        super().__init__()
        self.module = module
        self.config = config
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.world_size = dist.get_world_size()
        self.global_rank = dist.get_rank()
        from launcher.env import discover
        self.local_rank = discover().local_rank
        self._grad_norm = None
        self._loss = None
        self._tokens = None
        self.progress = Progress(config.steps_per_print, self.global_rank)

    def forward(self, *args, **kwargs):
        first = args[0] if args else None  # token ids [batch, sequence] give tokens/s
        self._tokens = first.numel() if isinstance(first, torch.Tensor) and \
            not first.is_floating_point() else None
        return self.module(*args, **kwargs)

    def train_batch_size(self) -> int:
        return self.config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.batch.micro_batch_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.batch.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def no_sync(self):
        return fsdp.no_sync(self.module)

    def backward(self, loss: torch.Tensor):
        """Scale by the accumulation steps and backpropagate; only the boundary micro-step
        reduce-scatters (earlier ones accumulate full gradients locally)."""
        self._loss = loss.detach()
        scaled = loss / self.gradient_accumulation_steps()
        if self.is_gradient_accumulation_boundary():
            scaled.backward()
        else:
            with self.no_sync():
                scaled.backward()
        return loss

    def step(self):
        """At the accumulation boundary: clip, optimizer step, scheduler step, zero gradients."""
        if self.is_gradient_accumulation_boundary():
            params = list(self.module.parameters())
            if self.config.gradient_clipping > 0:
                self._grad_norm = clip_grad_norm_(params, self.config.gradient_clipping)
            else:
                self._grad_norm = global_grad_norm(params)
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.optimizer.zero_grad()
            self.global_steps += 1
        self.micro_steps += 1
        self.global_samples += self.train_micro_batch_size_per_gpu() * self.world_size
        self.progress.micro_step(self.train_micro_batch_size_per_gpu() * self.world_size,
                                 self._tokens and self._tokens * self.world_size)
        if self.micro_steps % self.gradient_accumulation_steps() == 0:
            self.progress.optimizer_step(self.global_steps, self._loss, self.get_lr()[0],
                                         self._grad_norm)

    def zero_grad(self):
        self.optimizer.zero_grad()

    def get_lr(self):
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        return None if self._grad_norm is None else float(self._grad_norm)


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
    module = _wrap(model, cfg, mesh)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = _optimizer(cfg.optimizer, optimizer, params)
    sched = _scheduler(cfg.scheduler, lr_scheduler, opt)
    engine = VeScaleEngine(module, cfg, opt, sched)
    loader = None
    if training_data is not None:
        sampler = torch.utils.data.distributed.DistributedSampler(training_data)
        loader = torch.utils.data.DataLoader(training_data, batch_size=cfg.batch.micro_batch_per_gpu,
                                             sampler=sampler, collate_fn=collate_fn)
    return engine, opt, loader, sched

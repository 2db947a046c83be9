"""`initialize` and `VeScaleEngine`: glue between the config, fully_shard, the optimizer and
the scheduler, with DeepSpeed's signature and step semantics."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten

from ..checkpoint.background import BackgroundSaves
from ..checkpoint.hf import load_hf_checkpoint, save_hf_checkpoint
from ..checkpoint.sharded import load_checkpoint, save_checkpoint
from ..fsdp.api import no_sync, reduce_kept_gradients, release
from ..fsdp.guards import require_materialized
from ..fsdp.lookup import units_under
from ..launch.env import discover
from ..launch.process_group import join_process_group
from ..optim.clip import clip_grad_norm_, global_grad_norm
from ..optim.offload import check_offloadable
from . import loss_scaler as scaling
from .. import _connect
from . import extensions
from .colocation import Colocation
from .compile import CompileReport, compile_units, refused_compile_keys
from .config import EngineConfig, build_config
from .from_config import (build_optimizer, build_scheduler, check_client_scheduler,
                          client_optimizer_groups, named_model_parameters, optimizer_spec,
                          rebuild_for_offload, rebuild_optimizer,
                          resolve_named_parameters)
from .monitor import Monitors, PendingScalars
from .parallel_plan import apply_parallel_plan, build_meshes, check_plan, require_same_batch
from .preemption import SignalSave
from .progress import Progress
from .rank_agreement import config_facts, require_same_config
from .sequence_parallel import sequence_parallel_size
from .surface import DeepSpeedSurface
from .timers import WallClockBreakdown
from .training_state import EngineTrainingState
from .weights import place_model, prepare_weights, take_rank0_values
from .wrap import ExpertUnits, refuse_with_experts, wrap_model
from ..logs import install as install_logging, quiet_deepspeed_start
from ..versions import check_versions

__all__ = ["VeScaleEngine", "initialize"]

LOG = logging.getLogger("vescale_engine")

DEFAULT_TIMEOUT_S = 600


class VeScaleEngine(DeepSpeedSurface, nn.Module):
    """What DeepSpeed scripts call: engine(...), backward (or plain loss.backward()), step,
    no_sync, train/eval, destroy, counters. What Hugging Face Trainer and Accelerate call
    besides (the accumulation boundary they set, 16-bit state dicts, attribute forwarding to
    the model) comes from DeepSpeedSurface (surface.py)."""

    def __init__(self, module, config: EngineConfig, optimizer, lr_scheduler,
                 device: torch.device, meshes=None, mpu=None):
        super().__init__()
        self.device = device  # this rank's device: batches go here (batch.to(engine.device))
        self.module = module
        self.engine_config = config  # typed; `config` is the dict, as DeepSpeed's engine.config
        self.config = config.raw
        self.optimizer = optimizer
        self.optimizer.overflow = False  # DeepSpeed's flag, read by Accelerate's wrapper
        self.lr_scheduler = lr_scheduler
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._init_ranks(config.parallel, meshes, mpu)
        self.local_rank = discover().local_rank
        self.loss_scaler = scaling.from_config(config.precision.fp16)  # None unless fp16
        self.timers = WallClockBreakdown(config.reporting.wall_clock_breakdown)
        self.monitor = Monitors(config.raw, self.global_rank)
        self._monitor_events = PendingScalars(self.monitor)  # written once on the host
        self.progress = Progress(config.reporting.steps_per_print, self.global_rank, device)
        self._init_step_state()
        self.checkpoint_stall_s = None  # the last save_checkpoint's time in the caller
        self._compile_report = None  # set by compile()
        self._colocation = Colocation(module, optimizer, device)  # offload_states' record
        self._colocation.expose_on(optimizer, self.offload_states, self.reload_states)
        # checkpoint.writer.decoupled: saves written by a thread (a collective: its group)
        self._saves = BackgroundSaves() if config.checkpointing.background_saves else None
        # vescale.save_on_signal: the signal handlers, last (destroy() restores the old ones)
        self._signal_save = SignalSave(config.checkpointing.save_on_signal, device) \
            if config.checkpointing.save_on_signal is not None else None

    def sharded_model(self) -> nn.Module:
        """The model (checkpoint/state.py's HoldsModel: checkpoint functions given the engine
        read it)."""
        return self.module

    def _init_ranks(self, sizes, meshes, mpu) -> None:
        """DeepSpeed's rank and group attributes, from the parallel sizes (None without TP,
        EP or SP), the TP/EP meshes and DeepSpeed's Ulysses mpu."""
        self.process_group = dist.group.WORLD
        self.world_size = dist.get_world_size()
        self.global_rank = dist.get_rank()
        # DeepSpeed's names: the data-parallel ranks (world / (autotp_size x sequence-parallel
        # size)) and this one's place; the ranks the parameters are sharded over (every rank)
        self.dp_world_size = sizes.dp if sizes is not None else self.world_size
        self.dp_rank = sizes.dp_rank(self.global_rank) if sizes is not None else self.global_rank
        self.seq_dp_world_size = self.world_size // (sizes.tp if sizes is not None else 1)
        # DeepSpeed's Ulysses sequence parallelism: its mpu and group (sequence_parallel.py)
        self.mpu = mpu
        self.sequence_parallel_size = sizes.sp if sizes is not None else 1
        self.seq_parallel_group = mpu.get_sequence_parallel_group() \
            if self.sequence_parallel_size > 1 else None
        # the ranks whose micro-batches' tokens make one micro-step's: SP ranks hold chunks
        self._token_ranks = self.dp_world_size * self.sequence_parallel_size
        self.meshes = meshes  # parallel_plan.Meshes with tensor/expert parallelism, else None
        # the ranks of a TP group must get the same batch: checked on the first forward
        self._tp_batch_group = meshes.tp.get_group() \
            if meshes is not None and sizes.tp > 1 else None

    def _init_step_state(self) -> None:
        """Where the engine is between forward, backward and step (none of it yet)."""
        self._grad_norm = None
        self._tokens = None
        self._output_loss = None     # the last forward's output, when it is a scalar loss
        self._window_losses = []     # this accumulation window's micro-batch losses
        self._backward_graph = None  # autograd graph task the backward prologue ran for
        self._in_engine_backward = False
        self._user_no_sync = 0
        self._coalescing = False     # inside coalesce_grad_reduction
        self._script_scaled = None   # the loss engine.scale scaled, until its backward starts
        self._backward_script_scaled = False
        self._sync_context = None
        self._destroyed = False
        self._boundary = None  # set_gradient_accumulation_boundary's value, once called
        self._in_step = False  # inside step() (managed_gradient_accumulation false: a boundary)
        self._unmanaged_backwards = 0  # backward passes since the last step(), when unmanaged

    # -- forward and backward ------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        self._check_alive()
        self._colocation.require_on_device("engine forward")
        first = args[0] if args else None  # token ids [batch, sequence] give tokens/s
        self._tokens = first.numel() if isinstance(first, torch.Tensor) and \
            not first.is_floating_point() else None
        if self._tp_batch_group is not None:
            group, self._tp_batch_group = self._tp_batch_group, None
            require_same_batch(args, kwargs, group, self.device)
        if torch.is_grad_enabled():
            self._choose_gradient_sync()
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
            scaled, self._script_scaled = self._script_scaled, None
            self._backward_script_scaled = scaled is not None
            self._backward_prologue(self._output_loss if scaled is None else scaled)
            Variable._execution_engine.queue_callback(self._backward_epilogue)
        factor = self._gradient_factor()
        return grad if factor == 1.0 else grad * factor

    def _gradient_factor(self) -> float:
        """1/accumulation steps, times the fp16 loss scale unless engine.scale applied it."""
        scale = self.loss_scaler.loss_scale \
            if self.loss_scaler is not None and not self._backward_script_scaled else 1.0
        return scale / self.gradient_accumulation_steps()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's scale, for a script's own backward (`engine.scale(loss).backward()`):
        the loss times the fp16 loss scale (the loss itself without fp16). That backward then
        divides by the accumulation steps, as engine.backward and a plain loss.backward() do."""
        self._check_alive()
        # AssertionError, DeepSpeed's type, raised even under python -O
        if self.optimizer is None:
            raise AssertionError("must provide optimizer during init in order to use scale")
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.grad_fn is not None):
            raise AssertionError("loss must be a scalar tensor with grad_fn. For non-scalar "
                                 "tensors, use tensor.backward(grad)")
        self._script_scaled = loss.detach()
        if self.loss_scaler is None:
            return loss
        return loss.float() * self.loss_scaler.loss_scale  # in fp32, as engine.backward

    def _choose_gradient_sync(self):
        """Every micro-step reduce-scatters into the sharded gradient (ZeRO-3's memory: no
        full-size gradient is held between micro-steps), except inside engine.no_sync and,
        with vescale.local_grad_accumulation, the micro-steps before the boundary: those
        accumulate full gradients locally. Decided at forward, before any unit starts its
        backward (a plain loss.backward() reaches the engine's output hook only after the root
        unit's), and again at backward for an engine.no_sync entered between."""
        local = self._user_no_sync or (self.engine_config.local_grad_accumulation and
                                       not self.is_gradient_accumulation_boundary())
        if local and self._sync_context is None:
            self._sync_context = no_sync(self.module)
            self._sync_context.__enter__()
        elif not local and self._sync_context is not None:
            self._sync_context.__exit__(None, None, None)
            self._sync_context = None

    def _backward_prologue(self, loss):
        """Once per backward: note the loss and the micro-batch, and settle which micro-steps
        communicate."""
        self._check_alive()
        if loss is not None:
            self._window_losses.append(loss.float())
        if not self.managed_gradient_accumulation():
            self._unmanaged_backwards += 1
        # Counted per backward, not per step(): Accelerate calls step() once per window.
        self.progress.micro_step(self.train_micro_batch_size_per_gpu() * self.dp_world_size,
                                 self._tokens and self._tokens * self._token_ranks)
        self.timers.start("backward")
        self._choose_gradient_sync()

    def _backward_epilogue(self):
        if self._sync_context is not None:
            self._sync_context.__exit__(None, None, None)
            self._sync_context = None
        self.timers.stop("backward")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """DeepSpeed's backward: divide by the accumulation steps (and multiply by the fp16 loss
        scale), then backpropagate. Returns the loss divided by the accumulation steps."""
        self._check_alive()
        self._colocation.require_on_device("engine.backward")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError("engine.backward needs a scalar loss tensor")
        gas = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        scale = self.loss_scaler.loss_scale if self.loss_scaler is not None else 1.0
        self._script_scaled = None  # engine.backward(engine.scale(loss)): twice, as DeepSpeed
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
        if self._coalescing:  # DeepSpeed's AssertionError, raised even under python -O
            raise AssertionError("no_sync cannot be entered inside coalesce_grad_reduction (it "
                                 "already is one)")
        self._user_no_sync += 1
        try:
            yield
        finally:
            self._user_no_sync -= 1

    @contextlib.contextmanager
    def coalesce_grad_reduction(self):
        """DeepSpeed's coalesce_grad_reduction: the backward passes inside keep their full
        gradients locally (as no_sync), and the exit reduce-scatters them once into the gradient
        shards, on every rank, before the step that follows. engine.step() inside, and nesting
        with no_sync, are errors, as in DeepSpeed. A block left by an exception reduces
        nothing: what its backward passes kept is reduced with the next backward that syncs."""
        self._check_alive()
        if not self.managed_gradient_accumulation():  # (DeepSpeed's AssertionError)
            raise AssertionError(
                "coalesce_grad_reduction is not supported with managed_gradient_accumulation="
                "False; the caller already owns the accumulation boundary via step()")
        if self._user_no_sync or self._coalescing:  # (DeepSpeed's AssertionError)
            raise AssertionError(
                "coalesce_grad_reduction cannot be nested inside another no_sync context")
        self._coalescing = True
        self._user_no_sync += 1
        try:
            yield
        finally:
            self._user_no_sync -= 1
            self._coalescing = False
        reduce_kept_gradients(self.module)

    # -- the optimizer step --------------------------------------------------------------------

    def step(self, lr_kwargs=None):
        """At the accumulation boundary: (fp16: overflow check and unscale), clip, optimizer
        step, scheduler step, zero gradients. A step whose gradients overflowed is skipped on
        every rank but still counts in global_steps, as in DeepSpeed. Counters as DeepSpeed's:
        micro_steps counts step() calls, global_samples a train batch per optimizer step.
        With vescale.save_on_signal, an optimizer step after the signal saves a checkpoint and
        raises Preempted (preemption.py)."""
        self._check_alive()
        if self._user_no_sync:  # (DeepSpeed's AssertionError)
            raise AssertionError("It is illegal to call Engine.step() inside no_sync context "
                                 "manager")
        self._colocation.require_on_device("engine.step")
        if self._saves is not None:  # a background save's end (or failure), on every rank
            self._saves.poll(self.device)
        self._in_step = True
        try:
            boundary = self.is_gradient_accumulation_boundary()
            if boundary:
                if self._signal_save is not None:
                    self._signal_save.vote()  # before the norm: read below, once queued
                self.timers.start("optimizer")
                with record_function("vescale::optimizer_step"):
                    self._take_model_step(lr_kwargs)
                self.timers.stop("optimizer")
                self.timers.optimizer_step_done()
                self.global_samples += self._samples_this_step()
        finally:
            self._in_step = False
        self.micro_steps += 1
        if boundary:
            self._report()
            if self._compile_report is not None:
                self._compile_report.after_step(self.global_rank)
            if self._signal_save is not None:  # every rank the same: save, raise Preempted
                self._signal_save.save_if_agreed(self)

    def _take_model_step(self, lr_kwargs):
        # Norm, clipping and overflow over what the optimizer steps (model_parameters may be
        # a subset), as DeepSpeed's ZeRO does.
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        clip = self.engine_config.gradient_clipping
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
        self.optimizer.overflow = overflow
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
        if self.monitor.enabled:  # device values: no host sync per step on the GPU
            events = [("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
            if loss is not None:
                events.insert(0, ("Train/Samples/train_loss", loss, self.global_samples))
            if self._grad_norm is not None:
                events.append(("Train/Samples/grad_norm", self._grad_norm, self.global_samples))
            if self.loss_scaler is not None:
                events.append(("Train/Samples/loss_scale", self.loss_scaler.loss_scale,
                               self.global_samples))
            self._monitor_events.add(events)
            self._monitor_events.write_ready(wait=self.progress.due(self.global_steps))

    # -- DeepSpeed's accessors -----------------------------------------------------------------

    def train_batch_size(self) -> int:
        return self.engine_config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine_config.batch.micro_batch_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.engine_config.batch.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """The boundary set_gradient_accumulation_boundary gave last, once it was called;
        otherwise every gradient_accumulation_steps-th step() call (with
        managed_gradient_accumulation false: every step() call, true only inside it)."""
        if self._boundary is not None:
            return self._boundary
        if not self.managed_gradient_accumulation():
            return self._in_step
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def managed_gradient_accumulation(self) -> bool:
        return self.engine_config.managed_gradient_accumulation

    def _samples_this_step(self) -> int:
        """A train batch per optimizer step; unmanaged, the micro-batches backpropagated
        since the last step (DeepSpeed's count)."""
        if self.managed_gradient_accumulation():
            return self.train_batch_size()
        backwards, self._unmanaged_backwards = self._unmanaged_backwards, 0
        return self.train_batch_size() // self.gradient_accumulation_steps() * backwards

    def zero_grad(self):
        self._check_alive()
        self._colocation.require_on_device("engine.zero_grad")
        self.optimizer.zero_grad()

    def get_lr(self):
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_sequence_parallel_group(self):
        """DeepSpeed's: the sequence-parallel group of this rank (None without one)."""
        return self.seq_parallel_group

    def get_global_grad_norm(self):
        return None if self._grad_norm is None else float(self._grad_norm)

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,
                        exclude_frozen_parameters=False):
        """DeepSpeed's save_checkpoint; exclude_frozen_parameters leaves out the parameters
        with requires_grad=False (loading such a checkpoint keeps the model's own values)."""
        self._colocation.require_on_device("engine.save_checkpoint")
        refuse_with_experts(self.module, "engine.save_checkpoint")  # TP/EP pieces: mapped
        started = time.perf_counter()
        path = save_checkpoint(EngineTrainingState(self), save_dir, tag, client_state,
                               save_latest, exclude_frozen_parameters, background=self._saves)
        self.checkpoint_stall_s = time.perf_counter() - started  # what the caller waited
        return path

    def wait_for_checkpoint(self):
        """Until a background save (checkpoint.writer.decoupled) is written and published on
        every rank; its failure raised on every rank. Collective when one is in flight."""
        if self._saves is not None:
            self._saves.wait(self.device)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False):
        self._colocation.require_on_device("engine.load_checkpoint")
        refuse_with_experts(self.module, "engine.load_checkpoint")  # TP/EP pieces: mapped
        self.wait_for_checkpoint()  # the save in flight may be the one asked for
        return load_checkpoint(EngineTrainingState(self, load_lr_scheduler_states), load_dir, tag,
                               load_module_strict, load_optimizer_states, load_module_only,
                               self.engine_config.checkpointing.import_timeout_s)

    def load_hf_checkpoint(self, path, *, strict=True, key_map=None):
        """Hugging Face safetensors weights into the shards (checkpoint.hf.load_hf_checkpoint)."""
        self._colocation.require_on_device("engine.load_hf_checkpoint")
        refuse_with_experts(self.module, "engine.load_hf_checkpoint")  # TP/EP pieces: mapped
        return load_hf_checkpoint(self, path, strict=strict, key_map=key_map)

    def save_hf_checkpoint(self, path, dtype="bf16", max_shard_size="5GB", background=False):
        """The model as a Hugging Face checkpoint (checkpoint.hf.save_hf_checkpoint). With
        `background=True` rank 0 holds the gathered model in host memory and a thread writes
        it, as background saves do (wait_for_checkpoint; a failure raised at a later step)."""
        self._colocation.require_on_device("engine.save_hf_checkpoint")
        self.require_global_layout("engine.save_hf_checkpoint")
        if background and self._saves is None:  # every rank is here: the group can be made
            self._saves = BackgroundSaves()
        return save_hf_checkpoint(self, path, dtype=dtype, max_shard_size=max_shard_size,
                                  writer=self._saves if background else None)

    def require_global_layout(self, what: str) -> None:
        """Saved Hugging Face files and full state dicts hold global shapes: TP/EP pieces are
        gathered into them (fsdp/state_dict.gather_to_rank0); DeepSpeed MoE experts are refused
        everywhere (refuse_with_experts)."""
        refuse_with_experts(self.module, what)

    # -- compile (compile.py) ------------------------------------------------------------------

    def compile(self, backend="inductor", compile_kwargs=None, schedule=None,
                compiled_autograd_enabled=False) -> None:
        """DeepSpeed's engine.compile: torch.compile with `backend` and `compile_kwargs` on
        each innermost FSDP unit's forward (compile.py), the units' hooks left eager. What
        DeepSpeed's DeepCompile would do instead (`schedule`, compiled autograd) is refused in
        one line; the config's DeepCompile keys are named in one warning."""
        self._check_alive()
        if schedule is not None:
            raise ValueError("engine.compile(schedule=...): a DeepCompile schedule; this engine "
                             "compiles each unit with torch.compile and takes no schedule")
        if compiled_autograd_enabled:
            raise ValueError("engine.compile(compiled_autograd_enabled=True): compiled autograd "
                             "would trace the units' backward hooks (collectives); not supported")
        if self._compile_report is not None:
            return  # compiled already, as DeepSpeed's second call does nothing
        kwargs = dict(compile_kwargs or {})
        if "backend" in kwargs:
            if self.global_rank == 0:
                LOG.warning("engine.compile: the backend in compile_kwargs is overridden by "
                            "backend=%r (as DeepSpeed does)", backend)
            kwargs.pop("backend")
        refused = refused_compile_keys(self.config.get("compile"))
        if refused and self.global_rank == 0:
            LOG.warning("engine.compile: %s ask for DeepSpeed's DeepCompile passes, which this "
                        "engine does not run; each unit is compiled with torch.compile instead",
                        ", ".join(refused))
        names = compile_units(self.module, backend, kwargs)
        self._compile_report = CompileReport()
        if self.global_rank == 0:
            LOG.info("engine.compile: %d unit(s) compiled with backend %r (%s)", len(names),
                     backend, ", ".join(names[:4]) + (", ..." if len(names) > 4 else ""))

    @property
    def is_compiled(self) -> bool:
        return self._compile_report is not None

    # -- RL colocation (colocation.py) ---------------------------------------------------------

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """DeepSpeed's offload_states: move `include` (OffloadStateTypeEnum members or their
        names; None: all) off the device into host memory, pinned when asked, until
        reload_states(). Between steps only; see engine/colocation.py for what each name moves."""
        self._check_alive()
        self._colocation.offload(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """DeepSpeed's reload_states: everything offload_states moved, back where it was."""
        self._check_alive()
        self._colocation.reload(non_blocking)

    def empty_partition_cache(self) -> None:
        """DeepSpeed's: release the parameters ZeRO-3 keeps gathered between steps (its
        persistence threshold and prefetch cache). This engine keeps none: every unit is
        resharded by the end of its backward, or of an inference forward, so there is nothing
        to release (a unit still gathered then is waiting for a pending backward, or is inside
        GatheredParameters, and must stay). OpenRLHF calls it after offload_states."""
        self._check_alive()

    def fp16_enabled(self) -> bool:
        return self.loss_scaler is not None

    def bfloat16_enabled(self) -> bool:
        return self.engine_config.precision.bf16

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
        pending = None
        try:  # a background save finishes first (its failure raised once the rest is done)
            self.wait_for_checkpoint()
        except Exception as err:
            pending = err
        if self._signal_save is not None:
            self._signal_save.close()
        self._colocation.release()
        release(self.module)
        if isinstance(getattr(self.optimizer, "state", None), dict):  # torch optimizers
            self.optimizer.state.clear()
        if getattr(self.optimizer, "offload", None) is not None:  # its host memory
            self.optimizer.offload.release()
        self._monitor_events.write_ready(wait=True)
        self.monitor.close()
        self._window_losses = []
        self.process_group = None
        self._destroyed = True
        if pending is not None:
            raise pending

    def _check_alive(self):
        if self._destroyed:
            raise RuntimeError("this VeScaleEngine was destroyed (engine.destroy()); build a new "
                               "one with initialize()")


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, config_params=None):
    """DeepSpeed's initialize: returns (engine, optimizer, training_dataloader, lr_scheduler)."""
    with quiet_deepspeed_start():  # DeepSpeed's start-up warnings that mean nothing here
        return _initialize(args, model, optimizer, model_parameters, training_data,
                           lr_scheduler, mpu, dist_init_required, collate_fn, config,
                           config_params)


def _initialize(args, model, optimizer, model_parameters, training_data, lr_scheduler, mpu,
                dist_init_required, collate_fn, config, config_params):
    """The pipeline: join -> config -> agree -> meshes -> parallelize -> shard -> weights ->
    optimizer -> loader, each stage a function below with what it returns."""
    install_logging()  # progress and checkpoint lines print without logging setup (logs.py)
    _connect()  # what other libraries add to the engine (integrations/, extensions.py)
    check_versions()  # the libraries imported by now, each once (versions.py)
    if model is None:
        raise ValueError("initialize needs a model")
    raw, device = _join(_config_source(args, config, config_params), dist_init_required)
    cfg, plan = _agreed_config(raw, model, optimizer, mpu, device)
    _check_inputs(model, optimizer, lr_scheduler, cfg)
    # Parameters by name, before wrapping replaces them: the client optimizer's groups (as
    # DeepSpeed, model_parameters is then unused), else model_parameters (only these are
    # optimized), else every trainable parameter.
    instance = isinstance(optimizer, torch.optim.Optimizer)
    chosen = client_optimizer_groups(optimizer, model) if instance else \
        None if model_parameters is None else named_model_parameters(model_parameters, model)
    model = place_model(model, device)  # before wrapping: the DBuffers are made where it is
    on_meta = any(p.is_meta for p in model.parameters())
    take_rank0_values(model)  # before any sharding or tensor-parallel split
    placed = _parallelize(model, cfg, plan, device)
    module = wrap_model(model, cfg, placed.mesh, placed.experts)
    _weights(module, cfg, device, on_meta)
    params = [p for p in module.parameters() if p.requires_grad] if chosen is None else \
        resolve_named_parameters(chosen, module)
    opt, sched = _optimizer(cfg, optimizer, lr_scheduler, params)
    engine = VeScaleEngine(module, cfg, opt, sched, device, placed.meshes, mpu)
    for extension in extensions.registered("engine_built"):  # DeepSpeed's safe_* accessors
        extension.engine_built(engine)
    return engine, opt, _loader(engine, training_data, mpu, collate_fn), sched


def _config_source(args, config, config_params):
    """Where the config comes from: config=, config_params=, else args.deepspeed_config."""
    source = config if config is not None else config_params
    if source is None and args is not None:
        source = getattr(args, "deepspeed_config", None) or getattr(args, "config", None)
    if source is None:
        raise ValueError("no config: pass config=, config_params= or args.deepspeed_config")
    return source


def _join(source, dist_init_required) -> tuple:
    """(the raw config, this rank's device): the process group joined with the timeouts the
    config's vescale section asks for (checked with the rest once every rank is in)."""
    from config_schemas.validate import read_config
    raw = read_config(source)
    section = raw.get("vescale", {}) if isinstance(raw, dict) else {}
    section = section if isinstance(section, dict) else {}
    timeout = section.get("process_group_timeout_s", DEFAULT_TIMEOUT_S)
    meet = section.get("rendezvous_timeout_s")  # validated with the rest by build_config
    device = join_process_group(
        float(timeout) if isinstance(timeout, (int, float)) else DEFAULT_TIMEOUT_S,
        create=dist_init_required is not False,
        rendezvous_timeout_s=float(meet) if isinstance(meet, (int, float)) and meet > 0 else None)
    return raw, device


def _agreed_config(raw, model, optimizer, mpu, device) -> tuple:
    """(EngineConfig, the TP/EP plan or None), the same on every rank: every config error is
    found before wrapping, and the first collective makes every rank stop on any rank's."""
    error = plan = cfg = None
    try:
        sp = sequence_parallel_size(mpu)  # DeepSpeed's Ulysses groups, or 1
        cfg = build_config(raw, dist.get_world_size(), sp)
        if cfg.parallel.enabled:  # the model's side of it, still before any collective
            _require_parallel_optimizer(optimizer)
            plan = check_plan(model, cfg.parallel, cfg.tensor_parallel_plan)
    except Exception as err:  # the other ranks must hear of it, not wait in a collective
        error = err
    require_same_config(None if error else config_facts(cfg.canonical),
                        None if error is None else
                        (str(error).splitlines() or [type(error).__name__])[0], device)
    if error is not None:
        raise error
    return cfg, plan


def _check_inputs(model, optimizer, lr_scheduler, cfg) -> None:
    """The model, optimizer and scheduler the caller passed, refused before anything changes."""
    for extension in extensions.registered("check_model"):  # DeepSpeed's partitioned models
        extension.check_model(model)
    if units_under(model):  # DeepSpeed builds a second engine over its partitioned model
        raise ValueError(
            "initialize: the model is sharded already (by an earlier initialize or fully_shard): "
            "a second engine over it is not supported; keep using the first engine, or build "
            "the model again for a fresh one")
    if optimizer is None:
        optimizer_spec(cfg.optimizer)
    check_client_scheduler(lr_scheduler, optimizer)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the model's parameters go: the data-parallel mesh its units shard over, the
    TP/EP meshes (None without TP/EP) and the expert units."""
    mesh: object
    meshes: object = None
    experts: ExpertUnits | None = None


def _parallelize(model, cfg, plan, device) -> Placement:
    """The meshes of cfg.parallel; TP/EP (DTensors on their meshes); the mesh the units shard
    the pieces over."""
    meshes = build_meshes(cfg.parallel, device.type)
    if plan is None:
        return Placement(meshes.dense_dp())
    apply_parallel_plan(model, plan, meshes)
    experts = None
    if plan.expert_modules:
        experts = ExpertUnits(tuple(model.get_submodule(n) for n in plan.expert_modules),
                              meshes.expert_dp(), float(cfg.parallel.dp))
    return Placement(meshes.dense_dp(), meshes, experts)


def _weights(module, cfg, device, on_meta) -> None:
    """The weights the optimizer will hold, then the config's seed."""
    if on_meta or cfg.checkpointing.hf_checkpoint:  # for random init, init draws from the
        # generator as the
        # caller left it (or, for a model built inside a vescale zero.Init, as it was at the
        # build: integrations/deepspeed/zero_init.py)
        prepare_weights(module, cfg, device)
    require_materialized(module, "initialize")
    if cfg.seed is not None:  # after init (wrapping draws nothing): same stream either way
        _seed_everything(cfg.seed)


def _optimizer(cfg, optimizer, lr_scheduler, params) -> tuple:
    """(optimizer, scheduler) over the sharded parameters: the client's instance rebuilt over
    them, or one the config or a class names; offloaded before any state exists."""
    offload = cfg.offload.optimizer
    if offload is None and optimizer is None and cfg.optimizer is None:
        offload = cfg.offload.param_alone  # no optimizer: DeepSpeed's shards are on the host
    if isinstance(optimizer, torch.optim.Optimizer):  # with offload, Trainer's torch AdamW
        # becomes ours (steps on the host)
        opt = rebuild_for_offload(optimizer, params) if offload else \
            rebuild_optimizer(optimizer, params)
    else:
        opt = build_optimizer(cfg.optimizer, optimizer, params)
    if offload:  # before any state exists: it is made on the host
        check_offloadable(opt)
        opt.offload_to_host(**offload)
    sched = build_scheduler(cfg.scheduler, lr_scheduler, opt)
    return opt, sched


def _loader(engine, training_data, mpu, collate_fn):
    """The training loader: one shard of the data per data-parallel rank (the ranks of a TP
    group get the same batches), or DeepSpeed's Ulysses loader; None without data."""
    if training_data is None:
        return None
    micro = engine.engine_config.batch.micro_batch_per_gpu
    if engine.sequence_parallel_size > 1:
        return extensions.the_one("sequence_parallel_loader", "sequence parallelism (an mpu)")(
            training_data, mpu, micro, collate_fn, engine.device)
    sampler = torch.utils.data.distributed.DistributedSampler(
        training_data, num_replicas=engine.dp_world_size, rank=engine.dp_rank)
    return torch.utils.data.DataLoader(training_data, batch_size=micro, sampler=sampler,
                                       collate_fn=collate_fn,
                                       pin_memory=engine.device.type == "cuda")


def _require_parallel_optimizer(optimizer) -> None:
    """With tensor or expert parallelism: a client optimizer that does not compose with it."""
    what = "with tensor_parallel.autotp_size or expert_parallel.autoep_size > 1"
    # An instance is rebuilt over the pieces with its class (from_config.rebuild_optimizer):
    # element-wise ones are exact, torch's Muon refuses 1-D pieces in one line; a third-party
    # 8-bit one would quantize each rank's piece in blocks one process does not have.
    # bitsandbytes' AdamW(optim_bits=8) (Trainer's optim="adamw_bnb_8bit") has no "8bit" in its
    # name: its bits are in `args`
    eight_bit = "8bit" in type(optimizer).__name__.lower() or \
        getattr(getattr(optimizer, "args", None), "optim_bits", None) == 8
    if isinstance(optimizer, torch.optim.Optimizer) and eight_bit:
        raise ValueError(f"a {type(optimizer).__name__} optimizer instance {what}: rebuilt over "
                         "the tensor/expert-parallel pieces it would quantize each rank's piece "
                         "in its own blocks, not the tensor's; use optimizer.type AdamW8bit in "
                         "the config or pass vescale_engine.optim.AdamW8bit (the class)")


def _seed_everything(seed: int):
    """The config's seed for torch, Python's random and numpy (when installed)."""
    import random
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)

"""Import a DeepSpeed ZeRO-1/2/3 checkpoint as a vescale checkpoint (weights and Adam moments).

DeepSpeed's layout (learnt from its checkpoint files; stage in the optimizer files):
  TAG/mp_rank_00_model_states.pt (ZeRO-1/2) or zero_pp_rank_R_mp_rank_00_model_states.pt
      (ZeRO-3): `param_shapes` (one ordered {name: shape} per param group), `shared_params`
      (tied alias -> name), `buffer_names` and `module` (buffers), counters, `lr_scheduler`,
      and the client_state the script saved (every other key).
  TAG/zero_pp_rank_R_mp_rank_00_optim_states.pt, one per data-parallel rank R:
      ZeRO-1/2: the group's parameters are concatenated (each followed by its alignment padding)
        and cut into equal partitions; rank R holds `single_partition_of_fp32_groups[g]` and
        its optimizer state over the same partition in `base_optimizer_state`.
      ZeRO-3: every parameter is cut into equal partitions of ceil(numel / world) elements;
        rank R's `fp32_flat_groups[g]` is its partitions of the group's parameters, one after
        another, and `optimizer_state_dict.state[g]` holds the optimizer state over it.
Files are read with `weights_only=True`; DeepSpeed's few non-tensor classes are mapped to an
inert stand-in, so nothing of DeepSpeed is imported or executed.
"""
from __future__ import annotations

import glob
import itertools
import logging
import math
import os
import re
import shutil
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from . import layout
from .dcp import CheckpointError, CrcWriter
from .entries import fsync_dir, to_json, write_checked_json

__all__ = ["convert_zero", "is_zero_checkpoint", "ensure_vescale_checkpoint",
           "DEFAULT_IMPORT_TIMEOUT_S"]

LOG = logging.getLogger("vescale_engine")

_MODEL_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
_DEEPSPEED_CLASSES = ("deepspeed.runtime.zero.config.ZeroStageEnum",
                      "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                      "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                      "deepspeed.utils.tensor_fragment.fragment_address")


class _Inert:
    """Stands in for a DeepSpeed class in a pickle: keeps its arguments and state, runs nothing."""

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        self.state = state


def _load(path):
    try:
        with torch.serialization.safe_globals([(_Inert, name) for name in _DEEPSPEED_CLASSES]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: name it, one line
        raise CheckpointError(f"{path}: cannot read DeepSpeed checkpoint file "
                                   f"({type(err).__name__}: {str(err).splitlines()[0]})") from None


def is_zero_checkpoint(path) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in _MODEL_FILES)


def _stage(value) -> int:
    if isinstance(value, _Inert):
        value = value.args[0]
    return int(value)


def _rank_files(path):
    files = glob.glob(os.path.join(path, "*zero_pp_rank_*_mp_rank_00_optim_states.pt"))
    rank = lambda f: int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f)).group(1))
    files = sorted(files, key=rank)
    if not files or [rank(f) for f in files] != list(range(len(files))):
        raise CheckpointError(f"{path}: expected zero_pp_rank_0.._N-1 optim_states files, "
                                   f"found {[os.path.basename(f) for f in files]}")
    return files


def read_zero(path):
    """(full fp32 weights, {name: {moment: full tensor, 'step': 0-d}}, model states dict,
    optimizer hyperparameters per param group, ZeRO stage)."""
    model_file = next(os.path.join(path, f) for f in _MODEL_FILES
                      if os.path.isfile(os.path.join(path, f)))
    model = _load(model_file)
    for key in ("param_shapes", "module"):
        if key not in model:
            raise CheckpointError(f"{model_file}: no {key!r} entry; not a ZeRO checkpoint")
    optim = [_load(f)["optimizer_state_dict"] for f in _rank_files(path)]
    world = len(optim)
    stage = _stage(optim[0]["zero_stage"])
    weights, moments, groups = _frozen(path, model, stage, world), {}, []
    for g, shapes in enumerate(model["param_shapes"]):
        if stage == 3:
            flats = [o["fp32_flat_groups"][g] for o in optim]
            states = [o["optimizer_state_dict"]["state"].get(g, {}) for o in optim]
            inner = optim[0]["optimizer_state_dict"]
        elif stage in (1, 2):
            flats = [o["single_partition_of_fp32_groups"][g] for o in optim]
            states = [o["base_optimizer_state"]["state"].get(g, {}) for o in optim]
            inner = optim[0]["base_optimizer_state"]
        else:
            raise CheckpointError(f"{path}: ZeRO stage {stage} has no sharded optimizer "
                                       "state to import")
        groups.append({k: v for k, v in inner["param_groups"][g].items()
                       if k in ("lr", "betas", "eps", "weight_decay", "momentum")})
        names = [k for k, v in states[0].items() if isinstance(v, torch.Tensor) and v.dim() == 1]
        flat_of = {"param": flats, **{n: [s[n] for s in states] for n in names}}
        paddings = (optim[0].get("param_alignment_paddings") or [None] * (g + 1))[g]
        for kind, parts in flat_of.items():
            for name, full in _split(stage, world, shapes, parts, paddings, f"{path} group {g}"):
                if kind == "param":
                    weights[name] = full
                else:
                    moments.setdefault(name, {})[kind] = full
        for name in shapes:
            if "step" in states[0]:
                moments.setdefault(name, {})["step"] = torch.as_tensor(
                    states[0]["step"], dtype=torch.float32).reshape(())
    return weights, moments, model, groups, stage


def _frozen(path, model, stage, world):
    """Parameters with requires_grad=False: not in the optimizer files. ZeRO-1/2 keep them
    whole in the model file; ZeRO-3 keeps each rank's partition in that rank's model file."""
    shapes = model.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    if stage != 3:
        return {name: model["frozen_param_fragments"][name].float().view(tuple(shape)).clone()
                for name, shape in shapes.items()}
    files = [os.path.join(path, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in
             range(world)]
    fragments = [model["frozen_param_fragments"]] + [_load(f)["frozen_param_fragments"]
                                                     for f in files[1:]]
    return {name: torch.cat([f[name].reshape(-1) for f in fragments])[:math.prod(shape)]
            .float().view(tuple(shape)).clone() for name, shape in shapes.items()}


def _split(stage, world, shapes, parts, paddings, where):
    """Yield (name, full tensor) from the ranks' flat partitions of one param group."""
    if stage == 3:
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            each = -(-numel // world)
            if offset + each > parts[0].numel():
                raise CheckpointError(f"{where}: partitions end before {name}")
            full = torch.cat([p[offset:offset + each] for p in parts])[:numel]
            yield name, full.view(tuple(shape)).clone()
            offset += each
        if any(p.numel() - offset > world * 2 for p in parts):  # more than alignment left over
            raise CheckpointError(f"{where}: {parts[0].numel() - offset} elements unused")
        return
    merged = torch.cat(list(parts))
    offset = 0
    for i, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(shape)
        if offset + numel > merged.numel():
            raise CheckpointError(f"{where}: partitions end before {name}")
        yield name, merged[offset:offset + numel].view(tuple(shape)).clone()
        offset += numel + (paddings[i] if paddings else 0)


def convert_zero(ds_dir, out_dir, tag=None) -> str:
    """Write DeepSpeed checkpoint `ds_dir` (a save dir with `latest`, or a tag dir) as a vescale
    checkpoint under `out_dir` (same tag, `latest` updated). One process; returns its path."""
    ds_dir = os.fspath(ds_dir)
    if os.path.exists(ds_dir) and not os.path.isdir(ds_dir):
        raise CheckpointError(f"DeepSpeed checkpoint directory {ds_dir} is a file, not a "
                              "directory")
    if not os.path.isdir(ds_dir):
        raise FileNotFoundError(f"DeepSpeed checkpoint directory {ds_dir} does not exist")
    if is_zero_checkpoint(ds_dir):
        path, tag = ds_dir, tag or os.path.basename(os.path.normpath(ds_dir))
    else:
        latest = os.path.join(ds_dir, "latest")
        if tag is None and not os.path.isfile(latest):
            raise CheckpointError(f"{ds_dir}: no 'latest' file and no model states file; "
                                       "not a DeepSpeed checkpoint")
        if tag is None:
            tag, _ = layout.read_latest(latest)  # DeepSpeed's has no checksum
        path = os.path.join(ds_dir, tag)
        if not is_zero_checkpoint(path):
            raise CheckpointError(f"{path}: no {_MODEL_FILES[0]} or {_MODEL_FILES[1]}; not "
                                       "a DeepSpeed ZeRO checkpoint")
    weights, moments, model, groups, stage = read_zero(path)
    write_converted(weights, moments, model, groups, stage, os.fspath(out_dir), tag)
    return os.path.join(out_dir, tag)


def write_converted(weights, moments, model, groups, stage, out_dir, tag):
    sd = {}
    for name, w in weights.items():
        sd[f"model.{name}"] = w
    for alias, name in (model.get("shared_params") or {}).items():
        sd[f"model.{alias}"] = weights[name]
    for name in model.get("buffer_names") or []:
        sd[f"model.{name}"] = model["module"][name]
    for name, states in moments.items():
        for kind, t in states.items():
            sd[f"optim.state.{name}.{kind}"] = t
    steps = int(model.get("global_steps") or 0)
    accumulation = (model.get("ds_config") or {}).get("gradient_accumulation_steps")
    state = {"format": layout.FORMAT, "tag": tag, "world_size": 1,
             "global_steps": steps,
             "global_samples": int(model.get("global_samples") or 0),
             "micro_steps": steps * (accumulation if isinstance(accumulation, int) else 1),
             "skipped_steps": int(model.get("skipped_steps") or 0),
             "optimizer": {"class": "DeepSpeedZeRO", "param_groups": [
                 {k: to_json(v, k) for k, v in g.items()} for g in groups]},
             "client_state": _client_state(model),
             "model_keys": sorted(k[6:] for k in sd if k.startswith("model.")),
             "imported_from": "deepspeed"}
    if model.get("lr_scheduler") is not None:  # resuming continues the schedule (warmup)
        state["lr_scheduler"] = to_json(model["lr_scheduler"], "lr_scheduler")
    if stage >= 2 and model.get("frozen_param_shapes") is None:
        # Saved with exclude_frozen_parameters (ZeRO-2/3 otherwise record the frozen ones,
        # if only as {}): loading keeps the model's own values for its frozen parameters.
        state["excludes_frozen_parameters"] = True
    os.makedirs(out_dir, exist_ok=True)
    partial = os.path.join(out_dir, f".{tag}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    writer = CrcWriter(partial, sync_files=True)
    dcp.save(sd, storage_writer=writer, no_dist=True)
    state["files"] = writer.records()
    write_checked_json(os.path.join(partial, layout.STATE_FILE), state)
    fsync_dir(partial)
    layout.publish(out_dir, partial, os.path.join(out_dir, tag), tag, save_latest=True)


# What DeepSpeed's model states file holds of its own; the rest is the client_state a script
# passed to save_checkpoint.
_DEEPSPEED_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
                   "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler",
                   "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
                   "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
                   "checkpoint_parallel_dimensions", "universal_checkpoint_info"}


def _client_state(model) -> dict:
    """The script's client_state entries, as plain data; an entry that is not plain data (the
    only kind a vescale checkpoint keeps) is left out and named in a warning."""
    kept, dropped = {}, []
    for key, value in model.items():
        if key in _DEEPSPEED_KEYS:
            continue
        try:
            kept[key] = to_json(value, f"client_state[{key!r}]")
        except CheckpointError:
            dropped.append(str(key))
    if dropped:
        LOG.warning("importing a DeepSpeed checkpoint: client_state entries %s are not plain "
                    "data; left out", ", ".join(dropped))
    return kept


DEFAULT_IMPORT_TIMEOUT_S = 3 * 3600
_IMPORTS = itertools.count()  # every rank numbers its imports alike: load_checkpoint is collective


def ensure_vescale_checkpoint(path, timeout_s: float = DEFAULT_IMPORT_TIMEOUT_S):
    """A DeepSpeed ZeRO tag directory given to load_checkpoint is imported first (rank 0
    converts into `<dir>/.TAG.vescale/`, kept for next time); anything else is returned as is.

    The other ranks wait for rank 0 on the process group's key-value store, not in a
    collective: converting a large checkpoint takes longer than a collective may wait (NCCL's
    watchdog would abort the job). They wait up to `timeout_s` (the config's
    vescale.checkpoint_import_timeout_s); rank 0's error, if any, is raised on every rank."""
    if os.path.exists(os.path.join(path, layout.STATE_FILE)) or not is_zero_checkpoint(path):
        return path
    parent, tag = os.path.split(os.path.normpath(path))
    out = os.path.join(parent, f".{tag}.vescale")
    if not dist.is_initialized():
        problem = _import_once(path, out, tag)
    else:
        store = dist.distributed_c10d._get_default_store()
        key = f"vescale/convert-zero/{next(_IMPORTS)}"
        if dist.get_rank() == 0:
            problem = _import_once(path, out, tag)
            store.set(key, problem or "")
        else:
            try:
                store.wait([key], timedelta(seconds=timeout_s))
            except RuntimeError:  # DistStoreError: rank 0 died or is still converting
                raise CheckpointError(
                    f"{path}: rank 0 did not finish importing this DeepSpeed checkpoint within "
                    f"{timeout_s:g} s (vescale.checkpoint_import_timeout_s); raise it, or "
                    "convert once offline with `vescale convert-zero` and load the result") from None
            problem = store.get(key).decode()
    if problem:
        raise CheckpointError(problem)
    return os.path.join(out, tag)


def _import_once(path, out, tag) -> str | None:
    """Convert unless an earlier import did; the problem as one line, or None."""
    if os.path.exists(os.path.join(out, tag, layout.STATE_FILE)):
        return None
    try:
        convert_zero(path, out, tag)
    except (ValueError, OSError) as err:
        return str(err)
    except Exception as err:  # any failure reaches the waiting ranks, not only rank 0
        first = (str(err).splitlines() or [""])[0]
        return f"{path}: importing the DeepSpeed checkpoint failed ({type(err).__name__}: {first})"
    return None

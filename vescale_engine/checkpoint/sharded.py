"""Checkpoints: sharded save/load in PyTorch Distributed Checkpoint (DCP) format.

Every rank writes only its own pieces. A parameter's piece is a flat range of its row-major
storage (RaggedShard); `box_decomposition` turns that range into rectangular boxes of the real
tensor shape, and each box is one DCP chunk. So the files are ordinary DCP checkpoints with true
global shapes: they load on any world size and granularity (DCP reads the overlap of the saved
boxes with the boxes the loading rank owns), into a plain model (`dcp.load`) and into FSDP2.

Layout of `SAVE_DIR/TAG/`:
  `.metadata`, `__R_0.distcp`   DCP: `model.<fqn>` (every name of a tied parameter, buffers too),
                                `optim.state.<fqn>.<name>` (per-parameter optimizer state, the
                                parameter's shape, or 0-d for scalars like `step`),
                                `rng.rank<R>.<kind>` (each rank's generators)
  `vescale_state.json`          plain data: counters, scheduler, loss scaler, optimizer
                                hyperparameters, client state, and every file's size and CRC32
With `exclude_frozen_parameters` (DeepSpeed's option) the parameters with requires_grad=False are
not saved and `excludes_frozen_parameters` says so: loading keeps the model's own values for them.

Atomicity: everything is written into `SAVE_DIR/.TAG.partial`; once every rank has written and
fsynced, rank 0 renames it to `SAVE_DIR/TAG` and then replaces `latest` by rename. A process
killed before that leaves the previous checkpoint and `latest` untouched.

What is saved is a training state (state.py's TrainingState, handed in by its owner: the
engine's is engine/training_state.py): its module's parameters and buffers, its optimizer's
state and hyperparameters, and its plain values (`state_dict()`, each a top-level key of
`vescale_state.json`, given back to `load_state_dict()` on load). This module never reads or
writes an engine.

Optimizer state interface (how an optimizer plugs in): `optimizer.checkpoint_state(create)`
returns `{parameter: {name: tensor}}` where each tensor is either a 1-D view with exactly the
parameter's local numel (element-wise state: saved with the parameter's global shape, so it
reshards), a 0-d scalar (`step`: saved once) or a RaggedPiece (its own global 1-D shape, e.g.
per-block scales). With `create=True` the optimizer allocates missing state first so that
loading can write into the returned views; an optional `optimizer.checkpoint_state_loaded()`
runs after loading (e.g. to convert from other quantization blocks). An optimizer with
`checkpoint_info()` (plain data on its state's format, kept in vescale_state.json) gets
`checkpoint_state(create, saved_info)`: its own info when saving, the checkpoint's on load.
Every optimizer in vescale_engine.optim implements it; torch's element-wise optimizers (AdamW,
Adam, SGD, ...) need no such method (entries.py adapts them). Modules: state.py (the training
state), piece.py (RaggedPiece), dcp.py (pieces as DCP chunks), entries.py (named entries, plain
data), layout.py (the directory layout and its atomic publication), zero.py (DeepSpeed import).
"""
from __future__ import annotations

import errno
import functools
import logging
import time
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from ..fsdp.param import sharding_of
from ..shard.ragged_dtensor import RaggedDTensor, local_of
from ..shard.ragged_piece import RaggedPiece
from .dcp import (CheckpointError, CheckpointWriteError, CrcWriter, LoadPlanner, SafeReader,
                  SavePlanner, write_error)
from .entries import (crc32, from_json, fsync_dir, optimizer_entries, optimizer_info,
                      optimizer_state, persistent_buffers, piece, read_checked_json, restore_rng,
                      rng_entries, sharded_params, to_json, write_checked_json)
from .layout import (FORMAT, LATEST_FILE, STATE_FILE, bad_tag, partial_dir, publish, read_latest,
                     remove_partials, write_latest)
from .safetensors_format import save_file
from .zero import DEFAULT_IMPORT_TIMEOUT_S, ensure_vescale_checkpoint, is_zero_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate", "CheckpointError",
           "CheckpointWriteError", "STATE_FILE", "LATEST_FILE", "read_metadata", "read_state",
           "torch_state_target"]

LOG = logging.getLogger("vescale_engine")


# ---------------------------------------------------------------------------------------------
# Save.

# The top-level keys of vescale_state.json that are the checkpoint's own; every other key is a
# plain value of the training state (state.py), handed back to its load_state_dict.
OWN_KEYS = frozenset({"format", "tag", "world_size", "optimizer", "client_state",
                      "excludes_frozen_parameters", "model_keys", "files", "imported_from"})


def model_state_dict(module):
    """Everything DCP holds of the model for this rank, plus the names of each parameter."""
    params = sharded_params(module)
    names_of = {id(p): names for p, names in params}
    sd = {}
    for p, names in params:
        entry = piece(p, p.detach().reshape(-1) if sharding_of(p) is None
                      else local_of(p).detach())
        for name in names:
            sd[f"model.{name}"] = entry
    for name, b in persistent_buffers(module):
        sd[f"model.{name}"] = b.detach()
    return sd, params, names_of


def _training_values(training) -> dict:
    """The training state's plain values as JSON, each a top-level key of vescale_state.json."""
    values = training.state_dict()
    clash = sorted(set(values) & OWN_KEYS)
    if clash:
        raise CheckpointError(f"save_checkpoint: the training state's values {clash} have the "
                              "names of the checkpoint's own keys")
    return {k: to_json(v, k) for k, v in values.items()}


def _optimizer_values(optimizer) -> dict:
    """The optimizer's plain values: its class, its hyperparameters (each param group but its
    parameters) and what it records on its state's format (`checkpoint_info`)."""
    values = {"class": type(optimizer).__name__,
              "param_groups": [{k: to_json(v, f"param_groups[{i}][{k!r}]")
                                for k, v in g.items() if k != "params"}
                               for i, g in enumerate(optimizer.param_groups)]}
    info = optimizer_info(optimizer)
    if info is not None:
        values["checkpoint_info"] = to_json(info, "optimizer.checkpoint_info")
    return values


def save_checkpoint(training, save_dir, tag=None, client_state=None, save_latest=True,
                    exclude_frozen_parameters=False, background=None):
    """`training` (a state.TrainingState) saved as SAVE_DIR/TAG, TAG `global_step<step>`
    unless given; the checkpoint's path. With `background` (a background.BackgroundSaves) this
    rank's state is copied into host memory and the call returns; a thread writes the files
    and publishes them with the same guarantees (background.py)."""
    rank = dist.get_rank()
    tag = str(tag) if tag is not None else f"global_step{training.step}"
    if bad_tag(tag):
        raise CheckpointError(f"save_checkpoint: invalid tag {tag!r}: {bad_tag(tag)}")
    if background is not None:
        background.wait()  # the previous save first: its staged copies are reused
    optimizer = training.optimizer
    state = {"format": FORMAT, "tag": tag, "world_size": dist.get_world_size(),
             **_training_values(training),
             "optimizer": _optimizer_values(optimizer),
             "client_state": to_json(dict(client_state or {}), "client_state")}

    sd, params, names_of = model_state_dict(training.module)
    if exclude_frozen_parameters:  # DeepSpeed's option: the frozen parameters are not saved
        for key in _frozen_keys(params):
            del sd[key]
        state["excludes_frozen_parameters"] = True
    sd.update(optimizer_entries(optimizer, names_of, optimizer_state(optimizer, create=False)))
    sd.update(rng_entries(rank))
    state["model_keys"] = sorted(k[6:] for k in sd if k.startswith("model."))

    save_dir = os.fspath(save_dir)
    partial, final = partial_dir(save_dir, tag), os.path.join(save_dir, tag)
    _raise_rank0_problem(_prepare(save_dir, partial) if rank == 0 else None)
    write = functools.partial(_write_checkpoint, state, save_dir, partial, final, tag,
                              save_latest, training.step)
    if background is None:
        return write(sd, None, time.perf_counter())
    background.start(final, write, background.stage(sd))
    return final


def _write_checkpoint(state, save_dir, partial, final, tag, save_latest, step, sd, group,
                      started):
    """Write `sd` into `partial` with DCP, gather every rank's file records and let rank 0
    publish (every collective over `group`: None is the default group); the checkpoint's
    path once it is visible on every rank."""
    rank = dist.get_rank()
    writer = CrcWriter(partial, sync_files=True)  # CRCs taken while writing, no read-back
    planner = SavePlanner()
    try:
        dcp.save(sd, storage_writer=writer, planner=planner, process_group=group)
    except CheckpointException as err:  # every rank gets it, with every rank's failure
        problem = _broadcast_from_rank0(
            _failed_write(err, planner, save_dir, partial) if rank == 0 else None, group)
        if problem is None:
            raise
        raise CheckpointWriteError(*problem) from None
    written = writer.records()
    mine = {f: info for f, info in written.items() if f.startswith(f"__{rank}_")}
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    problem = None
    if rank == 0:
        files = {name: info for part in gathered for name, info in part.items()}
        files[".metadata"] = {k: v for k, v in written[".metadata"].items() if k != "items"}
        state["files"] = files
        problem = _write_and_publish(state, save_dir, partial, final, tag, save_latest)
    _raise_rank0_problem(problem, group)  # nobody returns before the checkpoint is visible
    if rank == 0:
        size = sum(info.get("bytes", 0) for info in state["files"].values()
                   if isinstance(info, dict))
        LOG.info("save_checkpoint: %s (step %d, %.1f MB, %.1f s)", final, step,
                 size / 2**20, time.perf_counter() - started)
    return final


def _broadcast_from_rank0(problem, group=None):
    """Rank 0's (errno, message) or None, on every rank (a collective over `group`)."""
    box = [problem]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _raise_rank0_problem(problem, group=None):
    """Every rank raises rank 0's problem (errno, message), or none does: no rank is left
    waiting in a collective for a rank 0 that failed alone."""
    problem = _broadcast_from_rank0(problem, group)
    if problem is not None:
        raise CheckpointWriteError(*problem)


def _prepare(save_dir, partial):
    """Rank 0, before anyone writes: the save directory exists, what interrupted saves left
    there is gone, the empty `.TAG.partial` is made; the problem as (errno, line), or None."""
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        return errno.ENOTDIR, f"save_checkpoint: {save_dir} is a file, not a directory"
    try:
        os.makedirs(save_dir, exist_ok=True)
        for name in remove_partials(save_dir):
            LOG.info("save_checkpoint: removed %s, left by an interrupted save", name)
        os.makedirs(partial)
    except OSError as err:
        return err.errno, f"save_checkpoint: {write_error(err.filename or save_dir, err)}"
    return None


def _failed_write(err, planner, save_dir, partial):
    """Rank 0, after DCP failed on some rank: the partial checkpoint removed (it may hold the
    space a retry needs) and the first rank's write error as (errno, one line); None when the
    failure was not a write error (then DCP's own report is raised)."""
    shutil.rmtree(partial, ignore_errors=True)
    for rank, (exc, _) in sorted(err.failures.items()):
        if isinstance(exc, OSError):
            line = write_error(exc.filename or partial, exc, planner.planned_bytes(),
                               what="the checkpoint's tensor data", rank=rank)
            return exc.errno, f"save_checkpoint: {line} (nothing was published)"
    return None


def _write_and_publish(state, save_dir, partial, final, tag, save_latest):
    """Rank 0: write vescale_state.json and publish; the problem as (errno, line), or None.
    Until the rename nothing is visible, and a failure removes the partial checkpoint."""
    try:
        write_checked_json(os.path.join(partial, STATE_FILE), state)
        fsync_dir(partial)
        publish(save_dir, partial, final, tag, save_latest=False)
    except OSError as err:
        shutil.rmtree(partial, ignore_errors=True)
        return err.errno, f"save_checkpoint: {_as_line(err)} (nothing was published)"
    if save_latest:
        try:
            write_latest(save_dir, tag)
        except OSError as err:
            return err.errno, (f"save_checkpoint: {final} is complete, but "
                               f"{os.path.join(save_dir, LATEST_FILE)} still names the previous "
                               f"checkpoint: {_as_line(err)}")
    return None


def _as_line(err: OSError) -> str:
    return str(err) if isinstance(err, CheckpointWriteError) else \
        str(write_error(err.filename or "?", err))


def _frozen_keys(params) -> list:
    """The state dict keys of the parameters with requires_grad=False (every name of each)."""
    return [f"model.{name}" for p, names in params if not p.requires_grad for name in names]


# ---------------------------------------------------------------------------------------------
# Load.

def resolve(load_dir, tag=None):
    """The checkpoint directory to load, or None when no tag is given and `load_dir` has no
    `latest` or does not exist (DeepSpeed's "nothing to load": a script's first run). A missing
    directory or tag when a tag is given, files where directories belong and a damaged `latest`
    are errors naming the path."""
    load_dir = os.fspath(load_dir)
    if os.path.exists(load_dir) and not os.path.isdir(load_dir):
        raise CheckpointError(f"checkpoint directory {load_dir} is a file, not a directory")
    if not os.path.isdir(load_dir):
        if tag is None:
            return None
        raise FileNotFoundError(f"checkpoint directory {load_dir} does not exist")
    if os.path.exists(os.path.join(load_dir, STATE_FILE)) and tag is None:
        return load_dir  # given the tag directory itself
    latest, checked = None, True
    if tag is None:
        latest = os.path.join(load_dir, LATEST_FILE)
        if not os.path.exists(latest):
            return None
        if not os.path.isfile(latest):
            raise CheckpointError(f"{latest} is not a file")
        tag, checked = read_latest(latest)
    path = os.path.join(load_dir, str(tag))
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"checkpoint tag {tag!r}: {path} is a file, not a directory")
    if not os.path.isdir(path):
        if latest:
            raise FileNotFoundError(f"{latest} names tag {tag!r}, but {path} does not exist")
        raise FileNotFoundError(f"checkpoint tag {tag!r} not found: {path} does not exist")
    if not checked and not is_zero_checkpoint(path):  # DeepSpeed's `latest` has no checksum
        warnings.warn(f"{latest} has no checksum (written by an older version or by hand): "
                      f"loading tag {tag!r} unchecked", stacklevel=3)
    return path


def _holds_safetensors(load_dir) -> bool:
    return any(name.endswith((".safetensors", ".safetensors.index.json"))
               for name in os.listdir(load_dir))


def read_state(path) -> dict:
    file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(file):
        hint = (" (a DeepSpeed ZeRO checkpoint: convert it with `vescale convert-zero`)"
                if is_zero_checkpoint(path) else "")
        raise CheckpointError(f"{file} is missing: not a vescale checkpoint{hint}")
    state = read_checked_json(file)
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format {state.get('format')!r}, expected {FORMAT!r}")
    return state


def verify_files(path, state, names=None):
    """Sizes of every file, CRC32 of `names` (all when None, each a full read): one line naming
    the bad file."""
    for name, info in sorted(state["files"].items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing")
        size = os.path.getsize(file)
        if size != info["bytes"]:
            raise CheckpointError(f"{file} is truncated or overwritten: {size} bytes, the "
                                  f"checkpoint wrote {info['bytes']}")
        if (names is None or name in names) and crc32(file) != info["crc32"]:
            raise CheckpointError(f"{file} is corrupted: CRC32 mismatch")


def read_metadata(path):
    return SafeReader(path).read_metadata()


def _items_read(metadata, sd):
    """{data file: {(offset, length) of each stored item this rank reads from it}}."""
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
    files = {}
    for fqn, obj in sd.items():
        chunks = obj.chunks() if isinstance(obj, RaggedPiece) else \
            [ChunkStorageMetadata(torch.Size([0] * obj.dim()), obj.shape)]
        for item in create_read_items_for_chunk_list(fqn, metadata.state_dict_metadata[fqn], chunks):
            info = metadata.storage_data[item.storage_index]
            files.setdefault(info.relative_path, set()).add((info.offset, info.length))
    return files


def _plan_verification(path, state, metadata, sd):
    """Check what can be checked before reading, and say what the reader checks as it reads:
    sizes of every file now; CRC32 of each item while it is read where the checkpoint recorded
    the CRC of every item this rank reads from a file ({file: {offset: (length, crc)}},
    returned); the whole file now, an extra read, otherwise (checkpoints from older versions)."""
    per_item, whole = {}, set()
    for name, wanted in _items_read(metadata, sd).items():
        recorded = {int(offset): tuple(item) for offset, item in
                    state["files"].get(name, {}).get("items", {}).items()}
        if all(recorded.get(offset, (None,))[0] == length for offset, length in wanted):
            per_item[name] = recorded
        else:
            whole.add(name)
    verify_files(path, state, names=whole)
    return per_item


def _load(sd, path, per_item, **kwargs):
    """dcp.load through our reader and planner; a CRC mismatch any rank found while reading
    is raised on every rank as its one line (DCP gathers every rank's failure)."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        dcp.load(sd, storage_reader=SafeReader(path, per_item), planner=LoadPlanner(), **kwargs)
    except CheckpointException as err:
        found = next((e for e, _ in err.failures.values() if isinstance(e, CheckpointError)), None)
        if found is None:
            raise
        raise CheckpointError(str(found)) from None


def _short(keys, n=3):
    keys = sorted(keys)
    more = f" and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(repr(k) for k in keys[:n]) + more


def _check_model_keys(path, metadata, sd, strict):
    saved = {k for k in metadata.state_dict_metadata if k.startswith("model.")}
    wanted = {k for k in sd if k.startswith("model.")}
    missing, unexpected = sorted(wanted - saved), sorted(saved - wanted)
    if strict and (missing or unexpected):
        what = []
        if missing:
            what.append(f"missing keys {_short(k[6:] for k in missing)}")
        if unexpected:
            what.append(f"unexpected keys {_short(k[6:] for k in unexpected)}")
        other = " (a checkpoint of another model?)" if 2 * len(wanted & saved) < len(wanted) else ""
        raise CheckpointError(f"checkpoint {path} does not match the model{other}: "
                              + "; ".join(what))
    for key in sorted(wanted & saved):
        _check_shape(path, metadata, key, sd[key])
    for key in missing:
        del sd[key]
    return [k[6:] for k in missing], [k[6:] for k in unexpected]


def _check_shape(path, metadata, key, obj):
    md = metadata.state_dict_metadata[key]
    shape = obj.shape  # a RaggedPiece's is the global shape
    if not hasattr(md, "size"):
        raise CheckpointError(f"checkpoint {path}: {key!r} is not a tensor")
    if tuple(md.size) != tuple(shape):
        raise CheckpointError(f"checkpoint {path}: {key!r} has shape {list(md.size)}, the model's "
                              f"is {list(shape)}")


def torch_state_target(p, group, md) -> torch.Tensor:
    """Where a torch optimizer's saved state entry (DCP tensor metadata `md`) of parameter `p`
    loads: element-wise state on p's device; 0-d state (`step`) on the host, as torch keeps it,
    unless the group is fused or capturable, whose kernels read it on the parameter's device."""
    if len(md.size):
        if isinstance(p, RaggedDTensor):  # state of p's layout, loaded through its local piece
            return torch.zeros_like(p, dtype=md.properties.dtype)
        return torch.zeros(p.numel(), dtype=md.properties.dtype, device=p.device)
    on_device = group.get("fused") or group.get("capturable")
    return torch.zeros((), dtype=md.properties.dtype, device=p.device if on_device else "cpu")


def _optimizer_targets(path, metadata, optimizer, params, names_of, skipped, saved_info):
    """Entries to load the optimizer state into: our interface's views where the optimizer
    defines its state, else state made for the names the checkpoint holds (torch optimizers)."""
    saved = {k for k in metadata.state_dict_metadata if k.startswith("optim.state.")}
    own = hasattr(optimizer, "checkpoint_state")
    if not own:  # torch optimizers: make the state the checkpoint has, then fill it
        by_param = {}
        for p, names in params:
            prefix = f"optim.state.{names[0]}."
            by_param[p] = {k[len(prefix):]: metadata.state_dict_metadata[k]
                           for k in saved if k.startswith(prefix)}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if by_param.get(p):
                    optimizer.state[p] = {name: torch_state_target(p, group, md)
                                          for name, md in by_param[p].items()}
        state = optimizer_state(optimizer, create=False)
    elif not saved:
        return {}
    else:
        state = optimizer_state(optimizer, create=True, saved_info=saved_info)
    entries = optimizer_entries(optimizer, names_of, state)
    for key in set(entries) - saved:  # parameters load_module_strict=False skipped: fresh state
        if any(key.startswith(f"optim.state.{name}.") for name in skipped):
            del entries[key]
    missing = sorted(set(entries) - saved)
    if missing:
        raise CheckpointError(f"checkpoint {path} has no optimizer state {_short(missing)}")
    for key, obj in entries.items():
        if isinstance(obj, RaggedPiece) or obj.dim():
            _check_shape(path, metadata, key, obj)
    return entries


def _load_param_groups(path, optimizer, groups):
    """The saved hyperparameters into the optimizer's param groups (the keys it has)."""
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint {path}: {len(groups)} optimizer param groups, "
                              f"the engine has {len(optimizer.param_groups)}")
    for group, saved in zip(optimizer.param_groups, groups):
        for k, v in from_json(saved).items():
            if k in group:
                group[k] = tuple(v) if isinstance(group[k], tuple) else v


def load_checkpoint(training, load_dir, tag=None, load_module_strict=True,
                    load_optimizer_states=True, load_module_only=False,
                    import_timeout_s=DEFAULT_IMPORT_TIMEOUT_S):
    """The checkpoint `load_dir` (`latest`, or `tag`) into `training` (a state.TrainingState:
    its model; unless `load_module_only`, its optimizer's state and hyperparameters when
    `load_optimizer_states`, its plain values and the RNG states); (path, client state), or
    (None, None) with a warning on every rank when there is nothing to load. A DeepSpeed ZeRO
    tag directory is imported first (other ranks wait up to `import_timeout_s`)."""
    rank = dist.get_rank()
    path = resolve(load_dir, tag)
    if path is None and os.path.isdir(load_dir) and _holds_safetensors(load_dir):
        raise CheckpointError(f"load_checkpoint: {os.fspath(load_dir)} holds a Hugging Face "
                              "safetensors checkpoint, not ours (no `latest`): load it with "
                              "engine.load_hf_checkpoint(path) (vescale_engine.load_hf_checkpoint)")
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, path is not None)  # a directory only some ranks see: stop all
    if len(set(found)) > 1:
        raise CheckpointError(f"load_checkpoint: {os.fspath(load_dir)} has a checkpoint on "
                              f"ranks {[r for r, f in enumerate(found) if f][:8]} but not on "
                              f"{[r for r, f in enumerate(found) if not f][:8]}: every rank must "
                              "see the same directory (a shared file system)")
    if path is None:  # as DeepSpeed: a warning on every rank, nothing loaded
        message = (f"load_checkpoint: {os.path.join(load_dir, LATEST_FILE)} not found, "
                   "nothing to load (pass tag= to load a checkpoint without `latest`)")
        warnings.warn(message, stacklevel=3)
        return None, None
    path = ensure_vescale_checkpoint(path, import_timeout_s)
    state = read_state(path)
    verify_files(path, state, names={".metadata"})
    metadata = read_metadata(path)

    sd, params, names_of = model_state_dict(training.module)
    optimizer = training.optimizer
    if state.get("excludes_frozen_parameters"):  # saved without them: the model keeps its own
        for key in _frozen_keys(params):
            if key not in metadata.state_dict_metadata:
                del sd[key]
    skipped, unexpected = _check_model_keys(path, metadata, sd, load_module_strict)
    if skipped or unexpected:
        message = (f"load_checkpoint {path} (load_module_strict=False): skipped missing "
                   f"{skipped}, ignored unexpected {unexpected}")
        LOG.warning(message)
        warnings.warn(message, stacklevel=3)
    full_load = not load_module_only
    if full_load and load_optimizer_states:
        sd.update(_optimizer_targets(path, metadata, optimizer, params, names_of,
                                     set(skipped),
                                     from_json(state["optimizer"].get("checkpoint_info"))))
    rng = {k: torch.empty(metadata.state_dict_metadata[k].size,  # generator states: host
                          dtype=metadata.state_dict_metadata[k].properties.dtype, device="cpu")
           for k in metadata.state_dict_metadata if k.startswith(f"rng.rank{rank}.")}
    if full_load:
        sd.update(rng)

    problem, per_item = None, {}
    try:
        per_item = _plan_verification(path, state, metadata, sd)
    except CheckpointError as err:
        problem = str(err)
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)  # every rank stops together, naming the file
    if any(problems):
        raise CheckpointError(next(p for p in problems if p))

    _load(sd, path, per_item)
    if hasattr(optimizer, "checkpoint_state_loaded") and full_load and load_optimizer_states:
        optimizer.checkpoint_state_loaded()

    if full_load:
        if load_optimizer_states:
            _load_param_groups(path, optimizer, state["optimizer"]["param_groups"])
        training.load_state_dict({k: from_json(v) for k, v in state.items()
                                  if k not in OWN_KEYS})
        restore_rng(rank, rng)
    if rank == 0:
        LOG.info("load_checkpoint: %s (%s)", path, f"step {training.step}" if full_load
                 else "module only")
    return path, from_json(state["client_state"])


# ---------------------------------------------------------------------------------------------
# Consolidate: one full, unsharded state dict.

def consolidate(ckpt_dir, out=None, dtype=torch.float32) -> dict:
    """The model's full state dict (keys as in `model.state_dict()`), in `dtype` (floating
    tensors only); written to `out` (.pt or .safetensors) when given. One process, no group."""
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory {os.fspath(ckpt_dir)} does not exist")
    path = resolve(ckpt_dir)
    if path is None:
        raise FileNotFoundError(f"{ckpt_dir} has no {LATEST_FILE} file and is not a checkpoint")
    state = read_state(path)
    verify_files(path, state, names={".metadata"})
    metadata = read_metadata(path)
    sd = {k: torch.empty(md.size, dtype=md.properties.dtype, device="cpu")
          for k, md in metadata.state_dict_metadata.items() if k.startswith("model.")}
    _load(sd, path, _plan_verification(path, state, metadata, sd), no_dist=True)
    full = {k[6:]: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    if out is not None:
        _write_state_dict(full, os.fspath(out))
    return full


def _write_state_dict(full, out):
    tmp = f"{out}.tmp"
    if out.endswith(".safetensors"):
        save_file(full, tmp, metadata={"format": "pt"})  # separate tensors, none shared
    elif out.endswith(".pt") or out.endswith(".pth") or out.endswith(".bin"):
        torch.save(full, tmp)
    else:
        raise CheckpointError(f"{out}: the output must end in .pt, .pth, .bin or .safetensors")
    os.replace(tmp, out)


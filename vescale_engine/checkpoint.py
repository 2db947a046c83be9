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

Atomicity: everything is written into `SAVE_DIR/.TAG.partial`; once every rank has written and
fsynced, rank 0 renames it to `SAVE_DIR/TAG` and then replaces `latest` by rename. A process
killed before that leaves the previous checkpoint and `latest` untouched.

Optimizer state interface (how an optimizer plugs in): `optimizer.checkpoint_state(create)`
returns `{parameter: {name: tensor}}` where each tensor is either a 1-D view with exactly the
parameter's local numel (element-wise state: saved with the parameter's global shape, so it
reshards) or a 0-d scalar (`step`: saved once). With `create=True` the optimizer allocates
missing state first so that loading can write into the returned views; an optional
`optimizer.checkpoint_state_loaded()` runs after loading (e.g. to requantize from the views).
Our AdamW and torch's element-wise optimizers (AdamW, Adam, SGD, ...) are handled here.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import warnings
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .ragged import RaggedShard, box_decomposition

__all__ = ["save_checkpoint", "load_checkpoint", "consolidate", "CheckpointError",
           "STATE_FILE", "LATEST_FILE"]

LOG = logging.getLogger("vescale_engine")
FORMAT = "vescale-dcp/1"
STATE_FILE = "vescale_state.json"
LATEST_FILE = "latest"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (or state that cannot be saved); names file or key."""


# ---------------------------------------------------------------------------------------------
# A ragged flat piece as DCP chunks.

class RaggedPiece:
    """This rank's flat range [start, start + numel) of a tensor of `shape`, as the boxes DCP
    reads and writes. Every box of `box_decomposition` covers a contiguous flat range, so each
    box is a view of `local` and loading writes straight into it."""

    def __init__(self, local: torch.Tensor, shape, start: int):
        self.local = local
        self.shape = torch.Size(shape)
        self.boxes = {}  # offsets -> (sizes, flat begin in local)
        at = 0
        for offsets, sizes in box_decomposition(self.shape, start, start + local.numel()):
            self.boxes[torch.Size(offsets)] = (torch.Size(sizes), at)
            at += math.prod(sizes)

    def chunks(self):
        return [ChunkStorageMetadata(offsets=o, sizes=s) for o, (s, _) in self.boxes.items()]

    def write_items(self, fqn):
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(o, s),
                                                      properties=props, size=self.shape))
                for o, (s, _) in self.boxes.items()]

    def box(self, offsets) -> torch.Tensor:
        sizes, at = self.boxes[torch.Size(offsets)]
        return self.local[at:at + math.prod(sizes)].view(sizes)


def _flatten(state_dict):
    for fqn, obj in state_dict.items():
        if isinstance(obj, dict):
            raise TypeError(f"checkpoint state must be flat, {fqn!r} is a dict")
    return state_dict


class _SavePlanner(DefaultSavePlanner):
    """The default planner, plus RaggedPiece values written as their boxes."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [i for i in plan.items if not isinstance(self.state_dict[i.index.fqn], RaggedPiece)]
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, RaggedPiece):
                items += obj.write_items(fqn)
        self.plan = type(plan)(items, planner_data=plan.planner_data, storage_data=plan.storage_data,
                               usable=plan.usable)
        return self.plan

    def lookup_object(self, index):
        obj = self.state_dict[index.fqn]
        return obj.box(index.offset) if isinstance(obj, RaggedPiece) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """The default planner, plus RaggedPiece targets; never unpickles (we save no blobs)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                         allow_partial_load=True)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        # not the default's: its meta-tensor initialisation replaces our pieces by None
        self.state_dict = self.original_state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self):
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, RaggedPiece)}
        saved, self.state_dict = self.state_dict, plain
        plan = super().create_local_plan()
        self.state_dict = saved
        items = list(plan.items)
        for fqn, obj in saved.items():
            if isinstance(obj, RaggedPiece) and obj.boxes:
                items += create_read_items_for_chunk_list(
                    fqn, self.metadata.state_dict_metadata[fqn], obj.chunks())
        return LoadPlan(items)

    def lookup_tensor(self, index):
        obj = self.state_dict[index.fqn]
        return obj.box(index.offset) if isinstance(obj, RaggedPiece) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value):
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; "
                              "vescale checkpoints hold tensors only and never unpickle")


# ---------------------------------------------------------------------------------------------
# What the engine holds, as named pieces.

def _sharded_params(module):
    """[(ShardedParameter or plain parameter, [every fqn it has], RaggedShard-local start)]:
    tied parameters once, with all their names (a plain model's state_dict has them all)."""
    seen, out = {}, []
    for fqn, p in module.named_parameters(remove_duplicate=False):
        key = id(getattr(p, "_vescale", p))
        if key in seen:
            seen[key][1].append(fqn)
            continue
        entry = [p, [fqn]]
        seen[key] = entry
        out.append(entry)
    return out


def _local_start(p) -> int:
    sp = getattr(p, "_vescale", None)
    if sp is None:
        return 0
    buf = sp.buffer
    placement = buf.layout.placements[sp.index]
    start, end = RaggedShard(sp.shape, sp.block, placement.local_units(buf.world_size)).local_range(buf.rank)
    assert end - start == p.numel(), (sp.fqn, start, end, p.numel())
    return start


def _global_shape(p):
    sp = getattr(p, "_vescale", None)
    return tuple(sp.shape) if sp is not None else tuple(p.shape)


def _piece(p, local):
    """A parameter-shaped entry: RaggedPiece over the local range, or the plain tensor."""
    if getattr(p, "_vescale", None) is None:
        return local.view(p.shape) if local.dim() else local
    return RaggedPiece(local, _global_shape(p), _local_start(p))


def _persistent_buffers(module):
    names = set(module.state_dict(keep_vars=True))
    return [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if n in names]


def optimizer_state(optimizer, create: bool) -> dict:
    """{parameter: {name: tensor}}: 1-D local views of element-wise state, 0-d scalars."""
    if hasattr(optimizer, "checkpoint_state"):
        return optimizer.checkpoint_state(create)
    from .optim.adamw import AdamW
    if isinstance(optimizer, AdamW):
        return _vescale_adamw_state(optimizer, create)
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            out[p] = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return out


def _vescale_adamw_state(opt, create):
    """Our AdamW keeps flat state per buffer; each parameter's state is its slice of it."""
    out = {}
    for buf, _group, _decay, _probe in opt._buffers:
        state = opt.state.setdefault(buf.master, {})
        if not state and create:
            state.update(step=torch.zeros((), dtype=torch.float32),
                         exp_avg=torch.zeros_like(buf.master),
                         exp_avg_sq=torch.zeros_like(buf.master))
        if not state:
            continue
        for group in opt.param_groups:
            for p in group["params"]:
                sp = p._vescale
                if sp.buffer is buf:
                    start, end = buf.local_ranges[sp.index]
                    out[p] = {"step": state["step"], "exp_avg": state["exp_avg"][start:end],
                              "exp_avg_sq": state["exp_avg_sq"][start:end]}
    return out


def _optimizer_entries(optimizer, names_of, state):
    entries = {}
    for p, named in state.items():
        for name, t in named.items():
            key = f"optim.state.{names_of[id(p)][0]}.{name}"
            if t.dim() == 0:
                entries[key] = t
            elif t.dim() == 1 and t.numel() == p.numel():
                entries[key] = _piece(p, t)
            else:
                raise CheckpointError(f"optimizer state {key} has shape {list(t.shape)}; the "
                                      f"checkpoint interface takes 0-d or {p.numel()} elements")
    return entries


def _rng_entries(rank):
    import numpy as np
    entries = {f"rng.rank{rank}.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        entries[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state()
    version, mt, gauss = random.getstate()
    entries[f"rng.rank{rank}.python"] = torch.tensor([version, *mt, -1 if gauss is None else 1],
                                                     dtype=torch.int64)
    entries[f"rng.rank{rank}.python_gauss"] = torch.tensor(0.0 if gauss is None else gauss,
                                                           dtype=torch.float64)
    _, keys, pos, has_gauss, cached = np.random.get_state()
    entries[f"rng.rank{rank}.numpy"] = torch.tensor([*keys.astype("int64"), pos, has_gauss],
                                                    dtype=torch.int64)
    entries[f"rng.rank{rank}.numpy_gauss"] = torch.tensor(cached, dtype=torch.float64)
    return entries


def _restore_rng(rank, loaded):
    import numpy as np
    pre = f"rng.rank{rank}."
    if pre + "torch" not in loaded:
        return False
    torch.set_rng_state(loaded[pre + "torch"])
    if pre + "cuda" in loaded and torch.cuda.is_available():
        torch.cuda.set_rng_state(loaded[pre + "cuda"])
    py = loaded[pre + "python"].tolist()
    gauss = loaded[pre + "python_gauss"].item() if py[-1] == 1 else None
    random.setstate((py[0], tuple(py[1:-1]), gauss))
    nps = loaded[pre + "numpy"].tolist()
    np.random.set_state(("MT19937", np.array(nps[:-2], dtype=np.uint32), nps[-2], nps[-1],
                         loaded[pre + "numpy_gauss"].item()))
    return True


# ---------------------------------------------------------------------------------------------
# Plain data: JSON, with tensors as lists (safe to read back).

def _to_json(value, where):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"{where}: key {k!r} is not a string or int")
            out[str(k) if isinstance(k, str) else f"__int__{k}"] = _to_json(v, f"{where}[{k!r}]")
        return out
    raise CheckpointError(f"{where} is a {type(value).__name__}; checkpoints keep plain data "
                          "only (None, bool, int, float, str, list, dict, tensor)")


def _from_json(value):
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        return {(int(k[7:]) if k.startswith("__int__") else k): _from_json(v)
                for k, v in value.items()}
    return value


def _write_json(path, data):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc32(path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


# ---------------------------------------------------------------------------------------------
# Save.

def engine_state_dict(engine, rank):
    """Everything DCP holds for this rank, plus the names of each parameter."""
    params = _sharded_params(engine.module)
    names_of = {id(p): names for p, names in params}
    sd = {}
    for p, names in params:
        piece = _piece(p, p.detach().reshape(-1) if getattr(p, "_vescale", None) is None
                       else p.detach())
        for name in names:
            sd[f"model.{name}"] = piece
    for name, b in _persistent_buffers(engine.module):
        sd[f"model.{name}"] = b.detach()
    return sd, params, names_of


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest=True):
    rank = dist.get_rank()
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST_FILE:
        raise CheckpointError(f"save_checkpoint: invalid tag {tag!r}")
    state = {"format": FORMAT, "tag": tag, "world_size": dist.get_world_size(),
             "global_steps": engine.global_steps, "global_samples": engine.global_samples,
             "micro_steps": engine.micro_steps,
             "optimizer": {"class": type(engine.optimizer).__name__,
                           "param_groups": [{k: _to_json(v, f"param_groups[{i}][{k!r}]")
                                             for k, v in g.items() if k != "params"}
                                            for i, g in enumerate(engine.optimizer.param_groups)]},
             "client_state": _to_json(dict(client_state or {}), "client_state")}
    if engine.lr_scheduler is not None:
        state["lr_scheduler"] = _to_json(engine.lr_scheduler.state_dict(), "lr_scheduler")
    scaler = getattr(engine, "loss_scaler", None)
    if scaler is not None:
        state["loss_scaler"] = _to_json(scaler.state_dict(), "loss_scaler")

    sd, params, names_of = engine_state_dict(engine, rank)
    sd.update(_optimizer_entries(engine.optimizer, names_of,
                                 optimizer_state(engine.optimizer, create=False)))
    sd.update(_rng_entries(rank))
    state["model_keys"] = sorted(k[6:] for k in sd if k.startswith("model."))

    partial = os.path.join(save_dir, f".{tag}.partial")
    final = os.path.join(save_dir, tag)
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a save that was killed before
        os.makedirs(partial)
    dist.barrier()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(partial, sync_files=True),
             planner=_SavePlanner())
    mine = {f: {"bytes": os.path.getsize(os.path.join(partial, f)),
                "crc32": _crc32(os.path.join(partial, f))}
            for f in os.listdir(partial) if f.startswith(f"__{rank}_")}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        files = {name: info for part in gathered for name, info in part.items()}
        meta = os.path.join(partial, ".metadata")
        files[".metadata"] = {"bytes": os.path.getsize(meta), "crc32": _crc32(meta)}
        state["files"] = files
        _write_json(os.path.join(partial, STATE_FILE), state)
        _fsync_dir(partial)
        _publish(save_dir, partial, final, tag, save_latest)
    dist.barrier()  # nobody returns before the checkpoint is visible
    return final


def _publish(save_dir, partial, final, tag, save_latest):
    """Make the finished checkpoint visible, then point `latest` at it: renames only."""
    if os.path.exists(final):  # saving a tag again replaces it
        old = os.path.join(save_dir, f".{tag}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, final)
    _fsync_dir(save_dir)
    if save_latest:
        tmp = os.path.join(save_dir, f".{LATEST_FILE}.tmp")
        with open(tmp, "w") as f:
            f.write(tag)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(save_dir, LATEST_FILE))
        _fsync_dir(save_dir)


# ---------------------------------------------------------------------------------------------
# Load.

def resolve(load_dir, tag=None):
    """The checkpoint directory to load, or None when `load_dir` has no `latest` (DeepSpeed's
    "nothing to load"). Missing directories and tags are errors naming the path."""
    load_dir = os.fspath(load_dir)
    if not os.path.isdir(load_dir):
        raise FileNotFoundError(f"checkpoint directory {load_dir} does not exist")
    if os.path.exists(os.path.join(load_dir, STATE_FILE)) and tag is None:
        return load_dir  # given the tag directory itself
    if tag is None:
        latest = os.path.join(load_dir, LATEST_FILE)
        if not os.path.isfile(latest):
            return None
        with open(latest) as f:
            tag = f.read().strip()
        if not tag:
            raise CheckpointError(f"{latest} is empty")
    path = os.path.join(load_dir, str(tag))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint tag {tag!r} not found: {path} does not exist")
    return path


def read_state(path) -> dict:
    file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(file):
        from .checkpoint_zero import is_zero_checkpoint
        hint = (" (a DeepSpeed ZeRO checkpoint: convert it with `vescale convert-zero`)"
                if is_zero_checkpoint(path) else "")
        raise CheckpointError(f"{file} is missing: not a vescale checkpoint{hint}")
    try:
        with open(file) as f:
            state = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file} is corrupted ({err})") from None
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format {state.get('format')!r}, expected {FORMAT!r}")
    return state


def verify_files(path, state, names=None):
    """Sizes of every file, CRC32 of `names` (all when None): one line naming the bad file."""
    for name, info in sorted(state["files"].items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is missing")
        size = os.path.getsize(file)
        if size != info["bytes"]:
            raise CheckpointError(f"{file} is truncated or overwritten: {size} bytes, the "
                                  f"checkpoint wrote {info['bytes']}")
        if (names is None or name in names) and _crc32(file) != info["crc32"]:
            raise CheckpointError(f"{file} is corrupted: CRC32 mismatch")


def read_metadata(path):
    return dcp.FileSystemReader(path).read_metadata()


def _files_for(metadata, sd):
    """The data files holding any chunk this rank reads."""
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
    files = set()
    for fqn, obj in sd.items():
        chunks = obj.chunks() if isinstance(obj, RaggedPiece) else \
            [ChunkStorageMetadata(torch.Size([0] * obj.dim()), obj.shape)]
        for item in create_read_items_for_chunk_list(fqn, metadata.state_dict_metadata[fqn], chunks):
            files.add(metadata.storage_data[item.storage_index].relative_path)
    return files


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
    shape = obj.shape if isinstance(obj, RaggedPiece) else obj.shape
    if not hasattr(md, "size"):
        raise CheckpointError(f"checkpoint {path}: {key!r} is not a tensor")
    if tuple(md.size) != tuple(shape):
        raise CheckpointError(f"checkpoint {path}: {key!r} has shape {list(md.size)}, the model's "
                              f"is {list(shape)}")


def _optimizer_targets(path, metadata, optimizer, params, names_of, skipped):
    """Entries to load the optimizer state into: our interface's views where the optimizer
    defines its state, else state made for the names the checkpoint holds (torch optimizers)."""
    saved = {k for k in metadata.state_dict_metadata if k.startswith("optim.state.")}
    own = hasattr(optimizer, "checkpoint_state") or type(optimizer).__name__ == "AdamW" and \
        type(optimizer).__module__.startswith("vescale_engine")
    if not own:  # torch optimizers: make the state the checkpoint has, then fill it
        by_param = {}
        for p, names in params:
            prefix = f"optim.state.{names[0]}."
            by_param[p] = {k[len(prefix):]: metadata.state_dict_metadata[k]
                           for k in saved if k.startswith(prefix)}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if by_param.get(p):
                    optimizer.state[p] = {
                        name: torch.zeros((), dtype=md.properties.dtype) if len(md.size) == 0
                        else torch.zeros(p.numel(), dtype=md.properties.dtype, device=p.device)
                        for name, md in by_param[p].items()}
        state = optimizer_state(optimizer, create=False)
    elif not saved:
        return {}
    else:
        state = optimizer_state(optimizer, create=True)
    entries = _optimizer_entries(optimizer, names_of, state)
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


def load_checkpoint(engine, load_dir, tag=None, load_module_strict=True,
                    load_optimizer_states=True, load_lr_scheduler_states=True,
                    load_module_only=False):
    rank = dist.get_rank()
    path = resolve(load_dir, tag)
    if path is None:
        warnings.warn(f"load_checkpoint: {os.path.join(load_dir, LATEST_FILE)} not found, "
                      "nothing to load", stacklevel=3)
        return None, None
    from .checkpoint_zero import ensure_vescale_checkpoint
    path = ensure_vescale_checkpoint(path)
    state = read_state(path)
    verify_files(path, state, names={".metadata"})
    metadata = read_metadata(path)

    sd, params, names_of = engine_state_dict(engine, rank)
    skipped, unexpected = _check_model_keys(path, metadata, sd, load_module_strict)
    if skipped or unexpected:
        message = (f"load_checkpoint {path} (load_module_strict=False): skipped missing "
                   f"{skipped}, ignored unexpected {unexpected}")
        LOG.warning(message)
        warnings.warn(message, stacklevel=3)
    full_load = not load_module_only
    if full_load and load_optimizer_states:
        sd.update(_optimizer_targets(path, metadata, engine.optimizer, params, names_of,
                                     set(skipped)))
    rng = {k: torch.empty(metadata.state_dict_metadata[k].size,
                          dtype=metadata.state_dict_metadata[k].properties.dtype)
           for k in metadata.state_dict_metadata if k.startswith(f"rng.rank{rank}.")}
    if full_load:
        sd.update(rng)

    problem = None
    try:
        verify_files(path, state, names=_files_for(metadata, sd))
    except CheckpointError as err:
        problem = str(err)
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)  # every rank stops together, naming the file
    if any(problems):
        raise CheckpointError(next(p for p in problems if p))

    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), planner=_LoadPlanner())
    if hasattr(engine.optimizer, "checkpoint_state_loaded") and full_load and load_optimizer_states:
        engine.optimizer.checkpoint_state_loaded()

    if full_load:
        if load_optimizer_states:
            groups = state["optimizer"]["param_groups"]
            if len(groups) != len(engine.optimizer.param_groups):
                raise CheckpointError(f"checkpoint {path}: {len(groups)} optimizer param groups, "
                                      f"the engine has {len(engine.optimizer.param_groups)}")
            for group, saved in zip(engine.optimizer.param_groups, groups):
                for k, v in _from_json(saved).items():
                    if k in group:
                        group[k] = tuple(v) if isinstance(group[k], tuple) else v
        if load_lr_scheduler_states and engine.lr_scheduler is not None and "lr_scheduler" in state:
            engine.lr_scheduler.load_state_dict(_from_json(state["lr_scheduler"]))
        scaler = getattr(engine, "loss_scaler", None)
        if scaler is not None and "loss_scaler" in state:
            scaler.load_state_dict(_from_json(state["loss_scaler"]))
        engine.global_steps = state["global_steps"]
        engine.global_samples = state["global_samples"]
        engine.micro_steps = state["micro_steps"]
        _restore_rng(rank, rng)
    return path, _from_json(state["client_state"])


# ---------------------------------------------------------------------------------------------
# Consolidate: one full, unsharded state dict.

def consolidate(ckpt_dir, out=None, dtype=torch.float32) -> dict:
    """The model's full state dict (keys as in `model.state_dict()`), in `dtype` (floating
    tensors only); written to `out` (.pt or .safetensors) when given. One process, no group."""
    path = resolve(ckpt_dir)
    if path is None:
        raise FileNotFoundError(f"{ckpt_dir} has no {LATEST_FILE} file and is not a checkpoint")
    state = read_state(path)
    verify_files(path, state)
    metadata = read_metadata(path)
    sd = {k: torch.empty(md.size, dtype=md.properties.dtype)
          for k, md in metadata.state_dict_metadata.items() if k.startswith("model.")}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), planner=_LoadPlanner(), no_dist=True)
    full = {k[6:]: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    if out is not None:
        _write_state_dict(full, os.fspath(out))
    return full


def _write_state_dict(full, out):
    tmp = f"{out}.tmp"
    if out.endswith(".safetensors"):
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise CheckpointError(f"{out}: writing .safetensors needs the safetensors package "
                                  "(pip install safetensors); or write a .pt file") from None
        save_file({k: v.contiguous() for k, v in full.items()}, tmp)
    elif out.endswith(".pt") or out.endswith(".pth") or out.endswith(".bin"):
        torch.save(full, tmp)
    else:
        raise CheckpointError(f"{out}: the output must end in .pt, .pth, .bin or .safetensors")
    os.replace(tmp, out)

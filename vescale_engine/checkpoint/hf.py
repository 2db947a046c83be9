"""Hugging Face checkpoints (safetensors directories) in and out of sharded modules.

Load: every rank reads the index and the file headers, matches the file's tensors to the
module's names (tied parameters: any one of their names; `key_map` renames the file's keys),
names every missing, unexpected and mis-shaped key in one error before any byte is written,
then reads ONLY the bytes of its own pieces. A RaggedShard piece is one row-major range
[b, e) of the flattened tensor, so it is one contiguous byte range of the file: read straight
into the fp32 master shard when the file holds the master's dtype (CPU), through one staging
buffer of at most 64 MiB otherwise (bf16 file, or a CUDA master: pinned host memory, then a
copy). A TP/EP parameter's piece is a range of its TP/EP-local tensor: its boxes on the
global tensor (checkpoint.dcp.RaggedPiece) are read one run of consecutive bytes at a time.
No full tensor is built and no file is mapped whole; no collective runs, every rank
decides alone (all see the same headers, so all raise the same error). Module buffers and
parameters that no unit manages are small: every rank reads them whole.

Save: one DBuffer at a time is all-gathered (under TP/EP: one copy of every piece sent to
rank 0, replicas send nothing, and placed on the global tensors,
fsdp.state_dict.gather_to_rank0); global rank 0 casts
its parameters to the save dtype and adds them to the shard being filled, writes a shard file once the next tensor would
overflow `max_shard_size`, and at the end renames the files to HF's names and writes the
index last (a crash never leaves an index naming missing files). Rank 0 holds at most one
shard plus one gathered buffer.
"""
from __future__ import annotations

import contextlib
import copy
import errno
import itertools
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..fsdp.dtensor_params import local_index_maps, sharded_mesh_dims
from ..fsdp.lookup import rank_local_units
from ..fsdp.materialize import allocate_shards, init_unloaded
from ..fsdp.param import sharding_of
from ..fsdp.state_dict import gather_to_rank0, named_entries
from ..shard.ragged_piece import RaggedPiece
from .background import BackgroundSaves
from .state import model_of
from .dcp import CheckpointWriteError, write_error
from .entries import fsync_dir, write_atomically
from .safetensors_format import DTYPES, dtype_of, memory_of, read_exactly, read_header, save_file

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint", "load_into", "LoadResult",
           "HFCheckpointError", "INDEX_NAME", "SINGLE_NAME", "STAGING_BYTES", "checkpoint_files",
           "read_stored", "parse_size"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
STAGING_BYTES = 64 << 20   # the most host memory a dtype-converting read holds at once
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_PARTIAL_FILE = re.compile(r"\.model-\d{5}\.partial")
_PREVIOUS_INDEX = f".{INDEX_NAME}.previous"  # an earlier save's index while a save runs
_LISTED = 8                # names an error lists before it says "and N more"


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint that does not fit the module (or is not one)."""


@dataclass
class LoadResult:
    """What `load_hf_checkpoint` did on this rank. `bytes_read` counts the tensor bytes read for
    sharded parameters (this rank's pieces only); `whole_bytes_read` the module buffers and
    unmanaged parameters every rank reads whole; `header_bytes` the index and headers;
    `staging_bytes` the host buffer dtype-converting reads went through (<= STAGING_BYTES)."""
    missing_keys: list = field(default_factory=list)
    unexpected_keys: list = field(default_factory=list)
    bytes_read: int = 0
    whole_bytes_read: int = 0
    header_bytes: int = 0
    files: int = 0
    staging_bytes: int = 0


@dataclass(frozen=True)
class _Stored:
    """One tensor in a safetensors file: where its bytes are."""
    key: str
    file: str
    dtype: torch.dtype
    shape: tuple
    offset: int     # absolute file offset of its first byte


# ---------------------------------------------------------------------------------------------
# Reading the checkpoint's index and headers.

def checkpoint_files(path) -> tuple[list, dict | None, int]:
    """(safetensors files, weight_map or None, index bytes read) for a directory holding
    `model.safetensors.index.json` or `model.safetensors`, one `.safetensors` file, or a list
    of them (the files from_pretrained resolved)."""
    if isinstance(path, (list, tuple)):
        files = [os.fspath(f) for f in path]
        wrong = [f for f in files if not (f.endswith(".safetensors") and os.path.isfile(f))]
        if wrong or not files:
            raise HFCheckpointError(f"{wrong[0] if wrong else 'an empty list'} is not a "
                                    ".safetensors file")
        return files, None, 0
    path = os.fspath(path)
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise HFCheckpointError(f"{path} is not a .safetensors file or a directory holding "
                                    f"{INDEX_NAME} or {SINGLE_NAME}")
        return [path], None, 0
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Hugging Face checkpoint {path} does not exist")
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        with open(index, "rb") as f:
            raw = f.read()
        try:
            weight_map = json.loads(raw)["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise HFCheckpointError(f"{index}: not a safetensors index (no weight_map)") from None
        files = sorted({os.path.join(path, name) for name in weight_map.values()})
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise HFCheckpointError(f"{index} names files that do not exist: "
                                    f"{_listed([os.path.basename(f) for f in absent])}")
        return files, {k: os.path.join(path, v) for k, v in weight_map.items()}, len(raw)
    single = os.path.join(path, SINGLE_NAME)
    if os.path.isfile(single):
        return [single], None, 0
    raise HFCheckpointError(f"{path} holds neither {INDEX_NAME} nor {SINGLE_NAME}: not a Hugging "
                            "Face safetensors checkpoint")


def read_stored(path) -> tuple[dict, int, int]:
    """({key: _Stored}, header bytes read, files) from the index and the files' headers."""
    files, weight_map, header_bytes = checkpoint_files(path)
    stored = {}
    for file in files:
        with open(file, "rb", buffering=0) as f:
            header, data_start = read_header(f, file)
        header_bytes += data_start
        for key, entry in header.items():
            if key == "__metadata__" or (weight_map is not None and weight_map.get(key) != file):
                continue
            dtype = dtype_of(entry["dtype"])
            if dtype is None:
                raise HFCheckpointError(f"{file}: tensor {key} has dtype {entry['dtype']}, which "
                                        f"this reader does not know ({sorted(DTYPES.values())})")
            stored[key] = _Stored(key, file, dtype, tuple(entry["shape"]),
                                  data_start + entry["data_offsets"][0])
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(stored))
        if absent:
            raise HFCheckpointError(f"{path}: the index lists tensors its files do not hold: "
                                    f"{_listed(absent)}")
    return stored, header_bytes, len(files)


# ---------------------------------------------------------------------------------------------
# Matching the file's keys to the module's.

def _module_of(module_or_engine) -> nn.Module:
    """The model: an engine's (state.HoldsModel), or the module itself."""
    return model_of(module_or_engine)


def _global_shape(tensor) -> tuple:
    sp = sharding_of(tensor)
    if sp is not None and sp.dtensor_spec is not None:  # TP/EP: the DTensor's global shape
        return tuple(sp.dtensor_spec.shape)
    return tuple(sp.shape) if sp is not None else tuple(tensor.shape)


def _tp_ep_piece(sp):
    """A TP/EP parameter's shard as boxes of its global tensor (None for other parameters)."""
    if not sharded_mesh_dims(sp.dtensor_spec):
        return None
    return RaggedPiece(sp.local(), sp.dtensor_spec.shape, sp.flat_range[0],
                       local_shape=sp.shape, index_maps=local_index_maps(sp.dtensor_spec))


def _read_box(reader, entry, offsets, view):
    """A box (`offsets`, view.shape) of the stored tensor into `view`: one read per run of
    consecutive stored elements (the dims after the run's are whole)."""
    shape = entry.shape
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    j = len(shape) - 1
    while j > 0 and view.shape[j] == shape[j]:
        j -= 1
    n = view.shape[j] * strides[j]
    for lead in itertools.product(*(range(k) for k in view.shape[:j])):
        begin = sum((o + i) * st for o, i, st in zip(offsets, lead, strides)) + \
            offsets[j] * strides[j]
        dst = view[lead]
        if dst.is_contiguous():
            reader.read(entry, begin, begin + n, dst.view(-1))
        else:  # a _StridedShard segment's box: through a temporary
            tmp = torch.empty(n, dtype=view.dtype, device=view.device)
            reader.read(entry, begin, begin + n, tmp)
            dst.copy_(tmp.view(dst.shape))


def _rename(stored: dict, key_map) -> dict:
    """{model name: _Stored} after `key_map` (dict: file key -> model name, keys it does not
    list unchanged; callable: file key -> model name). A tuple of names loads the file's
    tensor into each (copies of a module, as PEFT's modules_to_save makes)."""
    if key_map is None:
        return dict(stored)
    if not (callable(key_map) or isinstance(key_map, dict)):
        raise TypeError(f"key_map must be a dict or a callable, got {type(key_map).__name__}")
    renamed, sources = {}, {}
    for key, entry in stored.items():
        new = key_map(key) if callable(key_map) else key_map.get(key, key)
        names = new if isinstance(new, tuple) and new else (new,)
        if not all(isinstance(name, str) for name in names):
            raise HFCheckpointError(f"key_map gave {new!r} for {key}: it must give a name")
        for name in names:
            if name in renamed:
                raise HFCheckpointError(f"key_map maps both {sources[name]} and {key} to {name}")
            renamed[name], sources[name] = entry, key
    return renamed


def _match(module, stored: dict, strict: bool, path) -> tuple[list, list, list]:
    """([(model name, _Stored)] to load, missing, unexpected); every problem that stops the
    load is raised here, in one message, before any byte is read."""
    plan, missing, used, mismatched, wrong_dtype = [], [], set(), [], []
    for names, tensor in named_entries(module):
        found = [n for n in names if n in stored]
        if not found:
            missing.append(names[0])
            continue
        used.update(found)
        entry = stored[found[0]]
        shape = _global_shape(tensor)
        if entry.shape != shape:
            mismatched.append(f"{found[0]} (file {list(entry.shape)}, model {list(shape)})")
            continue
        target = _target_dtype(tensor)
        if not _loads_as(entry.dtype, target):
            wrong_dtype.append(f"{found[0]} ({DTYPES[entry.dtype]} in {entry.file}, model "
                               f"{str(target).removeprefix('torch.')})")
            continue
        plan.append((names[0], entry))
    unexpected = [n if stored[n].key == n else f"{stored[n].key} (as {n})"
                  for n in stored if n not in used]
    problems = [f"shape mismatch: {_listed(mismatched)}"] if mismatched else []
    if wrong_dtype:
        problems.append(f"dtype mismatch: {_listed(wrong_dtype)}")
    if strict and missing:
        problems.append(f"missing keys: {_listed(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected keys: {_listed(unexpected)}")
    if problems:
        keys = mismatched or (strict and (missing or unexpected))
        hint = " (key_map= renames file keys; strict=False skips missing and unexpected)" \
            if keys else ""
        raise HFCheckpointError(f"load_hf_checkpoint {os.fspath(path)}: " + "; ".join(problems)
                                + hint)
    return plan, missing, unexpected


def _target_dtype(tensor) -> torch.dtype:
    """The dtype a file's tensor is read into: a managed parameter's master shard, or the
    buffer or unmanaged parameter itself."""
    sp = sharding_of(tensor)
    return sp.sharded.dtype if sp is not None else tensor.dtype


def _loads_as(stored: torch.dtype, target: torch.dtype) -> bool:
    """Floating data loads into any floating tensor (a bf16 file into the fp32 master is
    cast); anything else only into its own dtype. Integer bytes cast to float (F32 data
    labelled I32) would load as garbage without a word."""
    if stored.is_floating_point and target.is_floating_point:
        return True
    return stored == target


def _listed(names) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


# ---------------------------------------------------------------------------------------------
# Reading the bytes.

class _RangeReader:
    """Reads element ranges of stored tensors into tensors, counting the bytes; keeps each file
    open once and one staging buffer for the reads that cannot land in place."""

    def __init__(self):
        self._files = {}
        self._staging = None
        self.bytes_read = 0

    def close(self):
        for f in self._files.values():
            f.close()
        self._files = {}

    def _file(self, name):
        if name not in self._files:
            self._files[name] = open(name, "rb", buffering=0)
        return self._files[name]

    def read(self, entry: _Stored, begin: int, end: int, out: torch.Tensor):
        """Elements [begin, end) of `entry`, flattened row-major, into the 1-D `out`."""
        itemsize = entry.dtype.itemsize
        f = self._file(entry.file)
        offset = entry.offset + begin * itemsize
        n = end - begin
        if out.dtype == entry.dtype and out.device.type == "cpu" and out.is_contiguous():
            self.bytes_read += read_exactly(f, offset, memory_of(out))  # in place, no copy
            # a write torch did not see: move the version counter, as a copy_ would, so that
            # an offloaded master's compute shard is refreshed (shard/compute_shard.py)
            if not out.is_inference():  # (an inference tensor has no version counter)
                torch.autograd.graph.increment_version(out)
            return
        chunk = max(1, STAGING_BYTES // itemsize)
        staging = self._staging_for(min(n, chunk) * itemsize, out.device)
        for start in range(0, n, chunk):
            k = min(chunk, n - start)
            piece = staging[:k * itemsize]
            self.bytes_read += read_exactly(f, offset + start * itemsize, memory_of(piece))
            out[start:start + k].copy_(piece.view(entry.dtype))  # casts; waits for the copy

    def _staging_for(self, nbytes, device):
        pinned = device.type == "cuda"  # host-to-device copies from pinned memory
        if self._staging is None or self._staging.numel() < nbytes or \
                self._staging.is_pinned() != pinned:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device="cpu",
                                        pin_memory=pinned)
        return self._staging


def _load(module, plan, result):
    """Read every planned tensor: sharded parameters their own range, the rest whole."""
    targets = {names[0]: tensor for names, tensor in named_entries(module)}
    reader = _RangeReader()
    try:
        with torch.no_grad():
            for name, entry in plan:
                tensor = targets[name]
                sp = sharding_of(tensor)
                piece = _tp_ep_piece(sp) if sp is not None else None
                if piece is not None:  # this rank's bytes only, from the global tensor
                    for offsets in piece.boxes:
                        _read_box(reader, entry, offsets, piece.box(offsets))
                    continue
                if sp is not None:
                    begin, end = sp.flat_range
                    if end > begin:
                        reader.read(entry, begin, end, sp.local())
                    continue
                before = reader.bytes_read
                value = torch.empty(entry.shape, dtype=entry.dtype, device="cpu")
                reader.read(entry, 0, value.numel(), value.view(-1))
                tensor.copy_(value)
                result.whole_bytes_read += reader.bytes_read - before
                reader.bytes_read = before
    finally:
        reader.close()
    result.bytes_read += reader.bytes_read
    result.staging_bytes = 0 if reader._staging is None else reader._staging.numel()


def _on_meta(module) -> list:
    return [names[0] for names, tensor in named_entries(module) if tensor.is_meta]


def load_into(module: nn.Module, path, *, strict: bool = True, key_map=None,
              device=None, init_missing=None) -> LoadResult:
    """Load a Hugging Face checkpoint into `module` right after `fully_shard` (what
    `initialize` calls for `vescale.hf_checkpoint`). A module whose shards are still on meta
    gets real storage on `device` first (`materialize.allocate_shards`); what the file does not
    hold (non-persistent buffers; missing keys under strict=False) is then initialized by
    `init_missing(module, names)`, by default by its own modules
    (`materialize.init_unloaded`)."""
    stored, header_bytes, files = read_stored(path)
    plan, missing, unexpected = _match(module, _rename(stored, key_map), strict, path)
    result = LoadResult(missing, unexpected, header_bytes=header_bytes, files=files)
    unloaded = []
    if _on_meta(module):
        # What the file cannot hold (non-persistent buffers such as rotary inv_freq) and, with
        # strict=False, its missing keys are initialized by their modules after the load.
        loaded = {name for name, _ in plan}
        given = {name for names, t in named_entries(module) for name in names
                 if getattr(sharding_of(t), "initial", None) is not None}
        # (`given`: real at wrap time, in a unit planned on meta: allocate writes that value)
        unloaded = sorted(({name for name, b in module.named_buffers(remove_duplicate=False)
                            if b.is_meta and name not in loaded} | set(missing)) - given)
        allocate_shards(module, device=device)
        still = _on_meta(module)
        if still:
            raise HFCheckpointError(f"load_hf_checkpoint: {_listed(still)} still on meta after "
                                    "allocate_shards (not managed by fully_shard)")
    _load(module, plan, result)
    if unloaded:
        (init_missing or init_unloaded)(module, unloaded)
    return result


def load_hf_checkpoint(module_or_engine, path, *, strict: bool = True,
                       key_map=None) -> LoadResult:
    """Load a Hugging Face safetensors checkpoint (a directory with model.safetensors.index.json
    or model.safetensors, or one .safetensors file) into a sharded module or engine, each rank
    reading only the bytes of its own pieces; no collectives. `key_map` renames the file's keys
    (dict file key -> model name, or a callable). strict=True: missing and unexpected keys are
    an error; strict=False loads what matches and lists them in the result. Shape mismatches
    are always an error. Returns a LoadResult (keys and byte counters)."""
    return load_into(_module_of(module_or_engine), path, strict=strict, key_map=key_map)


# ---------------------------------------------------------------------------------------------
# Saving.

_SAVE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size) -> int:
    """Bytes from an int or a string such as "5GB" (10^9), "500MB", "2GiB" (2^30), as HF's
    max_shard_size."""
    if isinstance(size, bool):
        raise ValueError(f"max_shard_size must be bytes or a size such as '5GB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
        unit = match.group(2).upper() if match else None
        if unit not in _UNITS:
            raise ValueError(f"max_shard_size {size!r} is not a size such as '5GB', '500MB', "
                             "'2GiB' or a number of bytes")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def _save_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _SAVE_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _SAVE_DTYPES:
        return _SAVE_DTYPES[dtype.lower()]
    raise ValueError(f"save_hf_checkpoint dtype {dtype!r}: use one of "
                     f"{sorted(_SAVE_DTYPES)} or the torch dtype")


def _saved_names(module, names) -> str | None:
    """The one name a tied parameter is saved under, as HF's save_pretrained picks it (its
    declared tied keys are dropped, the rest kept); None for a key HF never saves."""
    ignore = getattr(module, "_keys_to_ignore_on_save", None) or []
    names = [n for n in names if n not in ignore]
    if not names:
        return None
    tied = getattr(module, "all_tied_weights_keys", None) or {}
    kept = [n for n in names if n not in tied]
    return (kept or names)[0]


class _ShardWriter:
    """Fills shard files up to `limit` bytes on rank 0; names them and writes the index at the
    end. Files are written as `.model-NNNNN.partial` and renamed only when all are done."""

    def __init__(self, path, limit):
        self.path = path
        self.limit = limit
        self.pending, self.pending_bytes = {}, 0
        self.written = []       # [(partial file, [keys])]
        self.total_bytes = self.total_numel = 0

    def add(self, key, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.limit:
            self.flush()
        self.pending[key] = tensor
        self.pending_bytes += nbytes
        self.total_bytes += nbytes
        self.total_numel += tensor.numel()

    def flush(self):
        if not self.pending:
            return
        partial = os.path.join(self.path, f".model-{len(self.written) + 1:05d}.partial")
        try:
            save_file(self.pending, partial, metadata={"format": "pt"})
        except OSError as err:
            with contextlib.suppress(OSError):
                os.remove(partial)
            raise write_error(partial, err, self.pending_bytes, "its tensor data") from None
        self.written.append((partial, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def discard(self):
        """After a failure: the files written so far removed, nothing more kept."""
        for partial, _ in self.written:
            with contextlib.suppress(OSError):
                os.remove(partial)
        self.written, self.pending, self.pending_bytes = [], {}, 0

    def finish(self):
        self.flush()
        count = len(self.written)
        names = [SINGLE_NAME] if count == 1 else \
            [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        for (partial, keys), name in zip(self.written, names):
            os.replace(partial, os.path.join(self.path, name))
            weight_map.update({key: name for key in keys})
        for old in os.listdir(self.path):  # an earlier save's files that this one does not own
            if old not in names and (_SHARD_FILE.fullmatch(old) or old == SINGLE_NAME):
                os.remove(os.path.join(self.path, old))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes,
                                  "total_parameters": self.total_numel},
                     "weight_map": dict(sorted(weight_map.items()))}
            write_atomically(os.path.join(self.path, INDEX_NAME),
                             (json.dumps(index, indent=2) + "\n").encode())
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.path, _PREVIOUS_INDEX))
        fsync_dir(self.path)


def _prepare_directory(path) -> tuple | None:
    """Rank 0: the directory exists, holds no index of an earlier save (set aside as
    _PREVIOUS_INDEX, so that a crash from here on cannot leave an index naming files this save
    replaced) and no files of an interrupted save; the problem as (errno, line), or None."""
    if os.path.exists(path) and not os.path.isdir(path):
        return errno.ENOTDIR, f"save_hf_checkpoint: {path} is a file, not a directory"
    try:
        os.makedirs(path, exist_ok=True)
        index, previous = os.path.join(path, INDEX_NAME), os.path.join(path, _PREVIOUS_INDEX)
        if os.path.exists(index):
            os.replace(index, previous)
        elif os.path.exists(previous):  # an interrupted save's: it may name replaced files
            os.remove(previous)
        for name in os.listdir(path):  # an interrupted save's files: never loaded
            if _PARTIAL_FILE.fullmatch(name):
                os.remove(os.path.join(path, name))
    except OSError as err:
        return err.errno, f"save_hf_checkpoint: cannot write to {path}: {err}"
    return None


def _configs(module, dtype) -> list:
    """Copies of the configs to save beside the weights: config.json (with the saved dtype and
    the model's class, as save_pretrained writes it) and generation_config.json, when the model
    has them. Copies, so that a background writer never sees the model's change meanwhile."""
    out = []
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config = copy.deepcopy(config)
        config.dtype = str(dtype).split(".")[1]
        config.architectures = [type(module).__name__]
        out.append(config)
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", lambda: generation is not None)
    if generation is not None and can_generate():
        out.append(copy.deepcopy(generation))
    return out


def save_hf_checkpoint(module_or_engine, path, dtype="bf16", max_shard_size="5GB", *,
                       writer=None) -> None:
    """Write the sharded module as a Hugging Face checkpoint `from_pretrained` loads:
    `model-0000K-of-0000N.safetensors` + `model.safetensors.index.json` (or one
    `model.safetensors`), `config.json` and `generation_config.json` when the model has them.
    Every rank takes part (one all-gather per DBuffer); global rank 0 writes, holding at most
    one shard file's tensors plus one gathered buffer. Floating tensors are saved in `dtype`.
    A file rank 0 cannot write (a full disk) is one CheckpointWriteError on every rank, naming
    it and the bytes it needed; before the renames at the end, the earlier save in `path` is
    left whole.

    With `writer` (an engine's background.BackgroundSaves: engine.save_hf_checkpoint(...,
    background=True)) the gathers run here and rank 0 keeps every gathered tensor in host
    memory (the whole model in `dtype`); a thread writes the files, and a failure is raised on
    every rank where background saves raise theirs."""
    module = _module_of(module_or_engine)
    if rank_local_units(module):  # as engine/wrap.py's refuse_with_experts refuses them
        raise NotImplementedError(
            "save_hf_checkpoint: not supported yet for models with DeepSpeed MoE layers or "
            "other rank-local units (ShardingPolicy.rank_local: each expert-parallel rank "
            "holds different experts under the same names, and the file would keep only one "
            "rank's)")
    out_dtype = _save_dtype(dtype)
    limit = parse_size(max_shard_size)
    path = os.fspath(path)
    rank0 = dist.get_rank() == 0
    if writer is not None and not isinstance(writer, BackgroundSaves):
        raise TypeError(f"save_hf_checkpoint: writer={writer!r} is not an engine's background "
                        "writer (use engine.save_hf_checkpoint(path, background=True))")
    if writer is not None:
        writer.wait()  # one save in flight at a time; its directory may be this one
    _raise_rank0_problem(_prepare_directory(path) if rank0 else None)

    files = _ShardWriter(path, limit) if rank0 else None
    configs = _configs(module, out_dtype) if rank0 else []
    if writer is not None:
        held = [(name, value) for names, _source, value in gather_to_rank0(module, out_dtype)
                if (name := _saved_names(module, names)) is not None]
        writer.start(path, lambda *_: _write_held(files, held, configs, path), {})
        return
    problem = None
    for names, _source, value in gather_to_rank0(module, out_dtype):
        name = _saved_names(module, names)
        if name is not None and problem is None:
            try:  # on failure keep taking part in the gathers, then stop every rank
                _add(files, name, value, path)
            except CheckpointWriteError as err:
                problem = err.errno, str(err)
    if rank0 and problem is None:
        try:
            _finish(files, configs, path)
        except CheckpointWriteError as err:
            problem = err.errno, str(err)
    _raise_rank0_problem(problem)  # nobody returns before the files are complete


def _add(writer, name, value, path):
    try:
        writer.add(name, value)
    except OSError as err:
        _give_up(writer, path, err)


def _give_up(writer, path, err):
    """Before the renames: this save's files removed, the earlier save's index back."""
    writer.discard()
    _restore_previous_index(path)
    raise CheckpointWriteError(err.errno, f"save_hf_checkpoint: {err} (nothing was "
                                          f"replaced)") from None


def _finish(writer, configs, path):
    try:
        writer.flush()
    except OSError as err:
        _give_up(writer, path, err)
    try:
        writer.finish()
        for config in configs:
            config.save_pretrained(path)
    except OSError as err:
        raise CheckpointWriteError(err.errno, f"save_hf_checkpoint: {err}") from None


def _write_held(writer, held, configs, path):
    """The background writer's work: rank 0 writes what it holds (the other ranks nothing)."""
    if writer is None:
        return
    for name, value in held:
        _add(writer, name, value, path)
    _finish(writer, configs, path)


def _restore_previous_index(path):
    previous = os.path.join(path, _PREVIOUS_INDEX)
    if os.path.exists(previous):
        os.replace(previous, os.path.join(path, INDEX_NAME))


def _raise_rank0_problem(problem):
    """Every rank raises rank 0's problem (errno, line), or none does."""
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointWriteError(*box[0])

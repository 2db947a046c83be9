"""A rank's ragged flat pieces of tensors (piece.py's RaggedPiece) as DCP chunks of the tensors'
true shapes: each box of a piece is one DCP chunk. The two planners subclass DCP's default ones
only to write and read those boxes. Also: the checkpoint errors, the reader that never unpickles
and the writer that takes every file's CRC32 while writing.
"""
from __future__ import annotations

import collections
import contextlib
import errno
import io
import math
import os
import pickle
import zlib

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import StorageMeta

from ..shard.ragged_piece import RaggedPiece

__all__ = ["CheckpointError", "CheckpointWriteError", "SavePlanner", "LoadPlanner", "SafeReader",
           "CrcWriter", "write_error"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded (or state that cannot be saved); names file or key."""


class CheckpointWriteError(OSError):
    """A checkpoint file that could not be written (disk full, no permission, read-only): one
    line naming the path (and, for a full disk, the bytes needed); `errno` is the system's."""

    def __init__(self, code, message):
        super().__init__(code, message)

    def __str__(self):
        return self.strerror


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def write_error(path, err: OSError, needed=None, what="it", rank=None) -> CheckpointWriteError:
    """`err` (raised writing `path`, on `rank`) as one line: the path, the system's reason and,
    for a full disk, the bytes needed (`needed`; `what` says what needs them) and free."""
    path = os.fspath(path)
    reason = err.strerror or str(err)
    if err.errno in _DISK_FULL and needed is not None:
        reason += f": {what} needs {needed} bytes, {_free_bytes(path)} bytes are free there"
    where = "" if rank is None else f" (rank {rank})"
    return CheckpointWriteError(err.errno, f"cannot write {path}{where}: {reason}")


def _free_bytes(path) -> str:
    """The bytes an unprivileged writer may still use on `path`'s file system ("?" unknown)."""
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return "?"
    return str(st.f_bavail * st.f_frsize)


class SavePlanner(DefaultSavePlanner):
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
        if isinstance(obj, RaggedPiece):  # a strided (TP segment) box is written contiguous
            return obj.box(index.offset).contiguous()
        return super().lookup_object(index)

    def planned_bytes(self) -> int | None:
        """The tensor bytes every rank writes (the coordinator knows, once it has planned)."""
        plans = getattr(self, "global_plan", None)
        if plans is None:
            return None
        data = [item.tensor_data for plan in plans for item in plan.items]
        return sum(math.prod(d.chunk.sizes) * d.properties.dtype.itemsize
                   for d in data if d is not None)


class LoadPlanner(DefaultLoadPlanner):
    """The default planner, plus RaggedPiece targets; never unpickles (we save no blobs)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False,
                         allow_partial_load=True)
        self._staged = None    # (host staging, device target) of the box being read
        self._in_flight = []   # (staging, device) copied asynchronously, not yet waited for

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

    def resolve_tensor(self, read_item):
        """Where DCP copies a box it read: the target itself, or for a CUDA target a host
        staging tensor that `commit_tensor` copies on asynchronously."""
        target = super().resolve_tensor(read_item)
        if not _stage_through_host(target.device) or target.numel() == 0:
            return target
        staging = torch.empty(target.shape, dtype=target.dtype, device="cpu",
                              pin_memory=target.is_cuda)
        self._staged = (staging, target)  # DCP commits each box right after resolving it
        return staging

    def commit_tensor(self, read_item, tensor):
        staged, self._staged = self._staged, None
        if staged is not None:
            staging, target = staged
            target.detach().copy_(staging, non_blocking=staging.is_pinned())
            self._in_flight.append((staging, target.device))
        super().commit_tensor(read_item, tensor)

    def finish_file(self):
        """The file's boxes are read: wait once for their copies, then drop the staging."""
        in_flight, self._in_flight = self._in_flight, []
        for device in {device for _, device in in_flight}:
            _wait_for_host_copies(device)

    def load_bytes(self, read_item, value):
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; "
                              "vescale checkpoints hold tensors only and never unpickle")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles `.metadata`; this reads it with only DCP's metadata classes, torch.Size,
    dtypes and paths allowed, so a doctored file cannot run code."""

    def find_class(self, module, name):
        import pathlib

        from torch.distributed.checkpoint import filesystem, metadata
        allowed = {
            "torch.distributed.checkpoint.metadata": lambda: isinstance(
                getattr(metadata, name, None), type) and getattr(metadata, name),
            "torch.distributed.checkpoint.filesystem": lambda: name == "_StorageInfo" and
            filesystem._StorageInfo,
            "torch": lambda: (name == "Size" and torch.Size) or isinstance(
                getattr(torch, name, None), torch.dtype) and getattr(torch, name),
            "torch.serialization": lambda: name == "_get_layout" and
            torch.serialization._get_layout,
            "pathlib": lambda: name in ("PosixPath", "WindowsPath", "PurePosixPath",
                                        "PureWindowsPath") and getattr(pathlib, name),
            "collections": lambda: name == "OrderedDict" and collections.OrderedDict,
        }
        found = allowed.get(module, lambda: None)()
        if not found:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")
        return found


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader (tensors already come through torch.load(weights_only=True)) with a
    restricted unpickler for `.metadata`. `item_crcs` ({file: {offset: (length, crc32)}}, as
    CrcWriter recorded them): each item of those files is read once, into memory, and checked
    there before it is loaded, so verifying costs no second read of the file."""

    def __init__(self, path, item_crcs=None):
        super().__init__(path)
        self.item_crcs = item_crcs or {}

    def _slice_file(self, file, sinfo):
        items = self.item_crcs.get(sinfo.relative_path)
        if items is None:
            return super()._slice_file(file, sinfo)
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        if zlib.crc32(data) != items[sinfo.offset][1]:
            raise CheckpointError(f"{os.path.join(self.path, sinfo.relative_path)} is corrupted: "
                                  "CRC32 mismatch")
        return io.BytesIO(data)

    def read_data(self, plan, planner):
        """DCP's reading, one file at a time, so that the copies into the device wait once per
        file (LoadPlanner.finish_file)."""
        from torch.distributed.checkpoint.planner import LoadPlan
        per_file = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)
        done = None
        for items in per_file.values():
            done = super().read_data(LoadPlan(items), planner)
            if hasattr(planner, "finish_file"):
                planner.finish_file()
        return done if done is not None else super().read_data(plan, planner)

    def read_metadata(self, *args, **kwargs):
        path = os.path.join(self.path, ".metadata")
        try:
            with open(path, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
            raise CheckpointError(f"{path}: not DCP metadata ({err})") from None
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


# ---------------------------------------------------------------------------------------------
# CRC32 taken while writing, checked while reading: checkpoint I/O is not doubled.

class _CrcStream:
    """A file being written: the CRC32 of all its bytes, and of each item. DCP asks `tell()`
    just before and just after writing each item, so the bytes written between two `tell()`
    calls are one item's (load_checkpoint checks that every item it reads was recorded)."""

    def __init__(self, raw):
        self.raw = raw
        self.size = self.crc = self.item_crc = 0
        self.mark = raw.tell()
        self.items = {}  # offset -> (length, crc32)

    def write(self, data):
        written = self.raw.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.item_crc = zlib.crc32(data, self.item_crc)
        self.size += len(memoryview(data).cast("B"))
        return written

    def tell(self):
        pos = self.raw.tell()
        if pos > self.mark:
            self.items[self.mark] = (pos - self.mark, self.item_crc)
        self.mark, self.item_crc = pos, 0
        return pos

    def __getattr__(self, name):  # flush, fileno, close, ...
        return getattr(self.raw, name)


class _CrcFileSystem(FileSystem):
    def __init__(self):
        super().__init__()
        self.written = {}  # file name -> _CrcStream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with super().create_stream(path, mode) as raw:
                yield raw
            return
        try:
            with super().create_stream(path, mode) as raw:
                stream = _CrcStream(raw)
                yield stream
        except OSError as err:  # a write error carries no path: give it the file's
            if err.filename is None:
                raise OSError(err.errno, err.strerror or str(err), os.fspath(path)) from err
            raise
        self.written[os.path.basename(path)] = stream

    def rename(self, path, new_path):  # DCP writes .metadata.tmp, then renames it
        super().rename(path, new_path)
        stream = self.written.pop(os.path.basename(path), None)
        if stream is not None:
            self.written[os.path.basename(new_path)] = stream


class CrcWriter(dcp.FileSystemWriter):
    """DCP's file writer that records each file's size and CRC32 (and each item's) as it writes,
    instead of reading the files back."""

    def __init__(self, path, **kwargs):
        super().__init__(path, **kwargs)
        self.fs = _CrcFileSystem()

    def records(self) -> dict:
        """{file name: {"bytes", "crc32", "items": {offset: [length, crc32]}}} written so far."""
        return {name: {"bytes": s.size, "crc32": s.crc,
                       "items": {str(offset): list(item) for offset, item in s.items.items()}}
                for name, s in self.fs.written.items()}


def _stage_through_host(device) -> bool:
    """Loads into CUDA go through pinned host memory, copied asynchronously: one wait per file
    instead of a synchronous pageable copy per box."""
    return torch.device(device).type == "cuda"


def _wait_for_host_copies(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()

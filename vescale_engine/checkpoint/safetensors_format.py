"""The safetensors file format, written and read without the `safetensors` package.

A file is: 8 bytes (little-endian u64) giving the header's length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}` (padded with
spaces so the data starts 8-byte aligned), then the tensors' raw little-endian bytes, each at
its offsets relative to the end of the header. As the format requires (and the `safetensors`
package checks), the tensors' byte ranges tile the data section exactly: sorted by offset, the
first begins at 0, each begins where the one before ended, the last ends at the end of the file,
and each range holds exactly its shape's elements of its dtype. No overlap, no alias, no gap.
"""
from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import sys

import torch

__all__ = ["dtype_of", "memory_of", "read_header", "check_offsets", "read_exactly", "save_file",
           "load_file", "DTYPES"]

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}


MAX_HEADER_BYTES = 100 << 20  # the safetensors package's own limit


def dtype_of(name: str) -> torch.dtype | None:
    """The torch dtype a safetensors dtype name stands for (None when we do not know it)."""
    return _BY_NAME.get(name)


def memory_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage, without numpy: what
    `readinto` fills in place and what a writer sends to the file without a copy."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("memory_of needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _raw_bytes(tensor: torch.Tensor):
    t = tensor.detach().to("cpu").contiguous()
    return t, memory_of(t)  # the tensor keeps the viewed storage alive


def read_header(file, path: str = "") -> tuple[dict, int]:
    """(header, data_start) of an open binary safetensors file, reading only the header:
    `header` maps tensor names to {"dtype", "shape", "data_offsets"} (plus "__metadata__"),
    and data_start is the file offset that data_offsets count from."""
    name = path or getattr(file, "name", "file")
    file.seek(0)
    prefix = file.read(8)
    if len(prefix) < 8:
        raise ValueError(f"{name}: too short for a safetensors file")
    (length,) = struct.unpack("<Q", prefix)
    size = os.fstat(file.fileno()).st_size
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise ValueError(f"{name}: header length {length} is not that of a safetensors file "
                         f"of {size} bytes")
    try:
        header = json.loads(file.read(length))
    except ValueError as err:
        raise ValueError(f"{name}: the safetensors header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name}: the safetensors header is not a JSON object")
    check_offsets(header, size - 8 - length, name)
    return header, 8 + length


def check_offsets(header: dict, data_bytes: int, name: str) -> None:
    """Each entry well formed, its byte count its shape's, and the ranges tiling the
    `data_bytes` of data exactly (the format's rule): one line naming the file otherwise."""
    ranges = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            shape = list(entry["shape"])
            dtype = entry["dtype"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{name}: tensor {key} has a malformed header entry {entry}") \
                from None
        if not all(_is_count(n) for n in (begin, end, *shape)) or not isinstance(dtype, str):
            raise ValueError(f"{name}: tensor {key} has a malformed header entry {entry}")
        itemsize = _itemsize(dtype)
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise ValueError(f"{name}: tensor {key} has {end - begin} bytes [{begin}, {end}), "
                             f"its shape {shape} of {dtype} takes {math.prod(shape) * itemsize}")
        ranges.append((begin, end, key))
    at, before = 0, None
    for begin, end, key in sorted(ranges):
        if end > data_bytes:
            raise ValueError(f"{name}: tensor {key} has bytes [{begin}, {end}), past the end of "
                             f"the file's {data_bytes} bytes of data")
        if begin != at:
            what = f"overlaps tensor {before}" if begin < at else \
                f"leaves bytes [{at}, {begin}) unused"
            raise ValueError(f"{name}: tensor {key} at bytes [{begin}, {end}) {what}; a "
                             "safetensors file's tensors must tile its data in order")
        at, before = end, key
    if at != data_bytes:
        raise ValueError(f"{name}: its tensors end at data byte {at}, the file has {data_bytes} "
                         "bytes of data")


def _is_count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _itemsize(name: str) -> int | None:
    dtype = _BY_NAME.get(name)
    return None if dtype is None else dtype.itemsize


def read_exactly(file, offset: int, into: memoryview) -> int:
    """Fill `into` with the file's bytes from `offset` (an unbuffered file: straight into the
    target's memory); the number of bytes read."""
    file.seek(offset)
    done = 0
    while done < len(into):
        n = file.readinto(into[done:])
        if not n:
            raise ValueError(f"{getattr(file, 'name', 'file')}: ends before byte "
                             f"{offset + len(into)}")
        done += n
    return done


def save_file(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """Write `tensors` (name -> tensor) as a safetensors file at `path`."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors stores little-endian data; this host is big-endian")
    header, chunks, offset = {}, [], 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no safetensors name")
        keep, data = _raw_bytes(tensor)
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append((keep, data))
        offset += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, data in chunks:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())


def load_file(path: str) -> dict:
    """Read a safetensors file into name -> tensor (CPU), checking its structure."""
    with open(path, "rb") as f:
        header, data_start = read_header(f, path)
        out = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _BY_NAME.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']}, which this "
                                 f"reader does not know ({sorted(DTYPES.values())})")
            flat = torch.empty(math.prod(entry["shape"]), dtype=dtype)
            begin = entry["data_offsets"][0]
            read_exactly(f, data_start + begin, memory_of(flat))
            out[name] = flat.reshape(entry["shape"])
    return out

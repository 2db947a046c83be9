"""The safetensors file format, written and read without the `safetensors` package.

A file is: 8 bytes (little-endian u64) giving the header's length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}` (padded with
spaces so the data starts 8-byte aligned), then the tensors' raw little-endian bytes, each at
its offsets relative to the end of the header. Tensors may not overlap or alias.
"""
from __future__ import annotations

import ctypes
import json
import struct
import sys

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    t = tensor.detach().to("cpu").contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""


def save_file(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """Write `tensors` (name -> tensor) as a safetensors file at `path`."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors stores little-endian data; this host is big-endian")
    header, chunks, offset = {}, [], 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no safetensors name")
        data = _raw_bytes(tensor)
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in chunks:
            f.write(data)


def load_file(path: str) -> dict:
    """Read a safetensors file into name -> tensor (CPU), checking its structure."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (length,) = struct.unpack("<Q", blob[:8])
    if 8 + length > len(blob):
        raise ValueError(f"{path}: header length {length} runs past the end of the file")
    header = json.loads(blob[8:8 + length])
    data = memoryview(blob)[8 + length:]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype = _BY_NAME[entry["dtype"]]
        shape = entry["shape"]
        numel = 1
        for size in shape:
            numel *= size
        if end - begin != numel * torch.empty((), dtype=dtype).element_size() or end > len(data):
            raise ValueError(f"{path}: tensor {name} has {end - begin} bytes for shape {shape} "
                             f"{entry['dtype']}")
        flat = torch.frombuffer(bytearray(data[begin:end]), dtype=dtype) if numel else \
            torch.empty(0, dtype=dtype)
        out[name] = flat.reshape(shape)
    return out

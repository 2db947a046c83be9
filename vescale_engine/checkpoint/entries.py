"""What a checkpoint holds, as named entries: the engine's parameters and buffers, optimizer
state through the `checkpoint_state` interface, each rank's generators, and plain data as JSON
(the only thing besides DCP's tensors that a checkpoint stores; safe to read back)."""
from __future__ import annotations

import contextlib
import json
import os
import random
import warnings
import zlib

import torch

from ..fsdp.dtensor_params import local_index_maps, sharded_mesh_dims
from ..fsdp.param import sharding_of
from ..shard.ragged_dtensor import local_of
from ..shard.ragged_piece import RaggedPiece
from .dcp import CheckpointError, write_error

__all__ = ["sharded_params", "piece", "persistent_buffers", "optimizer_info", "optimizer_state",
           "optimizer_entries", "rng_entries", "restore_rng", "to_json", "from_json",
           "write_checked_json", "read_checked_json", "write_atomically", "fsync_dir", "crc32"]


def sharded_params(module):
    """[[parameter, [every fqn it has]]]: tied parameters once, with all their names (a plain
    model's state_dict has them all; the first name keys the optimizer state)."""
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
    sp = sharding_of(p)
    if sp is None:
        return 0
    start, end = sp.local_range
    assert end - start == local_of(p).numel(), (sp.fqn, start, end, local_of(p).numel())
    return start


def piece(p, local):
    """A parameter-shaped entry: RaggedPiece over the local range, or the plain tensor. A
    TP/EP parameter's range is one of its TP/EP-local tensor, placed on the global shape."""
    sp = sharding_of(p)
    if sp is None:
        return local.view(p.shape) if local.dim() else local
    spec = sp.dtensor_spec
    if not sharded_mesh_dims(spec):  # plain, or replicated on every TP peer: local is global
        return RaggedPiece(local, sp.shape, _local_start(p))
    return RaggedPiece(local, spec.shape, _local_start(p), local_shape=sp.shape,
                       index_maps=local_index_maps(spec))


def persistent_buffers(module):
    names = set(module.state_dict(keep_vars=True))
    return [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if n in names]


def optimizer_info(optimizer):
    """Plain data an optimizer records about its state's format (`checkpoint_info()`, e.g.
    AdamW8bit's block and code tables), saved in vescale_state.json; None when it has none."""
    return optimizer.checkpoint_info() if hasattr(optimizer, "checkpoint_info") else None


_OWN = object()


def optimizer_state(optimizer, create: bool, saved_info=_OWN) -> dict:
    """{parameter: {name: tensor}}: 1-D local views of element-wise state, 0-d scalars, or
    RaggedPieces (state with its own global 1-D length, e.g. per-block scales). An optimizer
    with `checkpoint_info` is told which format to expose: its own (saving, the default) or
    what the checkpoint recorded (loading; None when it recorded nothing)."""
    if hasattr(optimizer, "checkpoint_info"):
        return optimizer.checkpoint_state(
            create, optimizer.checkpoint_info() if saved_info is _OWN else saved_info)
    if hasattr(optimizer, "checkpoint_state"):
        return optimizer.checkpoint_state(create)
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            out[p] = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    return out


def optimizer_entries(optimizer, names_of, state):
    entries = {}
    for p, named in state.items():
        for name, t in named.items():
            t = local_of(t)  # a torch optimizer's state of a RaggedDTensor parameter: its piece
            key = f"optim.state.{names_of[id(p)][0]}.{name}"
            if isinstance(t, RaggedPiece):  # the optimizer placed it in its own global shape
                if not t.mapped and sharded_mesh_dims(
                        getattr(sharding_of(p), "dtensor_spec", None)):
                    raise CheckpointError(f"optimizer state {key}: state in the optimizer's "
                                          "own shape is not mapped to TP/EP global shapes "
                                          "(give its RaggedPiece the pieces' index_maps)")
                entries[key] = t
            elif t.dim() == 0:
                entries[key] = t
            elif t.dim() == 1 and t.numel() == local_of(p).numel():
                entries[key] = piece(p, t)
            else:
                raise CheckpointError(f"optimizer state {key} has shape {list(t.shape)}; the "
                                      "checkpoint interface takes 0-d or "
                                      f"{local_of(p).numel()} elements")
    return entries


def rng_entries(rank):
    import numpy as np
    entries = {f"rng.rank{rank}.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        entries[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state()
    version, mt, gauss = random.getstate()
    entries[f"rng.rank{rank}.python"] = torch.tensor([version, *mt, -1 if gauss is None else 1],
                                                     dtype=torch.int64, device="cpu")
    entries[f"rng.rank{rank}.python_gauss"] = torch.tensor(0.0 if gauss is None else gauss,
                                                           dtype=torch.float64, device="cpu")
    _, keys, pos, has_gauss, cached = np.random.get_state()
    entries[f"rng.rank{rank}.numpy"] = torch.tensor([*keys.astype("int64"), pos, has_gauss],
                                                    dtype=torch.int64, device="cpu")
    entries[f"rng.rank{rank}.numpy_gauss"] = torch.tensor(cached, dtype=torch.float64,
                                                          device="cpu")
    return entries


def restore_rng(rank, loaded):
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

def to_json(value, where):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return {"__tensor__": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(f"{where}: key {k!r} is not a string or int")
            out[str(k) if isinstance(k, str) else f"__int__{k}"] = to_json(v, f"{where}[{k!r}]")
        return out
    raise CheckpointError(f"{where} is a {type(value).__name__}; checkpoints keep plain data "
                          "only (None, bool, int, float, str, list, dict, tensor)")


def from_json(value):
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]),
                                device="cpu")
        return {(int(k[7:]) if k.startswith("__int__") else k): from_json(v)
                for k, v in value.items()}
    return value


STATE_CRC = "state_crc32"  # the key of a state file's own checksum


def _canonical_crc(data: dict) -> int:
    """CRC32 of the values, not of their layout: the canonical JSON of everything but the
    checksum itself (a changed digit changes it; re-indenting the file does not)."""
    body = {k: v for k, v in data.items() if k != STATE_CRC}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def write_checked_json(path, data: dict) -> None:
    """`data` as JSON at `path` (atomically), with its CRC32 under STATE_CRC."""
    data = json.loads(json.dumps(data))  # the checksum is of what a reader will see
    text = json.dumps({**data, STATE_CRC: _canonical_crc(data)}, indent=1)
    write_atomically(path, text.encode())


def read_checked_json(path) -> dict:
    """The JSON object at `path`, its STATE_CRC checked: any change of a value is one line
    naming the file. A file without STATE_CRC (written before checksums) is read with a
    warning; a wrong one is never accepted."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path} is corrupted: not JSON ({_first_line(err)})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is corrupted: not a JSON object")
    if STATE_CRC not in data:
        warnings.warn(f"{path} has no {STATE_CRC} (written by an older version): its values "
                      "cannot be checked", stacklevel=3)
        return data
    if data[STATE_CRC] != _canonical_crc(data):
        raise CheckpointError(f"{path} is corrupted: its values do not match its {STATE_CRC} "
                              "(edited or damaged after it was saved)")
    del data[STATE_CRC]
    return data


def _first_line(err) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]


def write_atomically(path, data: bytes) -> None:
    """`data` at `path` through a temporary file, fsynced, then renamed: a failure leaves the
    old file (if any) untouched and no temporary behind, and is one line naming `path` and
    the bytes it needed (CheckpointWriteError)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise write_error(path, err, len(data)) from None


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def crc32(path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc

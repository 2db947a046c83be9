"""The machine a step runs on, as a small JSON file: one GPU's compute and memory, and the two
levels of links between GPUs (NVLink/NVSwitch inside a node, one NIC per GPU between nodes,
rail-optimized). Shipped descriptions live in clusters/ ("h100", "h200"); any other file can be
named by path.

Format (every number either bare or {"value": x, "source": "where it comes from"}; the shipped
files give a source for each):

    {"name": "h100",
     "gpus_per_node": 8,
     "device": {"name": "...",
                "bf16_flops": dense bf16 peak, FLOP/s,
                "matmul_efficiency": the fraction of that peak large bf16 GEMMs reach,
                "attention_efficiency": the fraction flash attention reaches,
                "memory_bytes": device memory, bytes,
                "memory_bandwidth": HBM peak, bytes/s,
                "memory_efficiency": the fraction of it a device copy reaches},
     "intra_node": {"bandwidth": bytes/s per GPU, one direction,
                    "latency": s per ring step (NCCL's Simple protocol),
                    "efficiency": the fraction of bandwidth NCCL's busbw reaches},
     "inter_node": {... the same three, for one GPU's NIC},
     "protocols": optional, the NCCL protocols its collectives may use (default all three:
                  "LL", "LL128", "Simple"; a library with one algorithm, gloo: ["Simple"]),
     "overlap": optional, true (default) when collectives run beside compute (NCCL's own
                kernels and links); false when they share the processor (CPU ranks on gloo)}

Bad input is a ClusterError naming the file and the field.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..model_plan import read_json

__all__ = ["ClusterError", "Device", "Link", "Cluster", "load_cluster", "SHIPPED"]

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clusters")
SHIPPED = ("h100", "h200")


class ClusterError(ValueError):
    """A cluster description that cannot be used; the message names the file and field."""


@dataclass(frozen=True)
class Device:
    name: str
    bf16_flops: float
    matmul_efficiency: float
    attention_efficiency: float
    memory_bytes: float
    memory_bandwidth: float
    memory_efficiency: float


@dataclass(frozen=True)
class Link:
    bandwidth: float    # bytes/s per GPU, one direction
    latency: float      # s per ring step
    efficiency: float   # NCCL's busbw / bandwidth at large messages

    @property
    def busbw(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class Cluster:
    name: str
    path: str
    gpus_per_node: int
    device: Device
    intra_node: Link
    inter_node: Link
    protocols: tuple = ("LL", "LL128", "Simple")
    overlap: bool = True


_FRACTIONS = {"matmul_efficiency", "attention_efficiency", "memory_efficiency", "efficiency"}


def _number(path: str, section: dict, field: str, where: str) -> float:
    """A positive finite number (fractions: at most 1), bare or {"value", "source"}."""
    name = f"{where}.{field}" if where else field
    if field not in section:
        raise ClusterError(f"{path}: {name}: missing")
    raw = section[field]
    if isinstance(raw, dict):
        if "value" not in raw:
            raise ClusterError(f"{path}: {name}: expected a number or {{\"value\", \"source\"}}")
        source = raw.get("source", "")
        if not isinstance(source, str):
            raise ClusterError(f"{path}: {name}.source: must be a string")
        raw = raw["value"]
    if not isinstance(raw, (int, float)) or isinstance(raw, bool) or not math.isfinite(raw) \
            or raw <= 0:
        raise ClusterError(f"{path}: {name}: must be a positive number, got {raw!r}")
    if field in _FRACTIONS and raw > 1:
        raise ClusterError(f"{path}: {name}: a fraction must be at most 1, got {raw!r}")
    return float(raw)


def _section(path: str, data: dict, field: str) -> dict:
    if not isinstance(data.get(field), dict):
        raise ClusterError(f"{path}: {field}: missing or not an object")
    return data[field]


def _link(path: str, data: dict, field: str) -> Link:
    sec = _section(path, data, field)
    return Link(*(_number(path, sec, f, field) for f in ("bandwidth", "latency", "efficiency")))


def load_cluster(name_or_path: str) -> Cluster:
    """A shipped cluster by name ("h100", "h200") or a description file by path."""
    path = name_or_path
    if not os.path.exists(path):
        if os.sep in name_or_path or name_or_path.endswith(".json"):
            raise ClusterError(f"{name_or_path}: no such file")
        if name_or_path not in SHIPPED:
            raise ClusterError(f"{name_or_path}: unknown cluster (shipped: "
                               f"{', '.join(SHIPPED)}; or give a path to a JSON file)")
        path = os.path.join(HERE, f"{name_or_path}.json")
    data = read_json(path, ClusterError)
    if not isinstance(data, dict):
        raise ClusterError(f"{path}: expected a JSON object")
    name = data.get("name", os.path.splitext(os.path.basename(path))[0])
    gpus = _number(path, data, "gpus_per_node", "")
    if gpus != int(gpus):
        raise ClusterError(f"{path}: gpus_per_node: must be an integer, got {gpus!r}")
    dev = _section(path, data, "device")
    if not isinstance(dev.get("name"), str) or not dev["name"]:
        raise ClusterError(f"{path}: device.name: missing or not a string")
    device = Device(dev["name"], *(_number(path, dev, f, "device") for f in (
        "bf16_flops", "matmul_efficiency", "attention_efficiency", "memory_bytes",
        "memory_bandwidth", "memory_efficiency")))
    protocols = data.get("protocols", list(Cluster.protocols))
    if not isinstance(protocols, list) or not protocols or \
            any(p not in Cluster.protocols for p in protocols):
        raise ClusterError(f"{path}: protocols: a non-empty list of "
                           f"{', '.join(Cluster.protocols)}, got {protocols!r}")
    overlap = data.get("overlap", True)
    if not isinstance(overlap, bool):
        raise ClusterError(f"{path}: overlap: must be true or false, got {overlap!r}")
    return Cluster(str(name), path, int(gpus), device, _link(path, data, "intra_node"),
                   _link(path, data, "inter_node"), tuple(protocols), overlap)

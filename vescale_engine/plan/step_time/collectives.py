"""How long one NCCL collective takes: an alpha-beta model over two levels of links, the one
NCCL's own tuner uses to pick an algorithm and protocol (src/graph/tuning.cc, ncclTopoTuneModel).

A group is `size` ranks, `per_node` of them on each of n = size / per_node nodes. Its bus
bandwidth (NCCL's busbw: what each rank moves per second in a ring, at large messages) is

    n == 1:          B_nvl                          (NVLink through NVSwitch)
    n > 1, k == 1:   B_nic                          (one GPU per node: its own NIC)
    n > 1, k > 1:    min(B_nvl, k * B_nic)

with k = per_node, B_nvl and B_nic each link's bandwidth times its efficiency (cluster.py). A
ring crossing nodes goes out through one NIC per node; NCCL runs one channel per NIC (more, two
per NIC), each channel's ring leaving through a different GPU's NIC (rail-optimized), so the k
NICs of a node carry k rings at once and each rank's busbw is their sum, up to NVLink's (NCCL:
busBw = nChannels * bwInter). Eight GPUs with a 400 Gb/s NIC each thus keep ~370 GB/s busbw
across nodes, as nccl-tests measure on full DGX nodes; ~47 GB/s is one GPU per node.

Times, for `nbytes` the full buffer (all_gather's output, reduce_scatter's input, all_reduce's
buffer) and N = size:

    ring all_gather / reduce_scatter:  a + (N - n) a_nvl + (n - 1) a_net + (N-1)/N * nbytes / bw
    ring all_reduce:                   a + 2(N - n) a_nvl + 2n a_net    + 2(N-1)/N * nbytes / bw
    tree all_reduce:                   a + 2((k-1) a_nvl + floor(log2 n) a_net) + nbytes / (bw/2)
    broadcast (pipelined ring):        a + a_hop + nbytes / bw
    all_to_all (`nbytes` per rank):    a + a_hop + max(intra bytes / B_nvl, inter bytes / B_nic)

a_nvl, a_net: the cluster's per-step latencies (NCCL's Simple protocol); a: NCCL's base latency.
Each protocol (LL, LL128, Simple) scales those latencies and the bandwidth by NCCL's own
factors, and the fastest wins, as NCCL's tuner picks; all_reduce also picks ring or tree.
all_to_all: each rank sends (N-1)/N of its bytes, (k-1)/N to its node over NVLink and (N-k)/N
to other nodes over its own NIC (PXN routes through the rail's GPU), both at once.

Left out: congestion and adaptive routing in the fabric (nccl#1218 reports all_gather at 32
DGX H100 nodes at ~200 GB/s busbw where this gives ~300), stragglers and jitter, NVLink SHARP
(NVLS, which lifts an 8-GPU all_reduce to ~480 GB/s busbw) and IB SHARP (CollNet), PAT, the
LL/LL128 per-channel bandwidth caps, NCCL's channel count at small sizes (it ramps channels
with size: the latency terms stand for it), and the SMs a collective takes from compute.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .cluster import Cluster

__all__ = ["Group", "KINDS", "bus_bandwidth", "collective_time", "BASE_LATENCY"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
PROTOCOLS = ("LL", "LL128", "Simple")

# NCCL's tuning model (src/graph/tuning.cc, NCCL 2.2x), microseconds:
# base latency per algorithm and protocol ...
BASE_LATENCY = {"ring": {"LL": 6.6e-6, "LL128": 14.0e-6, "Simple": 8.4e-6},
                "tree": {"LL": 6.8e-6, "LL128": 14.0e-6, "Simple": 0.0}}
# ... and latency per step (hwLat), which here scales the cluster's Simple ring step latency
# (NVLink 3.4 us, network 14 us in NCCL's table) by NCCL's ratio for the algorithm/protocol.
_HW_LATENCY = {"nvl": {"ring": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4},
                       "tree": {"LL": 0.6, "LL128": 1.25, "Simple": 28.0}},
               "net": {"ring": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0},
                       "tree": {"LL": 5.0, "LL128": 8.5, "Simple": 28.0}}}
TREE_BW = 0.92   # tuning.cc: tree busBw = busBw * .92


@dataclass(frozen=True)
class Group:
    """`size` ranks, `per_node` on each node (size == per_node: one node)."""
    size: int
    per_node: int

    def __post_init__(self):
        if self.size < 1 or self.per_node < 1 or self.per_node > self.size \
                or self.size % self.per_node:
            raise ValueError(f"Group(size={self.size}, per_node={self.per_node}): per_node must "
                             f"divide size")

    @property
    def nodes(self) -> int:
        return self.size // self.per_node

    @classmethod
    def packed(cls, size: int, gpus_per_node: int) -> "Group":
        """Consecutive ranks: part of one node, or whole nodes."""
        if size > gpus_per_node and size % gpus_per_node:
            raise ValueError(f"{size} consecutive ranks are neither within one node nor whole "
                             f"nodes of {gpus_per_node}")
        return cls(size, min(size, gpus_per_node))


def bus_bandwidth(group: Group, cluster: Cluster) -> float:
    """NCCL busbw of a ring over the group at large messages, bytes/s (module docstring)."""
    if group.per_node > cluster.gpus_per_node:
        raise ValueError(f"a group with {group.per_node} ranks per node on {cluster.name}, "
                         f"which has {cluster.gpus_per_node} GPUs per node")
    nvl, nic = cluster.intra_node.busbw, cluster.inter_node.busbw
    if group.nodes == 1:
        return nvl
    return nic if group.per_node == 1 else min(nvl, group.per_node * nic)


def _protocol_bw(kind: str, algorithm: str, protocol: str, group: Group) -> float:
    """The fraction of Simple's bandwidth a protocol gets (tuning.cc's 'model refinements')."""
    if protocol == "Simple":
        return 1.0
    if algorithm == "tree":
        if protocol == "LL":
            return 1 / 3.8
        return 7 / 9 if group.nodes == 1 else 120 / 128
    if protocol == "LL":
        return 1 / 4 if group.nodes > 1 or kind == "all_reduce" else 1 / 3
    return 0.7 if group.per_node < 2 and group.nodes > 1 else 0.92   # LL128


def _hop(level: str, algorithm: str, protocol: str, cluster: Cluster) -> float:
    link = cluster.intra_node if level == "nvl" else cluster.inter_node
    return link.latency * _HW_LATENCY[level][algorithm][protocol] / \
        _HW_LATENCY[level]["ring"]["Simple"]


def _time(kind: str, algorithm: str, protocol: str, nbytes: float, group: Group,
          cluster: Cluster) -> float:
    N, n, k = group.size, group.nodes, group.per_node
    bw = bus_bandwidth(group, cluster) * _protocol_bw(kind, algorithm, protocol, group)
    lat = BASE_LATENCY[algorithm][protocol]
    nvl = _hop("nvl", algorithm, protocol, cluster)
    net = _hop("net", algorithm, protocol, cluster)
    if algorithm == "tree":   # all_reduce only: up the tree and down, algbw = busbw / 2
        lat += 2 * ((k - 1) * nvl + int(math.log2(n)) * net)
        return lat + nbytes / (TREE_BW * bw / 2)
    if kind in ("all_gather", "reduce_scatter"):
        return lat + (N - n) * nvl + (n - 1) * net + (N - 1) / N * nbytes / bw
    if kind == "all_reduce":   # tuning.cc: nInterSteps = 2 * nNodes across nodes
        inter = 2 * n if n > 1 else 0
        return lat + (2 * (N - 1) - inter) * nvl + inter * net + 2 * (N - 1) / N * nbytes / bw
    if kind == "broadcast":    # pipelined: one step's latency, the whole buffer at busbw
        return lat + (net if n > 1 else nvl) + nbytes / bw
    raise AssertionError(kind)


def _all_to_all(nbytes: float, group: Group, cluster: Cluster) -> float:
    N, k = group.size, group.per_node
    bus_bandwidth(group, cluster)   # the per-node check
    intra = (k - 1) / N * nbytes / cluster.intra_node.busbw
    inter = (N - k) / N * nbytes / cluster.inter_node.busbw
    hop = cluster.inter_node.latency if group.nodes > 1 else cluster.intra_node.latency
    return BASE_LATENCY["ring"]["Simple"] + hop + max(intra, inter)


def collective_time(kind: str, nbytes: float, group: Group, cluster: Cluster,
                    algorithm: str | None = None) -> float:
    """Seconds for one collective of `nbytes` (the full buffer; all_to_all: each rank's send
    buffer) over `group`. `algorithm`: "ring" or "tree" (all_reduce only), None for the faster,
    as NCCL's tuner picks; the protocol is always the fastest."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r} (expected one of {', '.join(KINDS)})")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if group.size == 1:
        return 0.0
    if kind == "all_to_all":
        if algorithm not in (None, "ring"):
            raise ValueError("all_to_all has no algorithm choice")
        return _all_to_all(nbytes, group, cluster)
    algorithms = ("ring", "tree") if kind == "all_reduce" else ("ring",)
    if algorithm is not None:
        if algorithm not in algorithms:
            raise ValueError(f"{kind} runs {' or '.join(algorithms)}, not {algorithm!r}")
        algorithms = (algorithm,)
    return min(_time(kind, a, p, nbytes, group, cluster)
               for a in algorithms for p in cluster.protocols)

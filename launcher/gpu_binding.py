"""CPU binding for CUDA ranks: local rank r drives GPU r (the engine's `local_rank % GPUs`,
one rank per GPU), so it runs on the cores of that GPU's NUMA node, found through sysfs
(PCI bus id -> /sys/bus/pci/devices/<id>/numa_node -> node's cpulist). Ranks on one node
split its usable cores into disjoint sets, as CPU ranks do (launcher.binding)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from launcher import binding as cpu


@dataclass(frozen=True)
class GpuBinding:
    cores: list     # cores[rank]: the cores that rank may run on, None: left unbound
    threads: int    # OMP_NUM_THREADS for every rank
    nodes: list     # nodes[rank]: its GPU's NUMA node, None when sysfs does not say


def gpu_bus_ids() -> list:
    """The visible GPUs' PCI addresses ("0000:1b:00.0", sysfs's form), in CUDA's order; None
    for a GPU whose address torch does not report."""
    import torch
    ids = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        bus = getattr(props, "pci_bus_id", None)
        ids.append(None if bus is None else f"{getattr(props, 'pci_domain_id', 0):04x}:"
                   f"{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0")
    return ids


def parse_cpulist(text: str) -> list:
    """'0-3,8,10-11' (sysfs's cpulist) -> [0, 1, 2, 3, 8, 10, 11]."""
    cores = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cores += range(int(first), int(last or first) + 1)
    return cores


def numa_node(bus_id: str | None, sysfs: str = "/sys") -> int | None:
    """The NUMA node a PCI device hangs off; None when unknown (-1, no file, no address)."""
    if bus_id is None:
        return None
    try:
        with open(os.path.join(sysfs, "bus", "pci", "devices", bus_id.lower(), "numa_node")) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cores(node: int, sysfs: str = "/sys") -> list:
    try:
        with open(os.path.join(sysfs, "devices", "system", "node", f"node{node}", "cpulist")) as f:
            return parse_cpulist(f.read())
    except OSError:
        return []


def numa_node_count(sysfs: str = "/sys") -> int:
    """NUMA nodes on this machine (1 where sysfs does not say)."""
    try:
        names = os.listdir(os.path.join(sysfs, "devices", "system", "node"))
    except OSError:
        return 1
    return max(1, sum(1 for n in names if n.startswith("node") and n[4:].isdigit()))


def plan_gpu_binding(nproc: int, bus_ids: list, usable: list, sysfs: str = "/sys",
                     threads: int | None = None) -> GpuBinding:
    """Rank r -> GPU r -> its NUMA node's usable cores, split evenly among the ranks of that
    node. More ranks than GPUs is an error (NCCL cannot run two ranks on one GPU)."""
    if nproc > len(bus_ids):
        raise ValueError(f"--nproc {nproc} but {len(bus_ids)} visible GPU(s): NCCL cannot run "
                         "two ranks on one GPU; start at most one rank per GPU, or set "
                         "VESCALE_BACKEND=gloo for CPU ranks")
    nodes = [numa_node(bus_ids[r], sysfs) for r in range(nproc)]
    cores = [None] * nproc
    for node in sorted({n for n in nodes if n is not None}):
        ranks = [r for r in range(nproc) if nodes[r] == node]
        allowed = [c for c in node_cores(node, sysfs) if c in set(usable)]
        if len(allowed) >= len(ranks):  # else leave them unbound rather than share cores
            for rank, cores_of_rank in zip(ranks, cpu.plan_binding(len(ranks), allowed).cores):
                cores[rank] = cores_of_rank
    bound = [len(c) for c in cores if c is not None]
    per_rank = threads or (min(bound) if bound else max(1, len(usable) // nproc))
    return GpuBinding(cores, per_rank, nodes)


def describe(bus_ids: list, plan: GpuBinding) -> list:
    """The line `vescale run` prints: each rank's GPU, NUMA node and cores."""
    parts = []
    for rank, (cores, node) in enumerate(zip(plan.cores, plan.nodes)):
        where = f"GPU {rank} ({bus_ids[rank] or 'PCI address unknown'})"
        if cores is None:
            why = "NUMA node unknown" if node is None else f"NUMA node {node}, too few cores"
            parts.append(f"rank {rank} -> {where}, unbound ({why})")
        else:
            parts.append(f"rank {rank} -> {where}, NUMA node {node}, cores "
                         f"[{cpu.core_ranges(cores)}]")
    return [f"vescale run: {'; '.join(parts)}; OMP_NUM_THREADS={plan.threads}"]

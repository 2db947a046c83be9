"""CPU core binding for local ranks, as DeepSpeed's --bind_cores_to_rank does: each rank gets
its own disjoint cores out of those this process may use, and as many OpenMP threads. Ranks
that share cores (or float over all of them) fight over caches and oversubscribe threads."""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Processor:
    brand: str
    logical_cores: int


@dataclass(frozen=True)
class Binding:
    cores: list     # cores[rank]: the cores that rank may run on
    threads: int    # OMP_NUM_THREADS for every rank
    shared: bool    # more ranks than cores: cores are handed out round-robin
    idle: list      # usable cores no rank got (the remainder of an uneven split)


def detect_processor() -> Processor:
    """The processor's brand and logical core count (py-cpuinfo)."""
    import cpuinfo
    info = cpuinfo.get_cpu_info()
    brand = info.get("brand_raw") or info.get("arch_string_raw") or "unknown processor"
    return Processor(brand, int(info.get("count") or os.cpu_count() or 1))


def usable_cores() -> list:
    """The cores this process may run on (a container or `taskset` may allow fewer than exist)."""
    return sorted(os.sched_getaffinity(0))


def plan_binding(nproc: int, cores: list, threads: int | None = None) -> Binding:
    """Split `cores` into `nproc` equal disjoint sets, in order (neighbouring cores share
    caches); with more ranks than cores, one core each, round-robin, one thread each."""
    if nproc > len(cores):
        return Binding([[cores[r % len(cores)]] for r in range(nproc)], 1, True, [])
    per_rank = len(cores) // nproc
    sets = [cores[r * per_rank:(r + 1) * per_rank] for r in range(nproc)]
    return Binding(sets, threads or per_rank, False, cores[nproc * per_rank:])


def bound_to(cores: list):
    """Context: the calling thread runs on `cores` until the block ends. A process started
    inside the block inherits this affinity (Linux gives a forked child the forking thread's
    mask), which binds a rank without running code between fork and exec."""
    return _Affinity(cores)


class _Affinity:
    def __init__(self, cores):
        self.cores = cores

    def __enter__(self):
        self.saved = os.sched_getaffinity(0)
        os.sched_setaffinity(0, self.cores)

    def __exit__(self, *exc):
        os.sched_setaffinity(0, self.saved)


def core_ranges(cores: list) -> str:
    """[0, 1, 2, 5] -> '0-2,5': readable core lists on machines with hundreds of cores."""
    parts, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            parts.append(str(start) if start == core else f"{start}-{core}")
            start = None
    return ",".join(parts)


def describe(processor: Processor, usable: list, binding: Binding) -> list:
    """The lines `vescale run` prints first: what was detected, and what each rank got."""
    lines = [f"vescale run: {processor.brand}, {processor.logical_cores} logical cores, "
             f"{len(usable)} usable [{core_ranges(usable)}]"]
    ranks = ", ".join(f"rank {r} -> cores [{core_ranges(c)}]" for r, c in enumerate(binding.cores))
    if binding.shared:
        lines.append(f"vescale run: {len(binding.cores)} ranks on {len(usable)} cores: cores "
                     f"shared round-robin, one thread each; {ranks}; OMP_NUM_THREADS=1")
    else:
        idle = f"; cores [{core_ranges(binding.idle)}] left idle" if binding.idle else ""
        lines.append(f"vescale run: {ranks}; OMP_NUM_THREADS={binding.threads}{idle}")
    return lines

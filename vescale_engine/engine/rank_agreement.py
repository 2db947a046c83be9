"""Every rank must train with the same config. `require_same_config` compares a fingerprint of
each rank's resolved config with one fixed-size all-gather, before any other collective (a
granularity or parameter dtype that differs would otherwise abort inside a C++ collective, a
different lr would train silently), and on a mismatch every rank fails with one line naming
the keys that differ and each rank's value. A rank whose config did not build takes part too,
so the others fail with its reason instead of waiting for it in the next collective.

What is compared: the validated config under canonical names (DeepSpeed's aliases mapped,
ignored top-level keys dropped), flattened to dotted key paths. Left out, because they may
legitimately differ per rank: the monitor sections (`tensorboard`, `csv_monitor`, `wandb`,
`comet`), which only rank 0 reads (or nothing does), so a per-rank output path in them changes
nothing. Paths elsewhere (`vescale.hf_checkpoint`, `vescale.save_on_signal.save_dir`) are
compared: every rank must read and write the same files.
"""
from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from config_schemas.validate import ConfigError

__all__ = ["config_facts", "require_same_config", "PER_RANK_SECTIONS"]

# Top-level sections read on rank 0 only (monitor.py) or not at all: free to differ per rank.
PER_RANK_SECTIONS = ("tensorboard", "csv_monitor", "wandb", "comet")

_SHOWN_KEYS = 4     # keys named in the one-line message
_SHOWN_CHARS = 60   # characters of one value


def _flatten(node, prefix: str, out: dict):
    if isinstance(node, dict) and node:
        for key, value in node.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = json.dumps(node, sort_keys=True, default=repr)


def config_facts(canonical: dict) -> dict:
    """{dotted key: JSON text of its value} for everything every rank must agree on (what
    the config resolves to, the batch sizes included, follows from these and the world
    size, which the process group fixes)."""
    facts = {}
    _flatten({k: v for k, v in canonical.items() if k not in PER_RANK_SECTIONS}, "", facts)
    return facts


def _digest(facts: dict | None, failure: str | None) -> torch.Tensor:
    """Status byte (0: built, 1: this rank's config failed) + sha256 of the facts."""
    text = failure if failure is not None else json.dumps(facts, sort_keys=True)
    return torch.tensor([failure is not None, *hashlib.sha256(text.encode()).digest()],
                        dtype=torch.uint8)


def _ranks(ranks: list) -> str:
    """'rank 3', 'ranks 0-2', 'ranks 0, 4-7'."""
    spans, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 3] + "..."


def describe_differences(per_rank: list) -> str:
    """One line naming each key whose value is not the same on every rank, with the ranks
    holding each value (a key a rank lacks shows as 'unset')."""
    keys = sorted({k for facts in per_rank for k in facts})
    parts = []
    for key in keys:
        values = [facts.get(key, "unset") for facts in per_rank]
        if len(set(values)) == 1:
            continue
        holders = {}
        for rank, value in enumerate(values):
            holders.setdefault(value, []).append(rank)
        parts.append(f"{key}: " + ", ".join(f"{_short(v)} on {_ranks(r)}"
                                            for v, r in holders.items()))
    more = f" (and {len(parts) - _SHOWN_KEYS} more keys)" if len(parts) > _SHOWN_KEYS else ""
    return "; ".join(parts[:_SHOWN_KEYS]) + more


def require_same_config(facts: dict | None, failure: str | None, device: torch.device):
    """Raise ConfigError on every rank unless every rank built the same config. `facts` is
    this rank's `config_facts`, or None with `failure` (the one-line reason) when its config
    did not build. Costs one all-gather of 33 bytes per rank; only on a mismatch are the facts
    themselves exchanged, to name what differs."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return
    mine = _digest(facts, failure).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)  # fixed size: gloo refuses unequal sizes
    if all(torch.equal(g, mine) for g in gathered):
        return  # the same config, or the same failure (each rank raises its own)
    detail = [None] * world
    dist.all_gather_object(detail, failure if failure is not None else facts)
    failed = [r for r, d in enumerate(detail) if isinstance(d, str)]
    if failed:
        if failure is not None:
            return  # this rank raises its own error
        first = failed[0]
        raise ConfigError([f"the config did not build on {_ranks(failed)} (rank {first}: "
                           f"{detail[first]}); this rank (rank {rank}) stops too"])
    raise ConfigError(["the config differs between ranks (every rank must train with the same "
                       "config): " + describe_differences(detail)])

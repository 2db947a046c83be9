"""Torch-free facts about the optimizers we ship: their defaults, and which parameters Muon
orthogonalizes. The optimizers import them from here, and so does the capacity planner
(`vescale plan --memory`), which must start without importing torch."""
from __future__ import annotations

import fnmatch
import math

__all__ = ["OPTIMIZERS", "ADAMW8BIT_BLOCK", "QUANT_CHUNK_ELEMENTS", "MUON_ADAMW_PATTERNS",
           "MUON_ROUNDS_IN_FLIGHT", "SHAMPOO_DEFAULTS", "SHAMPOO_BLOCK", "is_muon_matrix",
           "shampoo_block_cut",
           "shampoo_statistics", "shampoo_granularity_for", "shampoo_root_work"]

OPTIMIZERS = ("AdamW", "AdamW8bit", "Muon", "Shampoo")

# AdamW8bit: the default quantization block (also its sharding granularity), and the elements
# one restore-update-quantize pass works on at a time (quantize.py: bounds its temporaries).
ADAMW8BIT_BLOCK = "block:256"
QUANT_CHUNK_ELEMENTS = 1 << 22

# Muon: the name patterns whose parameters AdamW steps instead, and how many gather rounds run
# ahead of the one being orthogonalized (gather mode).
MUON_ADAMW_PATTERNS = ("*embed*", "wte.*", "wpe.*", "lm_head.*", "head.*", "output.*",
                       "*norm*", "ln*", "*bias")
MUON_ROUNDS_IN_FLIGHT = 2

# Shampoo (issue 26): its hyperparameters' defaults; start_preconditioning_step defaults to
# precondition_frequency. max_preconditioner_dim B is also its sharding granularity (rows:B).
SHAMPOO_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), epsilon=1e-12, grafting_epsilon=1e-8,
                        weight_decay=0.0, max_preconditioner_dim=1024, precondition_frequency=20)
SHAMPOO_BLOCK = SHAMPOO_DEFAULTS["max_preconditioner_dim"]  # what `vescale plan` estimates


def is_muon_matrix(name: str, shape, adamw_patterns=MUON_ADAMW_PATTERNS) -> bool:
    """Muon takes 2-D weights and stacked 3-D expert weights whose name matches no AdamW
    pattern; everything else (vectors, embeddings, the head, higher-rank tensors) is AdamW's."""
    if len(shape) not in (2, 3) or min(shape) == 0:
        return False
    parts = name.split(".")
    suffixes = [".".join(parts[i:]) for i in range(len(parts))]
    return not any(fnmatch.fnmatchcase(suffix, pattern) for pattern in adamw_patterns
                   for suffix in suffixes)


def shampoo_granularity_for(block: int) -> str:
    """The granularity the engine shards Shampoo's parameters with by default: `shampoo:B`,
    B-row runs (rows:B), or whole matrices for a stack whose row count is not a multiple of B
    (plan/granularity.py; optim/shampoo.py)."""
    return f"shampoo:{block}"


def shampoo_block_cut(shape, granularity_block: int, block: int):
    """The first flat element at which sharding a tensor of `shape` in atomic blocks of
    `granularity_block` elements may cut a Shampoo block of B = `block` rows (None when it never
    does: tensors of fewer than 2 dims, rows:B or a multiple of B, whole matrices). The same
    rule as optim/shampoo.py's block_cut, without torch (tests/engine/test_capacity.py compares
    them)."""
    shape = tuple(shape)
    numel = math.prod(shape)
    if len(shape) < 2 or numel == 0:
        return None
    m, n = shape[-2], shape[-1]
    for element in range(granularity_block, numel, granularity_block):
        if element % n or (element // n) % m % block:
            return element
    return None


def shampoo_statistics(shape, rows: int, block: int) -> int:
    """Elements of L plus R (and as many of QL plus QR) of the Shampoo blocks in the first
    `rows` rows of a parameter of `shape` (>= 2 dims) viewed as [prod(leading) * m, n]; `rows`
    ends between row runs of `block` (what a rank holds under Shampoo's granularity)."""
    shape = tuple(shape)
    if len(shape) < 2 or 0 in shape:
        return 0
    m, n = shape[-2], shape[-1]
    cols = [min(block, n - c) for c in range(0, n, block)]

    def of_rows(count):  # one matrix's first `count` rows
        total = 0
        for a in range(0, count, block):
            h = min(block, m - a, count - a)
            total += len(cols) * h * h + sum(w * w for w in cols)
        return total
    whole, rest = divmod(rows, m)
    return whole * of_rows(m) + of_rows(rest)


def shampoo_root_work(shape, first: int, last: int, block: int) -> int:
    """Eigendecomposition work of one root recomputation, sum of k^3 over the k x k L and R of
    every Shampoo block whose row run starts in rows [first, last) of a parameter of `shape`
    (>= 2 dims) viewed as [prod(leading) * m, n]: what a rank holding those rows computes
    every precondition_frequency steps (optim/shampoo.py's root_work, from the plan)."""
    shape = tuple(shape)
    if len(shape) < 2 or 0 in shape:
        return 0
    m, n = shape[-2], shape[-1]
    cols = [min(block, n - c) for c in range(0, n, block)]
    right = sum(w ** 3 for w in cols)
    work, row = 0, first
    while row < last:
        start = row % m - row % m % block   # the row run holding `row`, within its matrix
        height = min(block, m - start)
        if row % m == start:
            work += len(cols) * height ** 3 + right
        row += height - (row % m - start)
    return work

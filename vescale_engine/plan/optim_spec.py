"""Torch-free facts about the optimizers we ship: their defaults, and which parameters Muon
orthogonalizes. The optimizers import them from here, and so does the capacity planner
(`vescale plan --memory`), which must start without importing torch."""
from __future__ import annotations

import fnmatch

__all__ = ["OPTIMIZERS", "ADAMW8BIT_BLOCK", "QUANT_CHUNK_ELEMENTS", "MUON_ADAMW_PATTERNS",
           "MUON_ROUNDS_IN_FLIGHT", "SHAMPOO_DEFAULTS", "is_muon_matrix"]

OPTIMIZERS = ("AdamW", "AdamW8bit", "Muon")

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


def is_muon_matrix(name: str, shape, adamw_patterns=MUON_ADAMW_PATTERNS) -> bool:
    """Muon takes 2-D weights and stacked 3-D expert weights whose name matches no AdamW
    pattern; everything else (vectors, embeddings, the head, higher-rank tensors) is AdamW's."""
    if len(shape) not in (2, 3) or min(shape) == 0:
        return False
    parts = name.split(".")
    suffixes = [".".join(parts[i:]) for i in range(len(parts))]
    return not any(fnmatch.fnmatchcase(suffix, pattern) for pattern in adamw_patterns
                   for suffix in suffixes)

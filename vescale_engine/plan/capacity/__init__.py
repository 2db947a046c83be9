"""Capacity planning: per-rank memory and traffic of one training step, from a shapes file,
for our engine, PyTorch FSDP2 and DeepSpeed ZeRO-3 side by side (`vescale plan --memory`).

Ours and FSDP2 are *simulated*: one optimizer step (its gradient-accumulation micro-steps, then
the optimizer) is replayed as the sequence of allocations and frees their code makes, unit by
unit, and the largest sum of live bytes is the peak; every term is what the code allocates
(ours.py, fsdp2.py say which), on the device and, with offload, on the host, with the
bytes that cross between them per step. ZeRO-3 is estimated, not simulated, from its
allocation sites and default limits (zero3.py). Activations (and the memory a collective
library uses internally) are excluded: the output says so. Pure Python: no torch, so the command starts at
once.

One concept per module: request.py (the setup asked for, its checks), units.py (the model's
units), timeline.py (live bytes over a step), ours.py, fsdp2.py and zero3.py (each system's
memory and traffic), shampoo_work.py (Shampoo's eigendecomposition work per rank), report.py (the whole estimate). The names below are the package's
public ones, importable from `vescale_engine.plan.capacity` as before the split.
"""
from .fsdp2 import pcie_fsdp2, simulate_fsdp2, traffic_fsdp2
from .ours import (ADAMW8BIT_STEP_BYTES_PER_ELEMENT, ADAMW8BIT_TABLE_BYTES, PlanCache,
                   offloaded_buffers, pcie, simulate_ours, traffic)
from .report import ACTIVATIONS_NOTE, estimate
from .request import MASTER_BYTES, CapacityError, Setup, check_setup, default_granularity
from .shampoo_work import root_work_balance, root_work_per_rank
from .units import Tensor, Unit, default_root, model_units, tensor_uses
from .zero3 import ZERO3_DEFAULTS, estimate_zero3, pcie_zero3, sub_groups, traffic_zero3

__all__ = ["CapacityError", "Setup", "check_setup", "default_granularity", "estimate",
           "PlanCache", "tensor_uses",
           "default_root", "model_units", "Tensor", "Unit", "simulate_ours", "simulate_fsdp2",
           "estimate_zero3", "traffic", "traffic_fsdp2", "traffic_zero3", "MASTER_BYTES",
           "ACTIVATIONS_NOTE", "ADAMW8BIT_STEP_BYTES_PER_ELEMENT", "ADAMW8BIT_TABLE_BYTES",
           "ZERO3_DEFAULTS", "offloaded_buffers", "pcie", "pcie_fsdp2", "pcie_zero3",
           "sub_groups", "root_work_per_rank", "root_work_balance"]

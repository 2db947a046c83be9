"""Step-time modelling (`vescale plan --time`), torch-free: the pieces a step's schedule is
costed with. One concept per module: cluster.py (the machine, from a small JSON file; shipped:
clusters/h100.json, clusters/h200.json), collectives.py (an alpha-beta model of NCCL's
collectives over NVLink and the network), compute.py (a unit's FLOPs from the shapes file and
its "architecture" section, their time, and device-memory copies).
"""
from .cluster import SHIPPED, Cluster, ClusterError, Device, Link, load_cluster
from .collectives import KINDS, Group, bus_bandwidth, collective_time
from .compute import (CHECKPOINTING, GroupFlops, Work, active_params, copy_time, group_flops,
                      model_flops_per_token, unit_flops, unit_time)

__all__ = ["SHIPPED", "Cluster", "ClusterError", "Device", "Link", "load_cluster", "KINDS",
           "Group", "bus_bandwidth", "collective_time", "CHECKPOINTING", "GroupFlops", "Work",
           "active_params", "copy_time", "group_flops", "model_flops_per_token", "unit_flops",
           "unit_time"]

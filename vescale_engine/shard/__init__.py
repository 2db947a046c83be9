"""Sharding and its storage: RaggedShard (block ranges of one tensor over the ranks,
redistribution, gather-on-root, DCP boxes), the two collectives (all-gather and reduce-scatter:
native, or gloo point-to-point; how gradients are averaged, a buffer's CommSettings; a group's
default device) and DBuffer (one flat buffer per BufferLayout: master, gradient and full
storage, only while needed; what its collectives send is its wire formats, wire/: plain, int8
groups, FP8 tiles, hpZ's secondary gather; backward's gradients until reduced,
unreduced_grads.py; a master in host memory, offload_state.py and compute_shard.py), what the
collective path did (stats.py: STATS), the host heap's trimming (host_memory.py), and a ragged
piece as a DTensor of its global shape (ragged_dtensor.py: RaggedDTensor, its RaggedPlacement
and the aten ops it runs, ragged_ops.py; imported from its module). Must not know about
modules, hooks, optimizers or the config (RaggedDTensor only adds itself to torch's lists of
foreach-capable tensor types, as torch adds DTensor).
"""
from .dbuffer import DBuffer
from .ragged import (RaggedShard, Redistribution, ragged_to_ragged, ragged_to_replicate,
                     ragged_to_root, ragged_to_roots, root_to_ragged, roots_to_ragged)

__all__ = ["RaggedShard", "DBuffer", "Redistribution", "ragged_to_replicate", "ragged_to_ragged",
           "ragged_to_root", "root_to_ragged", "ragged_to_roots", "roots_to_ragged"]

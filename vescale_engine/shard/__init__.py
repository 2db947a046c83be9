"""Sharding and its storage: RaggedShard (block ranges of one tensor over the ranks,
redistribution, gather-on-root, DCP boxes), the two collectives (all-gather and reduce-scatter:
native, or gloo point-to-point; how gradients are averaged; a group's default device) and
DBuffer (one flat buffer per BufferLayout: master, gradient and full storage, only while
needed). Must not know about modules, hooks, optimizers or the config.
"""
from .dbuffer import DBuffer
from .ragged import (RaggedShard, Redistribution, ragged_to_ragged, ragged_to_replicate,
                     ragged_to_root, ragged_to_roots, root_to_ragged, roots_to_ragged)

__all__ = ["RaggedShard", "DBuffer", "Redistribution", "ragged_to_replicate", "ragged_to_ragged",
           "ragged_to_root", "root_to_ragged", "ragged_to_roots", "roots_to_ragged"]

"""Wire formats: what a DBuffer's collectives put on the network. One gather format (how the
weights travel into the full buffer) and one reduce format (how the full gradients travel into
the gradient shard) per buffer, chosen once when the buffer is made (DBuffer._wire_formats);
DBuffer keeps the storage and calls them. base.py: the two interfaces; plain.py: the
collectives as they are; int8.py: ZeRO++'s int8 groups (qwZ weights, qgZ gradients); fp8.py:
FP8 tiles (and the kept FP8 values fp8_matmul computes from); hpz.py: hpZ's secondary copy,
around the primary gather's format.
"""
from .base import GatherFormat, ReduceFormat
from .fp8 import Fp8TileGather
from .hpz import HpzGather
from .int8 import Int8Gather, Int8Reduce
from .plain import PlainGather, PlainReduce

__all__ = ["GatherFormat", "ReduceFormat", "PlainGather", "PlainReduce", "Int8Gather",
           "Int8Reduce", "Fp8TileGather", "HpzGather"]

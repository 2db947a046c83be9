"""Wire formats: what a DBuffer's collectives put on the network. One gather format (how the
weights travel into the full buffer) and one reduce format (how the full gradients travel into
the gradient shard) per buffer, chosen once when the buffer is made (`formats`, the one place
that knows them); DBuffer keeps the storage and calls them. base.py: the two interfaces; plain.py: the
collectives as they are; int8.py: ZeRO++'s int8 groups (qwZ weights, qgZ gradients); fp8.py:
FP8 tiles (and the kept FP8 values fp8_matmul computes from); hpz.py: hpZ's secondary copy,
around the primary gather's format.
"""
from ..quantize import GroupLayout
from .base import GatherFormat, ReduceFormat
from .fp8 import Fp8TileGather
from .hpz import HpzGather
from .int8 import Int8Gather, Int8Reduce
from .plain import PlainGather, PlainReduce

__all__ = ["GatherFormat", "ReduceFormat", "PlainGather", "PlainReduce", "Int8Gather",
           "Int8Reduce", "Fp8TileGather", "HpzGather", "formats"]


def formats(layout, quantize_group, quantized, hpz_group, quantize_format):
    """A buffer's (gather, reduce) formats, from DBuffer's constructor arguments: ZeRO++'s
    int8 groups of `quantize_group` elements for the weights ("weights" in `quantized`) and
    the gradients ("gradients"); FP8 weights ("fp8_e4m3": matrices of whole-row blocks by FP8
    tiles, every other tensor by int8 groups; gradients stay int8); hpZ's secondary gather
    inside `hpz_group` around the weights' format."""
    groups = GroupLayout(layout, quantize_group) if quantized else None
    if "weights" not in quantized:
        gather = PlainGather()
    elif quantize_format == "fp8_e4m3":
        gather = Fp8TileGather(layout, quantize_group)
    else:
        gather = Int8Gather(groups)
    if hpz_group is not None:
        gather = HpzGather(gather, hpz_group)
    reduce = Int8Reduce(groups) if "gradients" in quantized else PlainReduce()
    return gather, reduce

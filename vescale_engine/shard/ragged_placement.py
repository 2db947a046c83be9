"""RaggedPlacement: RaggedShard (ragged.py) as a DTensor `Placement` on one mesh dimension.

A placement says how the pieces lie, not how big the tensor is: it holds the block size and the
blocks per rank, and the DTensor it belongs to holds the global shape, so the two together are
exactly one RaggedShard (`layout(shape)`). Tensors of one shape and one RaggedPlacement have
the same flat range on every rank: element-wise operations between them pair the right
elements. It derives from torch's bare `Placement`, not `Shard`: it is not an even split of one
dimension, and torch's `Shard` rules must never take it for one (ragged_dtensor.py says why).
"""
from __future__ import annotations

from torch.distributed.tensor.placement_types import Placement

from .ragged import RaggedShard

__all__ = ["RaggedPlacement"]


class RaggedPlacement(Placement):
    """Rank r of the mesh dimension owns `local_units[r]` whole blocks of `block` elements of
    the row-major flattened tensor, right after the blocks of the ranks before it."""

    def __init__(self, block: int, local_units):
        super().__init__()
        block, local_units = int(block), tuple(int(u) for u in local_units)
        if block < 1:
            raise ValueError(f"RaggedPlacement block must be >= 1, got {block}")
        if not local_units or any(u < 0 for u in local_units):
            raise ValueError("RaggedPlacement local_units must be one count >= 0 per rank, got "
                             f"{list(local_units)}")
        # Set once: placements are hashed into DTensor specs, so they must not change.
        object.__setattr__(self, "_block", block)
        object.__setattr__(self, "_local_units", local_units)

    def __setattr__(self, name, value):
        raise AttributeError(f"RaggedPlacement is immutable (tried to set {name})")

    @classmethod
    def of(cls, layout: RaggedShard) -> "RaggedPlacement":
        return cls(layout.block, layout.local_units)

    @property
    def block(self) -> int:
        return self._block

    @property
    def local_units(self) -> tuple[int, ...]:
        return self._local_units

    def layout(self, shape) -> RaggedShard:
        """The RaggedShard of a tensor of `shape` placed so (raises if the blocks do not fit)."""
        return RaggedShard(tuple(shape), self._block, self._local_units)

    def __reduce__(self):
        # torch's C++ base cannot pickle a Python subclass: torch.save and deepcopy need this
        return RaggedPlacement, (self._block, self._local_units)

    def __eq__(self, other) -> bool:
        return isinstance(other, RaggedPlacement) and other._block == self._block and \
            other._local_units == self._local_units

    def __hash__(self) -> int:
        return hash(("RaggedPlacement", self._block, self._local_units))

    def __repr__(self) -> str:
        return f"RaggedPlacement(block={self._block}, local_units={self._local_units})"

    __str__ = __repr__

"""What a module holds for a sharded parameter between steps: its face.

A face is made over this rank's flat range of the master (or gradient) shard, without a copy.
The core's face is FSDP2's: a RaggedDTensor of the parameter's global shape (`RaggedFace`), so
torch's clip_grad_norm_, state-dict utilities, DCP, nn.init and optimizers see whole tensors.
Another view is a `ParameterFace` given in `ShardingPolicy(face=...)`: DeepSpeed ZeRO-3's plain
1-D piece (`ZeRO3Pieces`, what the engine asks for: the libraries it serves read parameters
as DeepSpeed's) is one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..shard.ragged_dtensor import mesh_of_group, ragged_dtensor
from .dtensor_params import face_mesh

__all__ = ["ParameterFace", "RaggedFace", "ZeRO3Pieces"]


class ParameterFace:
    """How a sharded parameter looks between steps. `global_shape`: the face has the
    parameter's global shape (torch ops see the whole tensor: casts and inits run on it as
    written); otherwise it is a piece, and such ops are refused or routed (fsdp/guards.py)."""
    global_shape: bool = True

    def check(self, fqn: str, param: torch.Tensor) -> None:
        """Refuse, before any collective, a parameter this face cannot present."""

    def mesh(self, shard_mesh, spec, fqn: str):
        """The mesh a TP/EP parameter's face lives on (checked when its unit is built), or
        None where the face needs none."""
        return None

    def make(self, sp, piece: torch.Tensor, mesh=None) -> torch.Tensor:
        """The face of `sp` (a ShardedParameter) over `piece`; `mesh` what `mesh` gave, on the
        first call, else None."""
        raise NotImplementedError


@dataclass(frozen=True)
class RaggedFace(ParameterFace):
    """FSDP2's contract: a RaggedDTensor of the global shape, its local tensor this rank's range
    of the buffer; a TP/EP parameter's on the N-D mesh of its shard group's dims and its TP/EP
    mesh (FSDP2's 2-D DTensor). Scalars and non-contiguous tensors are refused with FSDP2's
    errors: there is no dim 0 to shard or no layout to keep."""

    def check(self, fqn, param):
        if param.dim() == 0:
            raise ValueError(f"fully_shard doesn't support scalar parameters. Change {fqn} to a "
                             "1D tensor with numel equal to 1.")
        if not param.is_contiguous():
            raise NotImplementedError(f"FSDP does not support non-contiguous parameters yet: "
                                      f"{fqn} shape={tuple(param.shape)} "
                                      f"stride={param.stride()}")

    def mesh(self, shard_mesh, spec, fqn):
        return face_mesh(shard_mesh, spec, fqn)

    def make(self, sp, piece, mesh=None):
        if sp.dtensor_spec is not None:
            return ragged_dtensor(piece, sp.layout, mesh or sp.sharded._spec.mesh,
                                  tp=sp.dtensor_spec)
        # The compute device's mesh (an offloaded master is on the host, its collectives are
        # not); on meta, a placeholder until bind_storage.
        buf = sp.buffer
        device_type = "cpu" if buf.device.type == "meta" else buf.device.type
        return ragged_dtensor(piece, sp.layout, mesh_of_group(buf.shard_group, device_type))


@dataclass(frozen=True)
class ZeRO3Pieces(ParameterFace):
    """DeepSpeed ZeRO-3's parameter between steps: this rank's plain 1-D piece of the master
    shard. It takes what DeepSpeed takes (scalars, non-contiguous weights: a piece has no
    layout to keep) and needs no mesh; ops that would read it as a whole tensor (dtype casts,
    a model's init_weights) are refused or routed (fsdp/guards.py)."""
    global_shape = False

    def make(self, sp, piece, mesh=None):
        return piece

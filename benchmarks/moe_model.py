"""The MoE model the MoE benchmarks share (not a benchmark itself): fused experts with token
dispatch by all-to-all, in torchtitan's ExpertParallel style, and how each system shards it.

The experts of a layer are two fused tensors, w1 [E, 2I, H] (gate and up) and w2 [E, H, I],
distributed Shard(0) over the ep mesh (each EP rank holds E/ep whole experts). A layer routes
each token to its top-k experts, sorts the (token, expert) pairs by expert, exchanges the
per-expert counts (an all-to-all of E integers), sends every token to the EP rank owning its
expert (all-to-all, autograd: the backward is the reverse all-to-all), runs its local experts,
sends the results back and combines them with the router weights.

`shard(model, system, ...)`: ours (vescale_engine.fully_shard: experts over the efsdp mesh with
gradient_divide_factor = the dense data-parallel size, each block and the root over the dense
mesh) or FSDP2+EP (torch's fully_shard, torchtitan's recipe: experts on the efsdp mesh,
Shard(1) when efsdp x ep > E, set_gradient_divide_factor, set_force_sum_reduction_for_comms).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of the rows of `x` (dim 0) with the given splits; backward sends the
    gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class Experts(nn.Module):
    """E fused SwiGLU experts: w1 [E, 2I, H], w2 [E, H, I]. After `distribute` each rank's
    tensors are DTensors Shard(0) on the ep mesh; forward reads their local experts."""

    def __init__(self, experts, hidden, inter, local=None, padded_bmm=False):
        super().__init__()
        self.padded_bmm = padded_bmm
        n = experts if local is None else local
        self.w1 = nn.Parameter(torch.randn(n, 2 * inter, hidden) * hidden ** -0.5)
        self.w2 = nn.Parameter(torch.randn(n, hidden, inter) * inter ** -0.5)

    def forward(self, tokens, counts):
        """tokens [T, H] grouped by local expert, counts [E_local] (a list of ints)."""
        w1, w2 = self.w1.to_local(), self.w2.to_local()
        if self.padded_bmm:
            return self._padded_bmm(tokens, counts, w1, w2)
        outs = []
        for e, piece in enumerate(tokens.split(counts)):
            gate, up = (piece @ w1[e].t()).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ w2[e].t())
        return torch.cat(outs)


    @staticmethod
    def _padded_bmm(tokens, counts, w1, w2):
        """All local experts in one bmm over [E_local, C, H] (C = the largest count, the rest
        zeros): the weight gradients come out whole, once (the loop's w1[e] gives each expert
        a full-size zero-filled gradient to add up: time and memory that would swamp the
        memory benchmark)."""
        n, width = len(counts), max(max(counts), 1)
        sizes = torch.tensor(counts)
        expert = torch.repeat_interleave(torch.arange(n), sizes)
        starts = torch.cumsum(sizes, 0) - sizes
        slot = expert * width + torch.arange(len(expert)) - starts[expert]
        grid = tokens.new_zeros(n * width, tokens.shape[1]).index_copy(0, slot, tokens)
        gate, up = torch.bmm(grid.view(n, width, -1), w1.transpose(1, 2)).chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))
        return out.reshape(n * width, -1)[slot]


class MoE(nn.Module):
    """Router (top-k of a softmax) and the experts, tokens dispatched over the ep group."""

    def __init__(self, experts, hidden, inter, top_k, local=None, padded_bmm=False):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden, inter, local, padded_bmm)
        self.num_experts, self.top_k = experts, top_k
        self.ep_group = None

    def forward(self, x):
        T, H = x.shape
        E, k = self.num_experts, self.top_k
        weights, ids = self.router(x).softmax(-1).topk(k, dim=-1)      # [T, k]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        routed = x[order // k]                                          # [T k, H] by expert
        counts = torch.bincount(flat, minlength=E)                     # tokens per expert
        ep = dist.get_world_size(self.ep_group)
        local = E // ep
        # received per (source, local expert); starts as this rank's own counts, which a real
        # all-to-all overwrites and a fake process group (memory runs) leaves: then every
        # source is taken to send what this rank sends, the totals stay consistent
        recv_counts = counts.clone()
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        send = counts.view(ep, local).sum(1).tolist()
        recv_counts = recv_counts.view(ep, local)                     # [source, local expert]
        recv = _AllToAll.apply(routed, recv_counts.sum(1).tolist(), send, self.ep_group)
        # received rows are grouped (source rank, local expert): regroup by local expert
        src_expert = torch.repeat_interleave(torch.arange(ep * local), recv_counts.flatten())
        by_expert = (src_expert % local).argsort(stable=True)
        out = self.experts(recv[by_expert], recv_counts.sum(0).tolist())
        back = out[by_expert.argsort()]                                # (source, expert) again
        y = _AllToAll.apply(back, send, recv_counts.sum(1).tolist(), self.ep_group)
        combined = x.new_zeros(T, H).index_add(0, order // k,
                                               y * weights.reshape(-1)[order, None])
        return combined


class Block(nn.Module):
    """A dense MLP (standing in for attention and shared experts) and an MoE layer."""

    def __init__(self, hidden, dense, experts, inter, top_k, local=None, padded_bmm=False):
        super().__init__()
        self.norm1 = nn.RMSNorm(hidden)
        self.fc1 = nn.Linear(hidden, dense)
        self.fc2 = nn.Linear(dense, hidden)
        self.norm2 = nn.RMSNorm(hidden)
        self.moe = MoE(experts, hidden, inter, top_k, local, padded_bmm)

    def forward(self, x):
        x = x + self.fc2(F.gelu(self.fc1(self.norm1(x))))
        return x + self.moe(self.norm2(x))


class MoEModel(nn.Module):
    """Embedding, `layers` blocks (a dense MLP and an MoE), a head; cross-entropy loss."""

    def __init__(self, vocab=1024, hidden=128, dense=256, experts=8, inter=128, top_k=2,
                 layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList([Block(hidden, dense, experts, inter, top_k)
                                     for _ in range(layers)])
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)), targets)


def distribute_experts(moes, ep_mesh):
    """Experts of the MoE layers `moes` Shard(0) on `ep_mesh` (each EP rank its E/ep experts),
    tokens dispatched over its group. Tensors with E rows (one process's init) give this rank's
    slice of them; tensors built with E/ep rows (`Experts(local=...)`, the memory runs: no
    E-sized allocation) are this rank's experts as they are."""
    from torch.distributed.tensor import DTensor, Shard
    ep, r = ep_mesh.size(), ep_mesh.get_local_rank()
    for moe in moes:
        ex = moe.experts
        for name in ("w1", "w2"):
            full = getattr(ex, name).data
            n = moe.num_experts // ep
            local = full[r * n:(r + 1) * n].clone() if full.shape[0] == moe.num_experts \
                else full
            del full
            setattr(ex, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)],
                                                              run_check=False)))
        moe.ep_group = ep_mesh.get_group()


def shard(model, blocks, system, dense_mesh, efsdp_mesh, ep):
    """Shard as `system` ("ours" or "fsdp2"): each block's experts (`block.moe.experts`) over
    `efsdp_mesh` with the dense data-parallel size as gradient divisor, then each block, then
    `model` (the root), over `dense_mesh`."""
    dense = dense_mesh.size()
    if system == "ours":
        from vescale_engine.fsdp import fully_shard
        for block in blocks:
            fully_shard(block.moe.experts, mesh=efsdp_mesh, gradient_divide_factor=dense)
            fully_shard(block, mesh=dense_mesh)
        if model not in blocks:
            fully_shard(model, mesh=dense_mesh)
        return
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    for block in blocks:
        experts = block.moe.experts
        # torchtitan's rule: dim 0 (E/ep local experts) cannot give every efsdp rank a piece
        split_dim1 = efsdp_mesh.size() * ep > block.moe.num_experts
        fully_shard(experts, mesh=efsdp_mesh,
                    shard_placement_fn=(lambda p: Shard(1)) if split_dim1 else None)
        experts.set_gradient_divide_factor(float(dense))
        experts.set_force_sum_reduction_for_comms(True)  # PREMUL_SUM is NCCL-only
        fully_shard(block, mesh=dense_mesh)
    if model not in blocks:
        fully_shard(model, mesh=dense_mesh)

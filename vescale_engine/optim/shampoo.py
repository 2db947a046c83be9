"""Shampoo on RaggedShard-sharded parameters: exact block preconditioners, no communication.

The algorithm (docs/optimizers.md, issue 26), per parameter and step t with gradient g:
Adam grafting v <- b2 v + (1 - b2) g^2, A = g / (sqrt(v / (1 - b2^t)) + grafting_epsilon). A
1-D parameter uses D = A. A parameter of >= 2 dims is a stack of [m, n] matrices over its
leading dims, each cut into a grid of blocks (rows and columns in runs of B =
max_preconditioner_dim, the last run shorter). Per block Gb: L <- b2 L + (1 - b2) Gb Gb^T,
R <- b2 R + (1 - b2) Gb^T Gb (fp32, every step); at t >= S with (t - S) % F == 0 the roots
QL = (L + eps I)^-1/4, QR = (R + eps I)^-1/4 are recomputed (float64 eigh, eigenvalues clamped
at 0); for t >= S, Db = QL Gb QR scaled to the Frobenius norm of Ab, else Db = Ab. Then
m <- b1 m + (1 - b1) D and p <- p - lr m / (1 - b1^t) - lr weight_decay p.

Sharded with `shampoo:B` granularity (rows:B, or whole matrices for a stack whose rows are
not a multiple of B; the engine picks it, `block_cut` says which other granularities keep
blocks whole), every block lies whole in one rank's flat shard: a rank's piece is whole row
runs of B rows, all columns. Each rank keeps L, R, QL, QR of its own blocks only and
computes them alone, so the step has no collective at all and equals one process exactly.
Blocks of one size are batched: one bmm for the statistics of all of them, one batched eigh
for their roots (every F steps), one for the preconditioning. The step count lives on the
host, so the schedule needs no device sync.

State per parameter: `exp_avg` (m) and `exp_avg_sq` (v), element-wise; `L`, `R`, `QL`, `QR`
as this rank's contiguous range of the parameter's blocks' matrices, flattened in block order
(matrix, row run, column run): a RaggedPiece of a rank-independent global tensor
[matrices, elements per matrix], so checkpoints reshard N -> M exactly; `step`. A parameter
without a gradient in a step is skipped (its state and step untouched), as torch.optim does.

Expert parallelism: a stack of matrices split on its leading dims (fused experts, Shard(0) on
the ep mesh) holds whole global matrices, so its blocks are one process's; their statistics
are placed at their global matrices in checkpoints, and the result equals one process. A
matrix split inside by tensor parallelism would give blocks of TP pieces: refused, naming it.
1-D TP/EP pieces are element-wise (grafting only): exact.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ..fsdp.param import sharding_of
from ..shard.ragged_piece import RaggedPiece
from ..fsdp.dtensor_params import local_index_maps, sharded_mesh_dims
from ..plan.optim_spec import SHAMPOO_DEFAULTS, shampoo_granularity_for
from ..shard.ragged_dtensor import local_of
from .flat import evaluate_closure

__all__ = ["Shampoo", "shampoo_blocks", "block_cut", "shampoo_granularity", "inverse_fourth_root",
           "STATISTICS"]

STATISTICS = ("L", "R", "QL", "QR")
_NORM_FLOOR = 1e-30  # grafting: ||Ab|| / (||Pb|| + this)


def shampoo_blocks(shape, block: int) -> list:
    """[(row, rows, col, cols)] of every Shampoo block of a parameter of `shape` (>= 2 dims),
    in block order, `row` counting the rows of all its stacked matrices ([prod(lead) * m, n])."""
    m, n = shape[-2], shape[-1]
    runs = lambda size: [(a, min(block, size - a)) for a in range(0, size, block)]  # noqa: E731
    return [(e * m + a, h, c, w) for e in range(math.prod(shape[:-2]))
            for a, h in runs(m) for c, w in runs(n)]


def _row_boundary(shape, block: int, element: int) -> bool:
    """Whether a shard boundary at flat `element` falls between Shampoo blocks."""
    m, n = shape[-2], shape[-1]
    if element <= 0 or element >= math.prod(shape):
        return True
    return element % n == 0 and (element // n) % m % block == 0


def block_cut(shape, granularity_block: int, block: int):
    """The first flat element at which sharding in atomic blocks of `granularity_block`
    elements may cut a Shampoo block (None when it never does, e.g. for rows:B, a multiple of
    B rows, or whole matrices)."""
    if len(shape) < 2 or math.prod(shape) == 0:
        return None
    numel = math.prod(shape)
    for element in range(granularity_block, numel, granularity_block):
        if not _row_boundary(shape, block, element):
            return element
    return None


def inverse_fourth_root(stats: torch.Tensor, epsilon: float) -> torch.Tensor:
    """(X + eps I)^-1/4 of a stack of symmetric matrices, by eigh in float64 (eigenvalues
    clamped at 0 first), returned in float32."""
    values, vectors = torch.linalg.eigh(stats.to(torch.float64))
    scale = (values.clamp(min=0) + epsilon).pow(-0.25)
    return ((vectors * scale.unsqueeze(-2)) @ vectors.transpose(-1, -2)).to(torch.float32)


@dataclass(frozen=True)
class _Block:
    """One Shampoo block of this rank's piece, viewed as [rows of the piece, n]."""
    row: int
    rows: int
    col: int
    cols: int
    l_at: int  # offset of its rows x rows L (and QL) in the local flat L
    r_at: int  # offset of its cols x cols R (and QR) in the local flat R


@dataclass
class _Layout:
    """A parameter's blocks on this rank and where its statistics lie in the global ones."""
    cols: int          # n: the width of the piece's 2-D view
    blocks: list       # [_Block]
    l_size: int        # local flat L elements
    r_size: int
    l_start: int       # the local L's offset in the local stack's flat L (R alike)
    r_start: int
    l_matrix: int      # L elements of one matrix of the stack (R alike)
    r_matrix: int
    matrices: tuple    # (local matrices, global matrices)
    matrix_map: list | None  # global matrix of each local one (TP/EP), None: the same


def _matrix_map(sp):
    """For a TP/EP parameter of >= 3 dims split only on its leading dims: the global matrix
    index of each local matrix of its stack; None for a parameter that is not split. A split
    inside the matrices is an error naming the parameter."""
    spec = sp.dtensor_spec
    dims = sharded_mesh_dims(spec)
    if not dims:
        return None
    ndim = len(spec.shape)
    inside = [spec.placements[d] for d in dims if spec.placements[d].dim % ndim >= ndim - 2]
    if inside:
        raise NotImplementedError(
            f"Shampoo: {sp.fqn} is split inside its matrices by tensor parallelism "
            f"({inside[0]} of shape {list(spec.shape)}): its blocks would be blocks of TP "
            "pieces, not of the matrix; Shampoo supports expert parallelism (stacks split "
            "on a leading dim) and TP-replicated or 1-D parameters")
    maps = local_index_maps(spec)[:ndim - 2]
    lead = spec.shape[:ndim - 2]
    out = []
    for index in itertools.product(*(range(n) for n in sp.shape[:ndim - 2])):
        g = 0
        for d, i in enumerate(index):
            g = g * lead[d] + (maps[d][i] if maps[d] is not None else i)
        out.append(g)
    return out


def _layout(sp, block: int) -> _Layout:
    """This rank's blocks of `sp`; a shard boundary inside a block is an error naming it."""
    shape = tuple(sp.shape)
    matrix_map = _matrix_map(sp)
    start, end = sp.local_range
    for at in (start, end):
        if not _row_boundary(shape, block, at):
            raise ValueError(
                f"parameter {sp.fqn}: its shard on rank {sp.buffer.rank} starts or ends at "
                f"element {at}, inside a {block}x{block} Shampoo block (shape {list(shape)}); "
                f"shard it with granularity rows:{block} (or a multiple, or matrix)")
    n = shape[-1]
    first, last = start // n, end // n
    blocks, l_at, r_at = [], 0, 0
    l_start = r_start = l_matrix = r_matrix = 0
    for row, h, col, w in shampoo_blocks(shape, block):
        if row < first:
            l_start += h * h
            r_start += w * w
        elif row < last:
            blocks.append(_Block(row - first, h, col, w, l_at, r_at))
            l_at += h * h
            r_at += w * w
        if row < shape[-2]:   # the first matrix's blocks: every matrix has the same
            l_matrix += h * h
            r_matrix += w * w
    spec = sp.dtensor_spec
    matrices = (math.prod(shape[:-2]),
                math.prod(spec.shape[:-2]) if spec is not None else math.prod(shape[:-2]))
    return _Layout(n, blocks, l_at, r_at, l_start, r_start, l_matrix, r_matrix, matrices,
                   matrix_map)


class Shampoo(torch.optim.Optimizer):
    def __init__(self, params, lr=SHAMPOO_DEFAULTS["lr"], betas=SHAMPOO_DEFAULTS["betas"],
                 epsilon=SHAMPOO_DEFAULTS["epsilon"],
                 grafting_epsilon=SHAMPOO_DEFAULTS["grafting_epsilon"],
                 weight_decay=SHAMPOO_DEFAULTS["weight_decay"],
                 max_preconditioner_dim=SHAMPOO_DEFAULTS["max_preconditioner_dim"],
                 precondition_frequency=SHAMPOO_DEFAULTS["precondition_frequency"],
                 start_preconditioning_step=None):
        start = precondition_frequency if start_preconditioning_step is None \
            else start_preconditioning_step
        _check_hyperparameters(lr, betas, epsilon, grafting_epsilon, weight_decay,
                               max_preconditioner_dim, precondition_frequency, start)
        self._layouts = {}  # id(parameter) -> _Layout (>= 2-D parameters): add_param_group
        super().__init__(params, dict(lr=lr, betas=tuple(betas), epsilon=epsilon,
                                      grafting_epsilon=grafting_epsilon,
                                      weight_decay=weight_decay,
                                      max_preconditioner_dim=max_preconditioner_dim,
                                      precondition_frequency=precondition_frequency,
                                      start_preconditioning_step=start))

    def add_param_group(self, param_group: dict) -> None:
        """torch's, plus this rank's blocks of each parameter (torch's __init__ calls it for
        every group, and so may a user later)."""
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if sharding_of(p) is None:
                raise ValueError("vescale_engine.optim.Shampoo needs parameters sharded by "
                                 "vescale_engine.fully_shard; got a plain parameter of shape "
                                 f"{list(p.shape)}")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if len(p._vescale.shape) >= 2 and math.prod(p._vescale.shape):
                self._layouts[id(p)] = _layout(p._vescale, group["max_preconditioner_dim"])

    def root_work(self) -> float:
        """This rank's eigendecomposition work per root recomputation (sum of k^3 over its
        L and R matrices)."""
        return float(sum(b.rows ** 3 + b.cols ** 3 for lay in self._layouts.values()
                         for b in lay.blocks))

    def _new_state(self, p) -> dict:
        # on the host (the schedule reads them every step: no device sync); "roots": the
        # step whose statistics QL, QR are the roots of (0: none yet)
        state = {"step": torch.zeros((), dtype=torch.int64),
                 "roots": torch.zeros((), dtype=torch.int64),
                 "exp_avg": torch.zeros_like(local_of(p), memory_format=torch.preserve_format),
                 "exp_avg_sq": torch.zeros_like(local_of(p),
                                                memory_format=torch.preserve_format)}
        lay = self._layouts.get(id(p))
        if lay is not None:
            for name in STATISTICS:
                size = lay.l_size if name in ("L", "QL") else lay.r_size
                state[name] = torch.zeros(size, dtype=torch.float32, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            start, every = group["start_preconditioning_step"], group["precondition_frequency"]
            by_step = {}  # (t, whether its roots are recomputed) -> parameters
            for p in group["params"]:
                if p.grad is None:  # unused this step (a frozen or idle expert): untouched
                    continue
                if not self.state.get(p):
                    self.state[p] = self._new_state(p)
                state = self.state[p]
                state["step"] += 1
                t = int(state["step"])
                # on schedule, or when none were computed yet (S or F changed since)
                refresh = t >= start and ((t - start) % every == 0 or int(state["roots"]) == 0)
                if refresh:
                    state["roots"].fill_(t)
                by_step.setdefault((t, refresh), []).append(p)
            for (t, refresh), params in by_step.items():
                self._step_params(group, t, refresh, params)
        return loss

    def _step_params(self, group, t, refresh, params):
        beta1, beta2 = group["betas"]
        start = group["start_preconditioning_step"]
        # This rank's flat pieces: the math is per piece, with no DTensor dispatch per op.
        grads = [local_of(p.grad) for p in params]
        pieces = [local_of(p) for p in params]
        states = [self.state[p] for p in params]
        # Adam grafting, element-wise over every parameter at once
        squares = [s["exp_avg_sq"] for s in states]
        torch._foreach_mul_(squares, beta2)
        torch._foreach_addcmul_(squares, grads, grads, value=1 - beta2)
        denominators = torch._foreach_div(squares, 1 - beta2 ** t)
        torch._foreach_sqrt_(denominators)
        torch._foreach_add_(denominators, group["grafting_epsilon"])
        directions = torch._foreach_div(grads, denominators)  # A, then D in place
        del denominators
        sizes = {}  # (rows, cols) -> [(parameter index, block)]
        for i, p in enumerate(params):
            lay = self._layouts.get(id(p))
            for b in lay.blocks if lay is not None else ():
                sizes.setdefault((b.rows, b.cols), []).append((i, b))
        for (h, w), blocks in sizes.items():
            def views(tensors, name=None):
                out = []
                for i, b in blocks:
                    if name is None:
                        view = tensors[i].view(-1, self._layouts[id(params[i])].cols)
                        out.append(view[b.row:b.row + h, b.col:b.col + w])
                    elif name in ("L", "QL"):
                        out.append(states[i][name][b.l_at:b.l_at + h * h].view(h, h))
                    else:
                        out.append(states[i][name][b.r_at:b.r_at + w * w].view(w, w))
                return out
            g = torch.stack(views(grads)).float()   # statistics in fp32 whatever the dtype
            for name, product in (("L", g @ g.transpose(1, 2)), ("R", g.transpose(1, 2) @ g)):
                stats = views(None, name)
                torch._foreach_mul_(stats, beta2)
                torch._foreach_add_(stats, list(product.unbind(0)), alpha=1 - beta2)
                if refresh:
                    roots = inverse_fourth_root(torch.stack(stats), group["epsilon"])
                    torch._foreach_copy_(views(None, "Q" + name), list(roots.unbind(0)))
            if t >= start:
                targets = views(directions)
                adam = torch.stack(targets).float()
                pre = torch.stack(views(None, "QL")) @ g @ torch.stack(views(None, "QR"))
                scale = adam.flatten(1).norm(dim=1) / (pre.flatten(1).norm(dim=1) + _NORM_FLOOR)
                pre.mul_(scale.view(-1, 1, 1))
                torch._foreach_copy_(targets, list(pre.unbind(0)))
        moments = [s["exp_avg"] for s in states]
        torch._foreach_mul_(moments, beta1)
        torch._foreach_add_(moments, directions, alpha=1 - beta1)
        lr = group["lr"]
        if group["weight_decay"]:
            torch._foreach_mul_(pieces, 1 - lr * group["weight_decay"])
        torch._foreach_add_(pieces, moments, alpha=-lr / (1 - beta1 ** t))

    # -- checkpoints (the interface vescale_engine.checkpoint documents) ------------------------

    def checkpoint_state(self, create: bool) -> dict:
        """{parameter: {name: tensor}}: the moments as element-wise views of the local piece,
        `step` and `roots` 0-d, and L, R, QL, QR as RaggedPieces of the parameter's global
        statistics [matrices, elements per matrix] (block order): a rank's blocks are one
        contiguous range of them. Every parameter has an entry, `create` or not: one never
        stepped saves (and loads) the zero state it would start from."""
        out = {}
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state.get(p):  # never stepped: a fresh state is what it would get,
                    self.state[p] = self._new_state(p)   # so save and load one (not a gap)
                state = self.state[p]
                entry = {k: state[k] for k in ("step", "roots", "exp_avg", "exp_avg_sq")}
                lay = self._layouts.get(id(p))
                if lay is not None:
                    for name in STATISTICS:
                        entry[name] = _statistics_piece(state[name], lay, name in ("L", "QL"))
                out[p] = entry
        return out


def _statistics_piece(local: torch.Tensor, lay: _Layout, left: bool) -> RaggedPiece:
    """This rank's L or R (QL, QR) as a piece of the parameter's global statistics
    [matrices, elements per matrix]: a contiguous range of its local stack's, each local matrix
    placed at its global one under expert parallelism."""
    per = lay.l_matrix if left else lay.r_matrix
    start = lay.l_start if left else lay.r_start
    local_matrices, global_matrices = lay.matrices
    if lay.matrix_map is None:
        return RaggedPiece(local, (global_matrices, per), start)
    return RaggedPiece(local, (global_matrices, per), start, local_shape=(local_matrices, per),
                       index_maps=[lay.matrix_map, None])


def _check_hyperparameters(lr, betas, epsilon, grafting_epsilon, weight_decay, block, every,
                           start):
    betas = tuple(betas)
    problems = [(not lr >= 0, f"lr must be >= 0, got {lr}"),
                (len(betas) != 2 or not all(0 <= b < 1 for b in betas),
                 f"betas must be two numbers in [0, 1), got {list(betas)}"),
                (not epsilon > 0, f"epsilon must be > 0, got {epsilon}"),
                (not grafting_epsilon > 0, f"grafting_epsilon must be > 0, got {grafting_epsilon}"),
                (not weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay}"),
                (not (isinstance(block, int) and block > 0),
                 f"max_preconditioner_dim must be a positive integer, got {block!r}"),
                (not (isinstance(every, int) and every > 0),
                 f"precondition_frequency must be a positive integer, got {every!r}"),
                (not (isinstance(start, int) and start > 0),
                 f"start_preconditioning_step must be a positive integer, got {start!r}")]
    for bad, message in problems:
        if bad:
            raise ValueError(f"Shampoo {message}")


def shampoo_granularity(params: dict, granularity: dict, model=None) -> dict:
    """The granularity policy that keeps every Shampoo block whole on one rank.

    A config without `vescale.granularity.default` gets `shampoo:B` (B =
    max_preconditioner_dim): B-row runs, or whole matrices for a stack whose rows are not a
    multiple of B, decided from each tensor's shape (plan/granularity.py). A default the user
    set and the user's overrides are kept and checked: one that would let a shard boundary cut
    a block is an error naming the parameter. Units match override patterns against names
    relative to themselves, so every dotted suffix of a name is checked. With `model` None,
    nothing is checked."""
    from ..fsdp.policy import granularity_of
    from ..plan.granularity import parse_granularity
    block = params.get("max_preconditioner_dim", SHAMPOO_DEFAULTS["max_preconditioner_dim"])
    if not (isinstance(block, int) and block > 0):
        raise ValueError(f"Shampoo max_preconditioner_dim must be a positive integer, got "
                         f"{block!r}")
    user_default = "default" in granularity  # a default the user set, rows:1 included
    policy = {"default": str(parse_granularity(granularity["default"])) if user_default
              else shampoo_granularity_for(block),
              "overrides": dict(granularity.get("overrides", {}))}
    if model is None:
        return policy
    resolve = granularity_of(policy)
    for fqn, p in model.named_parameters():
        shape = tuple(p.shape)
        parts = fqn.split(".")
        for chosen in {resolve(".".join(parts[i:])) for i in range(len(parts))}:
            cut = block_cut(shape, chosen.block_size(shape), block)
            if cut is not None:
                raise ValueError(
                    f"parameter {fqn} {list(shape)}: granularity {chosen} would let a shard "
                    f"boundary cut a {block}x{block} Shampoo block (at element {cut}); use "
                    f"rows:{block}, a multiple of it, or matrix (or leave vescale.granularity "
                    "unset)")
    return policy

"""Muon on RaggedShard-sharded parameters, with AdamW for what is not a hidden matrix.

Per matrix (every 2-D weight, and each expert matrix of a stacked 3-D expert tensor):
momentum on the local shard; the matrix gathered whole on one root rank; Newton-Schulz there;
the result scattered back; the update applied to the local shard. Roots are chosen once,
deterministically, to balance Newton-Schulz FLOPs over ranks. Matrices move in rounds (every
rank's j-th matrix together, one uneven all-to-all each way: shard/ragged.py's
ragged_to_roots and roots_to_ragged); a bounded number of rounds is
gathered ahead, so a round's communication overlaps the round before it, no rank waits on
another's Newton-Schulz, and a root never holds more than a few gathered matrices at once.

With ZeRO-Offload (`offload_to_host`) the chosen buffers' fp32 masters and gradients live in
host memory (optim/offload.py) and so does every piece of this optimizer's state made for them:
momentum, Nesterov and weight decay run on the host. Only Newton-Schulz runs on the device:
each rank's pieces of a matrix go to the device in the Newton-Schulz dtype (2 bytes per
element for bf16) before the all-to-all that gathers it on its root, and the root's result
comes back to the host the same way, once the scatter has brought it (2 bytes per element).
Per step and offloaded matrix element: the gradient to the host as it is reduced (4 bytes,
counted by the offload), these 2 + 2, and the compute shard's refresh.

Each buffer's matrices move over that buffer's shard group, one group after another (in the
order the parameters first use them, the same on every rank). TP/EP (DTensor) parameters: an
expert tensor that EP split on a stacked dim (Shard(0)) holds whole matrices on each EP rank,
so orthogonalizing its local experts over their shard group (efsdp) is exact, with no EP-group
communication. A matrix TP split in its last two dims (colwise Shard(0), rowwise Shard(1),
_StridedShard) is orthogonalized as one process does, on the global matrix: its pieces (each
dp shard of each TP piece) move over the dp x tp ranks that hold them (the world at (dp, tp);
the TP group under HSDP, whose dp shard is one rank), the root places them by their TP index
maps, and Muon's lr scale uses the global shape. Traffic per step and TP-split R x C matrix,
in Newton-Schulz dtype bytes b: 2 R C b (1 - 1/(dp tp)) in all (each piece to the root and
back), where orthogonalizing each TP-local piece over dp (wrong) would move 2 R C b (1 - 1/dp);
the extra 2 R C b (1/dp - 1/(dp tp)) is the other TP coordinates' pieces. Roots are balanced
over the dp x tp ranks, so no rank carries more than its share of Newton-Schulz.

A matrix that already lives whole on one rank (always, when the planner shards with the
`matrix` granularity: the "tensor" mode) is orthogonalized there with no communication at all.

Hyperparameters take `torch.optim.Muon`'s names and defaults, and its step is reproduced
operation by operation (momentum as `lerp`, Nesterov, Newton-Schulz in bf16 on the transpose of
a tall matrix, decoupled weight decay with the unadjusted lr, `adjust_lr_fn`), so a user moving
from it changes nothing. Embeddings, the output head, norms and biases go to AdamW, chosen by
name patterns (matched against every dotted suffix of a parameter's name, so "head.*" matches
"model.head.weight" as well as the name inside its FSDP unit) and by shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

from ..fsdp.dtensor_params import global_shape, local_index_maps, refuse_tp_ep, sharded_mesh_dims
from ..fsdp.param import sharding_of
from ..plan.optim_spec import MUON_ADAMW_PATTERNS, MUON_ROUNDS_IN_FLIGHT, is_muon_matrix
from ..shard.ragged import RaggedShard, ragged_to_roots, roots_to_ragged
from ..shard.ragged_dtensor import local_of
from .adamw import adamw_update, new_adamw_state
from .flat import evaluate_closure
from .offload import OptimizerOffload, faces_in

__all__ = ["Muon", "newton_schulz", "adjusted_lr", "ns_flops", "is_muon_matrix",
           "DEFAULT_NS_COEFFICIENTS", "DEFAULT_NS_STEPS", "DEFAULT_EPS", "DEFAULT_ADAMW_PATTERNS",
           "NS_DTYPES", "MODES", "ROUNDS_IN_FLIGHT"]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's; docs/optimizers.md
DEFAULT_EPS = 1e-7
DEFAULT_NS_STEPS = 5
DEFAULT_ADAMW_PATTERNS = MUON_ADAMW_PATTERNS
NS_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
             "float32": torch.float32, "fp64": torch.float64, "float64": torch.float64}
MODES = ("gather", "tensor")
ROUNDS_IN_FLIGHT = MUON_ROUNDS_IN_FLIGHT  # gather mode: rounds gathered ahead of the one
# being orthogonalized


def newton_schulz(matrix: torch.Tensor, coefficients, steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalization (torch.optim.Muon's sequence of operations),
    computed in `dtype`; returns a tensor of that dtype."""
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = matrix.size(0) > matrix.size(1)
    if tall:  # iterate on the wide side: the Gram matrix is the smaller one
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn, rows: int, cols: int) -> float:
    """torch.optim.Muon's learning-rate scaling for a rows x cols matrix."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-adds of Newton-Schulz on a rows x cols matrix (what root choice balances)."""
    small, large = min(rows, cols), max(rows, cols)
    return steps * (2 * small * small * large + small ** 3)


@dataclass
class _Matrix:
    """One matrix Muon orthogonalizes: a parameter, or one expert of a stacked parameter."""
    param: int            # index into the Muon parameter list
    rows: int             # the matrix's global shape (a TP-split matrix's, not its piece's)
    cols: int
    lo: int               # this rank's slice of the parameter's local piece: [lo, hi)
    hi: int
    units: tuple          # elements of the matrix each rank of its exchange group holds
    root: int
    one_hot: bool         # already whole on `root`: no communication
    group: int = 0        # index into Muon._groups: the group it moves over
    tp: "_TPPieces | None" = None  # where a TP-split matrix's pieces lie (None: flat, in rank
    # order: the pieces concatenated are the matrix)

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def spec(self) -> RaggedShard:
        """How its pieces lie over the exchange group: rank r's `units[r]` elements, in rank
        order (for a flat matrix that order is the matrix's; a TP-split one is placed by
        `tp`)."""
        return RaggedShard((sum(self.units),), 1, self.units)

    def assemble(self, gathered: torch.Tensor) -> torch.Tensor:
        """The whole matrix from every rank's piece, concatenated in exchange-rank order."""
        if self.tp is None:
            return gathered.view(self.rows, self.cols)
        return self.tp.assemble(list(gathered.split(self.units)), self.rows, self.cols)

    def split(self, out: torch.Tensor) -> torch.Tensor:
        """The matrix `out` (rows x cols) as every rank's piece in exchange-rank order."""
        if self.tp is None:
            return out.reshape(-1)
        return torch.cat(self.tp.split(out))


@dataclass
class _Exchange:
    """A process group matrices move over: a buffer's shard group, or for TP-split matrices
    the data-parallel x tensor-parallel ranks that hold their pieces."""
    pg: object
    rank: int
    world_size: int
    device: torch.device


@dataclass
class _TPPieces:
    """Where each exchange rank's piece of one TP-split matrix lies in the global matrix. The
    ranks with one TP coordinate hold that coordinate's local matrix between them (their
    RaggedShard ranges of it, in order); the local matrix's rows and columns are global rows
    and columns by the DTensor's index maps (fsdp.dtensor_params.local_index_maps)."""
    pieces: list          # per exchange rank: (coordinate number, offset in its local matrix,
    # elements)
    coordinates: list     # per coordinate: (row selector, column selector, local rows, cols)

    def assemble(self, pieces, rows, cols) -> torch.Tensor:
        out = pieces[0].new_empty(rows, cols)
        for c, (rsel, csel, lr, lc) in enumerate(self.coordinates):
            mine = sorted(((at, k) for k, (coord, at, n) in enumerate(self.pieces)
                           if coord == c and n), key=lambda x: x[0])
            local = torch.cat([pieces[k] for _, k in mine]) if mine else pieces[0][:0]
            out[_block(rsel, csel)] = local.view(lr, lc)
        return out

    def split(self, out) -> list:
        local = [out[_block(rsel, csel)].reshape(-1) for rsel, csel, _, _ in self.coordinates]
        return [local[c][at:at + n] for c, at, n in self.pieces]


def _block(rows, cols) -> tuple:
    """The index of the rows x cols block of a matrix (each a slice or an index tensor): two
    index tensors broadcast as a column of rows against a row of columns."""
    if isinstance(rows, torch.Tensor) and isinstance(cols, torch.Tensor):
        return rows[:, None], cols
    return rows, cols


def _selector(index_map, size: int):
    """A slice when the global indices of a local dim are one run (Shard), else an index tensor
    (_StridedShard's segments)."""
    if index_map is None:
        return slice(0, size)
    if all(b == a + 1 for a, b in zip(index_map, index_map[1:])):
        return slice(index_map[0], index_map[0] + size) if size else slice(0, 0)
    return torch.tensor(index_map, dtype=torch.int64)


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=DEFAULT_NS_COEFFICIENTS, eps=DEFAULT_EPS,
                 ns_steps=DEFAULT_NS_STEPS, adjust_lr_fn=None, *, ns_dtype="bf16",
                 mode="gather", adamw_patterns=DEFAULT_ADAMW_PATTERNS, adamw_lr=None,
                 adamw_betas=(0.9, 0.999), adamw_eps=1e-8, adamw_weight_decay=None):
        _check_hyperparameters(lr, weight_decay, momentum, ns_coefficients, ns_steps,
                               adjust_lr_fn, ns_dtype, mode)
        params = list(params)
        if any(isinstance(p, dict) for p in params):
            raise ValueError("Muon builds its own parameter groups (Muon matrices, AdamW for the "
                             "rest): pass parameters, not groups")
        shared = [p for p in params if sharding_of(p) is None]
        if shared:
            raise ValueError("vescale_engine.optim.Muon needs parameters sharded by "
                             "vescale_engine.fully_shard; use torch.optim.Muon for a plain "
                             f"parameter of shape {list(shared[0].shape)}")
        self.mode = mode
        self.ns_dtype = NS_DTYPES[ns_dtype]
        self.adamw_patterns = tuple(adamw_patterns)
        # by the global shape: a TP piece can be empty on one rank (a dim tp does not
        # divide), and every rank must pick the same matrices for the exchanges to match
        matrices = [p for p in params if is_muon_matrix(p._vescale.fqn, global_shape(p._vescale),
                                                        self.adamw_patterns)]
        # AdamW is element-wise: any TP/EP piece steps as one process. A matrix TP split is
        # gathered whole over its dp x tp ranks; experts EP split hold whole matrices. Both at
        # once (expert TP) would need the stacked split mapped too.
        refuse_tp_ep([p for p in matrices if _splits_a_matrix(p._vescale) and
                      min(_split_dims(p._vescale)) < len(p._vescale.shape) - 2], "Muon",
                     "its stacked (expert) dim and its matrices are both split: expert tensor "
                     "parallelism")
        chosen = {id(p) for p in matrices}
        others = [p for p in params if id(p) not in chosen]
        if not matrices:
            described = ", ".join(f"{p._vescale.fqn} {list(p._vescale.shape)}" for p in params)
            raise ValueError("Muon: no 2-D (or stacked 3-D) parameter outside the AdamW name "
                             f"patterns {list(self.adamw_patterns)}; the parameters are: "
                             f"{described}. Use AdamW, or change adamw_patterns")
        groups = [dict(params=matrices, use_muon=True)]
        if others:
            groups.append(dict(params=others, use_muon=False,
                               lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas),
                               eps=adamw_eps, weight_decay=weight_decay
                               if adamw_weight_decay is None else adamw_weight_decay))
        super().__init__(groups, dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                      nesterov=nesterov, ns_coefficients=tuple(ns_coefficients),
                                      eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn))
        self._sharded = [p._vescale for p in matrices]
        self._matrices = self._plan_matrices(ns_steps)
        self.bytes_sent = 0  # bytes this rank sent for Muon in the last step (gathers + scatters)
        self.rounds_in_flight = ROUNDS_IN_FLIGHT  # gather rounds issued ahead (gather mode)
        self.offload = None  # OptimizerOffload once `offload_to_host` chose buffers
        self.record_trace = False  # tests: log ("gather", round), ("ns", matrix) and
        # ("scatter", round) in the order they are issued
        self.trace = []

    def offload_to_host(self, ratio: float = 1.0, pin_memory: bool = False,
                        offload_param: bool = False) -> OptimizerOffload:
        """Step `ratio` of the buffers (by bytes, largest first) with their master, gradient and
        this optimizer's state in host memory from now on (optim/offload.py); Newton-Schulz
        stays on the device. Before the first step only."""
        if self.state:
            raise RuntimeError("offload_to_host: the optimizer already holds state")
        params = [p for g in self.param_groups for p in g["params"]]
        buffers = list({id(p._vescale.buffer): p._vescale.buffer for p in params}.values())
        # the state is per parameter, made on the host beside its master: nothing in the
        # buffer's allocation but the master and gradient
        self.offload = OptimizerOffload(buffers, lambda b: [], ratio=ratio,
                                        pin_memory=pin_memory, offload_param=offload_param,
                                        faces_of=faces_in(params))
        return self.offload

    def _offloaded_buffers(self, stepped: bool) -> list:
        """The offloaded buffers holding parameters of this optimizer (with a gradient now,
        when `stepped`)."""
        if self.offload is None:
            return []
        found = {}
        for group in self.param_groups:
            for p in group["params"]:
                buf = p._vescale.buffer
                if self.offload.offloads(buf) and (not stepped or p.grad is not None):
                    found[id(buf)] = buf
        return list(found.values())

    def _count_pcie(self, param: int, nbytes: int, to_host: bool) -> None:
        """Newton-Schulz traffic of an offloaded matrix, in the offload's counters."""
        if self.offload is not None and self.offload.offloads(self._sharded[param].buffer):
            if to_host:
                self.offload.stats.bytes_to_host += nbytes
            else:
                self.offload.stats.bytes_to_device += nbytes

    # -- which rank orthogonalizes what ----------------------------------------------------------

    def _plan_matrices(self, ns_steps):
        """Every matrix's layout and root: matrices already whole on one rank stay there; the
        others go, largest first, to the least-loaded rank of their exchange group (ties: the
        rank holding most of it, then the lowest rank), so every rank computes the same
        assignment."""
        matrices = []
        # One exchange group per distinct process group, in first-use order (the same on every
        # rank): a buffer's shard group (with EP the experts' buffers shard over efsdp, the
        # dense ones over dp), or for TP-split matrices the dp x tp ranks holding their pieces.
        self._groups = []
        tp = _tp_exchanges([sp for sp in self._sharded if _splits_a_matrix(sp)])
        for index, sp in enumerate(self._sharded):
            buf = sp.buffer
            if id(sp) in tp:
                exchange, layouts = tp[id(sp)]
            else:
                exchange, layouts = _Exchange(buf.shard_group, buf.rank, buf.world_size,
                                              buf.device), None
            known = [k for k, e in enumerate(self._groups) if e.pg is exchange.pg]
            if not known:
                self._groups.append(exchange)
            group = known[0] if known else len(self._groups) - 1
            matrices += (_flat_matrices(index, sp, group) if layouts is None else
                         _tp_matrices(index, sp, group, layouts))
        self.ns_loads = []  # per exchange group: Newton-Schulz FLOPs of each of its ranks
        for group, exchange in enumerate(self._groups):
            load = [0] * exchange.world_size
            mine = [m for m in matrices if m.group == group]
            for m in mine:
                if m.one_hot:
                    load[m.root] += ns_flops(m.rows, m.cols, ns_steps)
            pending = sorted((m for m in mine if not m.one_hot),
                             key=lambda m: -ns_flops(m.rows, m.cols, ns_steps))
            for m in pending:
                m.root = min(range(exchange.world_size),
                             key=lambda r: (load[r], -m.units[r], r))
                load[m.root] += ns_flops(m.rows, m.cols, ns_steps)
            self.ns_loads.append(load)
        self.ns_load = self.ns_loads[0]
        return matrices

    # -- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        stepped = self._offloaded_buffers(stepped=True)
        for buf in stepped:  # the host gradients, once their copies have arrived
            self.offload.to_host(buf)
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        for buf in stepped:  # the host masters were written: the compute shards follow
            self.offload.stepped(buf)
        return loss

    def _muon_step(self, group):
        params = group["params"]
        with_grad = [i for i, p in enumerate(params) if p.grad is not None]
        if not with_grad:
            return
        momentum = group["momentum"]
        bufs = []
        for i in with_grad:
            state = self.state[params[i]]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(local_of(params[i].grad))
            bufs.append(state["momentum_buffer"])
        # This rank's flat pieces (the parameters are RaggedDTensors): sliced and stepped as such.
        grads = [local_of(params[i].grad) for i in with_grad]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        updates = dict(zip(with_grad, [g.lerp(b, momentum) for g, b in zip(grads, bufs)]
                           if group["nesterov"] else bufs))
        todo = [m for m in self._matrices if m.param in updates]
        self.bytes_sent = 0
        results = [None] * len(todo)
        for g, exchange in enumerate(self._groups):  # one group after another, in order
            picked = [k for k, m in enumerate(todo) if m.group == g]
            for k, out in zip(picked, self._orthogonalize([todo[k] for k in picked], updates,
                                                          group, exchange)):
                results[k] = out
        lr, decay = group["lr"], group["weight_decay"]
        for i in with_grad:
            local_of(params[i]).mul_(1 - lr * decay)
        for m, local in zip(todo, results):
            if m.hi > m.lo:
                target = local_of(params[m.param])[m.lo:m.hi]
                if local.device != target.device:  # the device's result to the host master
                    local = local.to(target.device)
                self._count_pcie(m.param, local.numel() * local.element_size(), to_host=True)
                target.add_(local, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], m.rows, m.cols))

    def _orthogonalize(self, todo, updates, group, exchange):
        """This rank's piece of every matrix's Newton-Schulz result.

        Matrices move in rounds: round j holds every rank's j-th matrix to orthogonalize
        (largest first), and one uneven all-to-all gathers a round onto its roots, another
        scatters its results back. `rounds_in_flight` rounds are gathered ahead (round j+1's
        gather is in flight while round j is orthogonalized) and each scatter is issued right
        after its round, so a rank never waits for another rank's Newton-Schulz, only for data
        (a pair of collectives per matrix, in one global order, made every rank wait whenever
        one rooted several matrices in a row). Bounding the rounds ahead bounds what a root
        holds: a few gathered matrices and results, not all of them at once. Pieces travel in
        the Newton-Schulz dtype: the iteration starts by casting to it, so casting first
        changes nothing but halves the bytes for bf16."""
        if not todo:
            return []
        rank, world, pg = exchange.rank, exchange.world_size, exchange.pg
        device, dtype = exchange.device, self.ns_dtype  # compute device (masters: maybe host)
        ns = dict(coefficients=group["ns_coefficients"], steps=group["ns_steps"],
                  eps=group["eps"], dtype=dtype)
        cost = [-ns_flops(m.rows, m.cols, group["ns_steps"]) for m in todo]
        by_root = [sorted((k for k, m in enumerate(todo) if m.root == r and not m.one_hot),
                          key=lambda k: (cost[k], k)) for r in range(world)]
        rounds = [[r_list[j] if j < len(r_list) else None for r_list in by_root]
                  for j in range(max(map(len, by_root)))]  # rounds[j][r]: matrix or None
        ahead = max(1, self.rounds_in_flight)

        def on_device(k):  # this rank's piece of matrix k, in the Newton-Schulz dtype
            m = todo[k]
            local = updates[m.param][m.lo:m.hi]
            self._count_pcie(m.param, local.numel() * dtype.itemsize, to_host=False)
            return local.to(device=device, dtype=dtype)

        def gather(j):  # every rank's piece of round j's matrices onto their roots
            moving = [k for k in rounds[j] if k is not None]
            self._log("gather", j)
            self.bytes_sent += sum(todo[k].units[rank] for k in moving
                                   if todo[k].root != rank) * dtype.itemsize
            return ragged_to_roots([on_device(k) for k in moving],
                                   [todo[k].spec for k in moving],
                                   [todo[k].root for k in moving], group=pg, async_op=True)

        def scatter(j, out):  # round j's results back into every rank's piece
            moving = [k for k in rounds[j] if k is not None]
            self._log("scatter", j)
            mine = rounds[j][rank]
            if mine is not None:
                self.bytes_sent += (todo[mine].numel - todo[mine].units[rank]) * dtype.itemsize
            return moving, roots_to_ragged(
                [out if k == mine else None for k in moving], [todo[k].spec for k in moving],
                [todo[k].root for k in moving], group=pg, async_op=True, dtype=dtype,
                device=device)

        results = [None] * len(todo)

        def finish_scatter(moving, handle):
            for k, local in zip(moving, handle.wait()):
                results[k] = local

        gathers = {j: gather(j) for j in range(min(ahead, len(rounds)))}
        for k, m in enumerate(todo):  # matrices already whole here, while the gathers run
            if m.one_hot and m.root == rank:
                self._log("ns", k)
                results[k] = newton_schulz(on_device(k).view(m.rows, m.cols),
                                           **ns).reshape(-1)
        scatters = []
        for j, row in enumerate(rounds):
            gathered = gathers.pop(j).wait()  # round j's pieces: the matrix this rank roots
            k = row[rank]
            out = None
            if k is not None:
                m = todo[k]
                self._log("ns", k)
                out = m.split(newton_schulz(m.assemble(gathered[0]), **ns))
            del gathered
            scatters.append(scatter(j, out))
            if j + ahead < len(rounds):
                gathers[j + ahead] = gather(j + ahead)
            if len(scatters) > ahead:  # the oldest result has had `ahead` rounds to arrive
                finish_scatter(*scatters.pop(0))
        for moving, handle in scatters:
            finish_scatter(moving, handle)
        empty = torch.empty(0, dtype=dtype, device=device)
        return [empty if out is None else out for out in results]

    def _log(self, what, index):
        if self.record_trace:
            self.trace.append((what, index))

    # -- checkpoints (the interface vescale_engine.checkpoint documents) ------------------------

    def checkpoint_state(self, create: bool) -> dict:
        """{parameter: {name: tensor}}: Muon's momentum and AdamW's moments are element-wise
        views of each parameter's local piece, steps 0-d: all reshard on load."""
        out = {}
        for group in self.param_groups:
            for p in group["params"]:
                if create and not self.state.get(p):
                    self.state[p] = {"momentum_buffer": torch.zeros_like(local_of(p))} \
                        if group["use_muon"] else new_adamw_state(local_of(p))
                if self.state.get(p):
                    out[p] = dict(self.state[p])
        return out

    def _adamw_step(self, group):
        params = [p for p in group["params"] if p.grad is not None and local_of(p).numel()]
        if not params:
            return
        for p in params:
            if not self.state.get(p):
                self.state[p] = new_adamw_state(local_of(p))
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        # torch.optim.AdamW's update over all of them in one fused call (one pass over memory).
        adamw_update([local_of(p) for p in params], [local_of(p.grad) for p in params], [s["exp_avg"] for s in states],
                     [s["exp_avg_sq"] for s in states], [s["step"] for s in states],
                     lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"])


def _overlap(start, end, lo, hi) -> tuple[int, int]:
    """[a, b) = [start, end) & [lo, hi), empty as (lo, lo) clipped into [lo, hi]."""
    a = min(max(start, lo), hi)
    return a, max(a, min(end, hi))


def _flat_matrices(index, sp, group) -> list:
    """The matrices of a parameter whose matrices are whole in its local tensor (plain, TP-
    replicated, or experts EP split on a stacked dim): each matrix's pieces are its ranges on
    the shard group's ranks, in rank order."""
    spec = sp.layout
    rows, cols = sp.shape[-2], sp.shape[-1]
    local_start, local_end = sp.local_range
    out = []
    for e in range(math.prod(sp.shape[:-2])):
        lo_e, hi_e = e * rows * cols, (e + 1) * rows * cols
        units = tuple(max(0, min(hi, hi_e) - max(lo, lo_e)) for lo, hi in spec.ranges())
        lo, hi = _overlap(lo_e, hi_e, local_start, local_end)
        owner = [r for r, u in enumerate(units) if u == rows * cols]
        out.append(_Matrix(index, rows, cols, lo - local_start, hi - local_start, units,
                           owner[0] if owner else -1, bool(owner), group))
    return out


def _tp_matrices(index, sp, group, layouts) -> list:
    """The matrices of a parameter TP split inside its matrices: each one the global matrix,
    whose pieces are every exchange rank's RaggedShard range of its TP-local matrix, placed by
    that rank's TP coordinate. `layouts`: per exchange rank (coordinate, local shape, local
    range); the stacked dims (experts) are not split, so local matrix e is global matrix e."""
    spec = sp.dtensor_spec
    rows, cols = spec.shape[-2], spec.shape[-1]
    coordinates, number = [], {}
    for coordinate, shape, _lo, _hi in layouts:
        if coordinate not in number:
            number[coordinate] = len(coordinates)
            maps = local_index_maps(spec, list(coordinate))
            coordinates.append((_selector(maps[-2], shape[-2]), _selector(maps[-1], shape[-1]),
                                shape[-2], shape[-1]))
    local_start, local_end = sp.local_range
    local_numel = sp.shape[-2] * sp.shape[-1]
    out = []
    for e in range(math.prod(sp.shape[:-2])):
        pieces = []
        for coordinate, shape, lo_q, hi_q in layouts:
            n = shape[-2] * shape[-1]
            a, b = _overlap(lo_q, hi_q, e * n, (e + 1) * n)
            pieces.append((number[coordinate], a - e * n, b - a))
        units = tuple(n for *_, n in pieces)
        if sum(units) != rows * cols:
            raise AssertionError(f"Muon: {sp.fqn} matrix {e}: the TP pieces hold {sum(units)} "
                                 f"of {rows * cols} elements (layout bug)")
        lo, hi = _overlap(e * local_numel, (e + 1) * local_numel, local_start, local_end)
        out.append(_Matrix(index, rows, cols, lo - local_start, hi - local_start, units, -1,
                           False, group, _TPPieces(pieces, coordinates)))
    return out


def _tp_peers(spec) -> tuple:
    """The ranks holding the other TP pieces of this rank's piece: spec.mesh along the mesh
    dims that split the tensor (replicas along the others hold copies)."""
    mesh = spec.mesh
    here = mesh.get_coordinate()
    dims = sharded_mesh_dims(spec)
    select = tuple(slice(None) if d in dims else here[d] for d in range(mesh.ndim))
    return tuple(sorted(mesh.mesh[select].flatten().tolist()))


def _tp_exchanges(split) -> dict:
    """{id(sp): (exchange, layouts)} for the TP-split parameters `split` (the same parameters
    on every rank). A TP-split matrix's pieces lie on its buffer's shard group S times the TP
    peers M of each of them: those |S| x |M| ranks are its exchange group (the world, the TP
    group when S is one rank (HSDP), else a new group). `layouts`: per rank of it, in its rank
    order, (TP coordinate, local shape, local range).

    Collective: one all_gather_object over the world (each rank's (S, M) per distinct pair, so
    that every rank knows every group and makes the same new groups in the same order), then
    one per exchange group (the layouts). Nothing when no parameter is TP-split anywhere."""
    if not split:
        return {}
    pairs, pair_of = [], []
    for sp in split:
        pair = (tuple(sorted(dist.get_process_group_ranks(sp.buffer.shard_group))),
                _tp_peers(sp.dtensor_spec))
        if pair not in pairs:
            pairs.append(pair)
        pair_of.append(pairs.index(pair))
    world, me = dist.get_world_size(), dist.get_rank()
    facts = [None] * world
    dist.all_gather_object(facts, pairs)
    if len({len(f) for f in facts}) != 1:
        raise RuntimeError("Muon: the ranks have different tensor-parallel layouts "
                           f"({[len(f) for f in facts]} per rank): build the same model on "
                           "every rank")
    made = {}
    groups = []  # per pair of mine: the exchange's process group
    for i, (shard, peers) in enumerate(pairs):
        spec = split[pair_of.index(i)].dtensor_spec
        every = sorted({tuple(sorted({q for s in facts[r][i][0] for q in facts[s][i][1]}))
                        for r in range(world)})
        mine = None
        for ranks in every:  # the same loop on every rank: new groups in the same order
            group_facts = [facts[q][i] for q in ranks]
            if len(ranks) != len(group_facts[0][0]) * len(group_facts[0][1]) or any(
                    not set(f[0]) | set(f[1]) <= set(ranks) for f in group_facts):
                raise NotImplementedError(
                    f"Muon: {split[pair_of.index(i)].fqn}: its TP pieces' data-parallel shards "
                    f"lie on ranks {list(ranks)}, not a (data-parallel x tensor-parallel) grid")
            if ranks == tuple(range(world)):
                pg = dist.group.WORLD
            elif all(ranks == f[1] for f in group_facts) and len(sharded_mesh_dims(spec)) == 1:
                pg = "tp"  # the TP group itself (data-parallel shards of one rank: HSDP)
            else:
                if ranks not in made:
                    made[ranks] = dist.new_group(list(ranks))
                pg = made[ranks]
            if me in ranks:
                mine = pg
        if mine == "tp":
            mine = spec.mesh.get_group(sharded_mesh_dims(spec)[0])
        groups.append(mine)
    out = {}
    for i, pg in enumerate(groups):
        params = [sp for sp, k in zip(split, pair_of) if k == i]
        mine = [(tuple(sp.dtensor_spec.mesh.get_coordinate()), tuple(sp.shape), *sp.local_range)
                for sp in params]
        every = [None] * dist.get_world_size(pg)
        dist.all_gather_object(every, mine, group=pg)
        exchange = _Exchange(pg, dist.get_rank(pg), dist.get_world_size(pg),
                             params[0].buffer.device)
        for k, sp in enumerate(params):
            out[id(sp)] = (exchange, [layouts[k] for layouts in every])
    return out


def _splits_a_matrix(sp) -> bool:
    """Whether TP cut this parameter inside its matrices (one of its last two dims), so that
    its local tensor holds pieces of matrices, not whole ones."""
    return any(d >= len(sp.shape) - 2 for d in _split_dims(sp))


def _split_dims(sp) -> set:
    """The tensor dims TP/EP split (as non-negative dims)."""
    spec = sp.dtensor_spec
    if spec is None:
        return set()
    ndim = len(sp.shape)
    return {d % ndim for d in (getattr(p, "dim", None) for p in spec.placements
                               if not isinstance(p, Replicate)) if d is not None}


def _check_hyperparameters(lr, weight_decay, momentum, ns_coefficients, ns_steps, adjust_lr_fn,
                           ns_dtype, mode):
    """torch.optim.Muon's checks, plus ours (dtype, mode)."""
    if not 0.0 <= lr:
        raise ValueError(f"Muon lr should be >= 0 but is: {lr}")
    if not 0.0 <= momentum:
        raise ValueError(f"Muon momentum should be >= 0 but is: {momentum}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Muon weight_decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn is not None and adjust_lr_fn not in ("original", "match_rms_adamw"):
        raise ValueError(f"Muon adjust_lr_fn {adjust_lr_fn!r} is not supported (use 'original' "
                         "or 'match_rms_adamw')")
    if len(tuple(ns_coefficients)) != 3:
        raise ValueError(f"Muon ns_coefficients must be 3 numbers, got {ns_coefficients}")
    if not 0 < ns_steps < 100:
        raise ValueError(f"Muon ns_steps must be in 1..99, got {ns_steps}")
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"Muon ns_dtype {ns_dtype!r} is not one of {', '.join(NS_DTYPES)}")
    if mode not in MODES:
        raise ValueError(f"Muon mode {mode!r} is not one of {', '.join(MODES)}")

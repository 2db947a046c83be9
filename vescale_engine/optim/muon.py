"""Muon on RaggedShard-sharded parameters, with AdamW for what is not a hidden matrix.

Per matrix (every 2-D weight, and each expert matrix of a stacked 3-D expert tensor):
momentum on the local shard; the matrix gathered whole on one root rank; Newton-Schulz there;
the result scattered back; the update applied to the local shard. Roots are chosen once,
deterministically, to balance Newton-Schulz FLOPs over ranks. Matrices move in rounds (every
rank's j-th matrix together, one uneven all-to-all each way); a bounded number of rounds is
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
communication; a matrix TP split in its last two dims is refused (it would need the TP-global
matrix gathered over the dp x tp ranks holding it).

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

from ..fsdp.dtensor_params import refuse_tp_ep
from ..plan.optim_spec import MUON_ADAMW_PATTERNS, MUON_ROUNDS_IN_FLIGHT, is_muon_matrix
from ..shard.ragged import RaggedShard
from .adamw import adamw_update, new_adamw_state
from .flat import evaluate_closure
from .offload import OptimizerOffload, faces_in

__all__ = ["Muon", "newton_schulz", "adjusted_lr", "ns_flops", "is_muon_matrix",
           "DEFAULT_NS_COEFFICIENTS", "DEFAULT_NS_STEPS", "DEFAULT_EPS", "DEFAULT_ADAMW_PATTERNS",
           "NS_DTYPES", "MODES", "ROUNDS_IN_FLIGHT"]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # PAPER.md / torch.optim.Muon
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
    rows: int
    cols: int
    lo: int               # this rank's slice of the parameter's local piece: [lo, hi)
    hi: int
    spec: RaggedShard     # the matrix's element layout over ranks
    root: int
    one_hot: bool         # already whole on `root`: no communication
    group: int = 0        # index into Muon._groups: the buffers' shard group it moves over

    @property
    def numel(self) -> int:
        return self.rows * self.cols


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
        shared = [p for p in params if getattr(p, "_vescale", None) is None]
        if shared:
            raise ValueError("vescale_engine.optim.Muon needs parameters sharded by "
                             "vescale_engine.fully_shard; use torch.optim.Muon for a plain "
                             f"parameter of shape {list(shared[0].shape)}")
        self.mode = mode
        self.ns_dtype = NS_DTYPES[ns_dtype]
        self.adamw_patterns = tuple(adamw_patterns)
        matrices = [p for p in params if is_muon_matrix(p._vescale.fqn, p._vescale.shape,
                                                        self.adamw_patterns)]
        # AdamW is element-wise: any TP/EP piece steps as one process. A matrix is orthogonalized
        # from its TP/EP-local tensor, which is exact only where that holds whole matrices.
        refuse_tp_ep([p for p in matrices if _splits_a_matrix(p._vescale)], "Muon",
                     "it would orthogonalize each rank's TP-local piece of the matrix, not the "
                     "matrix; only a split of the stacked dims of experts (EP Shard(0)) is exact")
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
        others go, largest first, to the least-loaded rank (ties: the rank holding most of it,
        then the lowest rank), so every rank computes the same assignment."""
        matrices = []
        # One exchange group per distinct shard group, in first-use order (the same on every
        # rank): with EP the experts' buffers shard over efsdp, the dense ones over dp.
        self._groups = []
        for index, sp in enumerate(self._sharded):
            buf = sp.buffer
            known = [k for k, b in enumerate(self._groups) if b.shard_group is buf.shard_group]
            if not known:
                self._groups.append(buf)
            group = known[0] if known else len(self._groups) - 1
            placement = buf.layout.placements[sp.index]
            world = buf.world_size
            spec = RaggedShard(sp.shape, sp.block, placement.local_units(world))
            rows, cols = sp.shape[-2], sp.shape[-1]
            local_start, local_end = spec.local_range(buf.rank)
            for e in range(math.prod(sp.shape[:-2])):
                lo_e, hi_e = e * rows * cols, (e + 1) * rows * cols
                units = [max(0, min(hi, hi_e) - max(lo, lo_e)) for lo, hi in spec.ranges()]
                lo = min(max(local_start, lo_e), local_end) - local_start
                hi = max(min(local_end, hi_e), local_start) - local_start
                owner = [r for r, u in enumerate(units) if u == rows * cols]
                matrices.append(_Matrix(index, rows, cols, lo, max(lo, hi),
                                        RaggedShard((rows, cols), 1, units),
                                        owner[0] if owner else -1, bool(owner), group))
        self.ns_loads = []  # per exchange group: Newton-Schulz FLOPs of each of its ranks
        for group, buf in enumerate(self._groups):
            load = [0] * buf.world_size
            mine = [m for m in matrices if m.group == group]
            for m in mine:
                if m.one_hot:
                    load[m.root] += ns_flops(m.rows, m.cols, ns_steps)
            pending = sorted((m for m in mine if not m.one_hot),
                             key=lambda m: -ns_flops(m.rows, m.cols, ns_steps))
            for m in pending:
                m.root = min(range(buf.world_size),
                             key=lambda r: (load[r], -m.spec.local_units[r], r))
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
                state["momentum_buffer"] = torch.zeros_like(params[i].grad)
            bufs.append(state["momentum_buffer"])
        grads = [params[i].grad for i in with_grad]
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        updates = dict(zip(with_grad, [g.lerp(b, momentum) for g, b in zip(grads, bufs)]
                           if group["nesterov"] else bufs))
        todo = [m for m in self._matrices if m.param in updates]
        self.bytes_sent = 0
        results = [None] * len(todo)
        for g, buf in enumerate(self._groups):  # one group after another, in the same order
            picked = [k for k, m in enumerate(todo) if m.group == g]
            for k, out in zip(picked, self._orthogonalize([todo[k] for k in picked], updates,
                                                          group, buf)):
                results[k] = out
        lr, decay = group["lr"], group["weight_decay"]
        for i in with_grad:
            params[i].mul_(1 - lr * decay)
        for m, local in zip(todo, results):
            if m.hi > m.lo:
                target = params[m.param][m.lo:m.hi]
                if local.device != target.device:  # the device's result to the host master
                    local = local.to(target.device)
                self._count_pcie(m.param, local.numel() * local.element_size(), to_host=True)
                target.add_(local, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], m.rows, m.cols))

    def _orthogonalize(self, todo, updates, group, buf):
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
        rank, world, pg = buf.rank, buf.world_size, buf.shard_group
        device, dtype = buf.device, self.ns_dtype  # the compute device (masters may be on the host)
        ns = dict(coefficients=group["ns_coefficients"], steps=group["ns_steps"],
                  eps=group["eps"], dtype=dtype)
        cost = [-ns_flops(m.rows, m.cols, group["ns_steps"]) for m in todo]
        by_root = [sorted((k for k, m in enumerate(todo) if m.root == r and not m.one_hot),
                          key=lambda k: (cost[k], k)) for r in range(world)]
        rounds = [[r_list[j] if j < len(r_list) else None for r_list in by_root]
                  for j in range(max(map(len, by_root)))]  # rounds[j][r]: matrix or None
        ahead = max(1, self.rounds_in_flight)

        def piece(k, r):  # how many elements of matrix k rank r holds
            return todo[k].spec.local_numel(r) if k is not None else 0

        def on_device(k):  # this rank's piece of matrix k, in the Newton-Schulz dtype
            m = todo[k]
            local = updates[m.param][m.lo:m.hi]
            self._count_pcie(m.param, local.numel() * dtype.itemsize, to_host=False)
            return local.to(device=device, dtype=dtype)

        def gather(j):
            row = rounds[j]
            self._log("gather", j)
            return self._exchange(
                [[on_device(k)] if k is not None else [] for k in row],
                [piece(row[rank], s) for s in range(world)], dtype, device, pg)

        results = [None] * len(todo)

        def finish_scatter(j, scattered):
            for k, local in zip(rounds[j], scattered()):
                if k is not None:
                    results[k] = local

        gathers = {j: gather(j) for j in range(min(ahead, len(rounds)))}
        for k, m in enumerate(todo):  # matrices already whole here, while the gathers run
            if m.one_hot and m.root == rank:
                self._log("ns", k)
                results[k] = newton_schulz(on_device(k).view(m.rows, m.cols),
                                           **ns).reshape(-1)
        scatters = []
        for j, row in enumerate(rounds):
            gathered = gathers.pop(j)()  # waits for round j's pieces
            k = row[rank]
            send = [[] for _ in range(world)]
            if k is not None:
                m = todo[k]
                self._log("ns", k)
                out = newton_schulz(torch.cat(gathered).view(m.rows, m.cols), **ns).reshape(-1)
                send = [[out[slice(*m.spec.local_range(s))]] for s in range(world)]
            del gathered
            self._log("scatter", j)
            scatters.append((j, self._exchange(
                send, [piece(row[r], rank) for r in range(world)], dtype, device, pg)))
            if j + ahead < len(rounds):
                gathers[j + ahead] = gather(j + ahead)
            if len(scatters) > ahead:  # the oldest result has had `ahead` rounds to arrive
                finish_scatter(*scatters.pop(0))
        for j, scattered in scatters:
            finish_scatter(j, scattered)
        empty = torch.empty(0, dtype=dtype, device=device)
        return [empty if out is None else out for out in results]

    def _exchange(self, send, recv_sizes, dtype, device, pg):
        """Start one uneven all-to-all: send[d] (tensors, concatenated) goes to rank d; rank s
        sends recv_sizes[s] elements here. Returns a function that waits and gives the
        received pieces, one per source rank."""
        rank = dist.get_rank(pg)
        send_sizes = [sum(t.numel() for t in pieces) for pieces in send]
        flat = [t.to(dtype) for pieces in send for t in pieces]
        source = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
        target = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        work = dist.all_to_all_single(target, source, output_split_sizes=recv_sizes,
                                      input_split_sizes=send_sizes, group=pg, async_op=True)
        self.bytes_sent += (sum(send_sizes) - send_sizes[rank]) * source.element_size()

        def received():
            work.wait()
            return list(target.split(recv_sizes))
        received.keep = source  # alive until the collective is done
        return received

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
                    self.state[p] = {"momentum_buffer": torch.zeros_like(p)} if group["use_muon"] \
                        else new_adamw_state(p)
                if self.state.get(p):
                    out[p] = dict(self.state[p])
        return out

    def _adamw_step(self, group):
        params = [p for p in group["params"] if p.grad is not None and p.numel()]
        if not params:
            return
        for p in params:
            if not self.state.get(p):
                self.state[p] = new_adamw_state(p)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        # torch.optim.AdamW's update over all of them in one fused call (one pass over memory).
        adamw_update(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                     [s["exp_avg_sq"] for s in states], [s["step"] for s in states],
                     lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"])


def _splits_a_matrix(sp) -> bool:
    """Whether TP/EP cut this parameter inside its matrices (one of its last two dims), so
    that its local tensor holds pieces of matrices, not whole ones."""
    spec = sp.dtensor_spec
    if spec is None:
        return False
    ndim = len(sp.shape)
    return any(d is not None and d % ndim >= ndim - 2
               for d in (getattr(p, "dim", None) for p in spec.placements
                         if not isinstance(p, Replicate)))


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

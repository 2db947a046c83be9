"""Behaviours of DeepSpeed ZeRO-3 that scripts and libraries rely on, each run by real DeepSpeed
and, after the one-line migration (`vescale_engine.patch_deepspeed()` plus a "vescale"
section), by our engine, on 2 gloo ranks, through the same script: leaf modules whose ranks
route to different experts; a model whose ranks drew different initial values; DeepSpeed's
`safe_*` accessors of the fp32 parameters, gradients and optimizer state.
"""
import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn


DIM, EXPERTS, STEPS, TOKENS = 8, 4, 3, 3
TOLERANCE = 1e-5  # fp32 round-off of different summation orders (test_deepspeed_parity.py)
CONFIG = {
    "train_micro_batch_size_per_gpu": TOKENS, "steps_per_print": 1000,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


POOL_ENV = {"DS_ACCELERATOR": "cpu"}


@contextlib.contextmanager
def _switched():
    """The migration's one line for the block (`vescale_engine.patch_deepspeed()`), DeepSpeed's
    own initialize back after it."""
    import deepspeed

    import vescale_engine
    original = deepspeed.initialize
    vescale_engine.patch_deepspeed()
    try:
        yield
    finally:
        deepspeed.initialize = original
        vescale_engine.unpatch()


class RoutedExperts(nn.Module):
    """An MoE block as transformers writes them: each token runs only its top-1 expert, so
    ranks holding different tokens run different experts (and a different number of them)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
            for _ in range(EXPERTS))
        self.routed = []  # the experts each forward ran

    def forward(self, x):
        weights = self.gate(x).softmax(-1)
        top = weights.argmax(-1)
        out = torch.zeros_like(x)
        ran = []
        for e, expert in enumerate(self.experts):
            rows = (top == e).nonzero().flatten()
            if len(rows):
                ran.append(e)
                out[rows] = expert(x[rows]) * weights[rows, e, None]
        self.routed.append(ran)
        return x + out


class MoEModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.moe = RoutedExperts()
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.head(self.moe(self.embed(x))), y)


def _data(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(TOKENS, DIM, generator=g), torch.randn(TOKENS, DIM, generator=g)


def _train_moe(rank, config, flag_leaf):
    import deepspeed
    from deepspeed.utils import set_z3_leaf_modules
    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = MoEModel()
    if flag_leaf:
        set_z3_leaf_modules(model, [RoutedExperts])
    return (*_train(rank, model, config), model.moe.routed)


def _train(rank, model, config):
    """DeepSpeed's loop: (losses, the full state dict after STEPS steps, the engine's class)."""
    import deepspeed
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    losses = []
    for step in range(STEPS):
        loss = engine(*_data(step, rank))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return losses, state, type(engine).__name__


def leaf_modules_rank(rank, world):
    from vescale_engine.engine.leaf_modules import units_with_whole_leaves
    from vescale_engine.engine.wrap import default_units
    ds_losses, ds_state, name, routed = _train_moe(rank, CONFIG, flag_leaf=True)
    assert name == "DeepSpeedEngine", name
    with _switched():
        runs = {}
        # set_z3_leaf_modules before initialize, and the config's leaf_module instead
        runs["set_z3_leaf_modules"] = _train_moe(rank, {**CONFIG, "vescale": {}}, True)
        config = {**CONFIG, "vescale": {}, "zero_optimization": {
            **CONFIG["zero_optimization"], "leaf_module": {"classes": ["RoutedExperts"]}}}
        runs["leaf_module"] = _train_moe(rank, config, False)
    out = {"ds_losses": ds_losses, "routed": routed}
    for key, (losses, state, name, _) in runs.items():
        assert name == "VeScaleEngine", name
        diff = max((state[k] - ds_state[k]).abs().max().item() for k in ds_state)
        out[key] = (losses, diff)
    # the units: the MoE block whole (not its experts), the root
    model = MoEModel()
    model.moe._z3_leaf = True
    out["units"] = [type(m).__name__ for m in units_with_whole_leaves(
        model, default_units(model).modules)]
    out["default_units"] = [type(m).__name__ for m in default_units(model).modules]
    return out


def test_leaf_modules_gather_whole_where_ranks_route_to_different_experts(pool):
    results = pool.run(leaf_modules_rank, timeout=300)
    # the ranks ran different experts in some step: without leaf modules each expert would be
    # a unit (default_units) and the ranks would wait in different all-gathers
    assert results[0]["routed"] != results[1]["routed"], [r["routed"] for r in results]
    assert results[0]["default_units"] == ["Sequential"] * EXPERTS
    assert results[0]["units"] == ["RoutedExperts"]
    for r in results:
        for key in ("set_z3_leaf_modules", "leaf_module"):
            losses, diff = r[key]
            assert all(abs(a - b) <= TOLERANCE * abs(b) for a, b in
                       zip(losses, r["ds_losses"], strict=True)), (key, losses, r["ds_losses"])
            assert diff < 1e-5, (key, diff)


class DenseModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(DIM, 4 * DIM)
        self.hidden = nn.Linear(4 * DIM, DIM)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.head(self.hidden(self.embed(x).relu())), y)


def _train_per_rank_init(rank, config):
    """A model built outside zero.Init with a seed per rank, its head set on rank 0 only."""
    import deepspeed
    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(rank)
    model = DenseModel()
    if rank == 0:
        with torch.no_grad():
            model.head.weight.fill_(0.05)
    return _train(rank, model, config)


def per_rank_init_rank(rank, world):
    config = {**CONFIG, "vescale": {"wrap_policy": {"module_classes": ["Linear"]}}}
    ds_losses, ds_state, name = _train_per_rank_init(rank, CONFIG)
    assert name == "DeepSpeedEngine", name
    with _switched():
        losses, state, name = _train_per_rank_init(rank, config)
    assert name == "VeScaleEngine", name
    torch.manual_seed(0)
    return dict(ds_losses=ds_losses, losses=losses,
                diff=max((state[k] - ds_state[k]).abs().max().item() for k in ds_state),
                head=state["head.weight"][0, 0].item())


def test_ranks_that_drew_different_initial_values_start_from_rank_0s(pool):
    results = pool.run(per_rank_init_rank, timeout=300)
    for r in results:
        assert all(abs(a - b) <= TOLERANCE * abs(b) for a, b in
                   zip(r["losses"], r["ds_losses"], strict=True)), (r["losses"], r["ds_losses"])
        assert r["diff"] < 1e-5, r["diff"]
    # both engines trained one model, the same on both ranks, from rank 0's head
    assert results[0]["head"] == results[1]["head"]
    assert abs(results[0]["head"] - 0.05) < 0.1


class HandsOutBias(nn.Linear):
    """A module that returns its own bias beside its output (DeepSpeed's "external
    parameter"): its caller computes with it, in forward and so in backward."""

    def forward(self, x):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        out = super().forward(x)
        return out, self.bias, self.bias.ds_status == ZeroParamStatus.AVAILABLE


class UsesChildsBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.child = HandsOutBias(DIM, DIM)
        self.head = nn.Linear(DIM, DIM)
        self.available = []  # the child's bias, as its caller received it

    def forward(self, x, y):
        out, bias, available = self.child(self.embed(x))
        self.available.append(available)
        return nn.functional.mse_loss(self.head(out * bias), y)  # (the product saves the bias)


def _train_fresh(rank, config, make, seen):
    """_train over a model `make()` builds: (losses, state, engine's class, its `seen` record)."""
    import deepspeed
    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = make()
    return (*_train(rank, model, config), getattr(model, seen))


def _against_deepspeed(rank, make, seen, vescale):
    """The same training by DeepSpeed, then switched (a "vescale" section `vescale`): losses,
    the `seen` records, and the largest parameter difference."""
    ds_losses, ds_state, name, ds_seen = _train_fresh(rank, CONFIG, make, seen)
    assert name == "DeepSpeedEngine", name
    with _switched():
        losses, state, name, ours = _train_fresh(rank, {**CONFIG, "vescale": vescale}, make, seen)
    assert name == "VeScaleEngine", name
    return dict(ds_losses=ds_losses, losses=losses, ds_seen=ds_seen, seen=ours,
                keys={k: (state[k] - ds_state[k]).abs().max().item() for k in ds_state})


def returned_parameter_rank(rank, world):
    # the child a unit of its own: it reshards after its forward unless it is kept
    r = _against_deepspeed(rank, UsesChildsBias, "available",
                           {"wrap_policy": {"module_classes": ["HandsOutBias"]}})
    assert r["ds_seen"] == [True] * STEPS and r["seen"] == [True] * STEPS, r
    assert all(abs(a - b) <= TOLERANCE * abs(b) for a, b in
               zip(r["losses"], r["ds_losses"], strict=True)), (r["losses"], r["ds_losses"])
    assert max(r["keys"].values()) < 1e-5, str(r["keys"])


def test_a_parameter_a_module_returns_stays_gathered_for_its_caller_as_under_deepspeed(pool):
    pool.run(returned_parameter_rank, timeout=300)


class ReadsChildrensWeights(nn.Module):
    """A parent computing with its children's weights (DeepSpeed gathers a parameter read in
    forward, its ZeROOrderedDict): after the child ran, and of a child that never runs.
    (Read before the child runs and used after it: DeepSpeed frees it at the child's end.)"""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.child = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, DIM)
        self.unused = nn.Linear(DIM, DIM)
        self.shapes = []  # the shapes of the weights the parent read

    def forward(self, x, y):
        h = self.child(self.embed(x))
        read = [self.child.weight, self.unused.weight]
        self.shapes.append([tuple(w.shape) for w in read])
        h = nn.functional.linear(h, read[0]) + nn.functional.linear(h, read[1])
        return nn.functional.mse_loss(self.head(h), y)


def reads_weights_rank(rank, world):
    # every Linear a unit of its own: each is sharded when the parent reads it
    r = _against_deepspeed(rank, ReadsChildrensWeights, "shapes",
                           {"wrap_policy": {"module_classes": ["Linear"]}})
    assert r["seen"] == r["ds_seen"] == [[(DIM, DIM)] * 2] * STEPS, r
    assert all(abs(a - b) <= TOLERANCE * abs(b) for a, b in
               zip(r["losses"], r["ds_losses"], strict=True)), (r["losses"], r["ds_losses"])
    assert max(r["keys"].values()) < 1e-5, str(r["keys"])


def test_a_parent_reading_its_childrens_weights_in_forward_gets_them_whole_as_under_deepspeed(
        pool):
    pool.run(reads_weights_rank, timeout=300)


class RaisesInRecompute(nn.Module):
    """A non-reentrant activation checkpoint whose recomputation raises while `raise_once`
    (DeepSpeed's retry after an exception in backward)."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.trainable = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, DIM)
        self.raise_once = True

    def _checkpointed(self, x):
        x = self.frozen(x)
        if self.raise_once and torch._C._current_graph_task_id() != -1:
            raise RuntimeError("injected in recomputation")
        return self.trainable(torch.tanh(x))

    def forward(self, x, y):
        from torch.utils.checkpoint import checkpoint
        h = checkpoint(self._checkpointed, x, use_reentrant=False)
        return nn.functional.mse_loss(self.head(h), y)


def failed_backward_rank(rank, world):
    """Ours on 2 ranks and one process over both ranks' data (DeepSpeed's own retry fails in
    its epilogue here: a parameter twice in a bucket): a backward raises, the gradients it had
    computed stay (as torch keeps them in .grad), the next one adds to them and steps."""
    import vescale_engine
    config = {**CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2,
                                                                  "weight_decay": 0.0}},
              "gradient_clipping": 0.0, "vescale": {}}
    torch.manual_seed(0)
    model, reference = RaisesInRecompute(), RaisesInRecompute()
    reference.load_state_dict(model.state_dict())
    engine, _, _, _ = vescale_engine.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config)
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.0)
    raised = []
    attempts = [("ours", lambda: engine.backward(engine(*_data(0, rank))))] + [
        ("reference", lambda r=r: (reference(*_data(0, r)) / world).backward())
        for r in range(world)]  # each rank's backward raises after the head's gradient
    for which, run in attempts:
        try:
            run()
        except RuntimeError as err:
            raised.append((which, str(err)))
    model.raise_once = reference.raise_once = False
    losses = []
    for step in range(1, STEPS):  # the retry, then a step more
        loss = engine(*_data(step, rank))
        engine.backward(loss)
        engine.step()
        ref = torch.stack([reference(*_data(step, r)) for r in range(world)]).mean()
        ref.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean.item() / world, ref.item()))
    full = vescale_engine.full_state_dict(engine.module)
    diff = {k: (v - full[k]).abs().max().item() for k, v in reference.state_dict().items()}
    assert raised == [("ours", "injected in recomputation")] + [
        ("reference", "injected in recomputation")] * 2, (raised, losses, diff)
    assert all(abs(a - b) <= TOLERANCE * abs(b) for a, b in losses), losses
    assert max(diff.values()) < 1e-5, str(diff)


def test_training_goes_on_after_a_backward_that_raised_keeping_its_gradients(pool):
    pool.run(failed_backward_rank, timeout=300)


def _train_unmanaged(rank, config):
    """DeepSpeed's managed_gradient_accumulation false: the script's step() ends each window,
    after 3 backward passes, then after 1 (gradient_accumulation_steps 2 all the same)."""
    import deepspeed
    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = DenseModel()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    out = {"losses": [], "boundaries": [], "counters": []}
    for window, backwards in enumerate((3, 1)):
        for i in range(backwards):
            loss = engine(*_data(10 * window + i, rank))
            engine.backward(loss)
            out["losses"].append(loss.item())
            out["boundaries"].append(engine.is_gradient_accumulation_boundary())
        engine.step()
        out["counters"].append((engine.global_steps, engine.global_samples, engine.micro_steps))
    try:
        with engine.coalesce_grad_reduction():
            pass
    except AssertionError as err:
        out["coalesce"] = str(err)
    out["managed"] = engine.managed_gradient_accumulation()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        out["state"] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    out["name"] = type(engine).__name__
    return out


def unmanaged_rank(rank, world):
    config = {**CONFIG, "gradient_accumulation_steps": 2, "managed_gradient_accumulation": False}
    theirs = _train_unmanaged(rank, config)
    assert theirs["name"] == "DeepSpeedEngine", theirs["name"]
    with _switched():
        ours = _train_unmanaged(rank, {**config, "vescale": {}})
    assert ours["name"] == "VeScaleEngine", ours["name"]
    diff = max((ours["state"][k] - theirs["state"][k]).abs().max().item() for k in theirs["state"])
    # the rest, without the parameters (compared above), for the messages
    ours, theirs = [{k: v for k, v in d.items() if k != "state"} for d in (ours, theirs)]
    assert theirs["counters"] == [(1, 3 * TOKENS * 2, 1), (2, 4 * TOKENS * 2, 2)], theirs
    for key in ("boundaries", "counters", "coalesce", "managed"):
        assert ours[key] == theirs[key], (key, ours[key], theirs[key])
    assert not ours["managed"] and "managed_gradient_accumulation=False" in ours["coalesce"]
    assert all(abs(a - b) <= TOLERANCE * abs(b) for a, b in
               zip(ours["losses"], theirs["losses"], strict=True)), (ours, theirs, diff)
    assert diff < 1e-5, diff


def test_managed_gradient_accumulation_false_steps_at_every_step_call_as_under_deepspeed(pool):
    pool.run(unmanaged_rank, timeout=300)


def _accessors(rank, config):
    """What a script reads and writes through deepspeed.utils' safe_* accessors."""
    import deepspeed
    from deepspeed import utils
    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = DenseModel()
    model.embed.bias.requires_grad_(False)  # frozen: DeepSpeed keeps no fp32 copy of it
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config)
    seen, losses = {}, []
    frozen = dict(engine.module.named_parameters())["embed.bias"]
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    for step in range(STEPS):
        loss = engine(*_data(step, rank))
        engine.backward(loss)
        if step == 1:  # after backward, before the step: the reduced gradients
            seen["grad"] = {n: utils.safe_get_full_grad(p).clone() for n, p in named}
            utils.safe_update_full_grad_vectorized([p for _, p in named],
                                                   lambda grad, p: grad * 2)
            seen["doubled"] = {n: utils.safe_get_full_grad(p).clone() for n, p in named}
            seen["frozen"] = [utils.safe_get_full_fp32_param(frozen),
                              utils.safe_get_local_fp32_param(frozen),
                              utils.safe_get_full_optimizer_state(frozen, "exp_avg")]
        engine.step()
        losses.append(loss.item())
        if step == 1:
            seen["param"] = {n: utils.safe_get_full_fp32_param(p).clone() for n, p in named}
            for key in ("exp_avg", "exp_avg_sq"):
                seen[key] = {n: utils.safe_get_full_optimizer_state(p, key).clone()
                             for n, p in named}
            seen["local"] = {n: utils.safe_get_local_fp32_param(p).clone() for n, p in named}
            # a script's edits: every rank passes the same full values
            head, bias = dict(named)["head.weight"], dict(named)["head.bias"]
            utils.safe_set_full_fp32_param(head, seen["param"]["head.weight"] * 0.5)
            utils.safe_set_full_optimizer_state(head, torch.zeros(DIM, DIM), "exp_avg")
            local = utils.safe_get_local_fp32_param(bias)
            utils.safe_set_local_fp32_param(bias, torch.zeros_like(local))
            seen["edited"] = [utils.safe_get_full_fp32_param(head).clone(),
                              utils.safe_get_full_optimizer_state(head, "exp_avg").clone(),
                              utils.safe_get_full_fp32_param(bias).clone()]
    seen["losses"] = losses
    return seen


def accessors_rank(rank, world):
    with _switched():
        ours = _accessors(rank, {**CONFIG, "vescale": {}})
    ds = _accessors(rank, CONFIG)
    out = {"losses": (ds["losses"], ours["losses"])}
    out["frozen"] = (ds["frozen"], ours["frozen"])
    for what in ("grad", "doubled", "param", "exp_avg", "exp_avg_sq"):
        out[what] = max((ours[what][n] - ds[what][n]).abs().max().item() /
                        max(ds[what][n].abs().max().item(), 1e-12) for n in ds[what])
    out["edited"] = max((a - b).abs().max().item() for a, b in zip(ours["edited"], ds["edited"]))
    out["halved"] = (ours["edited"][0] - ours["param"]["head.weight"] * 0.5).abs().max().item()
    out["zeroed"] = ours["edited"][1].abs().max().item() + ours["edited"][2].abs().max().item()
    out["local"] = {n: ours["local"][n].numel() for n in ours["local"]}
    out["shapes"] = {n: tuple(ours["param"][n].shape) for n in ours["param"]}
    out["local_is_a_piece"] = all(_is_a_run_of(ours["local"][n], ours["param"][n].flatten())
                                  for n in ours["local"])
    return out


def _is_a_run_of(piece, flat) -> bool:
    n = piece.numel()
    return n == 0 or any(torch.equal(piece, flat[i:i + n]) for i in range(flat.numel() - n + 1))


def test_safe_accessors_read_and_write_as_under_deepspeed(pool):
    results = pool.run(accessors_rank, timeout=300)
    for r in results:
        for what in ("grad", "doubled", "param", "exp_avg", "exp_avg_sq"):
            assert r[what] < 1e-5, (what, r[what])
        assert r["frozen"] == ([None] * 3, [None] * 3), r["frozen"]
        # the writes: read back alike (our local write too: the ranks' pieces of the bias)
        assert r["edited"] < 1e-6 and r["halved"] == 0 and r["zeroed"] == 0, r
        ds_losses, losses = r["losses"]
        # before the edits the same losses; after them ours computes with the written values
        # at once, DeepSpeed only after its next step (its module keeps its own partition)
        assert all(abs(a - b) <= TOLERANCE * abs(b) for a, b in
                   zip(losses[:2], ds_losses[:2], strict=True)), (losses, ds_losses)
        assert abs(losses[2] - ds_losses[2]) > 1e-3, (losses, ds_losses)
        assert r["local_is_a_piece"]
    # the local pieces of the two ranks make up each tensor
    for name, shape in results[0]["shapes"].items():
        assert results[0]["local"][name] + results[1]["local"][name] == \
            torch.Size(shape).numel(), name


def positional_rank(rank, world):
    """deepspeed.initialize called with DeepSpeed's positional order (distributed_port 7th)."""
    import deepspeed

    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    with _switched():
        model = DenseModel()
        engine, *_ = deepspeed.initialize(None, model, None, model.parameters(), None, None,
                                          29500, None, None, None, {**CONFIG, "vescale": {}})
        try:
            deepspeed.initialize(model=DenseModel(), config={**CONFIG, "vescale": {}},
                                 mesh_param=(2, 1))
            refused = None
        except TypeError as err:
            refused = str(err)
    assert (type(engine).__name__, engine.mpu) == ("VeScaleEngine", None)
    assert refused.startswith("deepspeed.initialize(mesh_param=...) with a"), refused


def test_initialize_takes_deepspeeds_positional_order(pool):
    pool.run(positional_rank, timeout=120)


def second_initialize_rank(rank, world):
    """DeepSpeed builds a second engine over a model it partitioned; we refuse in one line,
    and the first engine's parameters are left as they were."""
    import vescale_engine
    from vescale_engine.fsdp import full_state_dict
    torch.manual_seed(0)
    model = DenseModel()
    engine, *_ = vescale_engine.initialize(model=model, config={**CONFIG, "vescale": {}})
    before = {k: v.clone() for k, v in full_state_dict(engine.module).items()}
    try:
        vescale_engine.initialize(model=model, config={**CONFIG, "vescale": {}})
        refused = None
    except ValueError as err:
        refused = str(err)
    after = full_state_dict(engine.module)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    assert refused.startswith("initialize: the model is sharded already"), refused
    assert unchanged


def test_a_second_initialize_on_a_sharded_model_is_refused_and_changes_nothing(pool):
    pool.run(second_initialize_rank, timeout=120)


CHUNKS = 3  # backward passes per optimizer step in the loops below


def _manual_backward_loop(rank, config, how):
    """DeepSpeed 0.19.8's two manual-backward idioms, as its own tests write them:
    `coalesce`: CHUNKS backward passes inside engine.coalesce_grad_reduction(), the boundary
    set on the last, then step() (`chunks`: the same loop without the block, its reference);
    `scale`: `engine.scale(loss).backward()` then step() every micro-step (`engine`: with
    engine.backward(loss), its reference)."""
    import deepspeed
    os.environ.setdefault("LOCAL_RANK", str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = DenseModel()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    dtype = torch.float16 if config.get("fp16", {}).get("enabled") else torch.float32
    losses = []
    for step in range(STEPS):
        context = engine.coalesce_grad_reduction() if how == "coalesce" else _Nothing()
        with context:
            for i in range(CHUNKS):
                x, y = _data(step * CHUNKS + i, rank)
                loss = engine(x.to(dtype), y.to(dtype))
                if how in ("coalesce", "chunks"):
                    engine.set_gradient_accumulation_boundary(i == CHUNKS - 1)
                if how == "scale":
                    engine.scale(loss).backward()
                else:
                    engine.backward(loss)
                losses.append(loss.item())
                if how in ("scale", "engine"):
                    engine.step()
        if how in ("coalesce", "chunks"):
            engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        state = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return losses, state, type(engine).__name__


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _refusals(config):
    """What DeepSpeed refuses around the two idioms, on our engine: (exception type, message)."""
    import deepspeed
    torch.manual_seed(0)
    model = DenseModel()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except Exception as err:  # noqa: BLE001 (the type is what is compared)
            out[key] = (type(err).__name__, str(err))

    def step_inside():
        with engine.coalesce_grad_reduction():
            engine.step()

    def no_sync_inside():
        with engine.coalesce_grad_reduction():
            with engine.no_sync():
                pass

    def coalesce_inside():
        with engine.no_sync():
            with engine.coalesce_grad_reduction():
                pass

    attempt("step inside", step_inside)
    attempt("no_sync inside", no_sync_inside)
    attempt("coalesce inside no_sync", coalesce_inside)
    attempt("scale of a vector", lambda: engine.scale(torch.ones(2, requires_grad=True) * 2))
    attempt("scale without a graph", lambda: engine.scale(torch.ones(())))
    return out


def manual_backward_rank(rank, world):
    from vescale_engine.shard.stats import STATS
    from deepspeed.accelerator import get_accelerator
    accumulating = {**CONFIG, "gradient_accumulation_steps": 2,
                    "train_batch_size": 2 * TOKENS * world}
    fp16 = {**accumulating, "fp16": {"enabled": True, "initial_scale_power": 8}}
    # DeepSpeed computes fp16 on a CPU only where mkldnn does (AVX512-FP16 or AMX, its CPU
    # accelerator's is_fp16_supported), else it refuses the config: there the scale idiom is
    # compared with DeepSpeed's in fp32 (a loss scale of 1), and in fp16 with our own backward
    fp16_on_deepspeed = bool(get_accelerator().is_fp16_supported())
    scaled = fp16 if fp16_on_deepspeed else accumulating
    ds = {"coalesce": _manual_backward_loop(rank, CONFIG, "coalesce"),
          "scale": _manual_backward_loop(rank, scaled, "scale")}
    with _switched():
        ours, counts = {}, {}
        for key, how, config in (("coalesce", "coalesce", CONFIG), ("chunks", "chunks", CONFIG),
                                 ("scale", "scale", scaled), ("scale fp16", "scale", fp16),
                                 ("engine fp16", "engine", fp16)):
            before = STATS.reduce_scatters
            ours[key] = _manual_backward_loop(rank, {**config, "vescale": {}}, how)
            counts[key] = STATS.reduce_scatters - before
        refusals = _refusals({**CONFIG, "vescale": {}})
    ds_refusals = _refusals(CONFIG)

    def diff(a, b):
        return max((a[1][k] - b[1][k]).abs().max().item() for k in a[1])

    names = {k: v[2] for k, v in {**ours, **{"ds " + k: v for k, v in ds.items()}}.items()}
    assert set(names.values()) == {"VeScaleEngine", "DeepSpeedEngine"}
    assert [n for k, n in names.items() if not k.startswith("ds ")] == \
        ["VeScaleEngine"] * 5, names
    # (DeepSpeed's scale run in fp16 where fp16_on_deepspeed, else in fp32)
    for how in ds:
        losses, ds_losses = ours[how][0], ds[how][0]
        tolerance = 2e-3 if how == "scale" and fp16_on_deepspeed else TOLERANCE  # fp16 losses
        assert all(abs(a - b) <= tolerance * abs(b) for a, b in
                   zip(losses, ds_losses, strict=True)), (how, losses, ds_losses)
    vs_deepspeed = {k: diff(ours[k], ds[k]) for k in ds}
    assert vs_deepspeed["coalesce"] < 1e-5, vs_deepspeed
    assert vs_deepspeed["scale"] < (2e-3 if fp16_on_deepspeed else 1e-5), vs_deepspeed
    # the coalesced block reduces once per step what per-micro-step reduction reduced
    # CHUNKS times, to the same values; engine.scale's backward is engine.backward's
    coalesce_vs_chunks = diff(ours["coalesce"], ours["chunks"])
    assert coalesce_vs_chunks < 1e-6, coalesce_vs_chunks
    scale_vs_engine = diff(ours["scale fp16"], ours["engine fp16"])
    assert scale_vs_engine == 0, scale_vs_engine
    assert counts["coalesce"] * CHUNKS == counts["chunks"] > 0, counts
    # refused as DeepSpeed refuses them: the same exception type, before anything runs
    for key, ds_outcome in ds_refusals.items():
        assert ds_outcome is not None and refusals[key] is not None, (key, refusals, ds_refusals)
        assert refusals[key][0] == ds_outcome[0], (key, refusals[key], ds_outcome)


def test_coalesce_grad_reduction_and_scale_train_as_under_deepspeed(pool):
    pool.run(manual_backward_rank, timeout=400)

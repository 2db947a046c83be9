"""`vescale plan --memory` checked against measurement: the estimated per-rank peak of one
training step vs the peak tensor memory that step really allocates, for ours and PyTorch FSDP2,
and the estimated bytes all-gathered / reduce-scattered vs those the step's collectives move.

Models are built from shapes files (benchmarks/capacity_models/: a dense Llama-3-70B, a GPT-OSS
MoE with 128 fused experts, a Llama-3.2-1B with a tied embedding, each scaled down to fit this
machine; the files name the layer structure the builder below reads). Each (model, world size
W, system, setup) runs in a fresh process as rank 0 of W on PyTorch's fake process group
(FakeStore, as benchmarks/fake_pg_memory.py): the decoder layers and then the root are sharded,
and two training steps run (each: forward + backward per micro-step, then the optimizer step;
ours: vescale_engine.fsdp.fully_shard + our optimizers; FSDP2: torch's fully_shard + torch's
fused AdamW). The second step is measured.

What is measured, and why: tensor bytes allocated, from the PyTorch profiler's memory events
(every allocation and free of the CPU allocator, storage resizes included, with its running
total), profiled from before the model is built. That is what the estimate counts, exactly:
allocator-level bytes (RSS would add malloc's fragmentation and freed pages kept resident, and
a CUDA caching allocator its reserve). The peak is the largest running total during the
measured step; master, gradient and optimizer bytes are read from the tensors after it. The
measurement includes activations, which the estimate leaves out: with 8 tokens they are a few
hundred KB against tens of MB.

    python benchmarks/capacity_check.py                     # full table + plot
    python benchmarks/capacity_check.py --world-sizes 8 64 --quick
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:  # imported by path (tests/engine/test_capacity.py): ranks.py beside it
    sys.path.append(HERE)
from ranks import command_line, cpu_model, run_one, write_report  # noqa: E402
MODELS = {name: os.path.join(HERE, "capacity_models", f"{name}.json")
          for name in ("dense", "moe", "tied")}
WORLD_SIZES = (8, 64, 256, 1024)
TOLERANCE = 0.10
TOKENS = 4
EXPERT_CAPACITY = 2  # tokens per expert: activations stay small beside the parameters
HEAD_DIM = 32
MB = 1e6
DEFAULT_SETUP = {"optimizer": "AdamW", "param_dtype": "fp32", "reduce_dtype": None, "hsdp": 1,
                 "grad_accum": 1, "reshard_after_forward": True}
ZERO_PLUS_PLUS = ("quantized_weights", "quantized_gradients", "hpz",  # ours only, when given
                  "fp8_matmul")
# Setups beyond the default, at one world size: (model, label, changes, systems measured).
VARIANTS = [
    ("dense", "AdamW8bit", {"optimizer": "AdamW8bit"}, ("ours",)),
    ("dense", "Muon", {"optimizer": "Muon"}, ("ours",)),
    ("dense", "HSDP 4", {"hsdp": 4}, ("ours", "fsdp2")),
    ("dense", "no reshard after forward", {"reshard_after_forward": False}, ("ours", "fsdp2")),
    ("moe", "bf16 params, fp32 reduce", {"param_dtype": "bf16", "reduce_dtype": "fp32"},
     ("ours", "fsdp2")),
    ("tied", "grad accum 2", {"grad_accum": 2}, ("ours", "fsdp2")),
]
VARIANT_WORLD = 64


# ---------------------------------------------------------------------------------------------
# Shapes files: how the committed ones were made (`--write-models`), and tiny ones for tests.

def layer_tensors(H, Hq, Hkv, F, experts=None, bias=False) -> list:
    """A decoder layer's tensors, Hugging Face names: attention, then a dense SwiGLU MLP or
    GPT-OSS-style fused experts (gate_up_proj [E, H, 2F], down_proj [E, F, H])."""
    def proj(name, shape, bias_size):
        return [(name + ".weight", shape)] + ([(name + ".bias", [bias_size])] if bias else [])
    tensors = ([("input_layernorm.weight", [H])] + proj("self_attn.q_proj", [Hq, H], Hq)
               + proj("self_attn.k_proj", [Hkv, H], Hkv) + proj("self_attn.v_proj", [Hkv, H], Hkv)
               + proj("self_attn.o_proj", [H, Hq], H) + [("post_attention_layernorm.weight", [H])])
    if experts is None:
        tensors += [("mlp.gate_proj.weight", [F, H]), ("mlp.up_proj.weight", [F, H]),
                    ("mlp.down_proj.weight", [H, F])]
    else:
        E = experts
        tensors += [("mlp.router.weight", [E, H]), ("mlp.router.bias", [E]),
                    ("mlp.experts.gate_up_proj", [E, H, 2 * F]),
                    ("mlp.experts.gate_up_proj_bias", [E, 2 * F]),
                    ("mlp.experts.down_proj", [E, F, H]), ("mlp.experts.down_proj_bias", [E, H])]
    return [{"name": n, "shape": shape} for n, shape in tensors]


def model_shapes(name, vocab, H, layers, Hq, Hkv, F, experts=None, bias=False,
                 tied=False) -> dict:
    """A shapes file: embeddings, `layers` decoder layers, final norm and head; a tied head
    reuses the embedding, which then says `"uses": 2`; the architecture section the step-time
    model reads (the builder's experts each take EXPERT_CAPACITY of the TOKENS tokens: a token
    visits experts * EXPERT_CAPACITY / TOKENS of them)."""
    embed = {"name": "embed_tokens.weight", "shape": [vocab, H], **({"uses": 2} if tied else {})}
    head = [{"name": "norm.weight", "shape": [H]}] + \
        ([] if tied else [{"name": "lm_head.weight", "shape": [vocab, H]}])
    architecture = {"layers": layers, "hidden": H, "heads": Hq // HEAD_DIM,
                    "kv_heads": Hkv // HEAD_DIM, "head_dim": HEAD_DIM, "vocab": vocab,
                    "tied_embeddings": tied}
    if experts:
        architecture.update(experts=experts,
                            experts_per_token=min(experts, experts * EXPERT_CAPACITY // TOKENS))
    return {"name": name, "architecture": architecture, "groups": [
        {"name": "embed_tokens", "repeat": 1, "tensors": [embed]},
        {"name": "layers", "repeat": layers,
         "tensors": layer_tensors(H, Hq, Hkv, F, experts, bias)},
        {"name": "head", "repeat": 1, "tensors": head}]}


# Llama-3-70B, GPT-OSS-120B (128 experts kept: FSDP2 pads them past W = 128) and
# Llama-3.2-1B (tied), dimensions divided by 16, 20 and 8, fewer layers.
COMMITTED = {
    "dense": dict(name="dense-llama3-70b-scaled", vocab=8016, H=512, layers=6, Hq=512, Hkv=64,
                  F=1792),
    "moe": dict(name="moe-gpt-oss-120b-scaled", vocab=10054, H=144, layers=4, Hq=256, Hkv=32,
                F=144, experts=128, bias=True),
    "tied": dict(name="tied-llama3.2-1b-scaled", vocab=16032, H=256, layers=6, Hq=256, Hkv=64,
                 F=1024, tied=True),
}

# The tests' tiny versions of the three structures (parameters ~1-2 MB per unit, so the few KB
# of activations a measurement includes stay far below the tolerance).
TINY = {
    "dense": dict(name="dense-tiny", vocab=2048, H=128, layers=4, Hq=128, Hkv=64, F=512),
    "moe": dict(name="moe-tiny", vocab=2048, H=64, layers=4, Hq=64, Hkv=32, F=64, experts=16,
                bias=True),
    "tied": dict(name="tied-tiny", vocab=4096, H=128, layers=4, Hq=128, Hkv=32, F=256,
                 tied=True),
}


def write_tiny(folder) -> dict:
    """{structure: path} of TINY's shapes files, written into `folder`."""
    paths = {}
    for kind, dims in TINY.items():
        paths[kind] = os.path.join(folder, f"{kind}.json")
        with open(paths[kind], "w") as f:
            json.dump(model_shapes(**dims), f)
    return paths


# ---------------------------------------------------------------------------------------------
# The model a shapes file describes: embeddings, a stack of decoder layers (dense MLP or fused
# experts), final norm and head (tied to the embedding when the file has no lm_head).

def build_model(path: str):
    import torch
    import torch.nn.functional as F
    from torch import nn

    with open(path) as f:
        data = json.load(f)
    groups = data["groups"]
    if [g.get("repeat", 1) > 1 for g in groups] != [False, True, False]:
        raise ValueError(f"{path}: expected groups embeddings, layers (repeated), head")
    embed, layers, head = groups

    def add(module, name, shape):
        """Register a parameter under its dotted name, making containers on the way, in the
        file's order (fully_shard plans a unit's parameters in module order)."""
        *path_, leaf = name.split(".")
        for part in path_:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        if leaf.endswith("weight") and len(shape) == 1:
            value = torch.ones(shape)
        elif "bias" in leaf:
            value = torch.zeros(shape)
        else:
            value = torch.randn(shape) * 0.02
        module.register_parameter(leaf, nn.Parameter(value))

    def bias(module):
        return module._parameters.get("bias")

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            for t in layers["tensors"]:
                add(self, t["name"], t["shape"])

        def forward(self, x):
            a, H = self.self_attn, x.shape[-1]
            h = F.rms_norm(x, (H,), self.input_layernorm.weight)
            q = F.linear(h, a.q_proj.weight, bias(a.q_proj))
            k = F.linear(h, a.k_proj.weight, bias(a.k_proj))
            v = F.linear(h, a.v_proj.weight, bias(a.v_proj))
            heads, kv = q.shape[-1] // HEAD_DIM, k.shape[-1] // HEAD_DIM
            q, k, v = (t.view(len(x), -1, HEAD_DIM).transpose(0, 1) for t in (q, k, v))
            k, v = (t.repeat_interleave(heads // kv, dim=0) for t in (k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + F.linear(o.transpose(0, 1).reshape(len(x), -1), a.o_proj.weight,
                             bias(a.o_proj))
            h = F.rms_norm(x, (H,), self.post_attention_layernorm.weight)
            return x + self.mlp_forward(h)

        def mlp_forward(self, h):
            mlp = self.mlp
            if hasattr(mlp, "experts"):  # expert choice: each expert takes its top tokens
                e = mlp.experts
                probs = F.linear(h, mlp.router.weight, mlp.router.bias).softmax(-1)
                weight, token = probs.T.topk(EXPERT_CAPACITY, dim=-1)      # [E, C]
                gate, up = (torch.bmm(h[token], e.gate_up_proj)
                            + e.gate_up_proj_bias[:, None, :]).chunk(2, dim=-1)
                y = torch.bmm(F.silu(gate) * up, e.down_proj) + e.down_proj_bias[:, None, :]
                return torch.zeros_like(h).index_add(0, token.reshape(-1),
                                                     (y * weight[..., None]).flatten(0, 1))
            return F.linear(F.silu(F.linear(h, mlp.gate_proj.weight))
                            * F.linear(h, mlp.up_proj.weight), mlp.down_proj.weight)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            for t in embed["tensors"]:
                add(self, t["name"], t["shape"])
            self.layers = nn.ModuleList(Layer() for _ in range(layers["repeat"]))
            for t in head["tensors"]:
                add(self, t["name"], t["shape"])
            self.tied = not hasattr(self, "lm_head")

        def forward(self, ids, targets):
            x = F.embedding(ids, self.embed_tokens.weight)
            for layer in self.layers:
                x = layer(x)
            x = F.rms_norm(x, (x.shape[-1],), self.norm.weight)
            head_weight = self.embed_tokens.weight if self.tied else self.lm_head.weight
            return F.cross_entropy(F.linear(x, head_weight).float(), targets)

    return Model()


# ---------------------------------------------------------------------------------------------
# Worker: one measurement, in this process.

def measure(case: dict) -> dict:
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.manual_seed(0)
    torch.set_num_threads(1)
    W = case["world_size"]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=W)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, None: None}
    # before vescale_engine binds the collectives it uses
    traffic = _count_collectives(dist, case.get("hpz", 1) if case.get("hpz", 1) > 1 else None,
                                 bool(case.get("quantized_gradients")))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = build_model(case["path"])
        optimizer, read_state = _wrap(model, case, dtypes)
        vocab = model.embed_tokens.weight.shape[0] if case["system"] == "fsdp2" else \
            model.embed_tokens.weight._vescale.shape[0]
        ids = torch.randint(vocab, (TOKENS,))
        targets = torch.randint(vocab, (TOKENS,))

        def step():
            for _ in range(case["grad_accum"]):
                model(ids, targets).backward()
            with record_function("capacity::optimizer_step"):
                optimizer.step()

        step()
        optimizer.zero_grad()
        traffic["on"] = True
        with record_function("capacity::measured_step"):
            step()
        traffic["on"] = False
        state = read_state()
        optimizer.zero_grad()
    peak = _peaks(prof)
    dist.destroy_process_group()
    traffic.pop("on")
    sequence = traffic.pop("sequence")
    return {**case, **peak, **state, "traffic": traffic, "sequence": sequence,
            "torch": torch.__version__}


def _count_collectives(dist, hpz_size=None, quantized_gradients=False) -> dict:
    """Wrap the collectives both systems call so that, while counting is on, the bytes this
    rank moves are added up as the estimate counts them: what an all-gather receives and a
    reduce-scatter sends ((group size - 1) shards), what a ring all-reduce sends; with ZeRO++,
    the quantized gradients' all-to-all (all but this rank's own range) as the reduce-scatter
    and the all-gathers over hpZ groups of `hpz_size` as `all_gather_hpz`. `sequence` lists
    every collective in the order issued: [kind, group size, bytes of its full buffer]
    (all_reduce: of the tensor), what `vescale plan --time`'s schedule is checked against."""
    counts = {"on": False, "all_gather": 0, "reduce_scatter": 0, "all_reduce": 0,
              "sequence": []}

    import inspect

    def wrap(name, kind, which):
        original = getattr(dist, name)
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            if counts["on"]:
                bound = signature.bind(*args, **kwargs).arguments
                size = dist.get_world_size(bound.get("group"))
                tensor = bound[which]
                nbytes = tensor.numel() * tensor.element_size()
                counts["sequence"].append([kind, size, nbytes if kind in ("all_reduce",
                                                                          "all_to_all")
                                           else size * nbytes])
                if kind == "all_reduce":
                    counts[kind] += 2 * (size - 1) * nbytes // size
                elif kind == "all_to_all":  # quantized gradients: all but its own range
                    counts["reduce_scatter"] += (size - 1) * nbytes // size
                elif kind == "all_gather" and size == hpz_size:  # backward, from hpZ copies
                    counts["all_gather_hpz"] = counts.get("all_gather_hpz", 0) + \
                        (size - 1) * nbytes
                else:
                    counts[kind] += (size - 1) * nbytes
            return original(*args, **kwargs)
        setattr(dist, name, counted)

    wrap("all_gather_single", "all_gather", "input_tensor")
    wrap("reduce_scatter_single", "reduce_scatter", "output")
    wrap("all_reduce", "all_reduce", "tensor")
    if quantized_gradients:  # (Muon's all-to-alls are not the gradients' reduction)
        wrap("all_to_all_single", "all_to_all", "input")
    return counts


def _wrap(model, case, dtypes):
    """Shard the layers, then the root, for `case["system"]`; the optimizer, and a function
    reading the master / gradient / optimizer-state bytes rank 0 holds."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    W, R = case["world_size"], case["hsdp"]
    mesh = None if R == 1 else init_device_mesh("cpu", (R, W // R),
                                                mesh_dim_names=("replicate", "shard"))
    raf = case["reshard_after_forward"]
    if case["system"] == "ours":
        from vescale_engine import optim
        from vescale_engine.fsdp import MixedPrecisionPolicy, fully_shard, unit_of
        mp = MixedPrecisionPolicy(param_dtype=dtypes[case["param_dtype"]],
                                  reduce_dtype=dtypes[case["reduce_dtype"]])
        granularity = optim.DEFAULT_BLOCK if case["optimizer"] == "AdamW8bit" else "rows:1"
        for module in (*model.layers, model):  # the root with the default, as FSDP2's below
            fully_shard(module, mesh=mesh, reshard_after_forward=raf if module is not model
                        else None, mp_policy=mp, granularity=granularity,
                        quantized_weights=256 if case.get("quantized_weights") else None,
                        quantized_gradients=256 if case.get("quantized_gradients") else None,
                        hpz_partition_size=case.get("hpz", 1),
                        # "fp8": FP8 weight tiles (measured only: the estimate counts int8
                        # groups' scales); fp8_matmul: those kept with each gathered unit
                        quantization_format="fp8_e4m3" if case.get("fp8") or
                        case.get("fp8_matmul") else "int8",
                        fp8_matmul=bool(case.get("fp8_matmul")))
        opt = getattr(optim, case["optimizer"])(model.parameters(), lr=1e-3)
        buffers = [b for m in model.modules() if unit_of(m) for b in unit_of(m).buffers]

        def read_state():
            extra = _quantizer_bytes(opt) if case["optimizer"] == "AdamW8bit" else 0
            return {"master": sum(_nbytes(b.master) for b in buffers),
                    "grad": sum(_nbytes(b.grad) for b in buffers),
                    "optimizer": _state_bytes(opt) + extra}
        return opt, read_state
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (W,))
    mp = MixedPrecisionPolicy(param_dtype=dtypes[case["param_dtype"]],
                              reduce_dtype=dtypes[case["reduce_dtype"]])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=raf, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if case["optimizer"] != "AdamW":
        raise ValueError("FSDP2 is measured with torch's AdamW only")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def read_state():
        params = list(model.parameters())
        return {"master": _unique_bytes(p._local_tensor for p in params),
                "grad": _unique_bytes(p.grad._local_tensor for p in params
                                      if p.grad is not None),
                "optimizer": _state_bytes(opt)}
    return opt, read_state


def _quantizer_bytes(opt) -> int:
    """What AdamW8bit keeps beside its state: each quantizer's segment lengths, and the
    lookup tables quantize.py builds once per process and device."""
    import torch
    from vescale_engine.optim import quantize

    tables = []
    for signed in (True, False):
        tables += [*quantize._nearest_code_lookup(opt.quant_map, signed, torch.device("cpu")),
                   quantize.code_table(opt.quant_map, signed),
                   quantize._midpoints(opt.quant_map, signed)]
    return sum(q.device_bytes() for *_, q in opt._buffers) + _unique_bytes(tables)


def _nbytes(t) -> int:
    return t.untyped_storage().nbytes()


def _unique_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _state_bytes(opt) -> int:
    return _unique_bytes(getattr(t, "_local_tensor", t) for state in opt.state.values()
                         for t in state.values() if hasattr(t, "untyped_storage"))


def _peaks(prof) -> dict:
    """Largest running total of allocated bytes during the measured step (and during its
    optimizer step), from the profiler's allocation events; the total counts only what was
    allocated while profiling, i.e. everything the model and the step made."""
    from torch._C._profiler import _EventType

    allocations, windows = [], {}

    def walk(events):
        for e in events:
            if e.tag == _EventType.Allocation:
                allocations.append((e.start_time_ns, len(allocations),
                                    e.extra_fields.total_allocated))
            elif e.name.startswith("capacity::"):
                windows.setdefault(e.name, []).append((e.start_time_ns, e.end_time_ns))
            walk(e.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    allocations.sort()
    start, end = windows["capacity::measured_step"][0]
    step_start = max(s for s, _ in windows["capacity::optimizer_step"])
    before = [a for a in allocations if a[0] < start]
    inside = [a for a in allocations if start <= a[0] <= end]
    base = before[-1][2] if before else 0
    return {"peak": max([base] + [a[2] for a in inside]),
            "peak_optimizer_step": max([0] + [a[2] for a in inside if a[0] >= step_start]),
            "at_step_start": base}


# ---------------------------------------------------------------------------------------------
# Estimates, and the driver: a fresh process per measurement.

def estimate(case: dict) -> dict:
    sys.path.insert(0, ROOT)
    from vescale_engine.plan import capacity, model_plan

    return capacity.estimate(model_plan.load_shapes(case["path"]), setup_of(case))


def setup_of(case: dict):
    """The capacity.Setup a case is estimated (and its step's schedule built) with."""
    sys.path.insert(0, ROOT)
    from vescale_engine.plan import capacity

    return capacity.Setup(case["world_size"], optimizer=case["optimizer"],
                          param_dtype=case["param_dtype"], reduce_dtype=case["reduce_dtype"],
                          grad_accum=case["grad_accum"], hsdp=case["hsdp"],
                          reshard_after_forward=case["reshard_after_forward"],
                          **{k: case[k] for k in ZERO_PLUS_PLUS if k in case})


def run_case(case: dict, timeout: float) -> dict:
    row = run_one(__file__, ["--worker", json.dumps(case)], timeout,
                  env={"OMP_NUM_THREADS": "1"})
    if "error" in row:
        raise RuntimeError(f"{case['model']} {case['system']} W={case['world_size']} "
                           f"failed:\n{row['error']}")
    return row


def compare(measured: dict, est: dict) -> dict:
    """The estimate of `measured`'s system beside the measurement; error = est / measured - 1."""
    mine = est["memory"][measured["system"]]
    row = {"estimate": mine["total"], "error": mine["total"] / measured["peak"] - 1}
    traffic = est["traffic"] if measured["system"] == "ours" else \
        est["traffic"][measured["system"]]
    row["traffic_exact"] = all(traffic.get(k, 0) == measured["traffic"].get(k, 0)
                               for k in ("all_gather", "reduce_scatter", "all_gather_hpz"))
    for key in ("master", "grad", "optimizer"):
        row[f"{key}_error"] = (mine[key] - measured[key]) / max(1, measured["peak"])
    return row


def cases(models, world_sizes, quick=False) -> list:
    out = []
    for model in models:
        for W in world_sizes:
            for system in ("ours", "fsdp2"):
                out.append({"model": model, "path": MODELS[model], "system": system,
                            "world_size": W, "label": "default", **DEFAULT_SETUP})
    if not quick:
        for model, label, changes, systems in VARIANTS:
            if model in models:
                for system in systems:
                    out.append({"model": model, "path": MODELS[model], "system": system,
                                "world_size": VARIANT_WORLD, "label": label,
                                **DEFAULT_SETUP, **changes})
    return out


def report(rows, command, cpu) -> list:
    fmt = lambda b: f"{b / MB:,.1f}"  # noqa: E731
    worst = max(abs(r["error"]) for r in rows)
    out = ["# Capacity estimate vs measurement (fake process group, rank 0 of W)", "",
           f"Produced by `{command}` on {cpu} (torch {rows[0]['torch']}).", "",
           "Per-rank peak tensor memory of one training step (the second; forward + backward "
           "per micro-step, then the optimizer step), measured as the PyTorch profiler's "
           "allocation events' running total (allocator bytes: what `vescale plan --memory` "
           "estimates; RSS would add malloc's retained pages), against the estimate's "
           "`total`. Ours: `vescale_engine.fsdp.fully_shard` per decoder layer then the root, "
           "our AdamW / AdamW8bit / Muon; FSDP2: `torch.distributed.fsdp.fully_shard` the same "
           "way, `torch.optim.AdamW(fused=True)`. fp32 parameters unless the setup says "
           f"otherwise; one sequence of {TOKENS} tokens (its activations are measured but not "
           "estimated: most of what the estimate misses). MB = 10^6 bytes. Error = estimate / measured - 1; the master/grad/optimizer "
           "columns give (estimate - measured) of that part as a share of the measured peak.",
           "",
           f"**Worst error: {100 * worst:.1f}%** over {len(rows)} measurements "
           f"(tolerance {100 * TOLERANCE:.0f}%: {'met' if worst <= TOLERANCE else 'MISSED'}). "
           "Bytes all-gathered and reduce-scattered per rank in the step (counted at the "
           "collectives both systems call) equal the estimate's `traffic` in "
           f"{sum(r['traffic_exact'] for r in rows)} of {len(rows)}.",
           "",
           "| model | setup | W | system | measured peak MB | estimate MB | error | master | "
           "grad | optimizer | all-gather MB | reduce-scatter MB | traffic = estimate | "
           "ZeRO-3 estimate MB |",
           "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['label']} | {r['world_size']} | {r['system']} | "
                   f"{fmt(r['peak'])} | {fmt(r['estimate'])} | {100 * r['error']:+.1f}% | "
                   f"{100 * r['master_error']:+.1f}% | {100 * r['grad_error']:+.1f}% | "
                   f"{100 * r['optimizer_error']:+.1f}% | {fmt(r['traffic']['all_gather'])} | "
                   f"{fmt(r['traffic']['reduce_scatter'])} | "
                   f"{'yes' if r['traffic_exact'] else 'NO'} | {fmt(r['zero3'])} |")
    out += ["", "Models (benchmarks/capacity_models/, built by `build_model` in the script):", ""]
    for name, path in MODELS.items():
        with open(path) as f:
            data = json.load(f)
        out.append(f"- {name}: `{os.path.relpath(path, ROOT)}` ({data['name']}).")
    out += ["", "Notes:", "",
            "- The fake process group's collectives move no data but fill their outputs "
            "(torch 2.13), so every buffer a real collective would write exists, at its size.",
            "- The ZeRO-3 column is the estimate alone, with DeepSpeed's defaults: its "
            "reduce bucket alone is 5e8 elements (2 GB in fp32) whatever the model's size, "
            "and a model this small stays gathered whole (prefetch bucket, reuse distance). "
            "DeepSpeed cannot run on the fake process group.",
            "- Plot: `capacity_check.png` (peak per rank vs W per model, log scale)."]
    return out


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    default = [r for r in rows if r["label"] == "default"]
    models = list(dict.fromkeys(r["model"] for r in default))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for system, color, name in (("ours", "tab:blue", "ours"), ("fsdp2", "tab:orange",
                                                                   "FSDP2")):
            pts = sorted((r["world_size"], r["peak"] / MB, r["estimate"] / MB)
                         for r in default if r["model"] == model and r["system"] == system)
            if pts:
                ws, meas, est = zip(*pts)
                ax.plot(ws, est, color=color, label=f"{name} estimate")
                ax.plot(ws, meas, "o", color=color, label=f"{name} measured")
        pts = sorted({(r["world_size"], r["zero3"] / MB) for r in default
                      if r["model"] == model})
        if pts:
            ax.plot(*zip(*pts), "--", color="tab:green", label="ZeRO-3 estimate")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size W")
        ax.set_ylabel("peak per rank (MB)")
        ax.set_title(model)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    ap.add_argument("--quick", action="store_true", help="default setup only, no variants")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per measurement")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "capacity_check.md"))
    ap.add_argument("--write-models", action="store_true",
                    help="write benchmarks/capacity_models/*.json from COMMITTED and exit")
    ap.add_argument("--worker", metavar="CASE_JSON", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return
    if args.write_models:
        for kind, dims in COMMITTED.items():
            with open(MODELS[kind], "w") as f:
                json.dump(model_shapes(**dims), f, indent=1)
                f.write("\n")
        return
    rows = []
    for case in cases(args.models, args.world_sizes, args.quick):
        measured = run_case(case, args.timeout)
        est = estimate(case)
        row = {**measured, **compare(measured, est), "zero3": est["memory"]["zero3"]["total"]}
        rows.append(row)
        print(f"{case['model']:5s} {case['label']:26s} W={case['world_size']:5d} "
              f"{case['system']:5s} measured {row['peak'] / MB:9.1f} MB  estimate "
              f"{row['estimate'] / MB:9.1f} MB  {100 * row['error']:+6.1f}%", flush=True)
    write_report(args.out, report(rows, command_line(__file__), cpu_model()), echo=False)
    plot(rows, os.path.splitext(args.out)[0] + ".png")
    worst = max(abs(r["error"]) for r in rows)
    sys.exit(0 if worst <= TOLERANCE and all(r["traffic_exact"] for r in rows) else 1)


if __name__ == "__main__":
    main()

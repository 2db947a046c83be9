"""`vescale plan`: RaggedShard layouts of a model's units from a shapes file, their padding
against FSDP2's and ZeRO-3's (marked where those cut the blocks, with their padding keeping the
blocks whole: model_plan.alternatives), a warning naming what helps when a plan pads over 25%
(vescale_engine.plan.advice), and with --memory each rank's bytes and traffic for one training
step of the layout shown (vescale_engine.plan.capacity: the optimizer's granularity, a shard
group's ranks); with --tp / --ep, of the TP/EP-local tensors each rank holds
(vescale_engine.plan.parallel). Torch-free: the command starts at once."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from launcher import plan_time
from launcher.arg_types import positive_int
from vescale_engine.plan.granularity import GRANULARITY_HELP, parse_granularity
from vescale_engine.plan.planner import DEFAULT_ALIGN_BYTES, DEFAULT_MAX_BUFFERS, PlanError


def _positive_list(text: str) -> list:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"world sizes must be positive integers, got {text!r}")
    return values


def _granularity_list(text: str) -> list:
    try:
        return [parse_granularity(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err))


def add_parser(sub):
    p = sub.add_parser("plan", help="plan the sharded layout of a model's parameters",
                       description="Plan RaggedShard buffer layouts for every unit of a model "
                                   "given as a shapes file, and compare the padding with PyTorch "
                                   "FSDP2 and DeepSpeed ZeRO-3.")
    p.add_argument("--shapes", required=True, metavar="MODEL.json",
                   help="shapes file: groups (units) with 'repeat' and tensors with 'shape'")
    p.add_argument("--world-size", required=True, type=_positive_list, metavar="N[,N...]",
                   help="number of ranks; a comma list prints a sweep table")
    p.add_argument("--granularity", type=_granularity_list, metavar="G[,G...]",
                   help=f"atomic block policy: {GRANULARITY_HELP} (default rows:1; with "
                        "--memory, the optimizer's: AdamW8bit block:256, its quantization "
                        "block, which a given G is too; Shampoo shampoo:B); a comma list "
                        "sweeps them")
    p.add_argument("--align-bytes", type=positive_int, default=DEFAULT_ALIGN_BYTES, metavar="B",
                   help=f"shard sizes and tensor offsets are multiples of B bytes "
                        f"(default {DEFAULT_ALIGN_BYTES})")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="element type the alignment is counted in (default bf16)")
    p.add_argument("--max-buffers", type=positive_int, default=DEFAULT_MAX_BUFFERS, metavar="B",
                   help=f"most buffers one unit may be split into (default {DEFAULT_MAX_BUFFERS})")
    p.add_argument("--json", action="store_true",
                   help="print the plan as one JSON object (a list of them for a sweep)")
    p.add_argument("--verify", action="store_true",
                   help="check every plan against the layout invariants")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw padding against world size per granularity (needs matplotlib)")
    p.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="tensor-parallel size: plan the TP-local tensors of the shapes file's "
                        "'tp_plan' (default 1)")
    p.add_argument("--ep", type=positive_int, default=1, metavar="N",
                   help="expert-parallel size: each rank holds E/N experts of the tensors the "
                        "shapes file's 'ep_plan' names, sharded over world/(tp x N) x tp ranks "
                        "(efsdp); the rest over world/tp (default 1)")
    m = p.add_argument_group("memory and traffic (--memory)",
                             "Per-rank bytes of one training step for ours, PyTorch FSDP2 and "
                             "DeepSpeed ZeRO-3, and the bytes each rank all-gathers and "
                             "reduce-scatters per optimizer step; activations excluded. "
                             "docs/capacity_planning.md explains every term.")
    m.add_argument("--memory", action="store_true",
                   help="estimate per-rank memory and traffic (with --json: the `memory` and "
                        "`traffic` keys of each result)")
    m.add_argument("--optimizer", metavar="NAME",
                   help="an optimizer.type `vescale validate` accepts, DeepSpeed's names in "
                        "any case: AdamW (default; Adam runs as AdamW), AdamW8bit (quantizes "
                        "in the blocks it shards in: --granularity, default block:256), Muon or "
                        "Shampoo (shards shampoo:B)")
    m.add_argument("--max-preconditioner-dim", metavar="B",
                   help="with --optimizer Shampoo: its block size B, also its rows:B sharding "
                        "granularity (default 1024)")
    m.add_argument("--param-dtype", metavar="DTYPE",
                   help="compute and all-gather dtype: bf16 (default), fp16 or fp32; master "
                        "weights, gradient shards and optimizer moments are fp32")
    m.add_argument("--reduce-dtype", metavar="DTYPE",
                   help="gradient reduce-scatter dtype (default: the param dtype)")
    m.add_argument("--grad-accum", metavar="N",
                   help="micro-steps per optimizer step, each reduce-scattering (default 1)")
    m.add_argument("--hsdp", metavar="R",
                   help="HSDP replicate size: shard over world-size / R ranks, all-reduce the "
                        "gradient shards over R replicas (default 1)")
    m.add_argument("--no-reshard-after-forward", dest="reshard_after_forward",
                   action="store_false", default=None,
                   help="keep every unit gathered from its forward to its backward")
    m.add_argument("--root", metavar="GROUP[,GROUP]",
                   help="shapes-file groups the root unit owns (default: the non-repeated "
                        "groups before and after the repeated ones, e.g. embeddings and head)")
    m.add_argument("--device-memory", metavar="GB",
                   help="memory of one device in GB (10^9 bytes): also print what each system "
                        "leaves for activations")
    m.add_argument("--offload-optimizer", nargs="?", const="1", metavar="RATIO",
                   help="keep the fp32 master and optimizer state on the host: all of it, or "
                        "RATIO in (0, 1] of the optimizer bytes (ours: whole buffers, largest "
                        "first; FSDP2's CPUOffloadPolicy: always all); also prints host bytes "
                        "and host<->device bytes per step")
    m.add_argument("--offload-param", action="store_const", const=True, default=None,
                   help="keep the sharded parameters on the host between uses")
    m.add_argument("--tokens", metavar="N",
                   help="with --ep: tokens per data-parallel rank per micro-step, for the "
                        "all-to-all dispatch bytes (default 4096)")
    m.add_argument("--quantized-weights", action="store_const", const=True, default=None,
                   help="ours with zero_quantized_weights: int8 all-gathers, one fp32 scale "
                        "per group")
    m.add_argument("--quantized-gradients", action="store_const", const=True, default=None,
                   help="ours with zero_quantized_gradients: int8 gradient all-to-alls")
    m.add_argument("--quantization-group", metavar="G",
                   help="elements per quantization group (vescale.quantization_group_size, "
                        "default 256)")
    m.add_argument("--fp8-matmul", action="store_const", const=True, default=None,
                   help="ours with vescale.fp8_matmul (needs --quantized-weights): the FP8 "
                        "weights are kept with each gathered unit, 1 byte per element")
    m.add_argument("--hpz", metavar="N",
                   help="ours with zero_hpz_partition_size N: backward gathers inside groups "
                        "of N ranks; its secondary copies count as parameter memory")
    a = p.add_argument_group(
        "activations and sequence parallelism (--memory --seq; a dense Llama-style decoder)",
        "activation memory per rank for sequences of --seq tokens, with DeepSpeed Ulysses "
        "sequence parallelism over --sp ranks (ours and DeepSpeed ALST alike) beside FSDP2 "
        "without it; with --device-memory, the longest sequence each system fits")
    a.add_argument("--seq", metavar="TOKENS", help="sequence length (tokens per sequence)")
    a.add_argument("--sp", metavar="N", help="sequence-parallel ranks per sequence (default 1)")
    a.add_argument("--micro-batch", metavar="N", help="sequences per micro-batch (default 1)")
    a.add_argument("--activation-checkpointing", action="store_const", const=True,
                   default=None, help="every decoder layer checkpointed (Hugging Face's)")
    a.add_argument("--tiled-mlp", action="store_const", const=True, default=None,
                   help="DeepSpeed's TiledMLP: an MLP keeps only its input")
    a.add_argument("--tiled-loss", action="store_const", const=True, default=None,
                   help="DeepSpeed's TiledFusedLogitsLoss: no full-vocabulary logits kept")
    a.add_argument("--head-dim", metavar="D", help="attention head size (default 128)")
    plan_time.add_arguments(p)
    p.set_defaults(run=_run_plan)


_MEMORY_FLAGS = ("optimizer", "param_dtype", "reduce_dtype", "grad_accum", "hsdp",
                 "reshard_after_forward", "root", "device_memory", "offload_optimizer",
                 "offload_param", "tokens", "max_preconditioner_dim", "seq", "sp",
                 "micro_batch", "activation_checkpointing", "tiled_mlp", "tiled_loss",
                 "head_dim", "quantized_weights", "quantized_gradients", "quantization_group",
                 "hpz", "fp8_matmul")
_ACTIVATION_FLAGS = ("sp", "micro_batch", "activation_checkpointing", "tiled_mlp",
                     "tiled_loss", "head_dim")


def _flag_number(text, flag, kind):
    """A positive number from a flag's text (None stays None); else one line naming it."""
    from vescale_engine.plan.capacity import CapacityError
    if text is None:
        return None
    try:
        value = kind(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise CapacityError(f"{flag} must be a positive {'integer' if kind is int else 'number'}"
                            f", got {text!r}")
    return value


def _offload_ratio(text):
    """--offload-optimizer's RATIO: a number in (0, 1] (None: no offload, 0.0)."""
    from vescale_engine.plan.capacity import CapacityError
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:   # NaN fails too
        raise CapacityError(f"--offload-optimizer RATIO must be a number in (0, 1], got "
                            f"{text!r}")
    return value


def _capacity_setups(args, model) -> dict:
    """{world size: capacity.Setup}, checked: a bad value is one line, before any planning."""
    from vescale_engine.plan import capacity

    if not args.memory and not args.time:
        given = [f for f in _MEMORY_FLAGS if getattr(args, f) is not None]
        if given:
            raise capacity.CapacityError(f"--{given[0].replace('_', '-')} needs --memory "
                                         f"(or --time)")
        return {}
    args.grad_accum = _flag_number(args.grad_accum, "--grad-accum", int)
    args.hsdp = _flag_number(args.hsdp, "--hsdp", int)
    args.device_memory = _flag_number(args.device_memory, "--device-memory", float)
    args.tokens = _flag_number(args.tokens, "--tokens", int)
    args.max_preconditioner_dim = _flag_number(args.max_preconditioner_dim,
                                               "--max-preconditioner-dim", int)
    args.quantization_group = _flag_number(args.quantization_group, "--quantization-group", int)
    args.hpz = _flag_number(args.hpz, "--hpz", int)
    if args.quantization_group and not (args.quantized_weights or args.quantized_gradients):
        raise capacity.CapacityError("--quantization-group needs --quantized-weights or "
                                     "--quantized-gradients")
    if args.memory:
        # --seq is the time model's tokens too: a model the activation estimate cannot read
        # (MoE, MLA) is still timed; its memory says activations are excluded
        only_tokens = not any(getattr(args, f) is not None for f in _ACTIVATION_FLAGS
                              if f not in ("micro_batch", "activation_checkpointing"))
        try:
            _activation_flags(args, model)
        except capacity.CapacityError as err:
            if not (args.time and only_tokens and "activation estimate" in str(err)):
                raise
            print(f"note: {err}: memory without activations", file=sys.stderr)
            args.activations = None
    else:   # --time alone: the tokens per rank; the activation estimate is --memory's
        given = [f for f in _ACTIVATION_FLAGS if f != "micro_batch" and
                 getattr(args, f) is not None and f != "activation_checkpointing"]
        if given:
            raise capacity.CapacityError(f"--{given[0].replace('_', '-')} needs --memory")
        args.activations = None
        args.seq = _flag_number(args.seq, "--seq", int)
        args.micro_batch = _flag_number(args.micro_batch, "--micro-batch", int)
    args.optimizer_type, optimizer = _optimizer(args.optimizer)
    if args.max_preconditioner_dim and optimizer != "Shampoo":
        raise capacity.CapacityError("--max-preconditioner-dim needs --optimizer Shampoo")
    offload_ratio = _offload_ratio(args.offload_optimizer)
    root = None if args.root is None else tuple(r.strip() for r in args.root.split(",")
                                                 if r.strip())
    setups = {}
    # no --granularity: the optimizer's, as the engine picks it (Setup.layout_granularity)
    for granularity in args.granularity or [None]:
        for world_size in args.world_size:
            setup = capacity.Setup(
                world_size, optimizer=optimizer,
                param_dtype=args.param_dtype or "bf16", reduce_dtype=args.reduce_dtype,
                grad_accum=args.grad_accum or 1, hsdp=args.hsdp or 1,
                reshard_after_forward=args.reshard_after_forward is not False,
                granularity=None if granularity is None else str(granularity),
                align_bytes=args.align_bytes,
                max_buffers=args.max_buffers, root=root, offload_optimizer=offload_ratio,
                offload_param=bool(args.offload_param), tp=args.tp, ep=args.ep,
                tokens=args.tokens or 4096,
                shampoo_block=args.max_preconditioner_dim or capacity.Setup.shampoo_block,
                quantized_weights=bool(args.quantized_weights),
                quantized_gradients=bool(args.quantized_gradients),
                quantization_group=args.quantization_group or
                capacity.Setup.quantization_group, hpz=args.hpz or 1,
                fp8_matmul=bool(args.fp8_matmul))
            capacity.check_setup(setup, model)
            setups[(str(parse_granularity(setup.layout_granularity)), world_size)] = setup
    # the layouts shown are the ones the memory is estimated for
    args.granularity = list(dict.fromkeys(parse_granularity(s.layout_granularity)
                                          for s in setups.values()))
    return setups


def _activation_flags(args, model) -> None:
    """--seq and its flags, checked: args.activations becomes the decoder's DecoderDims (None
    without --seq)."""
    from vescale_engine.plan.activations import DecoderDims
    from vescale_engine.plan.capacity import CapacityError
    args.activations = None
    if args.seq is None:
        given = [f for f in _ACTIVATION_FLAGS if getattr(args, f) is not None]
        if given:
            raise CapacityError(f"--{given[0].replace('_', '-')} needs --seq")
        return
    args.seq = _flag_number(args.seq, "--seq", int)
    args.sp = _flag_number(args.sp, "--sp", int) or 1
    args.micro_batch = _flag_number(args.micro_batch, "--micro-batch", int) or 1
    head_dim = _flag_number(args.head_dim, "--head-dim", int) or 128
    if args.sp > 1 and (args.tp > 1 or args.ep > 1):
        raise CapacityError(f"--sp {args.sp} with --tp/--ep: sequence parallelism does not "
                            "combine with tensor or expert parallelism in the engine")
    for world in args.world_size:
        if world % args.sp:
            raise CapacityError(f"--sp {args.sp} does not divide the world size {world}")
    if args.seq % args.sp:
        raise CapacityError(f"--seq {args.seq} does not split over --sp {args.sp} ranks")
    try:
        args.activations = DecoderDims.from_shapes(model, head_dim)
    except ValueError as err:
        raise CapacityError(str(err)) from None


# The optimizer each optimizer.type `vescale validate` accepts is estimated as: the engine runs
# type "Adam" as AdamW (DeepSpeed's adam_w_mode, true by default; engine/from_config.py).
_ESTIMATED_AS = {"AdamW": "AdamW", "Adam": "AdamW", "AdamW8bit": "AdamW8bit", "Muon": "Muon",
                 "Shampoo": "Shampoo"}


def _optimizer(text) -> tuple:
    """(the optimizer.type `vescale validate` reads `text` as, the optimizer estimated): the
    same names and normalization (the config schema's enum, DeepSpeed's names in any case);
    anything else is one line naming the valid names."""
    from vescale_engine.plan.capacity import CapacityError
    if text is None:
        return "AdamW", "AdamW"
    from config_schemas.validate import canonical_config, load_schema
    node = load_schema()["properties"]["optimizer"]["properties"]["type"]
    name = canonical_config({"optimizer": {"type": text}})[0]["optimizer"]["type"]
    if name not in node["enum"]:
        raise CapacityError(f"unknown optimizer {text!r}: --optimizer takes an optimizer.type "
                            f"`vescale validate` accepts: {', '.join(node['enum'])} "
                            f"({', '.join(node.get('x-case-insensitive', []))} in any case)")
    if name not in _ESTIMATED_AS:
        raise CapacityError(f"--optimizer {name}: a valid optimizer.type (the engine runs "
                            f"torch.optim.{name}), but --memory estimates only "
                            f"{', '.join(n for n in _ESTIMATED_AS if n != 'Adam')} and Adam "
                            f"(which the engine runs as AdamW)")
    return name, _ESTIMATED_AS[name]


def _local(args, model) -> tuple:
    """(the model the layouts are planned for, {world size: ParallelSizes or None}): with --tp / --ep
    the TP/EP-local model and each world size's mesh, checked before any planning; with
    --memory --hsdp R each world size's mesh of R replicas (the layout of a shard group)."""
    from vescale_engine.plan import parallel
    hsdp = (args.hsdp or 1) if args.memory else 1
    if args.tp == 1 and args.ep == 1:
        return model, {w: parallel.make_mesh(w, 1, 1, hsdp) if hsdp > 1 else None
                       for w in args.world_size}
    meshes = {w: parallel.make_mesh(w, args.tp, args.ep, hsdp) for w in args.world_size}
    tp_plan, ep_plan, _ = parallel.read_plans(model.path)
    local, _ = parallel.local_model(model, next(iter(meshes.values())), tp_plan, ep_plan)
    return local, meshes


def _reduce_dtype_note(args) -> None:
    """Without --reduce-dtype the plans reduce gradients in the parameter dtype, as FSDP2 did
    up to torch 2.14; from 2.15, FSDP2 and ours under it reduce in the parameters' own dtype
    (fp32) unless reduce_dtype is set: say so when the installed torch is one of those."""
    from importlib import metadata

    from vescale_engine.versions import _release
    param = args.param_dtype or "bf16"
    if args.reduce_dtype is not None or param == "fp32":
        return
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return
    if _release(torch_version) >= (2, 15):
        print(f"note: gradients are reduced in {param} here (--reduce-dtype not given); with "
              f"torch {torch_version} FSDP2 and veScale Engine reduce them in the parameters' "
              f"fp32 unless MixedPrecisionPolicy.reduce_dtype is set: pass --reduce-dtype fp32 "
              f"to plan that", file=sys.stderr)


def _run_plan(args) -> int:
    from vescale_engine.plan import model_plan as mp

    model = mp.load_shapes(args.shapes)
    if args.plot and not args.plot.lower().endswith(".png"):
        raise mp.ShapesError(f"--plot must name a .png file, got {args.plot!r}")
    if args.plot:
        _require_matplotlib()
    plan_time.check(args)
    setups = _capacity_setups(args, model)   # resolves args.granularity; checks first
    args.granularity = args.granularity or [parse_granularity("rows:1")]
    local, meshes = _local(args, model)
    from vescale_engine.plan.advice import padding_warning
    estimates, warnings = {}, {}
    plans = []
    sweep = len(args.world_size) * len(args.granularity) > 1
    for granularity in args.granularity:
        for world_size in args.world_size:
            mesh = meshes[world_size]
            plan = mp.plan_model(local, mesh.dp_shard if mesh else world_size, granularity,
                                 align_bytes=args.align_bytes, dtype=args.dtype,
                                 max_buffers=args.max_buffers,
                                 expert_world_size=mesh.efsdp if mesh and mesh.ep > 1 else None)
            plan = dataclasses.replace(plan, mesh=mesh)
            if args.verify:
                plan.verify()
            plans.append(plan)
            if not args.json and len(plans) == 1 and sweep:
                _print_table_header(model, args)
            if not args.json and sweep:
                _print_table_row(plan)
            warning = padding_warning(plan)
            warnings[id(plan)] = [warning] if warning else []
            if warning and not args.json:
                sys.stdout.flush()
                print(warning, file=sys.stderr, flush=True)
    if not args.json and sweep:
        print(_FOOTNOTE)
    timed = plan_time.run(args, model, setups) if args.time else None
    if setups and args.memory:
        from vescale_engine.plan import capacity
        cache = capacity.PlanCache()
        uses = capacity.tensor_uses(model.path)
        for plan in plans:
            key = (str(plan.granularity), plan.world)
            est = estimates[key] = capacity.estimate(model, setups[key], uses, cache,
                                                     args.device_memory)
            if args.optimizer_type != est["setup"]["optimizer"]:   # Adam, run as AdamW
                est["setup"]["optimizer_type"] = args.optimizer_type
            for alt in mp.alternatives(plan):   # the same layout's blocks: mark theirs
                if "unsupported" not in est["memory"][alt.system] and not alt.unsupported:
                    est["memory"][alt.system].update(
                        ignores_blocks=alt.ignores_blocks,
                        whole_blocks_padding_ratio=alt.whole_blocks_padding_ratio)
    if args.json:
        out = [p.to_json() for p in plans]
        for obj, plan in zip(out, plans):
            obj["alternatives"] = {a.system: a.to_json() for a in mp.alternatives(plan)}
            obj["warnings"] = warnings[id(plan)]
            key = (str(plan.granularity), plan.world)
            if timed:
                obj["time"] = {**timed["rows"][key], "cluster": timed["cluster"].name,
                               "workload": dataclasses.asdict(timed["workload"])}
                obj["time"]["strong"] = next((r for r in timed["strong"] or []
                                              if r["world_size"] == plan.world), None)
            found = estimates.get(key)
            if found:
                obj.update(memory=found["memory"], traffic=found["traffic"],
                           memory_setup=found["setup"])
        json.dump(out[0] if len(out) == 1 else out, sys.stdout)
        print()
    elif len(plans) == 1:
        _print_detail(plans[0])
    if estimates and not args.json:
        _print_memory(model, plans, estimates, args.device_memory, args)
    if timed:
        plan_time.show(args, model, setups, timed)
    if args.verify and not args.json:
        print(f"verified: {len(plans)} model plan(s), every invariant holds")
    if args.plot and not (args.time and args.scan):   # --time --scan: its scaling plot
        _plot(plans, model, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    if setups:
        _reduce_dtype_note(args)
    return 0


def _print_table_header(model, args):
    print(f"{model.name}: {model.numel / 1e9:.2f}B parameters, align {args.align_bytes} B "
          f"({args.dtype}), at most {args.max_buffers} buffers per unit; padding in % of "
          f"parameters")
    if args.tp > 1 or args.ep > 1:
        print(f"TP/EP-local shapes, tp {args.tp}, ep {args.ep}: dense units over world/tp ranks,"
              f" expert units over world/ep (efsdp); padding of the local parameters")
    if _replicas(args) > 1:
        print(f"HSDP {args.hsdp} replicas: each layout is a shard group's, world / "
              f"{args.hsdp} ranks")
    print(f"{'granularity':<12} {'world':>6} {'vescale':>8} {'buffers':>7} {'1-buffer':>9} "
          f"{'1-buf LB':>9} {'per-block':>9} {'FSDP2':>8}  {'whole':>8} {'ZeRO-3':>8}  "
          f"{'whole':>8} {'plan s':>7}")


def _replicas(args) -> int:
    return (args.hsdp or 1) if args.memory else 1


_MARK = "*"
_FOOTNOTE = (f"{_MARK} ignores the block constraint: FSDP2 cuts each tensor's dim 0 into even "
             "chunks and ZeRO-3 each parameter's elements into even pieces, here cutting blocks;"
             " whole: that system's padding when each chunk or piece is rounded up to whole "
             "blocks (or one rank holds the tensor)")


def _print_table_row(plan):
    from vescale_engine.plan import model_plan as mp

    buffers = max(len(p.buffers) for p in plan.plans)
    (fsdp2, fsdp2_whole), (zero3, zero3_whole) = _alternatives(plan)
    print(f"{str(plan.granularity):<12} {plan.world:>6} {100 * plan.padding_ratio:>7.2f}% "
          f"{buffers:>7} {100 * mp.single_buffer_ratio(plan):>8.2f}% "
          f"{100 * mp.single_buffer_lower_bound_ratio(plan):>8.2f}% "
          f"{100 * mp.per_block_size_ratio(plan):>8.2f}% "
          f"{fsdp2:>9} {fsdp2_whole:>8} {zero3:>9} {zero3_whole:>8} "
          f"{plan.plan_seconds:>7.3f}", flush=True)


def _alternatives(plan, digits: int = 2) -> tuple:
    """((figure, whole-blocks figure) of FSDP2, of ZeRO-3) on the plan's (TP/EP-local) shapes,
    as text: a figure that ignores the block constraint (its sharding cuts blocks) is marked;
    n/a where FSDP2 cannot shard them (an uneven Shard(1) of experts)."""
    from vescale_engine.plan import model_plan as mp

    out = []
    for alt in mp.alternatives(plan):
        if alt.unsupported:
            out.append(("n/a ", "n/a"))
            continue
        out.append((f"{100 * alt.padding_ratio:.{digits}f}%"
                    f"{_MARK if alt.ignores_blocks else ' '}",
                    f"{100 * alt.whole_blocks_padding_ratio:.{digits}f}%"))
    return tuple(out)


def _mesh_line(mesh) -> str:
    if (mesh.tp, mesh.ep) == (1, 1):
        return (f"HSDP: {mesh.replicate} replicas of {mesh.dp_shard} ranks; the layout is a "
                f"shard group's")
    local = (["TP-sliced by the shapes file's tp_plan"] if mesh.tp > 1 else []) + \
        ([f"E/{mesh.ep} experts per rank"] if mesh.ep > 1 else [])
    experts = (f", expert units over {mesh.efsdp} (efsdp = dp_shard x tp / ep)"
               if mesh.ep > 1 else "")
    return (f"mesh: tp {mesh.tp}, ep {mesh.ep}: dense units sharded over {mesh.dp_shard} ranks"
            f" (dp_shard){experts}; local shapes: {', '.join(local)}")


def _print_detail(plan):
    print(f"{plan.model.name} on {plan.world} ranks, granularity {plan.granularity}, align "
          f"{plan.align_bytes} B ({plan.dtype}), at most {plan.max_buffers} buffers per unit")
    if plan.mesh is not None:
        print(_mesh_line(plan.mesh))
    for group, unit in zip(plan.model.groups, plan.plans):
        over = f" over {plan.group_world(group)} ranks" if plan.mesh is not None else ""
        print(f"  unit {group.name} x{group.repeat}{over}: {len(unit.buffers)} buffer(s), "
              f"padding {100 * unit.padding_ratio:.3f}%")
        for i, buf in enumerate(unit.buffers):
            print(f"    buffer {i}: shard {buf.shard_size:,} elements/rank, "
                  f"{len(buf.placements)} tensors, padding {buf.padding:,}")
    (fsdp2, fsdp2_whole), (zero3, zero3_whole) = _alternatives(plan, 3)
    what = ("TP/EP-local parameters (the tensors of one tp x ep coordinate)"
            if plan.mesh is not None and (plan.mesh.tp, plan.mesh.ep) != (1, 1)
            else "parameters")
    print(f"padding {100 * plan.padding_ratio:.3f}% of {plan.model.numel:,} {what} "
          f"(FSDP2 {fsdp2.strip()}, whole blocks {fsdp2_whole}; ZeRO-3 {zero3.strip()}, whole "
          f"blocks {zero3_whole}), planned in {plan.plan_seconds:.3f} s")
    if _MARK in fsdp2 + zero3:
        print(_FOOTNOTE.replace("; whole:", "; whole blocks:"))


def _print_memory(model, plans, estimates, device_memory, args=None):
    """One block per plan: per-rank GB of each system's parts and peak, and the traffic."""
    gb = 1e9
    for plan in plans:
        est = estimates[(str(plan.granularity), plan.world)]
        s = est["setup"]
        shard = (f"{s['shard_group_size']} x {s['hsdp']} replicas" if s["hsdp"] > 1
                 else f"{s['world_size']} ranks")
        given = s.get("optimizer_type")
        optimizer = f"{given} (run as {s['optimizer']})" if given else s["optimizer"]
        print(f"\nmemory per rank: {model.name} on {shard}, {optimizer}, params "
              f"{s['param_dtype']}, reduce {s['reduce_dtype']}, {s['grad_accum']} micro-step(s), "
              f"{'reshard' if s['reshard_after_forward'] else 'no reshard'} after forward, "
              f"granularity {s['granularity']}, root {'+'.join(s['root']) or '(none)'}")
        ep = s.get("ep", 1) > 1
        if plan.mesh is not None and (plan.mesh.tp, plan.mesh.ep) != (1, 1):
            print(_mesh_line(plan.mesh) + (
                f"; all-to-all: {s['tokens']:,} tokens per data-parallel rank per micro-step, "
                f"uniform routing; FSDP2: torchtitan's FSDP2+EP, ZeRO-3: DeepSpeed AutoEP"
                if ep else ""))
        a2a = " / sends (all-to-all)" if ep else ""
        print(f"GB (10^9 bytes) per rank, {est['activations']}; traffic: GB each rank "
              f"receives (all-gather) / sends (reduce-scatter){a2a} per optimizer step")
        left = f" {'left':>7}" if device_memory else ""
        print(f"{'system':<7} {'master':>8} {'grad':>8} {'optim':>8} {'gathered':>9} "
              f"{'peak':>8}{left} {'padding':>8} {'gather':>8} {'scatter':>8}"
              + (f" {'all2all':>8}" if ep else ""))
        cut = []
        for name, label in (("ours", "ours"), ("fsdp2", "FSDP2"), ("zero3", "ZeRO-3")):
            m = est["memory"][name]
            t = est["traffic"] if name == "ours" else est["traffic"][name]
            if "unsupported" in m:
                print(f"{label:<7} n/a: {m['unsupported']}")
                continue
            room = f" {m['headroom'] / gb:>7.2f}" if device_memory else ""
            mark = _MARK if m.get("ignores_blocks") else " "
            if m.get("ignores_blocks"):
                cut.append(f"{label} {_fine_pct(m['whole_blocks_padding_ratio'])}")
            print(f"{label:<7} {m['master'] / gb:>8.2f} {m['grad'] / gb:>8.2f} "
                  f"{m['optimizer'] / gb:>8.2f} {m['gathered_peak'] / gb:>9.2f} "
                  f"{m['total'] / gb:>8.2f}{room} {100 * m['padding_ratio']:>7.2f}%{mark}"
                  f"{t['all_gather'] / gb:>8.1f} {t['reduce_scatter'] / gb:>8.1f}"
                  + (f" {t['all_to_all'] / gb:>8.1f}" if ep else ""))
        zpp = [f"{what} (groups of {s['quantization_group']})" for key, what in
               (("quantized_weights", "int8 all-gathers"),
                ("quantized_gradients", "int8 gradient all-to-alls")) if s.get(key)]
        if s.get("fp8_matmul"):
            zpp.append("fp8_matmul (the FP8 weights kept with each gathered unit)")
        if s.get("hpz"):
            zpp.append(f"hpZ over {s['hpz']} ranks (its copies in ours' peak; backward "
                       f"gathers inside them: "
                       f"{est['traffic'].get('all_gather_hpz', 0) / gb:.1f} GB)")
        if zpp:
            print(f"ours with ZeRO++: {'; '.join(zpp)}; FSDP2 and ZeRO-3 without")
        if cut:
            print(f"{_MARK} ignores the block constraint: these figures are for a sharding that "
                  f"cuts {s['granularity']} blocks; keeping them whole would pad "
                  f"{', '.join(cut)}")
        work = est["memory"]["ours"].get("shampoo_root_work")
        if work:
            print(f"Shampoo root work per recomputation (sum of k^3 over each rank's L and R): "
                  f"busiest rank {work['max_over_mean']:.3f}x the mean, "
                  f"{work['idle_ranks']} of {s['shard_group_size']} ranks hold no block")
        if "pcie" in est["traffic"]:
            _print_offload(est)
        if device_memory:
            fits = [label for name, label in (("ours", "ours"), ("fsdp2", "FSDP2"),
                                               ("zero3", "ZeRO-3"))
                    if est["memory"][name].get("headroom", 0) > 0]
            print(f"fits in {device_memory:g} GB: {', '.join(fits) if fits else 'none'} "
                  f"(left: what remains for activations and the collectives' own buffers)")
        if args is not None and args.activations is not None:
            _print_activations(args, est, device_memory)


def _print_activations(args, est, device_memory):
    """Activation memory per rank (plan/activations.py) with --sp (ours, DeepSpeed ALST) and
    without it (FSDP2), the peak with them, and the longest sequence each system fits."""
    from vescale_engine.plan.activations import activation_bytes, longest_sequence
    gb = 1e9
    dtype = est["setup"]["param_dtype"]
    options = dict(micro_batch=args.micro_batch, dtype=dtype,
                   checkpointing=bool(args.activation_checkpointing),
                   tiled_mlp=bool(args.tiled_mlp), tiled_loss=bool(args.tiled_loss))
    given = [n for n, on in (("activation checkpointing", args.activation_checkpointing),
                             ("tiled MLP", args.tiled_mlp), ("tiled loss", args.tiled_loss))
             if on]
    print(f"activations per rank: seq {args.seq:,} x micro-batch {args.micro_batch}, {dtype} "
          f"compute{', ' + ', '.join(given) if given else ''} (GB; peak: with the model "
          "state's peak above)")
    rows = (("ours", f"ours, sp {args.sp}", args.sp),
            ("zero3", f"DeepSpeed ALST, sp {args.sp}", args.sp),
            ("fsdp2", "FSDP2, no sequence parallelism", 1))
    longest = []
    for name, label, sp in rows:
        m = est["memory"][name]
        if "unsupported" in m:
            continue
        act = activation_bytes(args.activations, args.seq, sp=sp, **options)
        print(f"  {label:<32} {act / gb:>9.2f}   peak {(m['total'] + act) / gb:>8.2f}")
        if device_memory:
            longest.append(f"{label} {longest_sequence(args.activations, m['headroom'], sp=sp, **options):,}")
    if longest:
        print(f"longest sequence in {device_memory:g} GB: {'; '.join(longest)} (tokens)")


def _fine_pct(ratio: float) -> str:
    """A percentage to 2 decimals, or to its first digit where that shows 0.00% for a
    non-zero ratio."""
    return f"{100 * ratio:.2f}%" if ratio == 0 or ratio >= 1e-4 else f"{100 * ratio:.1g}%"


def _print_offload(est):
    """With offload: each system's device peak (as above), host bytes and PCIe bytes."""
    gb = 1e9
    s = est["setup"]
    ratio = s["offload_optimizer"]
    print(f"offload: optimizer {'none' if not ratio else f'ratio {ratio:g}'}, parameters "
          f"{'on the host' if s['offload_param'] else 'on the device'} (FSDP2's "
          f"CPUOffloadPolicy offloads parameters, gradients and optimizer state, always all)")
    print("GB per rank; device: its peak (as above), shards: the part of it that is parameter "
          "shards kept for the all-gather; host: its peak (the parts shown and the host step's "
          "temporaries); h2d / d2h: bytes over PCIe per optimizer step")
    print(f"{'system':<7} {'device':>8} {'shards':>8} {'host':>8} {'master':>8} {'grad':>8} "
          f"{'optim':>8} {'params':>8} {'offload':>8} {'h2d':>8} {'d2h':>8}")
    for name, label in (("ours", "ours"), ("fsdp2", "FSDP2"), ("zero3", "ZeRO-3")):
        m = est["memory"][name]
        h = m["host"]
        t = (est["traffic"] if name == "ours" else est["traffic"][name])["pcie"]
        print(f"{label:<7} {m['total'] / gb:>8.2f} {m['param_shard'] / gb:>8.2f} "
              f"{h['total'] / gb:>8.2f} {h['master'] / gb:>8.2f} {h['grad'] / gb:>8.2f} "
              f"{h['optimizer'] / gb:>8.2f} {h['param'] / gb:>8.2f} "
              f"{100 * m['offloaded_ratio']:>7.1f}% "
              f"{t['host_to_device'] / gb:>8.1f} {t['device_to_host'] / gb:>8.1f}")
    if s["offload_param"] and not s["offload_optimizer"]:
        print("ours: offload_param needs offload_optimizer (initialize refuses it alone: the "
              "fp32 master lives with the optimizer state); ours is shown without offload")


def _require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlanError("--plot needs matplotlib: pip install matplotlib") from None


def _plot(plans, model, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for granularity in dict.fromkeys(str(p.granularity) for p in plans):
        points = [(p.world, 100 * p.padding_ratio) for p in plans
                  if str(p.granularity) == granularity]
        ax.plot(*zip(*points), marker="o", label=granularity)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("padding (% of parameters)")
    ax.set_title(f"{model.name}: vescale plan padding")
    ax.grid(True, alpha=0.3)
    ax.legend(title="granularity")
    fig.tight_layout()
    tmp = f"{path}.tmp-{os.getpid()}.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)  # never leave a half-written plot behind

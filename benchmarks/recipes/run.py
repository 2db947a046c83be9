"""LLaMA-Factory and axolotl as installed, on 2 gloo ranks: each framework's quickstart SFT
(full fine-tune, LoRA) and its ZeRO-3 CPU-offload config, once under DeepSpeed with the config
the framework ships and once through the documented switch (examples/migrate_from_deepspeed.md,
"LLaMA-Factory and axolotl": a copy of the config with "vescale": {} and the guide's script,
taken from the guide as written). Per-step losses and grad norms (trainer_state.json) and the
saved model or adapter are compared, and benchmarks/results/recipes.md is written.

    python3 benchmarks/recipes/run.py [--root DIR] [--frameworks F ...] [--cases C ...]

One command does everything: a framework's virtual environment is made by install.sh when it
is missing (ROOT/<framework>/venv; ROOT defaults to $RECIPES_ROOT or /tmp/vescale-recipes), the
tiny model, tokenizer and dataset by make_tiny.py, each run in ROOT/<framework>/runs/<case>/
<engine>/ (config, command, log.txt, output). A run that fails is recorded with the last lines
of its log; the others go on. Only the standard library is used here; the runs use the
framework's environment.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
GUIDE = REPO / "examples" / "migrate_from_deepspeed.md"
PUBLIC = REPO / "tests" / "configs_in_the_wild" / "public"
RESULTS = REPO / "benchmarks" / "results" / "recipes.md"
CASES = ("full", "lora", "offload")
ENGINES = ("deepspeed", "vescale")
sys.path.insert(0, str(HERE.parent))  # benchmarks/: ranks.py, the benchmarks' shared helpers
from ranks import free_port  # noqa: E402  (standard library only)

TIMEOUT_S = 1800  # one run; the whole run of one engine on 2 shared cores takes a few minutes

# The framework's shipped DeepSpeed configs (verbatim copies, sources in PUBLIC/README.md).
DS_CONFIGS = {
    "llamafactory": {"full": "llamafactory_ds_z3_config.json",
                     "lora": "llamafactory_ds_z3_config.json",
                     "offload": "llamafactory_ds_z3_offload_config.json"},
    "axolotl": {"full": "axolotl_zero3.json", "lora": "axolotl_zero3.json",
                "offload": "axolotl_zero3_bf16_cpuoffload_all.json"},
}

LORA_START = (
    "LoRA starts from a freshly initialized adapter written by make_tiny.py (`{key}: "
    "tiny/{path}`, the quickstart's rank and alpha, B = 0) instead of one peft draws in the run: "
    "peft draws A from the global RNG after the model is loaded, and loading leaves the RNG in a "
    "different state under DeepSpeed's zero.Init than under ours, so the runs would start from "
    "different A (in an earlier run of this script on axolotl: A differed by up to 2x its "
    "largest entry, step-1 grad norms by 2.8e-2)")
# What differs from the frameworks' own example configs, the same for both engines. Each
# line is written into results/recipes.md.
CHANGES = {
    "llamafactory": [
        "the model, tokenizer and dataset are the tiny local ones (make_tiny.py); template "
        "`default` (the examples' `llama3`/`qwen3_nothink` need those models' special tokens)",
        "`bf16: false` (fp32, so that 1e-5 is meaningful on CPU)",
        "`max_steps: 4` in place of `num_train_epochs: 3.0`, `logging_steps: 1`",
        "`preprocessing_num_workers: 1`, `dataloader_num_workers: 0` (2 cores)",
        "the offload case is the full fine-tune with `ds_z3_offload_config.json`",
        LORA_START.format(key="adapter_name_or_path", path="lora_r8"),
        "gradient checkpointing as LLaMA-Factory sets it by default (on, `use_reentrant_gc: "
        "true`)",
    ],
    "axolotl": [
        "the model, tokenizer and dataset are the tiny local ones (make_tiny.py, a local JSON "
        "file of type `alpaca`); `sequence_len: 256`",
        "`bf16: false` (fp32); the offload config's `\"bf16\": {\"enabled\": true}` is copied "
        "as `\"auto\"` for both engines so that it follows `bf16: false`",
        "`flash_attention: false` (CUDA only): torch's SDPA attention",
        "`optimizer: adamw_torch` in place of `adamw_8bit` / `paged_adamw_8bit` "
        "(bitsandbytes' 8-bit optimizers; neither engine builds them from a client optimizer "
        "under ZeRO-3 the same way)",
        "`lora_mlp_kernel`, `lora_qkv_kernel`, `lora_o_kernel: false`: axolotl turns these "
        "Triton LoRA kernels on by default for LoRA, and they need CUDA (`AssertionError: "
        "Torch not compiled with CUDA enabled` in axolotl/kernels/swiglu.py)",
        "`curriculum_sampling: true` (the packed batches in dataset order): with the default "
        "random order, axolotl's sampler (a `RandomSampler` without a generator under its "
        "multipack batch sampler) draws the order from the global RNG when training starts, "
        "which the two engines leave in different states: in an earlier run of this script "
        "the full fine-tune's step-1 losses differed by 5.3e-4 at learning rate 0",
        "`max_steps: 4`, `warmup_steps: 1`, `val_set_size: 0` (no evaluation), "
        "`dataset_processes: 1`",
        "the offload case is the full fine-tune with `zero3_bf16_cpuoffload_all.json`",
        LORA_START.format(key="lora_model_dir", path="lora_r16") + "; `lora_dropout: 0.0` "
        "(the example's 0.05 draws dropout masks from the same RNG)",
        "gradient checkpointing as the examples set it: LoRA `gradient_checkpointing: true` "
        "(axolotl writes `use_reentrant: true`), full `use_reentrant: false`",
    ],
}

ACCELERATE_SHIM = (
    "cpu_shims/sitecustomize.py: a launched rank that Accelerate gives no distributed backend "
    "(no accelerator) gets gloo, so that Trainer takes its DeepSpeed path as on GPUs (the test "
    "suite's `_accelerate_on_cpu_shim`)")
WORKAROUNDS = {
    "llamafactory": [
        ACCELERATE_SHIM + " (a no-op with Accelerate 1.11, which picks gloo itself)",
        "torchaudio: not installed; a stub module (cpu_shims/torchaudio) on PYTHONPATH for both "
        "runs. PyPI's torchaudio is a CUDA build (`OSError: libc10_cuda.so: cannot open shared "
        "object file`) and its newest release, 2.11.1, pins torch 2.11.1; LLaMA-Factory imports "
        "it at the top of data/mm_plugin.py and uses it for audio inputs only",
        "torchvision: not installed (PyPI's 0.28.0 for torch 2.13 is a CUDA build: "
        "`RuntimeError: operator torchvision::nms does not exist`, which breaks `import "
        "transformers.modeling_utils`); nothing in these runs uses it",
        "DeepSpeed 0.19.8 for both runs: LLaMA-Factory declares none (its README recommends "
        "0.16.4, minimum 0.10.0); 0.19.8 is what this repository's tests run and lies in the "
        "engine's supported range; `DS_ACCELERATOR=cpu`",
    ],
    "axolotl": [
        ACCELERATE_SHIM + ": without it Accelerate 1.13 counts 1 process while DeepSpeed runs 2 "
        "(`AssertionError: Check batch related parameters. train_batch_size is not equal to "
        "micro_batch_per_gpu * gradient_acc_step * world_size 4 != 2 * 2 * 2`)",
        "`accelerate launch --multi_gpu --num_processes 2` (the multi-process launcher a GPU "
        "machine's default config selects; without a GPU plain `accelerate launch` runs one "
        "process, which axolotl then initializes with NCCL: `RuntimeError: Distributed package "
        "doesn't have NCCL built in`)",
        "xformers and deepspeed-kernels: not installed (CUDA builds; xformers' wheels pin other "
        "torch releases); flash-attn is an extra, not installed",
        "DeepSpeed 0.19.8 for both runs, not axolotl's `[deepspeed]` extra (>=0.18.6,<0.19.0, "
        "below the engine's supported range, vescale_engine/versions.py; the guide says to "
        "install axolotl without it); "
        "`DS_ACCELERATOR=cpu`",
    ],
}

BOTH = ["OMP_NUM_THREADS=1", "HF_HUB_OFFLINE=1", "HF_DATASETS_OFFLINE=1", "WANDB_MODE=disabled",
        "TOKENIZERS_PARALLELISM=false", "AXOLOTL_DO_NOT_TRACK=1", "DS_ACCELERATOR=cpu",
        f"PYTHONPATH={HERE / 'cpu_shims'}"]


# ----------------------------------------------------------------------------- configs

def guide_script(framework):
    """The guide's script for `framework`, as written there."""
    name = {"llamafactory": "vescale_llamafactory.py", "axolotl": "vescale_axolotl.py"}[framework]
    for block in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S):
        if block.startswith(f"# {name}\n"):
            return name, block
    raise SystemExit(f"run.py: no `# {name}` script in {GUIDE}")


def ds_config(framework, case, engine):
    cfg = json.loads((PUBLIC / DS_CONFIGS[framework][case]).read_text())
    if cfg.get("bf16", {}).get("enabled") is True:
        cfg["bf16"]["enabled"] = "auto"  # follows the framework's bf16: false (CHANGES)
    if engine == "vescale":
        cfg["vescale"] = {}
    return cfg


def yaml_lines(d, indent=""):
    """A small YAML writer for the flat dicts and lists of dicts the configs below use."""
    out = []
    for key, value in d.items():
        if isinstance(value, list):
            out.append(f"{indent}{key}:")
            for item in value:
                first = True
                for k, v in item.items():
                    out.append(f"{indent}  {'- ' if first else '  '}{k}: {json.dumps(v)}")
                    first = False
        elif isinstance(value, dict):
            out.append(f"{indent}{key}:")
            out += yaml_lines(value, indent + "  ")
        else:
            out.append(f"{indent}{key}: {json.dumps(value)}")
    return out


def llamafactory_config(case, tiny, out, ds_path):
    """examples/train_lora/qwen3_lora_sft.yaml and examples/train_full (full SFT) with the
    changes in CHANGES."""
    cfg = {"model_name_or_path": str(tiny / "model"), "trust_remote_code": True,
           "stage": "sft", "do_train": True,
           "finetuning_type": "lora" if case == "lora" else "full",
           "deepspeed": str(ds_path),
           "dataset": "tiny_alpaca", "dataset_dir": str(tiny / "data"), "template": "default",
           "cutoff_len": 2048, "max_samples": 1000, "overwrite_cache": True,
           "preprocessing_num_workers": 1, "dataloader_num_workers": 0,
           "output_dir": str(out), "logging_steps": 1, "save_steps": 500, "plot_loss": False,
           "overwrite_output_dir": True, "save_only_model": False, "report_to": "none",
           "per_device_train_batch_size": 1, "max_steps": 4, "lr_scheduler_type": "cosine",
           "warmup_ratio": 0.1, "bf16": False, "ddp_timeout": 180000000}
    if case == "lora":
        cfg.update(lora_rank=8, lora_target="all", gradient_accumulation_steps=8,
                   learning_rate=1.0e-4, adapter_name_or_path=str(tiny / "lora_r8"))
    else:
        cfg.update(gradient_accumulation_steps=2, learning_rate=1.0e-5)
    return cfg


def axolotl_config(case, tiny, out, ds_path):
    """examples/llama-3/lora-1b.yml (LoRA) and examples/llama-3/fft-8b.yaml (full) with the
    changes in CHANGES."""
    cfg = {"base_model": str(tiny / "model"), "model_type": "LlamaForCausalLM",
           "tokenizer_type": "AutoTokenizer", "load_in_8bit": False, "load_in_4bit": False,
           "strict": False,
           "datasets": [{"path": str(tiny / "data" / "tiny_alpaca.json"), "ds_type": "json",
                         "type": "alpaca"}],
           "dataset_prepared_path": str(out.parent / "last_run_prepared"),
           "dataset_processes": 1, "val_set_size": 0.0, "output_dir": str(out),
           "sequence_len": 256, "sample_packing": True, "pad_to_sequence_len": True,
           "lr_scheduler": "cosine", "optimizer": "adamw_torch", "train_on_inputs": False,
           "group_by_length": False, "bf16": False, "fp16": False, "tf32": False,
           "gradient_checkpointing": True, "logging_steps": 1, "flash_attention": False,
           "max_steps": 4, "warmup_steps": 1, "saves_per_epoch": 1, "weight_decay": 0.0,
           "curriculum_sampling": True,
           "deepspeed": str(ds_path), "special_tokens": {"pad_token": "<|end_of_text|>"}}
    if case == "lora":
        cfg.update(adapter="lora", lora_model_dir=str(tiny / "lora_r16"),
                   lora_r=16, lora_alpha=32, lora_dropout=0.0,
                   lora_target_modules=["gate_proj", "down_proj", "up_proj", "q_proj",
                                        "v_proj", "k_proj", "o_proj"],
                   gradient_accumulation_steps=2, micro_batch_size=2, learning_rate=0.0002,
                   loss_watchdog_threshold=5.0, loss_watchdog_patience=3,
                   lora_mlp_kernel=False, lora_qkv_kernel=False, lora_o_kernel=False)
    else:
        cfg.update(gradient_accumulation_steps=8, micro_batch_size=1, learning_rate=2e-5,
                   gradient_checkpointing_kwargs={"use_reentrant": False})
    return cfg


def write_yaml(path, cfg):
    lines = []
    for key, value in cfg.items():
        if isinstance(value, list) and value and not isinstance(value[0], dict):
            lines.append(f"{key}:")
            lines += [f"  - {json.dumps(v)}" for v in value]
        else:
            lines += yaml_lines({key: value})
    path.write_text("\n".join(lines) + "\n")


# ----------------------------------------------------------------------------- running

def command(framework, engine, venv, cfg_path, script, port):
    bin_ = venv / "bin"
    if framework == "llamafactory":
        if engine == "deepspeed":  # `llamafactory-cli train` starts torchrun on launcher.py
            return (["env", "FORCE_TORCHRUN=1", "NPROC_PER_NODE=2", f"MASTER_PORT={port}",
                     str(bin_ / "llamafactory-cli"), "train", str(cfg_path)])
        return [str(bin_ / "torchrun"), "--nproc_per_node", "2", "--master_port", str(port),
                str(script), str(cfg_path)]
    # --multi_gpu: Accelerate's multi-process launcher (torchrun), which a GPU machine's
    # default config selects; each rank then finds no GPU and takes gloo.
    launch = [str(bin_ / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
              "--main_process_port", str(port)]
    if engine == "deepspeed":  # what `axolotl train CONFIG --launcher accelerate` runs
        return launch + ["-m", "axolotl.cli.train", str(cfg_path)]
    return launch + [str(script), str(cfg_path)]


def run_one(framework, case, engine, root):
    venv, tiny = root / framework / "venv", root / framework / "tiny"
    run = root / framework / "runs" / case / engine
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    ds_path = run / ("ds_config_vescale.json" if engine == "vescale" else "ds_config.json")
    ds_path.write_text(json.dumps(ds_config(framework, case, engine), indent=2))
    out = run / "output"
    make = llamafactory_config if framework == "llamafactory" else axolotl_config
    cfg_path = run / "config.yaml"
    write_yaml(cfg_path, make(case, tiny, out, ds_path))
    name, text = guide_script(framework)
    script = run / name
    script.write_text(text)
    cmd = command(framework, engine, venv, cfg_path, script, free_port())
    # DeepSpeed builds its CPU ops (shm comm, CPU Adam) with torch's extension builder; a folder
    # per framework keeps the two DeepSpeed releases from rebuilding over each other.
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in BOTH),
               PATH=f"{venv / 'bin'}:{os.environ['PATH']}",
               TORCH_EXTENSIONS_DIR=str(root / framework / "torch_extensions"))
    shown = " ".join(BOTH[:-1] + ["PYTHONPATH=benchmarks/recipes/cpu_shims",
                                  f"TORCH_EXTENSIONS_DIR={root / framework}/torch_extensions"]
                     + cmd)
    (run / "command.txt").write_text(shown + "\n")
    start = time.time()
    with open(run / "log.txt", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=run, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, timeout=TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = {"framework": framework, "case": case, "engine": engine, "returncode": rc,
              "repo_commit": repo_commit(),
              "seconds": round(time.time() - start, 1), "command": shown}
    result.update(read_outputs(out))
    if rc != 0 or not result["steps"]:
        result["error"] = error_lines(run / "log.txt")
    (run / "result.json").write_text(json.dumps(result, indent=1))
    print(f"run.py: {framework} {case} {engine}: rc {rc}, {len(result['steps'])} steps, "
          f"{result['seconds']} s", flush=True)
    return result


def repo_commit():
    """This repository's commit (what the veScale run imports), "+changes" if the tree differs."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--",
                            "vescale_engine"], capture_output=True, text=True).stdout.strip()
    return head + ("+changes" if dirty else "")


def read_outputs(out):
    """The per-step log of the last trainer_state.json written, and the saved weights file."""
    states = sorted(out.rglob("trainer_state.json"),
                    key=lambda p: json.loads(p.read_text()).get("global_step", 0))
    steps = []
    if states:
        for entry in json.loads(states[-1].read_text())["log_history"]:
            if "loss" in entry and "grad_norm" in entry:
                steps.append({"step": entry["step"], "loss": entry["loss"],
                              "grad_norm": entry["grad_norm"],
                              "learning_rate": entry.get("learning_rate")})
    saved = [p for name in ("adapter_model.safetensors", "model.safetensors")
             for p in [out / name] if p.exists()]
    # Which engine wrote the Trainer checkpoint: ours writes global_stepN/vescale_state.json
    # (torch.distributed.checkpoint files), DeepSpeed zero_pp_rank_*_model_states.pt.
    written_by = sorted({"veScale" for _ in out.rglob("vescale_state.json")}
                        | {"DeepSpeed" for _ in out.rglob("zero_pp_rank_*_model_states.pt")})
    return {"steps": steps, "saved": str(saved[0]) if saved else None,
            "checkpoint_by": " and ".join(written_by) or None}


def error_lines(log_path, n=12):
    """The log's last traceback lines (the exception and where it was raised)."""
    lines = log_path.read_text(errors="replace").splitlines()
    marks = [i for i, line in enumerate(lines) if re.match(r"\s*(\[rank\d+\]:\s*)?\w*(Error|"
                                                             r"Exception)\b.*:", line)]
    if marks:
        i = marks[0]
        return "\n".join(lines[max(0, i - n):i + 3])
    return "\n".join(lines[-n:])


# ----------------------------------------------------------------------------- comparing

def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def compare(framework, case, root, results):
    ds, vs = results.get("deepspeed"), results.get("vescale")
    row = {"framework": framework, "case": case}
    if not ds or not vs or not ds["steps"] or not vs["steps"]:
        return row
    n = min(len(ds["steps"]), len(vs["steps"]))
    row["steps"] = n
    row["loss"] = max(rel(v["loss"], d["loss"]) for d, v in zip(ds["steps"], vs["steps"]))
    row["grad_norm"] = max(rel(v["grad_norm"], d["grad_norm"])
                           for d, v in zip(ds["steps"], vs["steps"]))
    if ds["saved"] and vs["saved"]:
        init = root / framework / "tiny" / "model" / "model.safetensors"
        venv = root / framework / "venv"
        out = subprocess.run([str(venv / "bin" / "python"), str(HERE / "weights_diff.py"),
                              ds["saved"], vs["saved"], str(init)],
                             capture_output=True, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        if out.returncode == 0:
            row.update(json.loads(out.stdout.splitlines()[-1]))
        else:
            row["weights_error"] = out.stderr.strip().splitlines()[-1]
    return row


def versions(root, framework):
    freeze = root / framework / "pip-freeze.txt"
    names = ("llamafactory", "axolotl", "torch", "transformers", "peft", "trl", "accelerate",
             "datasets", "deepspeed", "tokenizers", "vescale-engine")
    found = {}
    if freeze.exists():
        for line in freeze.read_text().splitlines():
            name, _, version = line.partition("==")
            if name.lower() in names:
                found[name.lower()] = version
    return ", ".join(f"{n} {found[n]}" for n in names if n in found)


def cpu_model():
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"Model name:\s*(.+)", out)
    cores = re.search(r"^CPU\(s\):\s*(\d+)", out, flags=re.M)
    return f"{model.group(1).strip() if model else '?'}, {cores.group(1) if cores else '?'} CPUs"


def fmt(x):
    return "—" if x is None else f"{x:.2e}"


def write_results(root, frameworks, argv):
    command = "python3 benchmarks/recipes/run.py" + "".join(" " + a for a in argv)
    runs_by = root / "last_command.txt"
    if "--report-only" not in argv:
        runs_by.write_text(command + "\n")
    made = runs_by.read_text().strip() if runs_by.exists() else command
    lines = ["# LLaMA-Factory and axolotl through the switch, against DeepSpeed",
             "",
             f"Runs made by `{made}`, this file written by `{command}` on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; CPU: {cpu_model()}; "
             "2 gloo ranks (one process each, `OMP_NUM_THREADS=1`). Each framework's entry "
             "point runs each case twice: under DeepSpeed with the framework's shipped ZeRO-3 "
             "config, and through the switch as examples/migrate_from_deepspeed.md "
             "(\"LLaMA-Factory and axolotl\") documents it: a copy of the config with "
             "`\"vescale\": {}` and the guide's script, taken from the guide as written.",
             "",
             "Relative differences, ours against DeepSpeed: per-step loss and grad norm "
             "(trainer_state.json, every step; the largest of |ours - DeepSpeed| / |DeepSpeed|), "
             "and the saved model or adapter (largest over tensors of max |ours - DeepSpeed| / "
             "max |DeepSpeed|; for full fine-tunes also of the update, saved - initial). The "
             "target is 1e-5. Next to the update: one fp32 rounding of that tensor's weights "
             "relative to its update, the level below which two updates cannot be told apart "
             "(4 steps at the examples' learning rates move the weights little).", ""]
    for framework in frameworks:
        base = root / framework
        lines += [f"## {framework}", "", f"Versions: {versions(root, framework)}.", "",
                  "| case | steps | loss | grad norm | saved weights | update | DeepSpeed | ours |",
                  "|---|---|---|---|---|---|---|---|"]
        details = []
        for case in CASES:
            runs = {}
            for engine in ENGINES:
                p = base / "runs" / case / engine / "result.json"
                if p.exists():
                    runs[engine] = json.loads(p.read_text())
            if not runs:
                continue
            row = compare(framework, case, root, runs)
            state = {e: ("not run" if e not in runs else
                         "ok" if runs[e]["returncode"] == 0 and runs[e]["steps"] else
                         f"failed (rc {runs[e]['returncode']})") for e in ENGINES}
            lines.append(f"| {case} | {row.get('steps', '—')} | {fmt(row.get('loss'))} | "
                         f"{fmt(row.get('grad_norm'))} | {fmt(row.get('weights'))} | "
                         f"{fmt(row.get('update'))}"
                         + (f" (rounding {fmt(row['update_rounding'])})"
                            if row.get("update_rounding") else "")
                         + f" | {state['deepspeed']} | "
                         f"{state['vescale']} |")
            details.append(f"### {framework} {case}")
            details.append("")
            for engine in ENGINES:
                r = runs.get(engine)
                if not r:
                    continue
                at = (f", this repository at {r['repo_commit']}" if engine == "vescale" else "")
                by = (f"; its Trainer checkpoint is {r['checkpoint_by']}'s format"
                      if r.get("checkpoint_by") else "")
                details.append(f"{engine}: `{r['command']}` ({r['seconds']} s{at}{by})")
                details.append("")
                if r.get("error"):
                    details += ["```", r["error"], "```", ""]
            if runs.get("deepspeed", {}).get("steps") or runs.get("vescale", {}).get("steps"):
                details += ["| step | loss DeepSpeed | loss ours | grad norm DeepSpeed | "
                            "grad norm ours |", "|---|---|---|---|---|"]
                ds = runs.get("deepspeed", {}).get("steps", [])
                vs = runs.get("vescale", {}).get("steps", [])
                for i in range(max(len(ds), len(vs))):
                    d = ds[i] if i < len(ds) else {}
                    v = vs[i] if i < len(vs) else {}
                    details.append(f"| {d.get('step', v.get('step'))} | {d.get('loss', '—')} | "
                                   f"{v.get('loss', '—')} | {d.get('grad_norm', '—')} | "
                                   f"{v.get('grad_norm', '—')} |")
                details.append("")
            if row.get("weights_error"):
                details += [f"saved weights not compared: {row['weights_error']}", ""]
        lines += ["", "Changes from the framework's example configs (both engines alike):", ""]
        lines += [f"- {c}" for c in CHANGES[framework]]
        lines += ["", "CPU-only workarounds (both engines alike):", ""]
        lines += [f"- {w}" for w in WORKAROUNDS[framework]]
        lines += [""] + details
    RESULTS.write_text("\n".join(lines).rstrip() + "\n")
    print(f"run.py: wrote {RESULTS}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=os.environ.get("RECIPES_ROOT", "/tmp/vescale-recipes"))
    parser.add_argument("--frameworks", nargs="+", default=["llamafactory", "axolotl"],
                        choices=["llamafactory", "axolotl"])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES,
                        help="rerun only these (the other engine's last run in ROOT is kept)")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite results/recipes.md from the runs already in ROOT")
    args = parser.parse_args()
    root = Path(args.root).resolve()
    for framework in args.frameworks if not args.report_only else []:
        venv = root / framework / "venv"
        if not (venv / "bin" / "python").exists():
            subprocess.run(["bash", str(HERE / "install.sh"), framework, str(root)], check=True)
        tiny = root / framework / "tiny"
        if not (tiny / "model" / "model.safetensors").exists():
            subprocess.run([str(venv / "bin" / "python"), str(HERE / "make_tiny.py"), str(tiny)],
                           check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        for case in args.cases:
            for engine in args.engines:
                run_one(framework, case, engine, root)
    write_results(root, ["llamafactory", "axolotl"], sys.argv[1:])


if __name__ == "__main__":
    main()

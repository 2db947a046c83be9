#!/usr/bin/env bash
# Install one framework in its own virtual environment, at its newest release and the library
# versions it pins, with torch's CPU build and this repository (editable; the framework's pins
# decide transformers, peft, trl, accelerate and datasets).
#
#   bash benchmarks/recipes/install.sh llamafactory|axolotl [ROOT]
#
# ROOT (or $RECIPES_ROOT; default /tmp/vescale-recipes) gets ROOT/<framework>/venv,
# requirements.txt (what was asked of pip) and pip-freeze.txt (what it installed). An existing
# venv is reused (pip only adds what is missing).
#
# torch 2.13.0 (CPU build) is installed first and held by a constraint, so that no dependency
# pulls PyPI's CUDA build or another torch. The framework itself goes in with --no-deps; its
# declared requirements are then installed as its metadata states them, except the ones named in
# SKIP below, each for the reason given there (results/recipes.md lists them as workarounds).
set -euo pipefail
framework=$1
root=${2:-${RECIPES_ROOT:-/tmp/vescale-recipes}}
repo=$(cd "$(dirname "$0")/../.." && pwd)
dir=$root/$framework
venv=$dir/venv
mkdir -p "$dir"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }

pip install torch==2.13.0
echo "torch==2.13.0" > "$dir/constraints.txt"

# The requirements of an installed distribution ($1), with its extra $2 (may be empty), less
# the names in $3, one per line as pip reads them.
requirements() {
  DIST=$1 EXTRA=$2 SKIP=$3 "$venv/bin/python" - <<'PY'
import os
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement  # a fresh venv has pip's copy only

skip = set(os.environ["SKIP"].split())
for line in requires(os.environ["DIST"]):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": os.environ["EXTRA"]}):
        continue
    if req.name not in skip:
        print(str(req).split(";")[0])
PY
}

case $framework in
llamafactory)
  # torchaudio and torchvision are left out: PyPI's builds of them link CUDA's libraries
  # (libc10_cuda.so; torchvision: "operator torchvision::nms does not exist") and fail to import
  # with torch's CPU build, and torchaudio's newest release (2.11.1) pins torch==2.11.1.
  # LLaMA-Factory imports torchaudio at the top of data/mm_plugin.py (used for audio inputs
  # only): run.py puts a stub of it on the path of both runs. Nothing here imports torchvision.
  # DeepSpeed is no declared dependency of the wheel (its README's table of optional packages
  # says minimum 0.10.0, recommended 0.16.4): the release this repository's test environment
  # runs, 0.19.8, in the engine's supported range (vescale_engine/versions.py). Both runs use
  # it.
  pip install --no-deps llamafactory==0.9.5
  requirements llamafactory "" "torchaudio torchvision" > "$dir/requirements.txt"
  echo deepspeed==0.19.8 >> "$dir/requirements.txt"
  pip install -c "$dir/constraints.txt" -r "$dir/requirements.txt"
  ;;
axolotl)
  # axolotl, less the CUDA-only builds: xformers (CUDA wheels pinned to other torch releases),
  # flash-attn (an extra, not installed). Its [deepspeed] extra pins deepspeed<0.19 (and
  # deepspeed-kernels, which builds CUDA code at install time), below the engine's supported
  # range (vescale_engine/versions.py), so, as examples/migrate_from_deepspeed.md tells axolotl
  # users, DeepSpeed comes from this repository's range instead: 0.19.8, for both runs.
  pip install --no-deps axolotl==0.19.0
  requirements axolotl "" "xformers flash-attn" > "$dir/requirements.txt"
  echo deepspeed==0.19.8 >> "$dir/requirements.txt"
  pip install -c "$dir/constraints.txt" -r "$dir/requirements.txt"
  ;;
*)
  echo "install.sh: unknown framework $framework (llamafactory or axolotl)" >&2
  exit 2
  ;;
esac

# This repository with its [hf] extra, every package already installed held at its version: pip
# adds only what the engine needs beyond the framework (jsonschema, py-cpuinfo), and fails if the
# engine's declared ranges exclude a version the framework pinned.
pip list --format=freeze | grep -v -i '^vescale[-_]engine=' > "$dir/installed.txt"
pip install -c "$dir/installed.txt" -e "$repo[hf]"
pip list --format=freeze > "$dir/pip-freeze.txt"
echo "install.sh: $framework ready in $venv"

#!/usr/bin/env bash
# Checks to run on a single-GPU CUDA machine:
#   (a) the FSDP parity tests (they run on CPU/gloo, so they need no GPU, but run them there too);
#   (b) the fake-process-group memory comparison, ours vs PyTorch FSDP2, on CUDA:
#       torch.cuda.max_memory_allocated() growth over one forward + backward at W = 64 256 1024
#       (benchmarks/fake_pg_memory.py --device cuda; no NCCL needed with the fake backend).
# Everything goes to $OUT/gpu_check.log if $OUT is set, else benchmarks/results/gpu_check.log;
# the memory table also to gpu_fake_pg_memory.md next to it.
#
#   bash benchmarks/gpu_check.sh                       # on the GPU machine
#   DEVICE=cpu bash benchmarks/gpu_check.sh            # smoke test without a GPU (RSS metric)
# Environment: PYTHON (default: python), DEVICE (cuda), WORLD_SIZES ("64 256 1024"),
# REPEATS (1: CUDA allocator figures are deterministic), SKIP_TESTS=1 to skip (a).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
WORLD_SIZES=${WORLD_SIZES:-64 256 1024}
REPEATS=${REPEATS:-1}
DIR=${OUT:-benchmarks/results}
mkdir -p "$DIR"
LOG=$DIR/gpu_check.log
MD=$DIR/gpu_fake_pg_memory.md
[ "$DEVICE" = cuda ] || MD=$DIR/gpu_check_${DEVICE}_fake_pg_memory.md

{
  echo "== gpu_check $(date -u +%FT%TZ) on $(hostname), device=$DEVICE"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda available:', torch.cuda.is_available(),
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
  if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "ERROR: DEVICE=cuda but torch.cuda.is_available() is False"; exit 2
  fi

  rc_tests=skipped
  if [ "${SKIP_TESTS:-0}" != 1 ]; then
    echo; echo "== (a) $PY -m pytest -q tests/test_fsdp.py"
    "$PY" -m pytest -q tests/test_fsdp.py; rc_tests=$?
  fi

  echo; echo "== (b) $PY benchmarks/fake_pg_memory.py --device $DEVICE --world-sizes $WORLD_SIZES --repeats $REPEATS --out $MD"
  # shellcheck disable=SC2086  # WORLD_SIZES is a list
  "$PY" benchmarks/fake_pg_memory.py --device "$DEVICE" --world-sizes $WORLD_SIZES \
      --repeats "$REPEATS" --out "$MD"; rc_mem=$?

  echo; echo "== summary: tests rc=$rc_tests, memory rc=$rc_mem, table in $MD"
  [ "$rc_tests" = 0 ] || [ "$rc_tests" = skipped ] || exit 1
  [ "$rc_mem" = 0 ] || exit 1
} 2>&1 | tee "$LOG"
rc=$?
echo "log: $LOG"
exit $rc

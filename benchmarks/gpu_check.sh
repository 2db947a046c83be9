#!/usr/bin/env bash
# The GPU check: everything issue 13 asks to see on one CUDA device, in one run (under 8 minutes
# on one H200 without part (5), which is not yet timed on a GPU: its runs are bounded at 10
# minutes; DeepSpeed JIT-builds its CPUAdam op on first use), written to $OUT (default
# benchmarks/results/gpu_check_$DEVICE):
#   (1) the README's main job on one GPU (NCCL, world size 1), fp32 and bf16 configs;
#   (2) benchmarks/gpu_validate.py: placement, fp32 parity with unsharded torch (TF32 off), bf16
#       with accumulation, fp16 overflow skipping, host syncs (set_sync_debug_mode), memory
#       drift, native collectives and ragged redistributions, checkpoint resume for AdamW,
#       AdamW8bit, Muon and Shampoo (placement and host syncs for each too), stage 0;
#   (3) the fake-process-group memory comparison with FSDP2 at W = $WORLD_SIZES;
#   (4) step time and peak memory against FSDP2 on a ~1B-parameter bf16 model (world size 1),
#       and `vescale plan --time`'s prediction of both on this GPU's cluster file (within 10%:
#       benchmarks/step_time_check.py);
#   (5) benchmarks/gpu_offload.py: offload, peak device memory and step time of ~1B and ~3B
#       bf16 Llamas, ours vs DeepSpeed ZeRO-3 offload vs FSDP2 CPUOffloadPolicy (world size 1;
#       a variant the engine refuses is skipped with its reason);
#   (6) benchmarks/moe_ep_memory.py: one Kimi K2 / DeepSeek-V3 MoE layer with expert
#       parallelism (EP 8 and 64) as rank 0 of W = 256 and 1,024 (fake process group), peak
#       CUDA memory of a training step, ours vs FSDP2+EP, full-size layers;
#   (7) benchmarks/checkpoint_io.py: a save's stall, synchronous vs background (pinned host
#       staging), and end-to-end steps with saves, beside DeepSpeed (world size 1);
#   (8) benchmarks/compile_step.py: the step with and without engine.compile() (inductor),
#       beside FSDP2 with compiled blocks (world size 1);
#   (9) benchmarks/quantized_comm.py: int8 and FP8 weight and gradient collectives against
#       bf16 on NCCL (world size 1: the quantize and dequantize passes, bytes), then as rank
#       0 of W = 1024 with the fake process group (the passes at that world size);
#  (10) benchmarks/fp8_matmul.py: a Linear's forward on 128 x 128 FP8 weight tiles,
#       dequantize + bf16 matmul vs vescale.fp8_matmul's matmul vs one block-scaled call.
#
#   bash benchmarks/gpu_check.sh                  # on the GPU machine
#   DEVICE=cpu bash benchmarks/gpu_check.sh       # dry run on CPU (gloo, small sizes; in CI)
# Environment: PYTHON (python), DEVICE (cuda), OUT, WORLD_SIZES ("64 256 1024"; cpu: "64"),
# STEPS (main job steps: 300; cpu: 20).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
DIR=${OUT:-benchmarks/results/gpu_check_$DEVICE}
mkdir -p "$DIR"
LOG=$DIR/gpu_check.log
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DEVICE" = cpu ]; then
  export VESCALE_BACKEND=gloo
  WORLD_SIZES=${WORLD_SIZES:-64}
  STEPS=${STEPS:-20}
  STEP_TIME_FLAGS="--layers 2 --dim 64 --vocab 256 --seq 64 --batch 2 --steps 2 --warmup 1 --rounds 1"
  OFFLOAD_FLAGS="--smoke"
  MOE_FLAGS="--smoke"
  CKPT_FLAGS="--smoke --repeats 1 --steps 2 --every 1 --e2e-rounds 1"
  COMPILE_FLAGS="--layers 1 --dim 64 --seq 32 --batch 2 --steps 1 --warmup 1 --rounds 1"
  QUANT_FLAGS="--layers 1 --dim 128 --seq 16 --steps 2 --rounds 1"
  QUANT_FAKE_WORLD=64
  FP8_FLAGS="--smoke"
else
  WORLD_SIZES=${WORLD_SIZES:-64 256 1024}
  STEPS=${STEPS:-300}
  STEP_TIME_FLAGS=""
  OFFLOAD_FLAGS=""
  MOE_FLAGS="--scale 1 --tokens 1024"
  CKPT_FLAGS=""
  COMPILE_FLAGS="--layers 8 --dim 1024 --seq 1024 --batch 8 --steps 10 --warmup 3 --rounds 3"
  QUANT_FLAGS="--layers 4 --dim 1024 --seq 1024 --batch 4 --steps 10 --rounds 1"
  QUANT_FAKE_WORLD=256
  FP8_FLAGS=""
fi

declare -A RC
run() {  # run NAME TIMEOUT_S COMMAND...: log it, time it, keep its exit status
  local name=$1 limit=$2; shift 2
  echo; echo "== ($name) $*"
  local start=$SECONDS
  timeout "$limit" "$@"; RC[$name]=$?
  echo "== ($name) exit ${RC[$name]} after $((SECONDS - start)) s"
}

{
  echo "== gpu_check $(date -u +%FT%TZ) on $(hostname), device=$DEVICE, out=$DIR"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  # the versions this run measured (the GPU nodes' own torch: nothing is installed there)
  "$PY" -c "import platform, torch; print('python', platform.python_version(), '| torch',
    torch.__version__, '| cuda available:', torch.cuda.is_available(),
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
  "$PY" - <<'PY'
from importlib import metadata
found = []
for name in ("deepspeed", "transformers", "accelerate", "peft", "trl"):
    try:
        found.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        found.append(f"{name} (not installed)")
print(" | ".join(found))
PY
  if [ "$DEVICE" = cuda ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "ERROR: DEVICE=cuda but torch.cuda.is_available() is False"; exit 2
  fi
  [ "$DEVICE" = cpu ] && lscpu | grep -E "Model name|^CPU\(s\)"

  for cfg in vescale_default vescale_bf16; do
    run "main_job_$cfg" 240 "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 \
      examples/train_gpt.py --steps "$STEPS" --config "examples/configs/$cfg.json"
  done
  run validate 300 "$PY" benchmarks/gpu_validate.py --device "$DEVICE" --out "$DIR"
  # shellcheck disable=SC2086  # WORLD_SIZES is a list
  run fake_pg_memory 240 "$PY" benchmarks/fake_pg_memory.py --device "$DEVICE" \
    --world-sizes $WORLD_SIZES --repeats 1 --out "$DIR/fake_pg_memory_$DEVICE.md"
  # shellcheck disable=SC2086  # flags
  run step_time 300 "$PY" benchmarks/gpu_step_time.py --device "$DEVICE" $STEP_TIME_FLAGS --out "$DIR"
  run step_time_model 60 "$PY" benchmarks/step_time_check.py \
    --measured "$DIR/gpu_step_time_$DEVICE.json" --out "$DIR/step_time_model_$DEVICE.md"
  # shellcheck disable=SC2086  # flags
  run offload 600 "$PY" benchmarks/gpu_offload.py --device "$DEVICE" $OFFLOAD_FLAGS --out "$DIR"
  # shellcheck disable=SC2086  # flags
  run moe_ep_memory 600 "$PY" benchmarks/moe_ep_memory.py --device "$DEVICE" $MOE_FLAGS \
    --out "$DIR/moe_ep_memory_$DEVICE.md"
  # shellcheck disable=SC2086  # flags
  run checkpoint_io 300 "$PY" benchmarks/checkpoint_io.py --device "$DEVICE" --world 1 \
    $CKPT_FLAGS --out "$DIR/checkpoint_io_$DEVICE.md"
  # shellcheck disable=SC2086  # flags
  run compile_step 400 "$PY" benchmarks/compile_step.py --device "$DEVICE" --world 1 \
    $COMPILE_FLAGS --out "$DIR/compile_step_$DEVICE.md"
  # shellcheck disable=SC2086  # flags
  run quantized_comm 300 "$PY" benchmarks/quantized_comm.py --device "$DEVICE" --world 1 \
    $QUANT_FLAGS --out "$DIR/quantized_comm_$DEVICE.md"
  # shellcheck disable=SC2086  # flags
  run quantized_comm_fake 300 "$PY" benchmarks/quantized_comm.py --device "$DEVICE" \
    --fake-world "$QUANT_FAKE_WORLD" $QUANT_FLAGS --out "$DIR/quantized_comm_fake_$DEVICE.md"
  # shellcheck disable=SC2086  # flags
  run fp8_matmul 200 "$PY" benchmarks/fp8_matmul.py --device "$DEVICE" $FP8_FLAGS \
    --out "$DIR/fp8_matmul_$DEVICE.md"

  echo; echo "== summary (exit status per part; 0 = passed)"
  failed=0
  for name in "${!RC[@]}"; do
    echo "$name: ${RC[$name]}"
    [ "${RC[$name]}" = 0 ] || failed=1
  done
  echo "results in $DIR"
  exit $failed
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# Multi-node GPU training of the example with Open MPI's mpirun: one rank per GPU.
#
#   bash examples/jobs/mpirun_multinode.sh HOSTFILE [more train_gpt.py arguments]
#
# HOSTFILE lists the nodes, one per line, as "node1 slots=8" (slots = that node's GPUs); the
# first node runs rank 0. Run it from the repository root on the first node, with the same
# Python environment at the same path on every node and passwordless ssh between nodes.
# `vescale run --launcher mpi --hostfile HOSTFILE examples/train_gpt.py ...` builds the same
# kind of command line for you.
set -euo pipefail

HOSTFILE=${1:?usage: bash examples/jobs/mpirun_multinode.sh HOSTFILE [train_gpt.py args]}
shift

# Ranks (= GPUs) per node; every node in the hostfile runs this many.
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# Nodes: the hostfile's host lines (comments and blank lines skipped).
NODES=$(grep -cvE '^[[:space:]]*(#|$)' "$HOSTFILE")
# Where the process group meets: rank 0's node, the hostfile's first host (mpirun fills the
# hosts in order). The engine reads MASTER_ADDR/MASTER_PORT; rank, world size and local rank
# (which GPU) come from Open MPI's OMPI_COMM_WORLD_* variables.
MASTER_ADDR=$(grep -vE '^[[:space:]]*(#|$)' "$HOSTFILE" | head -n 1 | awk '{print $1}' | cut -d: -f1)
# A port free on that node.
MASTER_PORT=${MASTER_PORT:-29500}
# CPU threads per rank (data preparation and host-side work; the GPU does the math).
OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# The training config and the interpreter (the same venv path on every node).
CONFIG=${CONFIG:-examples/configs/vescale_default.json}
PYTHON=${PYTHON:-$(command -v python3)}

# NCCL (GPU collectives): NCCL_DEBUG=INFO prints the chosen transports when a job hangs;
# NCCL_SOCKET_IFNAME names the network interface for bootstrap and socket traffic (here: any but
# loopback and docker's bridge); NCCL_IB_DISABLE=1 turns InfiniBand off where it is broken.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker0}
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}

# Open MPI refuses to start as root unless told (containers often run as root).
AS_ROOT=()
if [ "$(id -u)" -eq 0 ]; then AS_ROOT=(--allow-run-as-root); fi

# CPU placement: local rank r drives GPU r, and on DGX/HGX-style nodes GPU r sits on NUMA node
# r / (GPUs per NUMA node). So the ranks fill the NUMA nodes in turn (--map-by ppr:K:numa, K
# ranks on each) and each is bound to its node's cores and memory (--bind-to numa); host-side
# work and the pinned copies then stay next to the GPU. NUMA nodes are counted on this node
# (the others are assumed alike); where the GPUs do not split evenly, the ranks stay unbound.
NUMA_NODES=$(ls -d /sys/devices/system/node/node[0-9]* 2>/dev/null | wc -l)
NUMA_NODES=$(( NUMA_NODES > 0 ? NUMA_NODES : 1 ))
if (( GPUS_PER_NODE % NUMA_NODES == 0 )); then
    PLACEMENT=(--map-by "ppr:$((GPUS_PER_NODE / NUMA_NODES)):numa" --bind-to numa)
else
    PLACEMENT=(--map-by "ppr:${GPUS_PER_NODE}:node" --bind-to none)
fi

# -n: all ranks; -x: variables every rank gets, on every node.
set -x
mpirun -n $((NODES * GPUS_PER_NODE)) --hostfile "$HOSTFILE" "${AS_ROOT[@]}" \
    "${PLACEMENT[@]}" \
    -x MASTER_ADDR="$MASTER_ADDR" -x MASTER_PORT="$MASTER_PORT" \
    -x OMP_NUM_THREADS="$OMP_NUM_THREADS" -x PATH -x PYTHONUNBUFFERED=1 \
    -x NCCL_DEBUG -x NCCL_SOCKET_IFNAME -x NCCL_IB_DISABLE \
    "$PYTHON" examples/train_gpt.py --config "$CONFIG" "$@"

#!/usr/bin/env bash
# Runs the training program on this machine with torchrun: NPROC ranks, standalone rendezvous.
#   bash launch/local.sh NPROC [training flags...]
#   bash launch/local.sh 2 --device cpu --distributed-backend gloo --tensor-model-parallel-size 2 ...
# Environment: PROGRAM (default pretrain_gpt_sp.py), PYTHON (default python), MAX_RESTARTS
# (default 0: restart the whole group this many times after a rank fails; with --load the program
# resumes from the last checkpoint), OMP_NUM_THREADS (default 1 thread per rank).
set -euo pipefail
if [[ $# -lt 1 || ! $1 =~ ^[0-9]+$ ]]; then
  echo "usage: bash launch/local.sh NPROC [training flags...]" >&2
  exit 2
fi
NPROC=$1
shift
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}   # see launch/slurm_common.sh
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export PYTHONUNBUFFERED=1
# After a restart the ranks must not meet in the agent's long-lived TCP store: it still holds the
# failed attempt's addresses, and a rank can read one before its new peer overwrites it (gloo:
# "connectFullMesh ... Connection refused", pytorch issue 135712). With this, rank 0 of each attempt
# hosts a fresh store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node "$NPROC" \
  --max-restarts "${MAX_RESTARTS:-0}" "${PROGRAM:-pretrain_gpt_sp.py}" "$@"

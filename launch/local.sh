#!/usr/bin/env bash
# Runs the training program on this machine with torchrun: NPROC ranks, rendezvous on loopback.
#   bash launch/local.sh NPROC [training flags...]
#   bash launch/local.sh 2 --device cpu --distributed-backend gloo --tensor-model-parallel-size 2 ...
# Environment: PROGRAM (default pretrain_gpt_sp.py), PYTHON (default python), MAX_RESTARTS
# (default 0: restart the whole group this many times after a rank fails; with --load the program
# resumes from the last checkpoint), OMP_NUM_THREADS (default 1 thread per rank), MASTER_PORT (the
# rendezvous port on 127.0.0.1; default: a free one).
# Addresses (launch/README.md, "What listens where"): the rendezvous endpoint, the ranks' MASTER_ADDR
# and gloo's / NCCL's sockets are 127.0.0.1 / lo, not --standalone's hostname on every interface.
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
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
PORT=${MASTER_PORT:-$("${PYTHON:-python}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
exec "${PYTHON:-python}" -m torch.distributed.run --nnodes 1 --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$PORT" --rdzv-id "local-$$" --local-addr 127.0.0.1 \
  --max-restarts "${MAX_RESTARTS:-0}" "${PROGRAM:-pretrain_gpt_sp.py}" "$@"

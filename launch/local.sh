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
# Before torchrun starts, every number is checked and the port tried: each problem is one sentence,
# exit 2 (torchrun would wait for ever on a port another program holds, join another job's store on
# a port in use by that job, or end in a traceback on NPROC 0 or a port that is no number).
set -euo pipefail
fail() { echo "launch/local.sh: error: $*" >&2; exit 2; }
if [[ $# -lt 1 ]]; then
  echo "usage: bash launch/local.sh NPROC [training flags...]" >&2
  exit 2
fi
[[ $1 =~ ^[0-9]{1,4}$ ]] && ((10#$1 >= 1)) || fail "NPROC must be a number of ranks from 1 to 9999, not '$1'."
NPROC=$((10#$1))
shift
MAX_RESTARTS=${MAX_RESTARTS:-0}
[[ $MAX_RESTARTS =~ ^[0-9]{1,4}$ ]] || fail "MAX_RESTARTS must be a whole number from 0 to 9999, not '$MAX_RESTARTS'."
if [[ -n ${MASTER_PORT:-} ]]; then
  [[ $MASTER_PORT =~ ^[0-9]{1,5}$ ]] && ((10#$MASTER_PORT >= 1 && 10#$MASTER_PORT <= 65535)) ||
    fail "MASTER_PORT must be a port number from 1 to 65535, not '$MASTER_PORT'."
fi
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
# The port: MASTER_PORT's, or a free one; either way tried now (bind on 127.0.0.1; a listener there,
# another job's rendezvous included, makes it fail).
PORT=$("${PYTHON:-python}" - "${MASTER_PORT:-0}" <<'PY'
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT is free; a listener is not
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError as err:
    sys.exit(f"launch/local.sh: error: MASTER_PORT={sys.argv[1]} on 127.0.0.1 is in use ({err.strerror}), by another "
             "program or job; choose another port, or leave MASTER_PORT unset for a free one.")
print(s.getsockname()[1])
PY
) || exit 2
exec "${PYTHON:-python}" -m torch.distributed.run --nnodes 1 --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$PORT" --rdzv-id "local-$$" --local-addr 127.0.0.1 \
  --max-restarts "$((10#$MAX_RESTARTS))" "${PROGRAM:-pretrain_gpt_sp.py}" "$@"

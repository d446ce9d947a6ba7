# Sourced by launch/srun.sbatch and launch/torchrun.sbatch (not a job script on its own): the
# environment every rank needs, the training flags, and the preemption/requeue logic.
# Expects: TRAIN_ARGS (array of default flags) and the job's "$@" passed to train_args_from.

# ---- CUDA / NCCL environment ----------------------------------------------------------------
# Sequence parallelism overlaps each layer's all-gather / reduce-scatter with the GEMMs next to it.
# That only works if the GPU starts kernels in the order they were queued: with one hardware work
# queue per device the communication kernel is issued ahead of the GEMM behind it, instead of
# being scheduled after it (Megatron-LM requires this for TP/SP overlap).
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# A failed or timed-out NCCL collective makes the watchdog abort the process instead of leaving
# the job hanging until its time limit (NCCL_ASYNC_ERROR_HANDLING is the pre-torch-2.2 name).
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# Warnings and errors only; set NCCL_DEBUG=INFO to see rings/trees and transports when debugging.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# One OpenMP thread per rank: GPU ranks hardly use the CPU, and 8 ranks x all cores thrash.
# (On CPU runs, set it to the cores per task.)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Log lines reach the job's output file as they are printed, not when a buffer fills.
export PYTHONUNBUFFERED=1
# Site-specific; uncomment and adapt when NCCL/gloo pick the wrong network interface:
# export NCCL_SOCKET_IFNAME=ib0    # interface for NCCL's bootstrap and socket transport
# export NCCL_IB_HCA=mlx5          # InfiniBand adapters NCCL may use
# export GLOO_SOCKET_IFNAME=ib0    # interface for gloo (--distributed-backend gloo)

# ---- training flags ---------------------------------------------------------------------------
# Flags given after the script name (`sbatch launch/srun.sbatch --train-iters 10 ...`, an optional
# leading `--` is dropped) replace the TRAIN_ARGS defaults of the template as a whole.
train_args_from() {
  if [[ ${1:-} == "--" ]]; then shift; fi
  if (( $# > 0 )); then TRAIN_ARGS=("$@"); fi
}

# ---- preemption and time limits ---------------------------------------------------------------
# `#SBATCH --signal=B:USR1@120` sends SIGUSR1 to this batch shell 120 s before the time limit.
# run_step forwards it to the job step (srun passes it on to every task); each rank's
# ExitSignalHandler sets a flag, the ranks agree at the next iteration boundary, save a checkpoint
# and exit 0. Then the job is requeued: it starts again from the top of the script with the same
# job id (SLURM_RESTART_COUNT=1, 2, ...) and the program resumes from --load.
# SIGTERM is left alone: Slurm sends it to every task itself (scancel, time limit without
# --signal, preemption), the program saves if it can, and a job preempted with PreemptMode=REQUEUE
# and --requeue is requeued by Slurm without our help.
run_step() {
  REQUEUE_REQUESTED=
  # Rank 0 writes "finished N" or "stopped N" here when it exits (megatron_sp/training/signals.py):
  # a SIGUSR1 that arrives after the last iteration must not requeue a job whose training is done.
  export MEGATRON_SP_EXIT_STATUS_FILE=${MEGATRON_SP_EXIT_STATUS_FILE:-$PWD/.megatron_sp_exit.${SLURM_JOB_ID:-$$}}
  rm -f "$MEGATRON_SP_EXIT_STATUS_FILE"
  "$@" &
  local step=$!
  trap "_forward_usr1 $step" USR1
  # `wait` returns early each time a trapped signal arrives: wait again until the step is gone.
  while kill -0 "$step" 2>/dev/null; do wait "$step"; done
  wait "$step"
  local rc=$?
  trap '' USR1   # a late SIGUSR1 must not kill this shell (its default action) after the step
  local status
  status=$(cat "$MEGATRON_SP_EXIT_STATUS_FILE" 2>/dev/null || true)
  rm -f "$MEGATRON_SP_EXIT_STATUS_FILE"
  if [[ -n $REQUEUE_REQUESTED && $status == finished* ]]; then
    echo "$(date +%T) launch: SIGUSR1 came but training had finished ($status); not requeueing"
  elif [[ -n $REQUEUE_REQUESTED ]]; then
    echo "$(date +%T) launch: step exited with $rc after SIGUSR1 (${status:-no status}); requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return $rc
}

_forward_usr1() {
  REQUEUE_REQUESTED=1
  echo "$(date +%T) launch: got SIGUSR1 (time limit or preemption ahead); forwarding to the ranks"
  kill -USR1 "$1" 2>/dev/null || true
}

echo "$(date +%T) launch: job ${SLURM_JOB_ID:-?} restart ${SLURM_RESTART_COUNT:-0}" \
     "on ${SLURM_JOB_NODELIST:-?} (${SLURM_NNODES:-1} nodes) from $PWD"

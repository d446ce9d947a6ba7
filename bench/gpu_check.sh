#!/usr/bin/env bash
# The GPU check in one call, as staged stages under one deadline (bench/gpu_check.py says which, their
# caps and the files they leave in $OUT). Written for one H200 with Python 3.12, torch 2.11 + CUDA 13,
# nvcc, pytest and no package index:
#   bash bench/gpu_check.sh                                               # at most ~510 s
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_DEADLINE=60 bash bench/gpu_check.sh    # CPU dry run, tiny shapes
# Environment: OUT (default /tmp/megatron_sp_gpu_check), GPU_CHECK_DEADLINE (seconds), PYTHON,
# MAX_JOBS, TORCH_CUDA_ARCH_LIST (default 9.0), GPU_CHECK_SITE (a directory holding a carried torchao,
# put on PYTHONPATH for the FP8 stage: bench/gpu_check.py says how).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONUNBUFFERED=1
# The extension is built in place, not installed: the programs import megatron_sp from here.
export PYTHONPATH="$ROOT${GPU_CHECK_SITE:+:$(cd "$GPU_CHECK_SITE" && pwd)}${PYTHONPATH:+:$PYTHONPATH}"
# a carried torchao's compiled kernels were built for this machine's torch, not the GPU machine's:
# leave them unloaded (FP8 training uses only its Python code and torch._scaled_mm)
if [ -n "${GPU_CHECK_SITE:-}" ]; then
  export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=${TORCHAO_FORCE_SKIP_LOADING_SO_FILES:-1}
fi
export PIP_NO_INDEX=1                     # nothing here installs packages; make sure nothing could
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}   # as launch/ sets it (SP overlap)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
unset MEGATRON_SP_SKIP_CUDA_BUILD
exec "${PYTHON:-python3}" bench/gpu_check.py

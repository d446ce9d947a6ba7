#!/usr/bin/env bash
# The GPU check of the fused ops, as one command on a CUDA machine (written for one H200 with
# Python 3.12, torch 2.11 + CUDA 13, nvcc, pytest, ninja and no internet):
#   1. builds megatron_sp._C in place with its CUDA kernels (sm_90 unless TORCH_CUDA_ARCH_LIST says),
#   2. runs the op tests, the CUDA ones included (tests/test_cuda_*.py, tests/test_ops_*.py; the
#      --tp-comm-overlap symmetric-memory path in a one-rank NCCL group),
#   3. runs bench/kernels.py --device cuda (bf16 with the torch.compile baselines, then fp32),
#   4. times pretrain_gpt_sp.py at the speed-goal config on synthetic tokens (tokens/s, MFU).
# Every step's log and the benchmark tables go to $OUT (or /tmp/megatron_sp_gpu_check/). Exit
# status 0 only when every step passed; later steps still run after a failed test step.
#   bash bench/gpu_check.sh          # about 5-7 minutes on one H200
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT_DIR="${OUT:-/tmp/megatron_sp_gpu_check}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
# The extension is built in place, not installed: the scripts under bench/ import megatron_sp from here.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
unset MEGATRON_SP_SKIP_CUDA_BUILD
status=0

# step NAME COMMAND...: runs it, logs to $OUT_DIR/NAME.log, remembers a failure.
step() {
  local name="$1" t0=$SECONDS rc
  shift
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT_DIR/$name.log"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

environment() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
  nvcc --version | tail -2
  "${CXX:-c++}" --version | head -1
  echo "MAX_JOBS=$MAX_JOBS TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
}

build() {
  rm -rf build megatron_sp/_C*.so    # never load an extension built elsewhere (CPU-only, other ABI)
  "$PY" setup.py build_ext --inplace || return 1
  "$PY" -c "from megatron_sp.ops._extension import BUILT_DEVICES as d, _LOAD_ERROR as e
print('megatron_sp._C kernels for:', sorted(d), e)
assert 'cuda' in d, 'the extension has no CUDA kernels'"
}

# pytest for the test step: installed if missing, from the package index or from wheels carried in
# .whl/ (for a machine without internet: `pip download -d .whl pytest` on one with it).
ensure_pytest() {
  "$PY" -c "import pytest" 2>/dev/null && return 0
  "$PY" -m pip install -q pytest 2>/dev/null ||
    { [ -d "$ROOT/.whl" ] && "$PY" -m pip install -q --no-index --find-links "$ROOT/.whl" pytest; }
  "$PY" -c "import pytest" || { echo "pytest is not installed and could not be installed"; return 1; }
}

step environment environment
step build build || { echo "build failed: see $OUT_DIR/build.log"; exit 1; }
step pytest ensure_pytest
step tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_ops.py tests/test_cuda_compile.py \
  tests/test_ops_bias_dropout_add.py tests/test_ops_layer_norm.py tests/test_ops_layout.py \
  tests/test_ops_extension.py tests/test_cuda_tp_overlap.py
step bench_bf16 "$PY" bench/kernels.py --device cuda --dtype bfloat16 \
  --markdown "$OUT_DIR/kernels_cuda_bf16.md"
step bench_fp32 "$PY" bench/kernels.py --device cuda --dtype float32 --no-compile \
  --markdown "$OUT_DIR/kernels_cuda_fp32.md"
# Training speed at the speed-goal config (GPT 24 × 2048, 16 heads, seq 2048, micro batch 4, vocab 50304,
# bf16, fwd+bwd+AdamW) on one GPU with random tokens (--mock-data: needs only torch, tested by
# tests/test_cli.py::test_mock_data_runs_with_torch_alone);
# with and without dropout (the reference figures' dropout setting is not stated). tokens/s per line.
train_speed() {
  local dropout
  for dropout in 0.0 0.1; do
    "$PY" pretrain_gpt_sp.py --device cuda --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 50303 \
      --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 4 \
      --global-batch-size 4 --train-iters 30 --log-interval 5 --eval-interval 1000 --lr-warmup-iters 5 \
      --hidden-dropout $dropout --attention-dropout $dropout --no-progress-bar \
      --log-jsonl "$OUT_DIR/train_speed_dropout$dropout.jsonl" || return 1
  done
}
step train_speed train_speed
echo "gpu_check: $([ $status -eq 0 ] && echo PASSED || echo FAILED); outputs in $OUT_DIR"
exit $status

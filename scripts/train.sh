#!/usr/bin/env bash
# The main job: sets up .venv (scripts/env.sh) and trains a small GPT on the embedded corpus
# (Python's own documentation and standard-library sources; no download) with 2 CPU processes,
# tensor parallel size 2 + sequence parallelism, on gloo. Logs, TensorBoard events, the JSON-lines
# file and the loss curve go to runs/default/. Extra arguments are passed to pretrain_gpt_sp.py.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
NPROC="${NPROC:-2}"
OUT="${OUT_DIR:-runs/default}"
mkdir -p "$OUT"
rm -f "$OUT/log.jsonl"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt_sp.py \
    --device cpu --distributed-backend gloo \
    --tensor-model-parallel-size "$NPROC" --sequence-parallel \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters 300 \
    --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 20 --lr-decay-style cosine \
    --log-interval 10 --eval-interval 100 --eval-iters 5 \
    --tensorboard-dir "$OUT/tensorboard" --log-jsonl "$OUT/log.jsonl" --loss-curve "$OUT/loss_curve.png" \
    --save "$OUT/checkpoints" --save-interval 100 \
    "$@"

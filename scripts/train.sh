#!/usr/bin/env bash
# The main job: sets up .venv (scripts/env.sh) and trains a small GPT on the embedded corpus
# (Python's own documentation and standard-library sources; no download) with 2 CPU processes,
# tensor parallel size 2 + sequence parallelism, on gloo, then prints what it learnt: a sample
# continuing "def main(" (tools/generate.py). Logs, TensorBoard events, the JSON-lines file and the
# loss curve go to runs/default/. Extra arguments are passed to pretrain_gpt_sp.py.
#
# Every value the run relies on is given here: Megatron-LM's defaults (no warmup, --min-lr 0, linear
# decay, --log-interval 100, no evaluation without --eval-interval) suit long runs, not this one.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
NPROC="${NPROC:-2}"
OUT="${OUT_DIR:-runs/default}"
mkdir -p "$OUT"
rm -f "$OUT/log.jsonl"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
bash launch/local.sh "$NPROC" \
    --device cpu --distributed-backend gloo \
    --tensor-model-parallel-size "$NPROC" --sequence-parallel \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --hidden-dropout 0.0 --attention-dropout 0.0 \
    --micro-batch-size 16 --global-batch-size 32 --train-iters 500 \
    --lr 4e-3 --min-lr 2e-4 --lr-warmup-iters 40 --lr-decay-style cosine --adam-beta2 0.95 \
    --log-interval 20 --eval-interval 100 --eval-iters 5 \
    --tensorboard-dir "$OUT/tensorboard" --log-jsonl "$OUT/log.jsonl" --loss-curve "$OUT/loss_curve.png" \
    --save "$OUT/checkpoints" --save-interval 250 \
    "$@"
echo "--- what it learnt: tools/generate.py --load $OUT/checkpoints --prompt 'def main(' (sampled, T=0.7)"
python tools/generate.py --load "$OUT/checkpoints" --prompt "def main(" --max-new-tokens 160 \
    --temperature 0.7 --top-k 40 --seed 1 --ignore-eod

"""FP8 loss drift against bf16 (issue 34): the default job (scripts/train.sh: 4 layers x 128, the embedded
corpus, 32 x 128 tokens per step, TP=2+SP, no dropout) for 50 iterations in --bf16 and with
--fp8-format hybrid under each recipe, and at TP=1 x DP=2, CP=2 and PP=2 (bf16, tensorwise and delayed). FP8 runs
torchao's emulated GEMMs on CPU (the FP8 values multiplied in fp32), so the figures are FP8's numerics.

    python bench/fp8_drift.py                   # 50 iterations
    python bench/fp8_drift.py --train-iters 20

Printed per run: the largest and the final relative difference of its per-iteration loss from the
bf16 run at the same layout, and the iteration of the largest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from _cli import table
from precision_drift import _port, drift

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JOB = (  # scripts/train.sh's model, data and schedule, less its outputs
    "--device cpu --distributed-backend gloo --num-layers 4 --hidden-size 128 --num-attention-heads 4 "
    "--seq-length 128 --hidden-dropout 0.0 --attention-dropout 0.0 --micro-batch-size 16 --global-batch-size 32 "
    "--lr 4e-3 --min-lr 2e-4 --lr-warmup-iters 40 --lr-decay-style cosine --adam-beta2 0.95 --lr-decay-iters 500 "
    "--log-interval 1 --eval-interval 100000 --eval-iters 1 --no-progress-bar --bf16"
).split()
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
CP2 = ["--context-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
HYBRID = ["--fp8-format", "hybrid"]
RUNS = {  # name: (processes, flags, the bf16 run it is compared with)
    "bf16 TP=2+SP": (2, TP2_SP, None),
    "fp8 delayed TP=2+SP": (2, TP2_SP + HYBRID, "bf16 TP=2+SP"),
    "fp8 tensorwise TP=2+SP": (2, TP2_SP + HYBRID + ["--fp8-recipe", "tensorwise"], "bf16 TP=2+SP"),
    "fp8 rowwise TP=2+SP": (2, TP2_SP + HYBRID + ["--fp8-recipe", "rowwise"], "bf16 TP=2+SP"),
    "fp8 mxfp8 TP=2+SP": (2, TP2_SP + HYBRID + ["--fp8-recipe", "mxfp8"], "bf16 TP=2+SP"),
    "bf16 DP=2": (2, [], None),
    "fp8 tensorwise DP=2": (2, HYBRID + ["--fp8-recipe", "tensorwise"], "bf16 DP=2"),
    "fp8 delayed DP=2": (2, HYBRID, "bf16 DP=2"),
    "bf16 CP=2": (2, CP2, None),
    "fp8 delayed CP=2": (2, CP2 + HYBRID, "bf16 CP=2"),
    "fp8 tensorwise CP=2": (2, CP2 + HYBRID + ["--fp8-recipe", "tensorwise"], "bf16 CP=2"),
    "bf16 PP=2": (2, PP2, None),
    "fp8 delayed PP=2": (2, PP2 + HYBRID, "bf16 PP=2"),
    "fp8 tensorwise PP=2": (2, PP2 + HYBRID + ["--fp8-recipe", "tensorwise"], "bf16 PP=2"),
}


def run(name, nproc, flags, iters, workdir) -> list:
    log = os.path.join(workdir, name.replace(" ", "_").replace("=", "").replace("+", "") + ".jsonl")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    command += ["--master-addr", "127.0.0.1", "--master-port", str(_port()), os.path.join(ROOT, "pretrain_gpt_sp.py")]
    command += [*DEFAULT_JOB, "--train-iters", str(iters), *flags, "--log-jsonl", log]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    with open(log) as f:
        return [r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-iters", type=int, default=50)
    p.add_argument("--runs", nargs="+", default=list(RUNS), help="a subset of the runs (their bf16 runs come along)")
    a = p.parse_args()
    names = [n for n in RUNS if n in a.runs or any(RUNS[m][2] == n for m in a.runs)]
    with tempfile.TemporaryDirectory() as workdir:
        losses = {n: run(n, RUNS[n][0], RUNS[n][1], a.train_iters, workdir) for n in names}
    rows = []
    for name, got in losses.items():
        against = RUNS[name][2]
        if against is not None:
            worst, at, final = drift(got, losses[against])
            rows.append([name, against, f"{worst:.2e}", at, f"{final:.2e}"])
    print(f"relative loss differences over {a.train_iters} iterations (the default job, --bf16 weights)")
    print(table(["run", "against", "max rel", "at iter", "final rel"], rows))
    print("losses (first, last): " + json.dumps({k: [round(v[0], 5), round(v[-1], 5)] for k, v in losses.items()}))


if __name__ == "__main__":
    main()

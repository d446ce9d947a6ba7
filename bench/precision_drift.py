"""bf16 loss drift across layouts and against fp32 (issue 17): the program (pretrain_gpt_sp.py) on the
tests' tiny model, dropout on, the same seed and data, --bf16 at TP=1 (the reference), TP=2+SP, TP=4+SP,
CP=2 (ring, and a2a), CP=4 (allgather, and a2a+p2p at 2 x 2), DP=2 (TP=2 x DP=2 with the distributed
optimizer), and fp32 at TP=1.

    python bench/precision_drift.py                    # 50 iterations
    python bench/precision_drift.py --train-iters 20

Printed per run: the largest and the final relative difference of the per-iteration loss from the
bf16 TP=1 run (for fp32: bf16 TP=1 against fp32 TP=1), and the iteration of the largest.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

from _cli import table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = (
    "--device cpu --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 8 --log-interval 1 --eval-interval 1000 --eval-iters 1 --lr-warmup-iters 2 "
    "--no-progress-bar --hidden-dropout 0.1 --attention-dropout 0.1"
).split()
RUNS = {  # name: (processes, flags)
    "bf16 TP=1": (1, ["--bf16"]),
    "bf16 TP=2+SP": (2, ["--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "bf16 TP=4+SP": (4, ["--bf16", "--tensor-model-parallel-size", "4", "--sequence-parallel"]),
    "bf16 CP=2": (2, ["--bf16", "--context-parallel-size", "2"]),
    "bf16 CP=2 a2a": (2, ["--bf16", "--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    "bf16 CP=4 allgather": (4, ["--bf16", "--context-parallel-size", "4", "--cp-comm-type", "allgather"]),
    "bf16 CP=4 a2a+p2p 2x2": (
        4,
        ["--bf16", "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"]
        + ["--hierarchical-context-parallel-sizes", "2", "2"],
    ),
    "bf16 TP=2 x DP=2 dist-opt": (4, ["--bf16", "--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]),
    "fp32 TP=1": (1, []),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name, nproc, flags, iters, workdir) -> list:
    log = os.path.join(workdir, name.replace(" ", "_").replace("=", "").replace("+", "") + ".jsonl")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_port()),
        os.path.join(ROOT, "pretrain_gpt_sp.py"),
        *TINY,
        "--train-iters",
        str(iters),
        *flags,
        "--log-jsonl",
        log,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    with open(log) as f:
        return [r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r]


def drift(got, want):
    rel = [abs(a - b) / abs(b) for a, b in zip(got, want)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    return rel[worst], worst + 1, rel[-1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-iters", type=int, default=50)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        losses = {name: run(name, n, flags, a.train_iters, workdir) for name, (n, flags) in RUNS.items()}
    ref = losses["bf16 TP=1"]
    rows = []
    for name, got in losses.items():
        if name == "bf16 TP=1":
            continue
        against = "bf16 TP=1" if name.startswith("bf16") else "bf16 TP=1 vs fp32 TP=1"
        worst, at, final = drift(ref, got) if name.startswith("fp32") else drift(got, ref)
        rows.append([name, against, f"{worst:.2e}", at, f"{final:.2e}"])
    print(f"relative loss differences over {a.train_iters} iterations (tiny model, dropout 0.1)")
    print(table(["run", "against", "max rel", "at iter", "final rel"], rows))
    print("losses (first, last): " + json.dumps({k: [round(v[0], 5), round(v[-1], 5)] for k, v in losses.items()}))


if __name__ == "__main__":
    main()

"""Running pretrain_gpt_sp.py from tests: through torchrun (real processes, gloo) or in-process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.path.join(REPO, "pretrain_gpt_sp.py")

TINY = [
    "--device",
    "cpu",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--log-interval",
    "1",
    "--eval-interval",
    "1000",
    "--eval-iters",
    "1",
    "--lr-warmup-iters",
    "2",
    "--no-progress-bar",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args, cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        PROGRAM,
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def losses(jsonl_path) -> list:
    """Training lm_loss per logged iteration (validation lines are skipped)."""
    with open(jsonl_path) as f:
        return [r["lm_loss"] for r in map(json.loads, f) if "lm_loss" in r]


def records(jsonl_path) -> list:
    with open(jsonl_path) as f:
        return [json.loads(line) for line in f]


def check(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc

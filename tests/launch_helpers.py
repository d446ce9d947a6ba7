"""Running pretrain_gpt_sp.py from tests: through torchrun (real processes, gloo) or in-process; and
what tests that start processes themselves share (a free port, an environment without launcher
variables, polling with a timeout)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

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


# What a launcher (torchrun, launch/*.sh) sets for the processes it starts: a test that starts ranks
# or a launcher itself removes them, so that none leaks in from the test's own environment.
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_RESTART_COUNT",
    "MEGATRON_SP_EXIT_STATUS_FILE",
)


def environ_without_launcher(drop_slurm: bool = False) -> dict:
    """os.environ less LAUNCH_VARS (and every SLURM_* variable with drop_slurm)."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not (drop_slurm and k.startswith("SLURM_"))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what: str, poll_s: float = 0.05):
    """Polls `predicate()` until it is truthy and returns its value; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not after {timeout:.0f} s")


def torchrun_command(nproc: int, args) -> list:
    """torchrun of pretrain_gpt_sp.py with `args` on `nproc` local ranks (a free port each time)."""
    return [
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


def torchrun(nproc: int, args, cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(
        torchrun_command(nproc, args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


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


@contextmanager
def bounded(seconds=20):
    """Fails the test (instead of hanging the suite) if the block blocks: FIFOs, huge configs."""

    def hang(*_):
        raise TimeoutError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)

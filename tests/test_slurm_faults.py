"""Faults as a cluster job meets them: a dead or hung rank must not hang the others (no Slurm needed).

- A rank killed with SIGKILL: the survivors' next gloo collective fails at once (connection closed).
- A rank that hangs (SIGSTOP): the survivors' collective times out after the process group's timeout.
- Under torchrun with --max-restarts, the agent restarts the group and the program resumes from its
  last checkpoint; the losses after the restart equal those of an uninterrupted run.
Each test prints how long the survivors took to exit (`pytest -s` shows it).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_helpers import REPO, environ_without_launcher, free_port, wait_until
from slurm_cluster import read_losses, tail
from test_slurm import PROBE, PROGRAM, TINY, probe_losses, program_missing, program_reference_losses


def start_probe_ranks(tmp_path, extra_args, world=2):
    """`world` probe processes that find each other through Slurm-style variables, as srun starts them."""
    base = environ_without_launcher(drop_slurm=True)
    port, log = free_port(), tmp_path / "probe.jsonl"
    procs = []
    for rank in range(world):
        env = dict(
            base,
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NTASKS=str(world),
            SLURM_STEP_NUM_TASKS=str(world),
            SLURM_STEP_ID="0",
            SLURM_JOB_ID="1",
            SLURM_JOB_NODELIST="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        with open(tmp_path / f"rank{rank}.out", "w") as out:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        PROBE,
                        "--device",
                        "cpu",
                        "--distributed-backend",
                        "gloo",
                        "--log-jsonl",
                        str(log),
                        *map(str, extra_args),
                    ],
                    cwd=REPO,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs, log


def _stop_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _seconds_until_exit(proc, timeout: float) -> float:
    start = time.monotonic()
    proc.wait(timeout=timeout)
    return time.monotonic() - start


def test_dead_rank_fails_the_survivor_at_once(tmp_path):
    procs, log = start_probe_ranks(
        tmp_path, ["--train-iters", "1000", "--iter-sleep", "0.1", "--distributed-timeout-s", "60"]
    )
    try:
        wait_until(lambda: len(read_losses(log)) >= 2, 60, "two probe iterations")
        procs[1].send_signal(signal.SIGKILL)
        seconds = _seconds_until_exit(procs[0], timeout=60)
    finally:
        _stop_all(procs)
    out = tail(tmp_path / "rank0.out")
    print(f"\nrank 1 killed (SIGKILL): rank 0 exited {procs[0].returncode} after {seconds:.2f} s")
    assert procs[0].returncode != 0
    assert seconds < 10, out  # a closed connection, not the 60 s timeout
    assert "Connection closed by peer" in out or "Connection reset" in out, out


def test_hung_rank_times_out_the_survivor(tmp_path):
    timeout_s = 3
    procs, log = start_probe_ranks(
        tmp_path, ["--train-iters", "1000", "--iter-sleep", "0.1", "--distributed-timeout-s", timeout_s]
    )
    try:
        wait_until(lambda: len(read_losses(log)) >= 2, 60, "two probe iterations")
        procs[1].send_signal(signal.SIGSTOP)
        seconds = _seconds_until_exit(procs[0], timeout=60)
    finally:
        _stop_all(procs)
    out = tail(tmp_path / "rank0.out")
    print(
        f"\nrank 1 stopped (SIGSTOP): rank 0 exited {procs[0].returncode} after {seconds:.2f} s (timeout {timeout_s} s)"
    )
    assert procs[0].returncode != 0
    assert timeout_s - 0.5 <= seconds <= timeout_s + 10, out
    assert "timed out" in out.lower() or "timeout" in out.lower(), out


# ---- torchrun --max-restarts --------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                kids.append(int(entry))
    return kids


def _worker_pids(agent_pid: int) -> dict[int, int]:
    """{local rank: pid} of the torchrun agent's workers."""
    workers = {}
    for pid in _children(agent_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"LOCAL_RANK="):
                workers[int(item.split(b"=", 1)[1])] = pid
    return workers


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_rank_and_time_survivor(agent, log: Path, after_iterations: int) -> float:
    """SIGKILL local rank 1 once `after_iterations` are logged; seconds until rank 0 is gone."""
    wait_until(
        lambda: len(read_losses(log)) >= after_iterations or agent.poll() is not None,
        120,
        f"{after_iterations} logged iterations",
    )
    assert agent.poll() is None, "the run ended before the fault could be injected"
    workers = wait_until(lambda: (w := _worker_pids(agent.pid)) and len(w) == 2 and w, 30, "torchrun's two workers")
    os.kill(workers[1], signal.SIGKILL)
    start = time.monotonic()
    wait_until(lambda: not _alive(workers[0]), 60, "rank 0 exiting after rank 1 died")
    return time.monotonic() - start


def run_local_torchrun(program, args, out: Path, max_restarts: int) -> subprocess.Popen:
    env = environ_without_launcher()
    env.update(PYTHON=sys.executable, PROGRAM=program, MAX_RESTARTS=str(max_restarts), OMP_NUM_THREADS="1")
    with open(out, "w") as f:
        return subprocess.Popen(
            ["bash", "launch/local.sh", "2", *map(str, args)], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT
        )


def assert_restarted_and_equal(losses, reference: dict, iters: int):
    iterations = [i for i, _ in losses]
    assert iterations[-1] == iters and set(iterations) == set(range(1, iters + 1))
    assert len(iterations) > len(set(iterations)), "no iteration was redone: did torchrun restart?"
    for i, loss in losses:  # redone iterations too: exact resume
        assert abs(loss - reference[i]) <= 1e-6, (i, loss, reference[i])


def test_torchrun_restarts_group_and_probe_resumes(tmp_path):
    log, ckpt, out = tmp_path / "probe.jsonl", tmp_path / "ckpt", tmp_path / "out.txt"
    args = [
        "--device",
        "cpu",
        "--distributed-backend",
        "gloo",
        "--train-iters",
        "10",
        "--iter-sleep",
        "0.2",
        "--log-jsonl",
        log,
        "--save",
        ckpt,
        "--load",
        ckpt,
        "--save-interval",
        "3",
        "--slow-restart-s",
        "2",
    ]  # rank 1 rejoins late: the stale-store race of launch/local.sh
    agent = run_local_torchrun(PROBE, args, out, max_restarts=1)
    try:
        seconds = kill_rank_and_time_survivor(agent, log, after_iterations=5)
        assert agent.wait(timeout=120) == 0, tail(out)
    finally:
        if agent.poll() is None:
            agent.kill()
    print(f"\ntorchrun: rank 1 killed, rank 0 gone after {seconds:.2f} s; group restarted")
    assert seconds < 35  # the survivor's own error, or torchrun's SIGTERM (+30 s before SIGKILL)
    assert_restarted_and_equal(read_losses(log), dict(probe_losses(10)), 10)
    assert json.loads(Path(f"{log}.env.json").read_text())[0]["torchrun_restart"] == 1


def test_torchrun_restarts_group_and_program_resumes(tmp_path):
    reason = program_missing("--save", "--load", "--save-interval")
    if reason:
        pytest.skip(reason)
    reference = dict(program_reference_losses())
    log, ckpt, out = tmp_path / "log.jsonl", tmp_path / "ckpt", tmp_path / "out.txt"
    ckpt.mkdir()
    args = [*TINY, "--log-jsonl", log, "--save", ckpt, "--load", ckpt, "--save-interval", "4"]
    agent = run_local_torchrun(PROGRAM, args, out, max_restarts=1)
    try:
        seconds = kill_rank_and_time_survivor(agent, log, after_iterations=6)
        assert agent.wait(timeout=180) == 0, tail(out)
    finally:
        if agent.poll() is None:
            agent.kill()
    print(f"\ntorchrun: rank 1 killed, rank 0 gone after {seconds:.2f} s; group restarted")
    assert seconds < 35
    assert_restarted_and_equal(read_losses(log), reference, 16)

"""Issue 10 with real processes: pretrain_gpt_sp.py ranks that hang, get signals, disagree about
the checkpoint or fail alone, and the Slurm launcher's requeue decision.

- a SIGSTOPped rank fails its TP peer after --distributed-timeout-minutes (0.05 min = 3 s), through
  the TP group's own timeout, with one sentence and exit 1;
- SIGINT to torchrun saves and exits like SIGTERM;
- ranks resume from the iteration rank 0 reads, even when another rank sees a stale marker, and a
  SIGUSR1 before the training loop stops the run at its first boundary instead of killing the rank;
- an input error seen by rank 1 alone is printed by rank 1, and every rank exits 2;
- a SIGUSR1 after training finished does not requeue the job.
Ranks are started as torchrun starts them (RANK, WORLD_SIZE, ... in the environment), one Popen each,
so that each rank's exit code and stderr can be checked; the SIGINT test goes through torchrun itself.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_helpers import PROGRAM, REPO, environ_without_launcher, free_port, torchrun_command, wait_until

from megatron_sp import checkpointing
from megatron_sp.checkpointing import checkpointer
from megatron_sp.training import pretrain

TINY = [
    "--device",
    "cpu",
    "--num-layers",
    "1",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "16",
    "--micro-batch-size",
    "2",
    "--log-interval",
    "1",
    "--eval-interval",
    "100000",
    "--eval-iters",
    "1",
    "--lr-warmup-iters",
    "1",
    "--no-progress-bar",
    "--mock-data",
]


def start_ranks(tmp_path, program_argv, world=2):
    """`world` ranks of a program (list of argv after the interpreter), as torchrun would start them."""
    base = environ_without_launcher(drop_slurm=True)
    port, procs = free_port(), []
    for rank in range(world):
        env = dict(
            base,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, *program_argv],
                cwd=tmp_path,
                env=env,
                text=True,
                stdout=open(tmp_path / f"rank{rank}.out", "w"),
                stderr=open(tmp_path / f"rank{rank}.err", "w"),
            )
        )
    return procs


def stop_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def logged_iterations(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if '"lm_loss"' in line) if path.exists() else 0


def error_lines(path: Path):
    return [line for line in path.read_text().splitlines() if "error:" in line]


# ---- bounded hangs --------------------------------------------------------------------------------
def test_sigstopped_rank_fails_its_tp_peer_after_the_timeout(tmp_path):
    """Before the fix the TP group had torch's 30 min default: the peer waited for minutes."""
    log = tmp_path / "log.jsonl"
    procs = start_ranks(
        tmp_path,
        [
            PROGRAM,
            *TINY,
            "--train-iters",
            "100000",
            "--tensor-model-parallel-size",
            "2",
            "--distributed-timeout-minutes",
            "0.05",
            "--log-jsonl",
            str(log),
        ],
    )
    try:
        wait_until(lambda: logged_iterations(log) >= 3 or procs[0].poll() is not None, 120, "three iterations")
        assert procs[0].poll() is None, (tmp_path / "rank0.err").read_text()
        procs[1].send_signal(signal.SIGSTOP)  # alive, never joins the next collective
        start = time.monotonic()
        procs[0].wait(timeout=60)
        seconds = time.monotonic() - start
    finally:
        stop_all(procs)
    err = (tmp_path / "rank0.err").read_text()
    print(f"\nrank 1 SIGSTOPped: rank 0 exited {procs[0].returncode} after {seconds:.2f} s (timeout 3 s)")
    assert procs[0].returncode == 1, err
    assert 2.5 <= seconds <= 15, err
    assert error_lines(tmp_path / "rank0.err") == [err.strip()], err  # one line, no traceback
    assert "rank 0: a collective failed (Timed out waiting 3000ms" in err and "Traceback" not in err
    assert "rank 1 stopped responding (no heartbeat in 2 s)" in err  # issue 39: the hung rank named


def test_sigstopped_pipeline_stage_during_async_save_is_named_and_the_exit_bounded(tmp_path):
    """Issue 39: under PP with --async-save the survivor printed its sentence after 3 s and then never
    exited (its exit waited on the background save's collective, on a group made without a timeout);
    now the save group has the run's timeout, and the sentence names the stage that stopped."""
    log = tmp_path / "log.jsonl"
    flags = ["--num-layers", "2", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
    flags += ["--save", str(tmp_path / "ckpt"), "--save-interval", "1", "--async-save"]
    procs = start_ranks(
        tmp_path,
        [PROGRAM, *TINY, *flags, "--train-iters", "100000", "--distributed-timeout-minutes", "0.05"]
        + ["--log-jsonl", str(log)],
    )
    try:
        wait_until(lambda: logged_iterations(log) >= 3 or procs[0].poll() is not None, 180, "three iterations")
        assert procs[0].poll() is None, (tmp_path / "rank0.err").read_text()
        procs[1].send_signal(signal.SIGSTOP)
        start = time.monotonic()
        procs[0].wait(timeout=90)
        seconds = time.monotonic() - start
    finally:
        stop_all(procs)
    err = (tmp_path / "rank0.err").read_text()
    print(f"\nPP stage 1 SIGSTOPped during --async-save: rank 0 exited {procs[0].returncode} after {seconds:.2f} s")
    assert procs[0].returncode == 1 and seconds <= 45, err
    assert error_lines(tmp_path / "rank0.err") == [err.strip()] and "Traceback" not in err, err
    assert "rank 1 (pipeline stage 1, this rank's next stage) stopped responding" in err, err


def test_async_save_worker_fails_within_the_world_timeout_when_a_peer_never_joins(tmp_path):
    """Issue 39: --async-save's group had torch's 30-minute default, and the process's exit waits for
    its thread: a survivor printed its sentence and then never exited (still alive at 120 s)."""
    script = os.path.join(REPO, "tests", "async_save_peer.py")
    procs = start_ranks(tmp_path, [script, str(tmp_path)])
    try:
        procs[0].wait(timeout=150)
    finally:
        stop_all(procs)
    out = (tmp_path / "rank0.out").read_text()
    print(f"\nasync-save worker, peer absent, world timeout 3 s: {out.strip()}")
    assert procs[0].returncode == 0 and out.startswith("failed after"), out + (tmp_path / "rank0.err").read_text()
    assert float(out.split()[2]) <= 30, out


# ---- signals --------------------------------------------------------------------------------------
def test_sigint_to_torchrun_saves_and_exits_like_sigterm(tmp_path):
    log, save = tmp_path / "log.jsonl", tmp_path / "ckpt"
    cmd = torchrun_command(2, [*TINY, "--train-iters", "100000", "--save", str(save), "--log-jsonl", str(log)])
    env = environ_without_launcher()
    with open(tmp_path / "out.txt", "w") as out:
        agent = subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env=dict(env, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(lambda: logged_iterations(log) >= 2 or agent.poll() is not None, 120, "two iterations")
        agent.send_signal(signal.SIGINT)  # Ctrl-C; torchrun forwards it to the ranks
        start = time.monotonic()
        agent.wait(timeout=60)
        seconds = time.monotonic() - start
    finally:
        if agent.poll() is None:
            agent.kill()
    out = (tmp_path / "out.txt").read_text()
    saved = checkpointing.read_latest(str(save))
    print(f"\nSIGINT to torchrun: saved iteration {saved}, torchrun gone after {seconds:.2f} s")
    assert saved is not None and saved >= 2, out
    assert f"exit signal received: saving at iteration {saved}" in out, out
    assert "KeyboardInterrupt" not in out and seconds < 25, out  # the ranks left by themselves (no 30 s kill)


def test_usr1_during_startup_does_not_kill_the_real_program(tmp_path):
    """pretrain_gpt_sp.py installs its handler before importing torch: a SIGUSR1 (Slurm's time-limit
    warning) while torch loads or the model is built stops the run at its first boundary, exit 0."""
    env = environ_without_launcher()
    proc = subprocess.Popen(
        [sys.executable, PROGRAM, *TINY, "--train-iters", "5"],
        cwd=tmp_path,
        text=True,
        env=dict(env, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    maps = Path(f"/proc/{proc.pid}/maps")
    wait_until(lambda: proc.poll() is not None or "libtorch" in maps.read_text(), 60, "torch to load")
    proc.send_signal(signal.SIGUSR1)  # torch is loading: long before the loop
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "exit signal (SIGUSR1) received before training: exiting at iteration 0" in out, out
    assert "iteration        1/" not in out


DRIVER = """
import os, signal, sys
from megatron_sp.training.signals import ExitSignalHandler
signals = ExitSignalHandler().install()                  # as pretrain_gpt_sp.py does
from megatron_sp import checkpointing
from megatron_sp.checkpointing import paths as checkpoint_paths
from megatron_sp.training import pretrain
rank, mode = int(os.environ["RANK"]), {mode!r}
argv = sys.argv[1:]
if rank == 1 and mode == "stale marker":
    checkpoint_paths.read_latest = lambda root: 2        # this rank's view of the marker is stale
    real_load = checkpointing.load
    def load(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGUSR1)             # SIGUSR1 before the training loop
        return real_load(*args, **kwargs)
    checkpointing.load = load
if rank == 1 and mode == "input error here only":
    argv[argv.index("--load") + 1] += "_missing_on_this_node"
real_run = pretrain.Trainer.run
def run(self, signals=None):
    print(f"rank {{rank}} resumes at iteration {{self.state.iteration}}", flush=True)
    return real_run(self, signals)
pretrain.Trainer.run = run
sys.exit(pretrain.main(argv, signals=signals))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Checkpoints at iterations 2 and 4 (marker: 4), written at TP=1 in this process."""
    root = tmp_path_factory.mktemp("ckpt") / "ckpt"
    assert pretrain.main(TINY + ["--train-iters", "4", "--save-interval", "2", "--save", str(root)]) == 0
    return root


def _driver(tmp_path, mode):
    path = tmp_path / "driver.py"
    path.write_text(DRIVER.format(mode=mode))
    return str(path)


def test_ranks_resume_the_iteration_rank0_reads_and_early_usr1_is_not_fatal(checkpoint, tmp_path):
    procs = start_ranks(
        tmp_path,
        [
            _driver(tmp_path, "stale marker"),
            *TINY,
            "--train-iters",
            "8",
            "--tensor-model-parallel-size",
            "2",
            "--load",
            str(checkpoint),
        ],
    )
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        stop_all(procs)
    outs = [(tmp_path / f"rank{r}.out").read_text() for r in range(2)]
    errs = [(tmp_path / f"rank{r}.err").read_text() for r in range(2)]
    assert codes == [0, 0], errs
    assert "rank 1 resumes at iteration 4" in outs[1], outs  # rank 0's choice, not its own 2
    assert "exit signal (on another rank) received before training: exiting at iteration 4" in outs[0], outs
    assert checkpointing.read_latest(str(checkpoint)) == 4 and "Traceback" not in errs[0] + errs[1]


def test_input_error_on_one_rank_is_printed_by_that_rank(checkpoint, tmp_path):
    start = time.monotonic()
    procs = start_ranks(
        tmp_path, [_driver(tmp_path, "input error here only"), *TINY, "--train-iters", "8", "--load", str(checkpoint)]
    )
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        stop_all(procs)
    seconds = time.monotonic() - start
    errs = [(tmp_path / f"rank{r}.err").read_text() for r in range(2)]
    assert codes == [2, 2], errs
    assert error_lines(tmp_path / "rank0.err") == [] and "Traceback" not in errs[0], errs
    assert error_lines(tmp_path / "rank1.err") == [errs[1].strip()], errs
    assert errs[1].startswith("pretrain_gpt_sp.py: error: rank 1: --load ") and "does not exist" in errs[1]
    assert seconds < 60, seconds  # nobody waits for a timeout


def _disagree_then_report():
    """Rank 1 sees another metadata.json; then both ranks report the resulting error."""
    import contextlib
    import io

    import torch.distributed as dist

    from megatron_sp import failures

    try:
        checkpointer._check_same_everywhere("ckpt/iter_0000004", {"iteration": 4, "seen_by": min(dist.get_rank(), 1)})
        message = None
    except checkpointing.CheckpointError as err:
        message = str(err)
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        code = failures.report_once(message or "no error", 2)
    return message, code, printed.getvalue()


def test_ranks_that_see_different_checkpoints_stop_and_report_once():
    from megatron_sp.testing import LocalWorld

    with LocalWorld(2) as world:
        results = world.run(_disagree_then_report)
    messages, codes, printed = zip(*results)
    assert messages[0] == messages[1] and "ranks [1] see a different metadata.json" in messages[0]
    assert codes == (2, 2) and sorted(bool(p) for p in printed) == [False, True]  # one rank prints
    assert "".join(printed) == f"pretrain_gpt_sp.py: error: {messages[0]}\n"


# ---- requeue (launch/slurm_common.sh) -------------------------------------------------------------
def test_program_reports_how_training_ended(tmp_path, monkeypatch):
    status = tmp_path / "status"
    monkeypatch.setenv("MEGATRON_SP_EXIT_STATUS_FILE", str(status))
    assert pretrain.main(TINY + ["--train-iters", "2"]) == 0
    assert status.read_text() == "finished 2\n"
    assert pretrain.main(TINY + ["--train-iters", "4", "--exit-interval", "1"]) == 0
    assert status.read_text() == "stopped 1\n"


REQUEUE_SCRIPT = """
set -uo pipefail
source launch/slurm_common.sh
scontrol() { echo "scontrol $*" >> "$CALLS"; }             # what the requeue would run
# The step: a rank that writes its exit status (as pretrain_gpt_sp.py does), then lingers.
run_step bash -c 'trap "" USR1; echo "$0" > "$MEGATRON_SP_EXIT_STATUS_FILE"; touch "$STEP_READY"; sleep 1' "$STATUS"
echo "rc=$?"
"""


@pytest.mark.parametrize("status, requeued", [("finished 16", False), ("stopped 5", True)])
def test_usr1_requeues_only_unfinished_training(tmp_path, status, requeued):
    calls, ready = tmp_path / "calls", tmp_path / "ready"
    env = dict(
        os.environ,
        CALLS=str(calls),
        STEP_READY=str(ready),
        STATUS=status,
        SLURM_JOB_ID="77",
        MEGATRON_SP_EXIT_STATUS_FILE=str(tmp_path / "exit_status"),
    )
    shell = subprocess.Popen(
        ["bash", "-c", REQUEUE_SCRIPT], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    wait_until(ready.exists, 30, "the step to start")
    shell.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 does
    out, _ = shell.communicate(timeout=30)
    assert "rc=0" in out, out
    assert calls.exists() == requeued, out
    if requeued:
        assert calls.read_text() == "scontrol requeue 77\n" and "requeueing job 77" in out
    else:
        assert "training had finished (finished 16); not requeueing" in out

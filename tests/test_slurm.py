"""The launch/ templates on a real one-node Slurm cluster (tests/slurm_cluster.py), 2 ranks on gloo.

Two programs run through the templates:
- tests/slurm_probe.py, a seconds-long stand-in that checks the launch path itself (rank/world/master
  from Slurm, torchrun rendezvous under srun, SIGUSR1 -> save -> requeue -> resume);
- pretrain_gpt_sp.py on a tiny model, whose loss log must equal a plain torchrun run of the same
  flags (launch/local.sh).
The whole module skips, with the reason, where a Slurm cluster cannot be brought up.
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from launch_helpers import wait_until
from slurm_cluster import read_losses, slurm_cluster, tail  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]
PROBE = "tests/slurm_probe.py"
PROGRAM = "pretrain_gpt_sp.py"
RANKS = 2
JOB_TIMEOUT_S = 180
TINY = [
    "--device",
    "cpu",
    "--distributed-backend",
    "gloo",
    "--tensor-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "4",
    "--train-iters",
    "16",
    "--log-interval",
    "1",
]


# ---- submitting the templates --------------------------------------------------------------------
def launch_env(program: str) -> dict:
    return {
        "PYTHON": sys.executable,
        "PROGRAM": program,
        "MEGATRON_SP_DIR": str(REPO),
        "OMP_NUM_THREADS": "1",
        "GPUS_PER_NODE": str(RANKS),
    }


def submit_template(cluster, template: str, out_dir: Path, program: str, args) -> tuple[int, Path]:
    """sbatch launch/<template>.sbatch with RANKS CPU ranks on one node; returns (job id, output)."""
    if template == "srun":  # one task per rank
        shape = [f"--ntasks-per-node={RANKS}", "--cpus-per-task=1"]
    else:  # one torchrun agent starting RANKS ranks
        shape = ["--ntasks-per-node=1", f"--cpus-per-task={RANKS}"]
    sbatch = [
        "--nodes=1",
        "--gpus-per-node=0",
        "--time=10",
        f"--job-name={template}",
        f"--output={out_dir}/{template}-%j.out",
        *shape,
    ]
    job = cluster.submit(REPO / "launch" / f"{template}.sbatch", args, env=launch_env(program), sbatch_args=sbatch)
    return job, out_dir / f"{template}-{job}.out"


def wait_completed(cluster, job: int, output: Path, timeout: float = JOB_TIMEOUT_S) -> dict:
    try:
        state = cluster.wait(job, timeout=timeout)
    except TimeoutError:
        cluster.cancel(job)
        raise AssertionError(f"job {job} did not finish in {timeout} s; output:\n{tail(output)}")
    assert state == "COMPLETED", f"job {job} ended {state}; output:\n{tail(output)}"
    return cluster.job(job)


def wait_for_iterations(cluster, job: int, log: Path, output: Path, n: int) -> None:
    """Until the job has logged n iterations; fails at once if the job ends first."""

    def logged_or_ended():
        if len(read_losses(log)) >= n:
            return True
        state = cluster.state(job)
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), (
            f"job {job} ended {state} before iteration {n}; output:\n{tail(output)}"
        )
        return False

    wait_until(logged_or_ended, JOB_TIMEOUT_S, f"job {job} logging iteration {n}", poll_s=0.1)


def probe_losses(iters: int, world: int = RANKS) -> list[tuple[int, float]]:
    """What slurm_probe.py logs: sum over ranks of (rank + 1) * i, squashed."""
    total = world * (world + 1) // 2
    return [(i, 10.0 / (1.0 + 0.01 * total * i)) for i in range(1, iters + 1)]


def read_env(log: Path) -> list[dict]:
    import json

    return json.loads(Path(str(log) + ".env.json").read_text())


# ---- the probe: launch path only ----------------------------------------------------------------
@pytest.mark.parametrize("template", ["srun", "torchrun"])
def test_usr1_saves_requeues_and_resumes_probe(slurm_cluster, tmp_path, template):
    """Ranks from Slurm's environment (or torchrun's); SIGUSR1 to the batch shell (what
    --signal=B:USR1@120 does) -> every rank saves at the same iteration, exits, the job requeues
    itself and resumes from --load."""
    log, ckpt = tmp_path / "probe.jsonl", tmp_path / "ckpt"
    args = [
        "--device",
        "cpu",
        "--distributed-backend",
        "gloo",
        "--train-iters",
        "10",
        "--iter-sleep",
        "0.3",
        "--log-jsonl",
        log,
        "--save",
        ckpt,
        "--load",
        ckpt,
    ]
    job, out = submit_template(slurm_cluster, template, tmp_path, PROBE, args)
    wait_for_iterations(slurm_cluster, job, log, out, 2)
    slurm_cluster.signal(job, "USR1", batch=True)
    info = wait_completed(slurm_cluster, job, out)
    assert info["Restarts"] == "1", tail(out)
    assert "requeueing job" in tail(out)
    assert read_losses(log) == probe_losses(10)  # each iteration once: saved where it stopped
    ranks = read_env(log)  # as the resumed run saw it
    launcher = "slurm" if template == "srun" else "torchrun"
    assert [(r["rank"], r["local_rank"], r["world_size"], r["launcher"], r["restart"]) for r in ranks] == [
        (0, 0, 2, launcher, 1),
        (1, 1, 2, launcher, 1),
    ]
    if template == "srun":  # master from the node list, port from the job id (as srun.sbatch sets)
        assert ranks[0]["master_addr"] == slurm_cluster.host
        assert ranks[0]["master_port"] == 10000 + job % 20000


# ---- the training program ----------------------------------------------------------------------
def program_missing(*flags: str) -> str | None:
    """Why pretrain_gpt_sp.py cannot run these tests yet (None when it can)."""
    if not (REPO / PROGRAM).exists():
        return f"{PROGRAM} does not exist yet"
    sources = [REPO / PROGRAM, *sorted((REPO / "megatron_sp").rglob("*.py"))]
    text = "".join(p.read_text(errors="replace") for p in sources)
    missing = [f for f in flags if f'"{f}"' not in text]
    return f"{PROGRAM} has no {', '.join(missing)} yet" if missing else None


def run_local_torchrun(args, out: Path, env_extra=None) -> subprocess.Popen:
    env = dict(os.environ, **launch_env(PROGRAM), **(env_extra or {}))
    with open(out, "w") as f:
        return subprocess.Popen(
            ["bash", "launch/local.sh", str(RANKS), *map(str, args)],
            cwd=REPO,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )


_REFERENCE = {}


def program_reference_losses() -> list[tuple[int, float]]:
    """The program's losses under a plain local torchrun (no Slurm) with the TINY flags.

    Computed once per session (here and in test_slurm_faults.py); skips when the program can't run.
    """
    reason = program_missing("--log-jsonl", "--distributed-backend")
    if reason:
        pytest.skip(reason)
    if "losses" not in _REFERENCE:
        d = Path(tempfile.mkdtemp(prefix="megatron_sp_reference_"))
        proc = run_local_torchrun([*TINY, "--log-jsonl", d / "log.jsonl"], d / "out.txt")
        assert proc.wait(timeout=JOB_TIMEOUT_S) == 0, tail(d / "out.txt")
        losses = read_losses(d / "log.jsonl")
        shutil.rmtree(d, ignore_errors=True)
        assert [i for i, _ in losses] == list(range(1, 17)), losses
        _REFERENCE["losses"] = losses
    return _REFERENCE["losses"]


@pytest.fixture
def reference_losses():
    return program_reference_losses()


def assert_same_losses(got, want):
    assert [i for i, _ in got] == [i for i, _ in want]
    worst = max(abs(a - b) for (_, a), (_, b) in zip(got, want))
    assert worst <= 1e-6, f"losses differ by up to {worst:.3g}:\n{got}\n{want}"


@pytest.mark.parametrize("template", ["torchrun"])  # srun: test_usr1_saves_requeues_and_resumes_program
def test_template_matches_local_torchrun(slurm_cluster, reference_losses, tmp_path, template):
    """The program under a template logs the losses of a plain local torchrun. (Through srun.sbatch the
    requeue test below asserts the same, across a preemption, so the suite runs that once.)"""
    log = tmp_path / "log.jsonl"
    job, out = submit_template(slurm_cluster, template, tmp_path, PROGRAM, [*TINY, "--log-jsonl", log])
    wait_completed(slurm_cluster, job, out)
    assert_same_losses(read_losses(log), reference_losses)


def test_usr1_saves_requeues_and_resumes_program(slurm_cluster, reference_losses, tmp_path):
    """Preempted mid-run: saves at the next iteration, requeues, resumes from --load, same losses."""
    reason = program_missing("--save", "--load")
    if reason:
        pytest.skip(reason)
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    ckpt.mkdir()  # the first run finds no checkpoint in --load and starts from scratch
    args = [*TINY, "--log-jsonl", log, "--save", ckpt, "--load", ckpt]
    job, out = submit_template(slurm_cluster, "srun", tmp_path, PROGRAM, args)
    wait_for_iterations(slurm_cluster, job, log, out, 1)
    slurm_cluster.signal(job, "USR1", batch=True)
    info = wait_completed(slurm_cluster, job, out)
    assert info["Restarts"] == "1", f"the job was not requeued (finished before the signal?):\n{tail(out)}"
    # Saved at the iteration where it stopped, so the resumed run logs each iteration once.
    assert_same_losses(read_losses(log), reference_losses)

"""Launcher detection (torchrun, Slurm, single) and Slurm host lists; init_distributed's checks."""

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from megatron_sp.training import dist_env
from megatron_sp.training.dist_env import DistEnv, detect_env, expand_nodelist, first_host

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "head", "MASTER_PORT": "29400"}
SLURM_STEP = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "node[01-04],gpu7",
    "SLURM_STEP_NODELIST": "node[01-04],gpu7",
}


def test_torchrun_environment():
    assert detect_env(TORCHRUN) == DistEnv(
        rank=3, world_size=8, local_rank=1, master_addr="head", master_port=29400, launcher="torchrun"
    )


def test_torchrun_wins_over_slurm():
    """`srun torchrun ...`: the workers see both; torchrun's numbering is the one that counts."""
    env = detect_env({**SLURM_STEP, **TORCHRUN})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("torchrun", 3, 8, 1)


def test_incomplete_torchrun_environment_names_what_is_missing():
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        detect_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        detect_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_slurm_step_environment():
    env = detect_env(SLURM_STEP)
    assert env == DistEnv(
        rank=5, world_size=8, local_rank=1, master_addr="node01", master_port=10000 + 123456 % 20000, launcher="slurm"
    )


def test_slurm_master_is_first_node_of_the_step():
    env = detect_env({**SLURM_STEP, "SLURM_STEP_NODELIST": "node[03-04]"})
    assert env.master_addr == "node03"


def test_slurm_master_addr_and_port_overrides():
    env = detect_env({**SLURM_STEP, "MASTER_ADDR": "node02-ib", "MASTER_PORT": "4242"})
    assert (env.master_addr, env.master_port) == ("node02-ib", 4242)


def test_slurm_step_world_size_beats_job_task_count():
    """A step may use fewer tasks than the job (srun -n2 inside a 8-task allocation)."""
    assert detect_env({**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}).world_size == 2


def test_slurm_without_job_id_needs_master_port():
    env = {k: v for k, v in SLURM_STEP.items() if k not in ("SLURM_JOB_ID", "SLURM_STEP_ID")}
    with pytest.raises(ValueError, match="MASTER_PORT"):
        detect_env(env)
    assert detect_env({**env, "MASTER_PORT": "5000"}).master_port == 5000


def test_batch_shell_of_multi_task_job_is_an_error():
    """The batch script has SLURM_PROCID=0 and the job's SLURM_NTASKS but no step: not a rank."""
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "vm"}
    with pytest.raises(ValueError, match="srun"):
        detect_env(batch)
    assert detect_env({**batch, "SLURM_NTASKS": "1"}).launcher == "single"


def test_single_process():
    env = detect_env({})
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (0, 1, 0, "single")


def test_bad_integer_is_named():
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        detect_env({**TORCHRUN, "WORLD_SIZE": "two"})


@pytest.mark.parametrize("port", ["abc", "0", "70000", "-1", "9" * 5000, " 29500"])
@pytest.mark.parametrize("launcher", ["torchrun", "slurm", "single"])
def test_bad_master_port_is_named(port, launcher):
    """Was: "invalid literal for int()" (or Python's digit limit) without naming the variable."""
    base = {"torchrun": TORCHRUN, "slurm": {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0"}}
    with pytest.raises(ValueError) as err:
        detect_env({**base.get(launcher, {}), "MASTER_PORT": port, "MASTER_ADDR": "127.0.0.1"})
    assert str(err.value).startswith("MASTER_PORT=") and "is not a port number (1 to 65535)" in str(err.value)


LOCAL_SH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "local.sh")


def _local_sh(nproc, **env):
    environ = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MAX_RESTARTS")}
    environ.update(env, PYTHON=sys.executable, PROGRAM="/nonexistent.py")
    return subprocess.run(["bash", LOCAL_SH, nproc], env=environ, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    "nproc, env, words",
    [
        ("0", {}, "NPROC must be a number of ranks from 1 to 9999, not '0'"),
        ("two", {}, "NPROC must be a number of ranks from 1 to 9999, not 'two'"),
        ("99999", {}, "NPROC must be"),
        ("1", {"MASTER_PORT": "abc"}, "MASTER_PORT must be a port number from 1 to 65535, not 'abc'"),
        ("1", {"MASTER_PORT": "70000"}, "MASTER_PORT must be a port number from 1 to 65535, not '70000'"),
        ("1", {"MAX_RESTARTS": "-1"}, "MAX_RESTARTS must be a whole number from 0 to 9999, not '-1'"),
    ],
)
def test_local_launcher_checks_its_numbers(nproc, env, words):
    """Was: torchrun's AssertionError (NPROC 0) or ValueError traceback (a port that is no number)."""
    proc = _local_sh(nproc, **env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"launch/local.sh: error: {words}." or words in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_local_launcher_refuses_a_port_in_use():
    """A listener on MASTER_PORT (another program, or another job's rendezvous store): one sentence at once
    (was: torchrun waiting past 1000 s without a word, or joining the other job's store)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        start = time.monotonic()
        proc = _local_sh("1", MASTER_PORT=str(port))
        elapsed = time.monotonic() - start
    finally:
        listener.close()
    assert proc.returncode == 2 and elapsed < 10, (proc.stderr, elapsed)
    assert proc.stderr.strip().startswith(f"launch/local.sh: error: MASTER_PORT={port} on 127.0.0.1 is in use")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("vm", ["vm"]),
        ("node[01-04],gpu7", ["node01", "node02", "node03", "node04", "gpu7"]),
        ("node[1,3-5]", ["node1", "node3", "node4", "node5"]),
        ("gpu-[9-11]", ["gpu-9", "gpu-10", "gpu-11"]),
        ("n[008-010]", ["n008", "n009", "n010"]),
        ("a,b[2-3],c", ["a", "b2", "b3", "c"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("dgx[7]-ib", ["dgx7-ib"]),
        ("10.0.0.1", ["10.0.0.1"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-", "node01]", "node[a-b]", "", "n[[1]]"])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        expand_nodelist(bad)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol (slurm-client) not installed")
@pytest.mark.parametrize("nodelist", ["node[01-04],gpu7", "n[008-010],a", "rack[1-2]-n[01-02]", "x[1,3-4]"])
def test_expand_nodelist_agrees_with_scontrol(nodelist, tmp_path):
    conf = tmp_path / "slurm.conf"  # scontrol reads a configuration even to expand host lists
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\n")
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist],
        capture_output=True,
        text=True,
        env=dict(os.environ, SLURM_CONF=str(conf)),
    )
    if out.returncode != 0:
        pytest.skip(f"scontrol show hostnames fails here: {out.stderr.strip()}")
    assert expand_nodelist(nodelist) == out.stdout.split()


def test_first_host_falls_back_to_scontrol(monkeypatch):
    calls = []

    def fake_run(argv, **kw):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="weird1\nweird2\n", stderr="")

    monkeypatch.setattr(dist_env.subprocess, "run", fake_run)
    assert first_host("node[01-02]") == "node01" and not calls  # parsed here, no subprocess
    assert first_host("weird[1-2") == "weird1"
    assert calls == [["scontrol", "show", "hostnames", "weird[1-2"]]


@pytest.fixture
def clean_launch_env(monkeypatch):
    """No launcher variables; whatever init_distributed exports is undone after the test."""
    for key in [*TORCHRUN, *SLURM_STEP]:
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)


def test_init_distributed_single_process_has_no_process_group(clean_launch_env):
    import torch.distributed as dist

    env = dist_env.init_distributed("gloo", "cpu")
    assert env.launcher == "single" and not dist.is_initialized()
    assert os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"
    dist_env.destroy_distributed()  # no process group to leave; the exported variables are undone
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ


@pytest.mark.parametrize(
    "backend, device, match",
    [
        ("mpi", "cpu", "gloo or nccl"),
        ("gloo", "tpu", "cpu or cuda"),
        ("nccl", "cpu", "needs --device cuda"),
    ],
)
def test_init_distributed_rejects_bad_settings(clean_launch_env, backend, device, match):
    with pytest.raises(ValueError, match=match):
        dist_env.init_distributed(backend, device)


def test_init_distributed_cuda_without_gpu_is_clear(clean_launch_env, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        dist_env.init_distributed("gloo", "cuda")


def test_warns_about_torchrun_restarts_with_shared_store(clean_launch_env, monkeypatch):
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }.items():
        monkeypatch.setenv(key, value)
    with pytest.warns(UserWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        dist_env.init_distributed("gloo", "cpu")


def _leave(rank, port, delay, results):
    """One rank of a 2-rank gloo world (rank 0 hosts the TCP store, as under srun or launch/'s
    torchrun): meets, then leaves; rank 1 is slow to leave."""
    import time

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    os.environ["LOCAL_RANK"] = str(rank)
    dist_env.init_distributed("gloo", "cpu", timeout_s=60)
    dist.barrier()
    if rank == 1:
        time.sleep(delay)
    start = time.monotonic()
    dist_env.destroy_distributed(wait_for_peers=True)
    results.put((rank, start, time.monotonic()))


def test_store_host_leaves_after_every_peer_has_torn_down(clean_launch_env):
    """The shutdown race (issue 21): rank 0 hosts the store, so it must not exit while a peer is still
    destroying its process groups (NCCL's threads poll the store then; a vanished store killed that
    rank and the launcher reported exit 1 for a finished run)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")  # no torch re-import: the children only meet and leave
    results = ctx.Queue()
    procs = [ctx.Process(target=_leave, args=(r, port, 1.0, results)) for r in range(2)]
    for p in procs:
        p.start()
    times = dict((rank, (start, end)) for rank, start, end in (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert times[0][1] >= times[1][0], "rank 0 (the store's host) left before rank 1 began to leave"


def test_heartbeat_names_the_rank_that_stopped():
    """A rank whose counter does not move is named, with its pipeline stage (issue 39)."""
    from megatron_sp import heartbeat

    port = _free_port()
    master = torch_dist().TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    try:
        heartbeat.start("127.0.0.1", port, 0)  # rank 1 never beats (SIGSTOPped, killed)
        assert heartbeat.silent_ranks(2, "127.0.0.1", port) == [1]
        assert heartbeat.describe(2, 0, pp_size=2).startswith("rank 1 (pipeline stage 1, this rank's next stage)")
        assert heartbeat.describe(2, 0).startswith("rank 1 stopped responding")
    finally:
        heartbeat.stop()
        del master


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_dist():
    import torch.distributed as dist

    return dist

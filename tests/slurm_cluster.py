"""A real one-node Slurm cluster for tests, built from Debian's packages.

`SlurmCluster(root)` writes a slurm.conf under `root`, starts its own munged, slurmctld and slurmd
(as root, without systemd) and stops them by their pid files. Everything lives under `root`, ports
are picked free, so a second test session on the same machine brings up a cluster of its own.

    with SlurmCluster(tmp_dir) as cluster:
        job = cluster.submit("launch/srun.sbatch", ["--device", "cpu"], sbatch_args=["--ntasks=2"])
        assert cluster.wait(job, timeout=60) == "COMPLETED"

Non-obvious constraints, each learnt the hard way:
- The node declares more CPUs than the machine has (`SlurmdParameters=config_overrides`), or
  `--ntasks=4` on a 2-core machine stays pending for ever.
- The host name must resolve, or torch's rendezvous (which looks it up) hangs.
- munged's socket folder must be mode 755 so that unprivileged job steps can reach it.
- A requeued job waits `cred_expire` seconds before it may start again (default 120 s): set to 5,
  the least Slurm accepts (below that it silently keeps 120), and the main scheduling loop, which
  is what starts it then, runs every second instead of every 60 s.
- `sbatch --wait` polls every 10 s; `wait()` polls `scontrol show job` instead.
- Every Slurm command needs SLURM_CONF: use `cluster.env` / `cluster.cmd()`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal as _signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "srun")
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not installed and not installable, not root, ...)."""


def ensure_slurm_installed() -> None:
    """Installs Debian's Slurm and munge packages when missing; raises SlurmUnavailable if it can't."""
    if all(shutil.which(b) or os.path.exists(f"/usr/sbin/{b}") for b in BINARIES):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable(
            f"Slurm is not installed and we are not root with apt-get: install {' '.join(PACKAGES)} to run these tests"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
    proc = subprocess.run(install, env=env, capture_output=True, text=True)
    if proc.returncode != 0:  # stale package lists are the usual cause
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
        proc = subprocess.run(install, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {proc.stderr[-500:]}")


def ensure_hostname_resolves() -> str:
    """Returns the host name, adding `127.0.0.1 <hostname>` to /etc/hosts when it does not resolve."""
    host = socket.gethostname()
    try:
        socket.gethostbyname(host)
    except socket.gaierror:
        if os.geteuid() != 0:
            raise SlurmUnavailable(f"host name {host!r} does not resolve and we cannot edit /etc/hosts")
        with open("/etc/hosts", "a") as f:
            f.write(f"\n127.0.0.1 {host}\n")
    return host


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _daemon_binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """One slurmctld + one slurmd on this machine, configured and run from `root`."""

    def __init__(self, root: str | os.PathLike, cpus: int = 8, cred_expire_s: int = 5):
        self.root = Path(root)
        self.cpus = cpus
        self.cred_expire_s = cred_expire_s
        self.host = socket.gethostname()
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "run" / "munge.socket.2"
        self._pid_files = [self.root / "slurmd.pid", self.root / "slurmctld.pid", self.root / "munge" / "munged.pid"]

    # ---- life cycle -------------------------------------------------------------------------
    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def env(self) -> dict:
        """os.environ plus SLURM_CONF: pass it to every Slurm command."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self, ready_timeout: float = 30.0) -> None:
        if os.geteuid() != 0:
            raise SlurmUnavailable("the test cluster runs its daemons as root; we are not root")
        ensure_slurm_installed()
        self.host = ensure_hostname_resolves()
        for sub in ("state", "spool", "munge/run", "munge/etc"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        try:
            self._start_munged()
            self._write_conf()
            self._run_daemon("slurmctld", "-c")  # -c: fresh state, no jobs from an earlier session
            self._run_daemon("slurmd")
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stops the daemons through their pid files (slurmd first, munged last)."""
        for pid_file in self._pid_files:
            try:
                pid = int(pid_file.read_text().strip())
            except (OSError, ValueError):
                continue
            try:
                os.kill(pid, _signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.05)
            if _alive(pid):
                os.kill(pid, _signal.SIGKILL)

    def _start_munged(self) -> None:
        munge = self.root / "munge"
        key = munge / "etc" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        os.chmod(munge / "etc", 0o700)
        os.chmod(self.munge_socket.parent, 0o755)
        cmd = [
            _daemon_binary("munged"),
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SlurmUnavailable(f"munged did not start: {proc.stderr.strip()}")

    def _write_conf(self) -> None:
        ctld_port, slurmd_port = _free_ports(2)
        r = self.root
        self.conf.write_text(f"""\
ClusterName=megatronsp
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire_s}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0,sched_interval=1
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=600
InactiveLimit=0
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")

    def _run_daemon(self, name: str, *args: str) -> None:
        proc = subprocess.run(
            [_daemon_binary(name), "-f", str(self.conf), *args], env=self.env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise SlurmUnavailable(f"{name} did not start: {proc.stderr.strip()}; see {self.root}/{name}.log")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            proc = self.cmd("sinfo", "-h", "-N", "-o", "%T", check=False)
            state = proc.stdout.strip()
            if proc.returncode == 0 and state.rstrip("*") in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.2)
        raise SlurmUnavailable(
            f"node not ready after {timeout:.0f} s (state {state!r}); see {self.root}/slurmctld.log and slurmd.log"
        )

    # ---- jobs -------------------------------------------------------------------------------
    def cmd(self, *argv: str, check: bool = True, env: dict | None = None):
        """Runs a Slurm client command with this cluster's SLURM_CONF; returns CompletedProcess."""
        proc = subprocess.run(list(argv), env=dict(self.env, **(env or {})), capture_output=True, text=True)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def submit(self, script: str | os.PathLike, args=(), env: dict | None = None, sbatch_args=()) -> int:
        """sbatch `script args...` with `env` added to the submitting environment; returns the job id."""
        out = self.cmd("sbatch", "--parsable", *sbatch_args, str(script), *map(str, args), env=env)
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """`scontrol show job` as a dict of its Key=Value fields ({} once the job is forgotten)."""
        proc = self.cmd("scontrol", "show", "job", "-o", str(job_id), check=False)
        if proc.returncode != 0:
            return {}
        fields = {}
        for token in proc.stdout.split():
            key, sep, value = token.partition("=")
            if sep:
                fields[key] = value
        return fields

    def state(self, job_id: int) -> str:
        return self.job(job_id).get("JobState", "UNKNOWN")

    def wait(self, job_id: int, timeout: float = 120, states=TERMINAL_STATES, poll_s: float = 0.2) -> str:
        """Polls until the job reaches one of `states` and returns it; TimeoutError after `timeout`."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state in states:
                return state
            time.sleep(poll_s)
        raise TimeoutError(f"job {job_id} still {state} after {timeout:.0f} s")

    def signal(self, job_id: int, sig: str = "USR1", batch: bool = True) -> None:
        """Sends `sig` to the batch shell (what `#SBATCH --signal=B:SIG@T` does) or to all steps."""
        self.cmd("scancel", f"--signal={sig}", *(["--batch"] if batch else []), str(job_id))

    def requeue(self, job_id: int) -> None:
        self.cmd("scontrol", "requeue", str(job_id))

    def cancel(self, job_id: int) -> None:
        self.cmd("scancel", str(job_id), check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (our child, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="session")
def slurm_cluster():
    """The session's Slurm cluster; the tests using it skip with the reason when Slurm can't run."""
    root = tempfile.mkdtemp(prefix="megatron_sp_slurm_")
    cluster = SlurmCluster(root)
    try:
        cluster.start()
    except SlurmUnavailable as e:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"no Slurm cluster: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


# ---- helpers shared by the launch tests ----------------------------------------------------------
def read_losses(path: str | os.PathLike) -> list[tuple[int, float]]:
    """(iteration, lm_loss) for each line of a training log (JSON lines), in file order."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                out.append((record["iteration"], record["lm_loss"]))
    return out


def tail(path: str | os.PathLike, chars: int = 4000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"<no output: {e}>"

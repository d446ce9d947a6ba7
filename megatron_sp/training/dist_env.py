"""Where this process sits in the job: rank, world size, local rank and master, from the launcher.

Three launchers are understood, in this order of precedence:

=========  ====================================================================================
torchrun   RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (set by torchrun / elastic agent)
slurm      inside an `srun` step: SLURM_PROCID, SLURM_STEP_NUM_TASKS (or SLURM_NTASKS),
           SLURM_LOCALID; master = MASTER_ADDR if set, else the first host of the step's node list;
           port = MASTER_PORT if set, else 10000 + SLURM_JOB_ID % 20000 (same on every rank)
single     none of the above: rank 0 of 1, no process group
=========  ====================================================================================

torchrun's variables win, so `srun torchrun ...` (launch/torchrun.sbatch) works: the Slurm task is
the elastic agent, and its workers see torchrun's variables.

What a dead or hung rank does to the others (the bound is `timeout_s` of `init_distributed`):

- gloo: a collective whose peer process died fails at once with a connection error (the peer's
  socket is closed); a peer that hangs (alive, never joins the collective) makes the collective
  raise after `timeout_s`. Either way the surviving ranks get a RuntimeError and exit.
- NCCL: collectives are asynchronous; the process group's watchdog thread aborts the communicator
  and kills the process after `timeout_s` when TORCH_NCCL_ASYNC_ERROR_HANDLING is 1 (tear down
  and clean up; 3, torch's default since 2.2, tears down without clean-up). `init_distributed`
  sets 1 when unset.
- Under torchrun, the agent sees a worker exit non-zero, stops the others (SIGTERM, then SIGKILL)
  and restarts the whole group if `--max-restarts` allows; the program then resumes from `--load`.
  Under `srun --kill-on-bad-exit=1`, Slurm kills the step as soon as one task exits non-zero.
"""

from __future__ import annotations

import os
import re
import subprocess
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

from megatron_sp import heartbeat

LAUNCHERS = ("torchrun", "slurm", "single")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job.

    rank         global rank, 0 .. world_size-1
    world_size   number of processes in the job
    local_rank   rank on this node: the CUDA device index to use
    master_addr  host of rank 0, where the TCP store for the rendezvous listens
    master_port  port of that store
    launcher     "torchrun" | "slurm" | "single"
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str

    def __post_init__(self):
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}, got {self.launcher!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside the world of size {self.world_size}")
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")


def detect_env(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """Reads the launcher's environment (see the module docstring); pure apart from a rare scontrol."""
    if any(k in environ for k in _TORCHRUN_VARS):
        return _from_torchrun(environ)
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        if "SLURM_STEP_ID" in environ or "SLURM_JOB_ID" not in environ:
            return _from_slurm(environ)
        _check_batch_shell(environ)
    return DistEnv(
        rank=0,
        world_size=1,
        local_rank=0,
        master_addr="127.0.0.1",
        master_port=_port(environ),
        launcher="single",
    )


def _port(environ: Mapping[str, str], default: int = 29500) -> int:
    """MASTER_PORT, a port number 1..65535 (the variable named when it is not one)."""
    if not environ.get("MASTER_PORT"):
        return default
    text = environ["MASTER_PORT"]
    if not (text.isascii() and text.isdigit() and len(text) <= 5 and 1 <= int(text) <= 65535):
        raise ValueError(f"MASTER_PORT={text!r} is not a port number (1 to 65535)")
    return int(text)


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except KeyError:
        raise ValueError(f"{name} is not set; the launcher's environment is incomplete") from None
    except ValueError:
        raise ValueError(f"{name}={environ[name]!r} is not an integer") from None


def _from_torchrun(environ: Mapping[str, str]) -> DistEnv:
    missing = [k for k in _TORCHRUN_VARS if k not in environ]
    if missing:
        raise ValueError(
            f"torchrun-style environment without {', '.join(missing)}: set all of "
            f"{', '.join(_TORCHRUN_VARS)} or none (launch with torchrun)"
        )
    world = _int(environ, "WORLD_SIZE")
    if world > 1 and not ("MASTER_ADDR" in environ and "MASTER_PORT" in environ):
        raise ValueError("WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are not set: launch with torchrun")
    return DistEnv(
        rank=_int(environ, "RANK"),
        world_size=world,
        local_rank=_int(environ, "LOCAL_RANK"),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_port(environ),
        launcher="torchrun",
    )


def _from_slurm(environ: Mapping[str, str]) -> DistEnv:
    world_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    return DistEnv(
        rank=_int(environ, "SLURM_PROCID"),
        world_size=_int(environ, world_var),
        local_rank=int(environ.get("SLURM_LOCALID", 0)),
        master_addr=environ.get("MASTER_ADDR") or _slurm_head_node(environ),
        master_port=_slurm_port(environ),
        launcher="slurm",
    )


def _check_batch_shell(environ: Mapping[str, str]) -> None:
    """In the batch script itself (no srun step) only a one-task job may run the program directly."""
    ntasks = _int(environ, "SLURM_NTASKS")
    if ntasks > 1:
        raise ValueError(
            f"running in the batch script of a {ntasks}-task Slurm job but not under "
            "srun: start one process per task with srun (launch/srun.sbatch) or "
            "one torchrun per node (launch/torchrun.sbatch)"
        )


def _slurm_head_node(environ: Mapping[str, str]) -> str:
    # The step's first node hosts its task 0; it differs from the job's when a step uses a subset.
    for var in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if environ.get(var):
            return first_host(environ[var])
    raise ValueError("Slurm environment without SLURM_JOB_NODELIST: cannot find the master node; set MASTER_ADDR")


def _slurm_port(environ: Mapping[str, str]) -> int:
    if environ.get("MASTER_PORT"):
        return _port(environ)
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id:
        raise ValueError("Slurm environment without SLURM_JOB_ID: set MASTER_PORT")
    # Same on every rank, and two jobs sharing a head node rarely collide.
    return 10000 + int(job_id) % 20000


# ---- Slurm host lists ---------------------------------------------------------------------------
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expands a Slurm host list ("node[01-03,07],gpu7" -> node01 node02 node03 node07 gpu7).

    Several bracket groups in one name ("rack[1-2]-n[1-2]") expand as a product, like Slurm's.
    Raises ValueError for anything else.
    """
    hosts = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_item(item))
    if not hosts:
        raise ValueError(f"empty Slurm node list {nodelist!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError(f"unbalanced brackets in Slurm node list {text!r}")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in Slurm node list {text!r}")
    items.append(text[start:])
    return [item for item in items if item]


def _expand_item(item: str) -> list[str]:
    open_at = item.find("[")
    if open_at < 0:
        if "]" in item:
            raise ValueError(f"unbalanced brackets in Slurm host {item!r}")
        return [item]
    close_at = item.index("]", open_at)
    prefix, ranges, rest = item[:open_at], item[open_at + 1 : close_at], item[close_at + 1 :]
    return [prefix + num + tail for num in _expand_ranges(ranges, item) for tail in _expand_item(rest)]


def _expand_ranges(ranges: str, item: str) -> list[str]:
    numbers = []
    for part in ranges.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise ValueError(f"cannot parse range {part!r} in Slurm host {item!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        width = len(lo)  # zero padding: node[01-10] -> node01 .. node10
        numbers.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return numbers


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: ours for the usual forms, `scontrol show hostnames` else."""
    try:
        return expand_nodelist(nodelist)[0]
    except ValueError:
        pass
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True, timeout=30
        ).stdout.split()
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"cannot expand Slurm node list {nodelist!r} ({e}); set MASTER_ADDR") from e
    if not out:
        raise ValueError(f"scontrol expanded Slurm node list {nodelist!r} to nothing; set MASTER_ADDR")
    return out[0]


# ---- process group ------------------------------------------------------------------------------
def init_distributed(backend: str, device: str, timeout_s: float = 600) -> DistEnv:
    """Detects the launcher, selects the CUDA device and joins the default process group.

    Single-process runs (world size 1) return without a process group. `timeout_s` bounds the
    rendezvous and every collective (see the module docstring for what a dead rank does).
    """
    import torch
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"--distributed-backend must be gloo or nccl, got {backend!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    if backend == "nccl" and device != "cuda":
        raise ValueError("the nccl backend needs --device cuda; use --distributed-backend gloo on CPU")
    env = detect_env()
    _export(env)
    _warn_shared_store_restarts(env)
    device_id = _select_cuda_device(env.local_rank) if device == "cuda" else None
    if env.world_size == 1:
        return env
    if backend == "nccl":
        # The watchdog aborts on a failed or timed-out collective instead of hanging for ever.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    try:
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
            **({"device_id": torch.device("cuda", device_id)} if backend == "nccl" else {}),
        )
    except Exception as e:  # noqa: BLE001 - re-raised with where we tried to meet
        raise RuntimeError(
            f"rank {env.rank}/{env.world_size} ({env.launcher}) could not join the process group at "
            f"{env.master_addr}:{env.master_port} within {timeout_s:.0f} s: {e}"
        ) from e
    heartbeat.start(env.master_addr, env.master_port, env.rank)  # names a hung peer (megatron_sp/heartbeat.py)
    return env


def _warn_shared_store_restarts(env: DistEnv) -> None:
    """torchrun restarts + the agent's shared TCP store can hand new ranks the old ranks' addresses."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if env.rank == 0 and restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        warnings.warn(
            "torchrun --max-restarts with the agent's shared TCP store: after a restart a "
            "rank may read the failed attempt's addresses and fail to connect (pytorch "
            "issue 135712); export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun, "
            "as launch/local.sh and launch/torchrun.sbatch do",
            stacklevel=3,
        )


_EXPORTED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_previous_env: dict = {}


def _export(env: DistEnv) -> None:
    """torch's env:// rendezvous (and libraries we call) read these; destroy_distributed puts the
    previous values back, so an in-process run (tests, notebooks) leaves the environment as it was
    (a leaked WORLD_SIZE=1 would override Slurm's in jobs submitted later from this process)."""
    if not _previous_env:
        _previous_env.update({k: os.environ.get(k) for k in _EXPORTED})
    os.environ.update(
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
    )


def _restore_env() -> None:
    for key, value in _previous_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _previous_env.clear()


def _select_cuda_device(local_rank: int) -> int:
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError(
            "--device cuda but no CUDA device is visible; use --device cpu --distributed-backend gloo on CPU"
        )
    # One visible GPU per task (srun --gpus-per-task=1 / CUDA_VISIBLE_DEVICES binding): it is ours.
    index = 0 if count == 1 else local_rank
    if index >= count:
        raise RuntimeError(
            f"local rank {local_rank} needs a GPU but only {count} are visible: "
            "start at most one process per GPU on each node"
        )
    torch.cuda.set_device(index)
    return index


_LEFT_KEY = "megatron_sp/teardown"


def destroy_distributed(wait_for_peers: bool = False, wait_s: float = 60.0) -> None:
    """Leaves the default process group, if any (safe to call twice or without one).

    wait_for_peers (the end of a run that every rank reached): the ranks destroy their groups only
    once all have arrived (no pair closed under a peer still finishing its last collective), and
    rank 0 returns only once every rank has destroyed its groups. Rank 0 hosts the TCP store
    (torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as launch/ sets it; srun): if it exited
    first, a peer still tearing down (NCCL's watchdog and heartbeat threads poll the store) would
    find the store gone and die, and the launcher report exit 1 for a run that had finished and saved.
    Both waits go through the store and are bounded by wait_s.
    """
    import torch.distributed as dist

    heartbeat.stop()
    if dist.is_available() and dist.is_initialized():
        store = _default_store() if wait_for_peers else None
        rank, world = dist.get_rank(), dist.get_world_size()
        if store is not None:
            _count_in(store, "arrived", rank, world, wait=True, wait_s=wait_s)
        dist.destroy_process_group()
        if store is not None:
            _count_in(store, "left", rank, world, wait=rank == 0, wait_s=wait_s)
    _restore_env()


def _default_store():
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (a private API): nothing to wait on
        return None


def _count_in(store, what: str, rank: int, world: int, wait: bool, wait_s: float) -> None:
    """This rank counts itself in on the store; with wait, it returns once all `world` have (bounded)."""
    import time

    attempt = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    key = f"{_LEFT_KEY}/{attempt}/{what}"
    try:
        store.set_timeout(timedelta(seconds=10))
        count = store.add(key, 1)
        deadline = time.monotonic() + wait_s
        while wait and count < world and time.monotonic() < deadline:
            time.sleep(0.02)
            count = store.add(key, 0)
    except Exception:  # noqa: BLE001 - the host is gone already (we are not it): nothing to protect
        pass

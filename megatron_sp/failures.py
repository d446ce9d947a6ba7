"""How the program fails: one sentence, printed once, by the rank that hit the problem.

Every error ends the run with a single line on stderr and an exit code:

    pretrain_gpt_sp.py: error: <what is wrong and how to fix it>
    exit 2  bad input: flags, sizes, data, tokenizer, checkpoint to load, directory to save to
    exit 1  a fault while running: a peer rank died or hung, the disk filled up, the loss diverged

Who prints it:
- errors that follow from the command line alone (ArgumentError, GPTConfig) are the same on every
  rank, so rank 0 prints them;
- errors that depend on what a rank sees (files, directories) are gathered after the ranks meet
  (`agree`), every rank exits 2, and the lowest failing rank prints its sentence;
- errors while running are printed by the first rank that reports (an atomic counter in the
  process group's TCP store); if the store cannot be reached, the rank prints anyway.
"""

from __future__ import annotations

import os
import re
import sys
from datetime import timedelta
from typing import Optional

PROG = "pretrain_gpt_sp.py"
_STORE_KEY = "megatron_sp/error_reported"


def one_sentence(err: BaseException) -> str:
    """The first line of the message (torch's own messages can run to many lines)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def print_error(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def launcher_rank() -> int:
    """This process's rank from the launcher's environment (before any process group exists)."""
    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def report_deterministic(err: BaseException, code: int) -> int:
    """An error every rank computes identically from the command line: rank 0 prints it."""
    if launcher_rank() == 0:
        print_error(one_sentence(err))
    return code


def agree(error: Optional[str]) -> Optional[tuple[int, str]]:
    """Collective: (lowest rank with an error, its message), or None when no rank has one."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return (0, error) if error else None
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, error)
    for rank, message in enumerate(views):
        if message:
            return rank, message
    return None


def report_agreed(failure: tuple[int, str], code: int) -> int:
    import torch.distributed as dist

    rank, message = failure
    me = dist.get_rank() if dist.is_initialized() else 0
    if me == rank:
        print_error(f"rank {rank}: {message}" if dist.is_initialized() else message)
    return code


def report_once(message: str, code: int) -> int:
    """A runtime error: printed by the first rank to report it (the others stay quiet)."""
    if _first_to_report():
        print_error(message)
    return code


def _first_to_report() -> bool:
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    attempt = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=3))  # the store's host may be the hung rank
        return store.add(f"{_STORE_KEY}/{attempt}", 1) == 1
    except Exception:  # noqa: BLE001 - no store, or its host is gone: better twice than never
        return True


_COLLECTIVE_MARKERS = ("gloo", "nccl", "connection closed by peer", "connection reset", "timed out", "broken pipe")


def is_collective_failure(err: BaseException) -> bool:
    """A torch.distributed error of a collective: gloo raises plain RuntimeErrors, NCCL DistErrors."""
    import torch.distributed as dist

    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(marker in text for marker in _COLLECTIVE_MARKERS)


def describe_collective_failure(err: BaseException, timeout_minutes: float, pp_size: int = 1) -> str:
    """One sentence for a torch.distributed error raised by a collective (peer died or hung), naming
    the ranks whose heartbeat stopped (megatron_sp/heartbeat.py), with their pipeline stage."""
    import torch.distributed as dist

    from megatron_sp import heartbeat

    rank = dist.get_rank() if dist.is_initialized() else launcher_rank()
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1") or 1)
    reason = re.sub(r"^\[[^\]]*\]\s*", "", one_sentence(err))  # gloo's "[.../pair.cc:534] " prefix
    if len(reason) > 200:
        reason = reason[:200] + "..."
    named = heartbeat.describe(world, rank, pp_size)
    who = f"{named}, past" if named else "another rank died, or stopped responding for longer than"
    return (
        f"rank {rank}: a collective failed ({reason}): {who} --distributed-timeout-minutes {timeout_minutes:g} "
        "(its own output, if any, says why)."
    )

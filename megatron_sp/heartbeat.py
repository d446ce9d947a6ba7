"""Which rank stopped responding: a heartbeat per rank in the rendezvous store.

A collective that times out says only that it timed out; which peer never arrived, torch does not
say. So every rank runs a daemon thread that adds 1 to its own key in the TCP store every
INTERVAL_S seconds (its own client connection, so the training's store traffic is untouched). A
SIGSTOPped or killed rank's thread stops with it. When a rank reports a collective failure, it
reads every rank's counter, waits a few intervals and reads again: the ranks whose counters did
not move are the ones that stopped responding (no clocks compared, so skew between nodes does not
matter). If the store itself does not answer, its host (rank 0) is the one. The keys carry the
launcher's restart count, so a restarted group never reads an earlier attempt's beats.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Optional

INTERVAL_S = 0.5
_THREAD = []  # the running heartbeat of this process, if any


def _key(rank: int) -> str:
    attempt = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return f"megatron_sp/heartbeat/{attempt}/{rank}"


def _client(host: str, port: int, timeout_s: float):
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class _Beat(threading.Thread):
    def __init__(self, host: str, port: int, rank: int):
        super().__init__(name="megatron_sp-heartbeat", daemon=True)
        self.where, self.rank, self.stopped = (host, port), rank, threading.Event()

    def run(self):
        try:
            store = _client(*self.where, timeout_s=10)
            while not self.stopped.is_set():
                store.add(_key(self.rank), 1)
                self.stopped.wait(INTERVAL_S)
        except Exception:  # noqa: BLE001 - the store is gone (the run is ending): nothing to beat for
            return


def start(host: str, port: int, rank: int) -> None:
    """This rank's heartbeat (once per process; a daemon thread: it never delays an exit)."""
    stop()
    beat = _Beat(host, port, rank)
    beat.start()
    _THREAD.append(beat)


def stop() -> None:
    while _THREAD:
        _THREAD.pop().stopped.set()


def silent_ranks(world: int, host: Optional[str] = None, port: Optional[int] = None) -> Optional[list]:
    """The ranks whose heartbeat did not move over a few intervals; [] when all beat; None when the
    store does not answer (its host, rank 0, is then the silent one) or there is no heartbeat."""
    if not _THREAD:
        return None
    host, port = host or _THREAD[-1].where[0], port or _THREAD[-1].where[1]  # the store this process beats in
    try:
        store = _client(host, port, timeout_s=3)

        def counts():
            return [store.add(_key(r), 0) for r in range(world)]  # add 0: read without waiting for the key

        before = counts()
        time.sleep(4 * INTERVAL_S)
        after = counts()
    except Exception:  # noqa: BLE001 - the store does not answer
        return None
    return [r for r in range(world) if after[r] == before[r]]


def describe(world: int, me: int, pp_size: int = 1) -> str:
    """Words naming the silent ranks (with their pipeline stage under pp > 1), or ''."""
    silent = silent_ranks(world)
    if silent is None:
        return "rank 0 stopped responding (the store it hosts does not answer either)" if me and _THREAD else ""
    silent = [r for r in silent if r != me]
    if not silent:
        return ""
    per_stage = world // pp_size if pp_size > 1 else world
    mine = me // per_stage

    def name(r):
        if pp_size <= 1:
            return f"rank {r}"
        stage = r // per_stage
        side = {mine - 1: ", this rank's previous stage", mine + 1: ", this rank's next stage"}.get(stage, "")
        return f"rank {r} (pipeline stage {stage}{side})"

    return f"{', '.join(name(r) for r in silent)} stopped responding (no heartbeat in {4 * INTERVAL_S:g} s)"

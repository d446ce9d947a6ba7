"""Shared helper for the bench scripts: a world of gloo CPU processes that runs module-level functions.

    with World(4) as world:
        per_rank = world.run(fn, *args)      # fn(*args) on every rank; list of results by rank

Starting a process and importing torch costs seconds on a small machine, so a script starts one
world (the largest size it needs) and runs every configuration in it; a TP group of size t < world
size simply leaves the world with dp = world / t data-parallel replicas (each computes the same
thing). `fn` must be a module-level function (it is pickled by reference); an exception on any rank is
re-raised in the parent with that rank's traceback.

The scripts import this file as `_dist` (bench/ is on sys.path when a script runs) and put the repo
root on sys.path so that `megatron_sp` imports without installation.
"""
from __future__ import annotations

import os
import queue
import sys
import tempfile
import traceback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


def _worker(rank, world_size, init_file, tasks, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        while True:
            item = tasks.get()
            if item is None:
                break
            fn, args, kwargs = item
            try:
                results.put((rank, True, fn(*args, **kwargs)))
            except BaseException:  # noqa: BLE001 - forwarded to the parent
                results.put((rank, False, traceback.format_exc()))
            finally:
                from megatron_sp import parallel_state
                parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


class World:
    """`world_size` gloo processes (spawned), alive until close() / the end of a `with` block."""

    def __init__(self, world_size: int, timeout: float = 300.0):
        import torch.multiprocessing as mp

        self.world_size, self.timeout = world_size, timeout
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._dir.name, "init")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, world_size, init_file, self._tasks[r], self._results))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, **kwargs):
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=self.timeout)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                raise RuntimeError(f"bench world timed out after {self.timeout}s (dead ranks: {dead})")
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("bench worker failure\n" + "\n".join(errors))
        return out

    def close(self):
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._dir.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

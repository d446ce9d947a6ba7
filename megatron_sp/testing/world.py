"""A world of gloo processes on this machine that lives across many calls.

Starting a process and importing torch costs seconds, so tests and benchmarks start one world and
send it work: `world.run(fn, *args)` calls the module-level function `fn(*args)` on every rank and
returns the per-rank results (picklable). An exception on any rank is re-raised in the caller with
that rank's traceback; a rank that dies or hangs fails the call after `timeout` seconds. After each
call the ranks forget their model-parallel groups, so the next call may choose another layout.

    with LocalWorld(4) as world:
        per_rank = world.run(fn, tp_size)
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback


def _worker(rank, world_size, init_file, tasks, results):
    os.environ["OMP_NUM_THREADS"] = "1"
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
            except BaseException:  # forwarded to the caller, whatever it is
                results.put((rank, False, traceback.format_exc()))
            finally:
                from megatron_sp import parallel_state

                parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


class LocalWorld:
    """`world_size` spawned gloo processes, alive until close() or the end of a `with` block."""

    def __init__(self, world_size: int, timeout: float = 600.0):
        import torch.multiprocessing as mp

        self.world_size, self.timeout = world_size, timeout
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._dir.name, "init")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, daemon=True, args=(r, world_size, init_file, self._tasks[r], self._results))
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float | None = None, **kwargs):
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=timeout or self.timeout)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                raise RuntimeError(f"local world timed out after {timeout or self.timeout}s (dead ranks: {dead})")
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError("worker failure\n" + "\n".join(errors))
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

"""A pool of gloo worker processes that lives for a whole test module.

Starting a process and importing torch costs ~2 s, so each module starts its world once and sends
it work: `pool.run(fn, *args)` calls the module-level function `fn(*args)` on every rank and returns
the list of per-rank results (picklable). An exception on any rank is re-raised here with the
rank's traceback; a rank that dies or hangs fails the call after `timeout` seconds.
"""
from __future__ import annotations

import os
import queue
import tempfile
import traceback

import torch.multiprocessing as mp


def _worker_main(rank, world_size, init_file, tasks, results):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - forwarded to the test process
            results.put((rank, False, traceback.format_exc()))
        finally:
            from megatron_sp import parallel_state
            parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


class WorkerPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._dir.name, "init")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker_main, daemon=True,
                                   args=(r, world_size, init_file, self._tasks[r], self._results))
                       for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, timeout: float = 600, **kwargs):
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out, errors = [None] * self.world_size, []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                raise RuntimeError(f"worker pool timed out after {timeout}s (dead ranks: {dead})")
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

"""Process-level switches of a run and what happens around each step: --deterministic-mode,
--disable-bf16-reduced-precision-matmul, --logging-level, --manual-gc, --empty-unused-memory-level,
--profile and --exit-duration-in-mins (Megatron-LM's meanings)."""

from __future__ import annotations

import gc
import logging
import os
import time

import torch
import torch.distributed as dist

from megatron_sp.training.reporting import StepProfiler, memory_stats


class Runtime:
    def __init__(self, args, ps):
        self.args, self.ps = args, ps
        self.started = time.monotonic()
        self._step_times = []
        self._was_deterministic = torch.are_deterministic_algorithms_enabled()
        if args.deterministic_mode:
            if args.device == "cuda":
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what cuBLAS needs for it
            torch.use_deterministic_algorithms(True)
        if args.disable_bf16_reduced_precision_matmul and args.device == "cuda":
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        if args.logging_level is not None:
            logging.getLogger().setLevel(args.logging_level)
        if args.manual_gc:  # collections happen between steps, on every rank alike
            gc.disable()
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.profiler = StepProfiler(args, rank)

    def before_step(self, iteration: int) -> None:
        self.profiler.before_step(iteration)
        self._step_start = time.monotonic()

    def after_step(self, iteration: int) -> None:
        self._step_times.append(time.monotonic() - self._step_start)
        self.profiler.after_step(iteration)
        a = self.args
        if a.manual_gc and a.manual_gc_interval and iteration % a.manual_gc_interval == 0:
            gc.collect()
        if a.empty_unused_memory_level >= 1 and a.device == "cuda":
            torch.cuda.empty_cache()

    def memory(self) -> dict:
        return memory_stats(self.args.device)

    def out_of_time(self) -> bool:
        """--exit-duration-in-mins: True on every rank once any rank's next step (at the slowest step
        time seen) would end past the limit, so the run saves and exits in time (an all-reduce)."""
        limit = self.args.exit_duration_in_mins
        if limit is None:
            return False
        slowest = max(self._step_times, default=0.0)
        late = torch.tensor([float(time.monotonic() - self.started + slowest > 60.0 * limit)], device=self.args.device)
        if dist.is_initialized():
            dist.all_reduce(late, op=dist.ReduceOp.MAX)
        return bool(late.item())

    def close(self) -> None:
        """Ends the profile and restores the process switches (tests run several trainers in one process)."""
        self.profiler.stop()
        if self.args.manual_gc:
            gc.enable()
        torch.use_deterministic_algorithms(self._was_deterministic)

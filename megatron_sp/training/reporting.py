"""What a run reports besides the log line (training/logger.py writes them): Weights & Biases
(--wandb-project; optional package, works offline), a torch profiler trace (--profile), device
memory (--log-memory-to-tensorboard) and the step-level extras the log line and TensorBoard show
(--log-params-norm, --log-num-zeros-in-grad, timers)."""

from __future__ import annotations

import os


class WandbWriter:
    """wandb.init once on the first rank; `log(values, step)`. Without network (or with
    WANDB_MODE=offline) wandb writes its offline run under the save dir, to sync later."""

    def __init__(self, args):
        import wandb

        save_dir = args.wandb_save_dir or os.path.join(args.save or ".", "wandb")
        os.makedirs(save_dir, exist_ok=True)
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        config = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}
        self.run = wandb.init(
            project=args.wandb_project,
            name=args.wandb_exp_name,
            entity=args.wandb_entity,
            dir=save_dir,
            config=config,
            mode=mode,
        )

    def log(self, values: dict, step: int) -> None:
        self.run.log({k: v for k, v in values.items() if v is not None}, step=step)

    def close(self) -> None:
        self.run.finish()


class StepProfiler:
    """torch.profiler over training steps [--profile-step-start, --profile-step-end) on the ranks of
    --profile-ranks; the Chrome trace goes to --profile-dir (one file per rank)."""

    def __init__(self, args, rank: int):
        self.enabled = args.profile and (not args.profile_ranks or rank in args.profile_ranks)  # [] is all ranks
        self.start, self.end, self.rank = args.profile_step_start, args.profile_step_end, rank
        base = args.tensorboard_dir or args.save or "."
        self.dir = args.profile_dir or os.path.join(base, "profile")
        self._prof, self.trace = None, None

    def before_step(self, iteration: int) -> None:
        """iteration: the step about to run (1-based)."""
        if self.enabled and iteration == self.start + 1 and self._prof is None:
            import torch.profiler as tp

            activities = [tp.ProfilerActivity.CPU]
            if _cuda():
                activities.append(tp.ProfilerActivity.CUDA)
            self._prof = tp.profile(activities=activities, record_shapes=True)
            self._prof.__enter__()

    def after_step(self, iteration: int) -> None:
        if self._prof is not None and iteration >= self.end:
            self.stop()

    def stop(self) -> None:
        if self._prof is None:
            return
        self._prof.__exit__(None, None, None)
        os.makedirs(self.dir, exist_ok=True)
        self.trace = os.path.join(self.dir, f"trace_rank{self.rank}_steps{self.start}-{self.end}.json")
        self._prof.export_chrome_trace(self.trace)
        self._prof = None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def memory_stats(device: str) -> dict:
    """Megatron's mem-* scalars on CUDA; this process's resident set size on CPU."""
    import torch

    if device == "cuda":
        stats = torch.cuda.memory_stats()
        return {
            "mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
            "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
            "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
            "mem-allocated-count": stats.get("allocation.all.current", 0),
        }
    import resource

    return {"mem-max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

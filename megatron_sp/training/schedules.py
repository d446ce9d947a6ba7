"""Learning-rate schedule: linear warmup from `init` (--lr-warmup-init, default 0), then constant /
linear / cosine decay to min_lr (Megatron's OptimizerParamScheduler without the weight-decay
schedule). Its unit is an iteration, or a sample with --train-samples (the trainer passes the
samples seen once the step is done), so the
warmup/decay spans are --lr-warmup-iters/--lr-decay-iters or --lr-warmup-samples/--lr-decay-samples."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LRSchedule:
    lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: str = "cosine"  # constant | linear | cosine
    init: float = 0.0  # the LR warmup starts here

    def __post_init__(self):
        if self.style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown lr decay style {self.style!r}; use constant, linear or cosine.")

    def at(self, iteration: int) -> float:
        """Learning rate for the step that ends at `iteration` units (1-based iterations, or samples)."""
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return self.init + (self.lr - self.init) * iteration / self.warmup_iters
        if self.style == "constant":
            return self.lr
        span = max(1, self.decay_iters - self.warmup_iters)
        progress = min(1.0, (iteration - self.warmup_iters) / span)
        if self.style == "linear":
            coeff = 1.0 - progress
        else:
            coeff = 0.5 * (math.cos(math.pi * progress) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def apply(self, optimizer, iteration: int, decoupled: "LRSchedule | None" = None) -> float:
        """Sets every group's LR; a group marked "decoupled" (--decoupled-lr) follows `decoupled`."""
        lr = self.at(iteration)
        for group in optimizer.param_groups:
            group["lr"] = decoupled.at(iteration) if decoupled is not None and group.get("decoupled") else lr
        return lr

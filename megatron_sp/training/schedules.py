"""Learning-rate and weight-decay schedules with the meaning of Megatron-LM's OptimizerParamScheduler.

The unit is a *sample* of a successful update, always (Megatron's: --train-iters' spans are
iterations × --global-batch-size). `ParamScheduler.num_steps` counts the samples of the updates done so
far; the update about to run uses the rates at that count, so the first update runs at
--lr-warmup-init (default 0) and an fp16 step skipped for an overflow does not advance the schedule.

    LRSchedule   lr(num_steps)   linear warmup from `init` over `warmup` samples (a float: a
                                 --lr-warmup-fraction stays fractional), then constant / linear / cosine /
                                 inverse-square-root / WSD (warmup-stable-decay) to min_lr at `decay`
    WDSchedule   wd(num_steps)   --start-weight-decay to --end-weight-decay over `incr` samples
                                 (constant / linear / cosine)
    ParamScheduler               the run's state: num_steps, the rates written into the optimizer's
                                 groups (a "decoupled" group has its own lr/min_lr, a group's
                                 weight decay is wd × its "wd_mult"), and the checkpoint entry with
                                 Megatron's keys and resume rules (--use-checkpoint-opt_param-scheduler,
                                 --override-opt_param-scheduler)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

LR_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_STYLES = ("constant", "linear", "cosine")


@dataclass
class LRSchedule:
    lr: float  # the peak (Megatron's max_lr)
    min_lr: float
    warmup: float  # samples
    decay: int  # samples; past it: min_lr
    style: str = "linear"
    init: float = 0.0  # --lr-warmup-init: the warmup starts here
    wsd_decay: Optional[int] = None  # WSD: the final samples that anneal
    wsd_style: str = "exponential"

    def __post_init__(self):
        if self.style not in LR_STYLES:
            raise ValueError(f"unknown lr decay style {self.style!r}; use one of {', '.join(LR_STYLES)}.")
        if self.style == "WSD" and self.wsd_decay is None:
            raise ValueError("the WSD decay style needs its annealing span (--lr-wsd-decay-iters/-samples).")

    def at(self, num_steps: float, lr: Optional[float] = None, min_lr: Optional[float] = None) -> float:
        """The rate after num_steps samples of updates; lr/min_lr: a group's own (--decoupled-lr)."""
        lr = self.lr if lr is None else lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup > 0 and num_steps <= self.warmup:
            return self.init + (lr - self.init) * float(num_steps) / float(self.warmup)
        if self.style == "constant":
            return lr
        if num_steps > self.decay:
            return min_lr
        if self.style == "inverse-square-root":
            return max(min_lr, lr * max(self.warmup, 1) ** 0.5 / max(num_steps, 1) ** 0.5)
        ratio = float(num_steps - self.warmup) / float(self.decay - self.warmup)
        return min_lr + self._coeff(num_steps, ratio) * (lr - min_lr)

    def _coeff(self, num_steps: float, ratio: float) -> float:
        if self.style == "linear":
            return 1.0 - ratio
        if self.style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        anneal_start = self.decay - self.wsd_decay  # WSD: stable, then anneal over the last wsd_decay
        if num_steps <= anneal_start:
            return 1.0
        r = float(num_steps - anneal_start) / float(self.wsd_decay)
        return {
            "linear": lambda: 1.0 - r,
            "cosine": lambda: 0.5 * (math.cos(math.pi * r) + 1.0),
            "exponential": lambda: 2.0 * math.pow(0.5, r) - 1.0,
            "minus_sqrt": lambda: 1.0 - math.sqrt(r),
        }[self.wsd_style]()


@dataclass
class WDSchedule:
    start: float
    end: float
    incr: int  # samples (the whole run's)
    style: str = "constant"

    def at(self, num_steps: float) -> float:
        if num_steps > self.incr or self.style == "constant":
            return self.end
        ratio = float(num_steps) / float(self.incr)
        coeff = ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start + coeff * (self.end - self.start)


# (state_dict key, attribute path, what Megatron calls it in its messages, the flag that sets it)
_CHECKED = (
    ("max_lr", ("lr", "lr"), "learning rate", "--lr"),
    ("min_lr", ("lr", "min_lr"), "minimum learning rate", "--min-lr"),
    ("lr_warmup_steps", ("lr", "warmup"), "warmup samples", "--lr-warmup-*"),
    ("lr_decay_steps", ("lr", "decay"), "decay samples", "--lr-decay-iters/--lr-decay-samples"),
    ("lr_decay_style", ("lr", "style"), "learning rate decay style", "--lr-decay-style"),
    ("start_wd", ("wd", "start"), "start weight decay", "--start-weight-decay"),
    ("end_wd", ("wd", "end"), "end weight decay", "--end-weight-decay"),
    ("wd_incr_steps", ("wd", "incr"), "weight decay samples", "--train-iters/--train-samples"),
    ("wd_incr_style", ("wd", "style"), "weight decay incr style", "--weight-decay-incr-style"),
)


@dataclass
class ParamScheduler:
    """The run's schedule state; a checkpoint entry (JSON, checkpointing/checkpointer.py's "rest")."""

    lr: LRSchedule
    wd: WDSchedule
    decoupled: Optional[tuple] = None  # (lr, min_lr) of the groups marked "decoupled"
    use_checkpoint: bool = False  # --use-checkpoint-opt_param-scheduler
    override: bool = False  # --override-opt_param-scheduler
    num_steps: float = 0
    log: object = field(default=print, repr=False)
    label = "learning-rate schedule"

    def group_lr(self, group: dict) -> float:
        if group.get("decoupled") and self.decoupled is not None:
            return self.lr.at(self.num_steps, *self.decoupled)
        return self.lr.at(self.num_steps)

    def current(self) -> tuple:
        """(lr, decoupled lr or None) for the next update: what the log line shows, as Megatron's does."""
        return self.lr.at(self.num_steps), (self.lr.at(self.num_steps, *self.decoupled) if self.decoupled else None)

    def apply(self, optimizer) -> None:
        """Writes the rates for the next update into every group (Megatron's step(0))."""
        wd = self.wd.at(self.num_steps)
        for group in optimizer.param_groups:
            group["lr"] = self.group_lr(group)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def step(self, increment: int, optimizer) -> None:
        """After a successful update of `increment` samples (the global batch)."""
        self.num_steps += increment
        self.apply(optimizer)

    def state_dict(self) -> dict:
        out = {key: getattr(getattr(self, part), attr) for key, (part, attr), _, _ in _CHECKED}
        return {**out, "num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        """Megatron's rules: --override-opt_param-scheduler keeps the command line's values,
        --use-checkpoint-opt_param-scheduler takes the checkpoint's; the samples done always come from
        the checkpoint. With neither flag Megatron-LM refuses a checkpoint whose values differ (an
        assertion); here the command line's are kept, as with --override-opt_param-scheduler, and one line
        says which differ (so extending --train-iters on resume works as it always did here)."""
        for key, (part, attr), name, flag in _CHECKED:
            if key not in state:  # (a checkpoint of an older megatron_sp: the command line's)
                continue
            mine, theirs = getattr(getattr(self, part), attr), state[key]
            if self.override or mine == theirs:
                continue
            if self.use_checkpoint:
                self.log(f" > using checkpoint value {theirs} for {name}")
                setattr(getattr(self, part), attr, theirs)
            else:
                self.log(
                    f" > the checkpoint's {name} is {theirs}, the command line's ({flag}) {mine}: using "
                    f"{mine} (Megatron-LM would refuse; --use-checkpoint-opt_param-scheduler takes the checkpoint's)"
                )
        self.num_steps = state["num_steps"]

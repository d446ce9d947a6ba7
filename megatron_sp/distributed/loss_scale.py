"""Loss scaling for fp16 (and a static scale on request), as Megatron-LM's grad_scaler.py.

The loss is multiplied by the scale before the backward, so that small fp16 gradients do not round to
zero; the optimizer divides the fp32 main gradients by it again (`unscale_and_check`). A step whose
gradients overflowed on any rank is skipped on every rank.

    ConstantLossScaler   --loss-scale S: always S
    DynamicLossScaler    fp16 without --loss-scale (Megatron's defaults): start at --initial-loss-scale
                         2^32; after --hysteresis (2) overflowing steps halve, never below
                         --min-loss-scale (1); double after --loss-scale-window (1000) clean steps in a
                         row, which also restores the hysteresis

Underflow is the opposite failure, which Megatron does not catch: with a scale too small (a tiny
--initial-loss-scale) every fp16 gradient rounds to zero and AdamW would "train" on zeros without any
error. A step whose unscaled gradient norm is exactly 0 is skipped and the scale multiplied by
`underflow_growth`; if gradients are still all zero at `max_scale`, `update` says "no_gradient" and the
caller stops the run (the model then produces no gradient at any usable scale). A scale below
`min_scale` only shrinks gradients (some still round to zero), so clean steps raise it by
`underflow_growth` too until it reaches `min_scale`; above it the usual rules apply.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_sp.parallel_state import collective_device


def _check_scale(value: float, what: str) -> float:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"the {what} loss scale must be positive and finite, got {value}.")
    return float(value)


class ConstantLossScaler:
    """A static scale (--loss-scale): unscale, skip overflowing steps, never change."""

    def __init__(self, scale: float):
        self.scale = _check_scale(scale, "static")

    def unscale_and_check(self, params) -> bool:
        """Divides the gradients by the scale; True when every rank's gradients are finite."""
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)
        bad = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else collective_device())
        for g in grads:
            bad += (~torch.isfinite(g)).any().float()
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        finite = bad.item() == 0
        if not finite:
            self.overflow()
        return finite

    def overflow(self) -> None:
        pass

    def update(self, grad_norm: float) -> str:
        return "ok"

    def state_dict(self):
        return {"scale": self.scale}

    def load_state_dict(self, state):
        pass  # the command line's scale holds


class DynamicLossScaler(ConstantLossScaler):
    """Megatron's dynamic scaler plus the underflow rule (see the module docstring)."""

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        underflow_growth: float = 2.0**8,
        max_scale: float = 2.0**32,
    ):
        self.scale = _check_scale(initial_scale, "initial")
        self.growth_interval, self.min_scale, self.hysteresis = int(growth_interval), min_scale, int(hysteresis)
        self.underflow_growth, self.max_scale = underflow_growth, max(max_scale, self.scale)
        self._clean_steps, self._hysteresis_left = 0, self.hysteresis

    def overflow(self) -> None:
        """An overflowing step: the hysteresis-th in a row (since the last growth) halves the scale."""
        self._clean_steps = 0
        self._hysteresis_left -= 1
        if self._hysteresis_left <= 0:
            self.scale = max(self.scale / 2.0, self.min_scale)

    def update(self, grad_norm: float) -> str:
        """After a finite step: "ok" (apply it), "underflow" (all gradients zero: skip it, the scale
        was raised) or "no_gradient" (still all zero at max_scale: stop)."""
        if grad_norm == 0.0:
            self._clean_steps = 0
            if self.scale >= self.max_scale:
                return "no_gradient"
            self.scale = min(self.scale * self.underflow_growth, self.max_scale)
            return "underflow"
        self._clean_steps += 1
        if self.scale < self.min_scale:
            self.scale = min(self.scale * self.underflow_growth, self.min_scale)
        elif self._clean_steps % self.growth_interval == 0:
            self.scale *= 2.0
            self._hysteresis_left = self.hysteresis
        return "ok"

    def state_dict(self):
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state):
        self.scale, self._clean_steps = state["scale"], state.get("clean_steps", 0)
        self._hysteresis_left = state.get("hysteresis_left", self.hysteresis)  # (older checkpoints)


class SkippedSteps:
    """Steps skipped in a row and in all (fp16 overflow or underflow). Megatron-LM keeps skipping and
    exits 0 without a word when nothing trained; the run still goes on (Megatron's meaning), but
    `count` returns a warning each time `window` (--loss-scale-window) steps in a row were skipped,
    and `summary` one for the end of the run."""

    def __init__(self, window: int):
        self.window, self.in_a_row, self.total, self.steps = max(1, int(window)), 0, 0, 0

    def count(self, skipped: bool, iteration: int, scale: float) -> str | None:
        self.steps += 1
        self.total += bool(skipped)
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if not self.in_a_row or self.in_a_row % self.window:
            return None
        return (
            f"the last {self.in_a_row} steps (to iteration {iteration}) were all skipped: the fp16 gradients "
            f"overflowed or underflowed in each (loss scale now {scale:.3g}), so the weights have not "
            "changed; check the learning rate, the data and --loss-scale / --initial-loss-scale (training goes on)."
        )

    def summary(self) -> str | None:
        if not self.total:
            return None
        if self.total == self.steps:
            return (
                f"every one of this run's {self.steps} steps was skipped (fp16 overflow or underflow): nothing trained."
            )
        return None


def build_loss_scaler(args):
    """The run's scaler: --loss-scale (fp16/bf16), dynamic for fp16, none otherwise."""
    if getattr(args, "loss_scale", None) is not None:
        return ConstantLossScaler(args.loss_scale)
    if not args.fp16:
        return None
    return DynamicLossScaler(args.initial_loss_scale, int(args.loss_scale_window), args.min_loss_scale, args.hysteresis)

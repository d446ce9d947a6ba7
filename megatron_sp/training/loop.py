"""One training step (gradient accumulation over micro-batches, grad sync, clipping, AdamW) and the
evaluation pass. Everything here is per-rank code between collectives; see pretrain.py for set-up.

Precision is the model's own (Megatron's --bf16 / --fp16: bf16/fp16 parameters and activations, no
autocast); the gradients accumulate in the optimizer's fp32 gradient buffers and it steps fp32 main
weights (distributed/optimizer.py)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from megatron_sp.distributed.grad_sync import OverlappedGradSync
from megatron_sp.distributed.loss_scale import DynamicLossScaler
from megatron_sp.distributed.optimizer import clip_grads
from megatron_sp.parallel_state import ParallelState
from megatron_sp.training import moe_metrics, pipeline_step


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm became NaN/inf."""


class GradientUnderflowError(RuntimeError):
    """fp16 gradients stay exactly zero even at the largest loss scale."""


@dataclass
class StepResult:
    loss: float  # mean micro-batch loss over the global batch
    grad_norm: float  # before clipping
    skipped: bool  # fp16 overflow or underflow: no update this step
    underflow: bool = False  # fp16: every gradient was zero (the loss scale was raised)
    timers: dict = field(default_factory=dict)  # seconds: forward-backward, grads-all-reduce, optimizer
    moe: dict = field(default_factory=dict)  # the MoE auxiliary losses (training/moe_metrics.py)


def to_device(batch: dict, device: str) -> dict:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def forward_loss(model, batch: dict) -> torch.Tensor:
    return model(
        batch["tokens"],
        batch["labels"],
        loss_mask=batch.get("loss_mask"),
        position_ids=batch.get("position_ids"),
        attention_mask=batch.get("attention_mask"),
        sample_ids=batch.get("sample_ids"),
    )


def mean_over_data_parallel(values, ps: ParallelState, device) -> float:
    """Mean of this rank's micro-batch losses and those of the other DP ranks (each counted once)."""
    total = torch.stack([v.float() for v in values]).sum().reshape(1).to(device)
    if ps.dp_size > 1:
        dist.all_reduce(total, group=ps.dp_group)
    return total.item() / (len(values) * ps.dp_size)


def token_count(batch: dict) -> torch.Tensor:
    """The tokens a micro-batch's loss averages over (its loss mask's sum; all of them without one)."""
    mask = batch.get("loss_mask")
    return (mask.sum() if mask is not None else torch.tensor(batch["labels"].numel())).float()


def sum_over_data_parallel(values, ps: ParallelState, device) -> float:
    total = torch.stack([v.float().to(device) for v in values]).sum().reshape(1)
    if ps.dp_size > 1:
        dist.all_reduce(total, group=ps.dp_group)
    return total.item()


class _Stopwatch:
    """Wall-clock seconds per phase of a step (synchronised on CUDA so a phase holds its kernels)."""

    def __init__(self, device: str):
        self.device, self.times, self._last = device, {}, time.perf_counter()

    def lap(self, name: str) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.times[name], self._last = now - self._last, now


def _accumulate(model, data_iter, num_micro_batches, device, scale, grad_sync, per_token, buffers=None):
    """Forward and backward of every micro-batch; returns (losses, token counts). Per-token loss:
    each backward is of the micro-batch's loss *sum* (rescaled by the global token count later).
    buffers: the optimizer's gradient buffers (None under FSDP2)."""
    if pipeline_step.is_pipeline(model):
        pipeline_step.hook_schedule(model, buffers, grad_sync)
        return _accumulate_pipeline(model, data_iter, num_micro_batches, device, scale, per_token)
    losses, counts = [], []
    for micro in range(num_micro_batches):
        if grad_sync is not None and micro == num_micro_batches - 1:
            grad_sync.arm()  # DP all-reduces start during this backward
        batch = to_device(next(data_iter), device)
        loss = forward_loss(model, batch)
        count = token_count(batch).to(loss.device)
        weight = count if per_token else 1.0 / num_micro_batches
        (loss * (scale * weight)).backward()
        losses.append(loss.detach() * count if per_token else loss.detach())
        counts.append(count)
    return losses, counts


def _accumulate_pipeline(model, data_iter, num_micro_batches, device, scale, per_token):
    """_accumulate under pipeline parallelism: one schedule run (training/pipeline_step.py)."""
    micro, whole = pipeline_step.read_global_batch(data_iter, num_micro_batches, device, to_device)
    values = pipeline_step.run_schedule(model, whole, num_micro_batches, scale=scale, per_token=per_token)
    counts = [token_count(b).to(values.device) for b in micro]
    return [v * c if per_token else v for v, c in zip(values, counts)], counts


def train_step(
    model,
    optimizer,
    data_iter,
    num_micro_batches: int,
    ps: ParallelState,
    *,
    device: str,
    clip_grad: float,
    iteration: int,
    scaler: Optional[DynamicLossScaler] = None,
    grad_sync: Optional[OverlappedGradSync] = None,
    per_token_loss: bool = False,
    empty_cache: bool = False,
    moe_per_layer: bool = False,
) -> StepResult:
    """Accumulates gradients over the micro-batches (into optimizer.grad_buffers), syncs them, clips
    and steps. scaler: a distributed/loss_scale.py scaler (fp16, --loss-scale), or None.
    per_token_loss (--calculate-per-token-loss): the loss is the global batch's token sum divided by
    its token count (over micro-batches and DP ranks), not the mean of the micro-batch means.
    empty_cache (--empty-unused-memory-level 2): empty the CUDA cache after the backward."""
    optimizer.zero_grad(set_to_none=True)
    moe_metrics.start_step(model)
    watch = _Stopwatch(device)
    scale = scaler.scale if scaler is not None else 1.0
    losses, counts = _accumulate(
        model, data_iter, num_micro_batches, device, scale, grad_sync, per_token_loss, optimizer.grad_buffers
    )
    if per_token_loss:
        tokens = max(sum_over_data_parallel(counts, ps, device), 1.0)
        loss_value = sum_over_data_parallel(losses, ps, device) / tokens
    else:
        loss_value = mean_over_data_parallel(losses, ps, device)
    watch.lap("forward-backward")
    if empty_cache and device == "cuda":
        torch.cuda.empty_cache()
    if not math.isfinite(loss_value):
        raise NonFiniteError(
            f"the training loss is {loss_value} at iteration {iteration}; lower --lr, "
            f"check the data, or use --bf16 instead of --fp16."
        )
    partition = optimizer.partition  # who holds which gradients (the norms read it)
    optimizer.finalize_grads(model, ps, grad_sync)
    params = optimizer.prepare_grads()  # fp32 main weights with their gradients (only the owned ones)
    if per_token_loss and params:  # the DP average divided by dp size; the loss wants the token count
        torch._foreach_mul_([p.grad for p in params], ps.dp_size / tokens)
    watch.lap("grads-all-reduce")
    result = _update(optimizer, params, scaler, clip_grad, ps, partition, loss_value, iteration)
    result.moe = moe_metrics.finish_step(model, ps, moe_per_layer)
    watch.lap("optimizer")
    result.timers = watch.times
    return result


def _update(optimizer, params, scaler, clip_grad, ps, partition, loss_value, iteration) -> StepResult:
    """fp16 checks, clipping and the optimizer step (or the reason to skip it)."""
    if scaler is not None and not scaler.unscale_and_check(params):
        return StepResult(loss_value, float("nan"), skipped=True)
    grad_norm = clip_grads(params, clip_grad, ps, partition)
    verdict = scaler.update(grad_norm) if scaler is not None and math.isfinite(grad_norm) else "ok"
    if verdict == "no_gradient":  # the same on every rank: the norm is global
        raise GradientUnderflowError(
            f"the fp16 gradients are all zero at iteration {iteration} even at loss scale {scaler.scale:.3g}; "
            f"use --bf16, or check that the loss reaches the parameters (--eod-mask-loss on all-EOD data?)."
        )
    if verdict == "underflow":
        return StepResult(loss_value, grad_norm, skipped=True, underflow=True)
    if not math.isfinite(grad_norm):
        raise NonFiniteError(
            f"the gradient norm is {grad_norm} at iteration {iteration}; lower --lr or enable --clip-grad."
        )
    optimizer.step()
    return StepResult(loss_value, grad_norm, skipped=False)


@torch.no_grad()
def evaluate(
    model, data_iter, iters: int, num_micro_batches: int, ps: ParallelState, *, device: str, per_token_loss=False
) -> float:
    """Mean loss over `iters` global batches of the validation split (per token: over their tokens)."""
    model.eval()
    losses, counts = [], []
    try:
        if pipeline_step.is_pipeline(model):
            return _evaluate_pipeline(model, data_iter, iters, num_micro_batches, ps, device, per_token_loss)
        for _ in range(iters * num_micro_batches):
            batch = to_device(next(data_iter), device)
            loss = forward_loss(model, batch)
            count = token_count(batch).to(loss.device)
            losses.append(loss * count if per_token_loss else loss)
            counts.append(count)
    finally:
        model.train()
    if per_token_loss:
        return sum_over_data_parallel(losses, ps, device) / max(sum_over_data_parallel(counts, ps, device), 1.0)
    return mean_over_data_parallel(losses, ps, device)


def _evaluate_pipeline(model, data_iter, iters, num_micro_batches, ps, device, per_token_loss) -> float:
    """evaluate under pipeline parallelism: the schedule's forward-only pass per global batch."""
    losses, counts = [], []
    for _ in range(iters):
        micro, whole = pipeline_step.read_global_batch(data_iter, num_micro_batches, device, to_device)
        values = pipeline_step.run_schedule(model, whole, num_micro_batches, forward_only=True)
        batch_counts = [token_count(b).to(values.device) for b in micro]
        losses += [v * c if per_token_loss else v for v, c in zip(values, batch_counts)]
        counts += batch_counts
    if per_token_loss:
        return sum_over_data_parallel(losses, ps, device) / max(sum_over_data_parallel(counts, ps, device), 1.0)
    return mean_over_data_parallel(losses, ps, device)

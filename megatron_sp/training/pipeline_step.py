"""The training loop's micro-batches under pipeline parallelism: one schedule run per global batch.

Every rank of a pipeline reads the same micro-batches from its own data iterator (the data depend on
the DP rank only), concatenates them and hands the whole batch to PipelineGPT.step, whose schedule
(torch.distributed.pipelining) splits it again, runs the stages and returns the last stage's
micro-batch losses on every rank. The gradients land in the gradient buffers (param.main_grad) through
their hooks; a zero-bubble schedule's deferred weight gradients, which it writes into `.grad`, are
moved there afterwards. Then the tied embedding's copies are summed over the embedding group, before
the DP reduction. With --overlap-grad-reduce the DP buckets are armed just before the rank's final
backward (PipelineGPT.before_last_backward; 1F1B, GPipe and interleaved 1F1B), the tied embedding's
bucket waiting for finish() (after its copies' sum); zero-bubble schedules reduce after the schedule.
"""

from __future__ import annotations

import torch

from megatron_sp.pipeline_parallel.model import BATCH_KEYS


def is_pipeline(model) -> bool:
    return hasattr(model, "step") and hasattr(model, "finalize_embedding_grads")


def read_global_batch(data_iter, num_micro_batches, device, to_device):
    """The next num_micro_batches micro-batches, each as read, and concatenated into one batch."""
    micro = [to_device(next(data_iter), device) for _ in range(num_micro_batches)]
    whole = {k: torch.cat([b[k] for b in micro]) for k in BATCH_KEYS if micro[0].get(k) is not None}
    return micro, whole


def run_schedule(model, whole, num_micro_batches, *, scale=1.0, per_token=False, forward_only=False):
    """The micro-batch losses [m] of one schedule run (on every rank of the pipeline)."""
    return model.step(
        whole["tokens"],
        whole["labels"],
        num_microbatches=num_micro_batches,
        loss_mask=whole.get("loss_mask"),
        position_ids=whole.get("position_ids"),
        attention_mask=whole.get("attention_mask"),
        sample_ids=whole.get("sample_ids"),
        scale=scale,
        per_token=per_token,
        forward_only=forward_only,
    )


@torch.no_grad()
def collect_grads(model) -> None:
    """Gradients left in `.grad` (zero-bubble weight passes) into main_grad; then the tied copies summed."""
    for p in model.parameters():
        if p.grad is not None and getattr(p, "main_grad", None) is not None:
            p.main_grad.add_(p.grad)
            p.grad = None
    model.finalize_embedding_grads(grad=lambda p: p.main_grad)

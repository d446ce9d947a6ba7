"""The training loop's micro-batches under pipeline parallelism: one schedule run per global batch.

Every rank of a pipeline reads the same micro-batches from its own data iterator (the data depend on
the DP rank only), concatenates them and hands the whole batch to PipelineGPT.step, whose schedule
(torch.distributed.pipelining) splits it again, runs the stages and returns the last stage's
micro-batch losses on every rank. The gradients land in the gradient buffers (param.main_grad) through
their hooks; a zero-bubble schedule's deferred weight gradients, which it writes into `.grad`, are
moved there right after each weight pass. With --overlap-grad-reduce each stage arms its parameters
just before its final backward of the step (its last weight pass under a zero-bubble schedule;
PipelineGPT.before_last_backward), so a bucket's DP reduction starts once all its parameters are
complete, whichever chunks hold them; the tied embedding's bucket waits for finish(), after its
copies' sum over the embedding group (distributed/grad_sync.py finalize_model_grads).
"""

from __future__ import annotations

from functools import partial

import torch

from megatron_sp.pipeline_parallel.model import BATCH_KEYS, PipelinedModel


def is_pipeline(model) -> bool:
    """Whether a pipeline schedule runs the model (its contract: pipeline_parallel.model.PipelinedModel)."""
    return isinstance(model, PipelinedModel)


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


def hook_schedule(model, buffers, grad_sync) -> None:
    """Connects the schedule's backward to the gradient buffers and the overlapped DP sync (none under
    FSDP2, which owns the gradients): a zero-bubble weight pass's `.grad` goes into the buffers at once,
    and each stage arms its parameters just before its final backward."""
    model.before_last_backward = grad_sync.arm if grad_sync is not None else None
    model.after_weight_backward = partial(_into_buffers, buffers) if buffers is not None else None


@torch.no_grad()
def _into_buffers(buffers, params) -> None:
    for p in params:
        if p.grad is not None:
            buffers.accumulate(p)

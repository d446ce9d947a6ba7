"""Gradient synchronisation after the backward of the last micro-batch.

1. SP-region parameters (LayerNorms, row-parallel biases, positions under SP): their gradients are
   partial sums over the sequence shards, summed over the TP group (GPTModel does it).
2. Data parallelism: every gradient is averaged over the DP group, in flat buckets so that a few
   large all-reduces replace one per parameter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.parallel_state import ParallelState

BUCKET_BYTES = 25 * 1024 * 1024


def _buckets(grads, bucket_bytes):
    bucket, size = [], 0
    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def all_reduce_data_parallel_grads(params, ps: ParallelState, bucket_bytes: int = BUCKET_BYTES):
    """Averages gradients over the DP group (bucketed, one all-reduce per dtype bucket)."""
    if ps.dp_size == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same_dtype in by_dtype.values():
        for bucket in _buckets(same_dtype, bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=ps.dp_group)
            flat.div_(ps.dp_size)
            torch._foreach_copy_(bucket, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in bucket]), bucket)])


def finalize_model_grads(model, ps: ParallelState):
    """Everything between backward and the optimizer step, except clipping."""
    model.reduce_sequence_parallel_grads()
    all_reduce_data_parallel_grads(list(model.parameters()), ps)

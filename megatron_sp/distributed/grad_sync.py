"""Gradient synchronisation between the backward passes and the optimizer step, in place on the
gradient buffers (distributed/grad_buffers.py: each parameter's `main_grad` is a view of its bucket).

1. Data and context parallelism: every gradient is averaged over the DP group and summed over the CP
   group (each CP rank saw its part of every sequence; the loss is the whole sequence's mean): one
   all-reduce per bucket buffer over its parameters' replica group (DP×CP; a bucket holds one group's
   parameters), and the buffer *is* the gradients, so nothing is copied in or out. With
   `OverlappedGradSync` a bucket's all-reduce starts during the last micro-batch's backward as soon
   as all its gradients are in, and runs while autograd computes the gradients of earlier layers.
2. Partial gradients over the TP group: SP-region parameters and key/value heads held in copies,
   summed by the model's `partial_grads` (tensor_parallel/partial_grads.py) on the main_grads.
The sums act on different groups and commute; the DP×CP one goes first because the overlapped
buckets start it during the backward.

With the distributed optimizer's `partition` (distributed/distributed_optimizer.py) a bucket holds one
owner's parameters and is reduced to that owner instead of all-reduced; the other replicas leave
those gradients alone (nothing reads them before the next step zeroes the buffers).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.distributed.grad_buffers import GradBuffers
from megatron_sp.models.trainable import TrainableModel
from megatron_sp.parallel_state import ParallelState


def _replicated(bucket, ps) -> bool:
    """Whether the bucket's parameters have replicas to sum over (their replica group, DP×CP for dense ones)."""
    return ps.size(bucket.role) > 1


def _start(bucket, ps, partition=None, async_op=False):
    """The bucket's sum over its replica group, in place: all-reduced, or reduced to its owner."""
    group = ps.group(bucket.role)
    if partition is None:
        return dist.all_reduce(bucket.buffer, group=group, async_op=async_op)
    dst = partition.global_rank(bucket.owner, bucket.role)
    return dist.reduce(bucket.buffer, dst=dst, group=group, async_op=async_op)


def _finish(bucket, ps, partition=None):
    """DP replicas average (CP parts add up; the global batch is dp_size ranks' samples whatever the
    group); a bucket another replica owns holds no final value."""
    if partition is None or bucket.owner == partition.shares[bucket.role].rank:
        bucket.buffer.div_(ps.dp_size)


def reduce_data_parallel_grads(buffers: GradBuffers, ps: ParallelState, partition=None):
    """Averages the gradients over DP (and sums over CP) after the backward: one all-reduce, or one
    reduce to the owner, per bucket."""
    for bucket in buffers.buckets:
        if _replicated(bucket, ps):
            _start(bucket, ps, partition)
            _finish(bucket, ps, partition)
    _mean_of_unreplicated(buffers, ps)


def _mean_of_unreplicated(buffers: GradBuffers, ps: ParallelState) -> None:
    """Buckets with no replicas but DP > 1 (experts whose EP group spans the DP ranks: each already
    holds the sum over them) still take the DP mean."""
    if ps.dp_size > 1:
        for bucket in buffers.buckets:
            if not _replicated(bucket, ps):
                bucket.buffer.div_(ps.dp_size)


class OverlappedGradSync:
    """DP gradient averaging overlapped with the last micro-batch's backward.

    `arm()` before the last micro-batch's backward (under pipeline parallelism `arm(params)` before
    each stage's final backward, with the parameters it completes); once every parameter of a bucket
    has its final gradient in the buffer (the buffers tell this object, see GradBuffers.listeners) the
    bucket's asynchronous all-reduce starts; `finish()` starts what is left (parameters that got no
    gradient) and waits.
    """

    def __init__(self, buffers: GradBuffers, ps: ParallelState, partition=None):
        self.buffers, self.ps, self.partition = buffers, ps, partition
        buffers.listeners.append(self._on_grad_ready)
        self._reset()

    def _reset(self):
        self.ready = [set() for _ in self.buffers.buckets]
        self.launched = {}
        self.armed, self.armed_params = False, set()

    def arm(self, params=None):
        """The next gradients of `params` (default: every parameter) are their last of the step."""
        if params is None:
            self.armed = True
        else:
            self.armed_params.update(id(p) for p in params)

    def _on_grad_ready(self, param):
        if not (self.armed or id(param) in self.armed_params):
            return
        if getattr(param, "waits_for_step_sums", False):
            return  # (a pipeline's tied embedding: its bucket waits for finish(), after the copies' sum)
        bucket = self.buffers.bucket_of[id(param)]
        if not _replicated(bucket, self.ps):
            return
        self.ready[bucket.index].add(id(param))
        if len(self.ready[bucket.index]) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket):
        self.launched[bucket.index] = (bucket, _start(bucket, self.ps, self.partition, async_op=True))

    def finish(self):
        for bucket in self.buffers.buckets:
            if bucket.index not in self.launched and _replicated(bucket, self.ps):
                self._launch(bucket)
        for bucket, handle in self.launched.values():
            handle.wait()
            _finish(bucket, self.ps, self.partition)
        _mean_of_unreplicated(self.buffers, self.ps)
        self._reset()

    def remove(self):
        self.buffers.listeners.remove(self._on_grad_ready)


def _main_grad(p):
    return p.main_grad


@torch.no_grad()
def finalize_model_grads(
    model: TrainableModel,
    ps: ParallelState,
    buffers: GradBuffers,
    overlapped: OverlappedGradSync | None = None,
    partition=None,
):
    """Everything between the last backward and the optimizer step, except clipping: under pipeline
    parallelism the tied embedding's copies summed, the DP average (summing over CP too), then the
    partial sums over TP (model.partial_grads), on the main_grads of the parameters this rank steps
    (all of them without a partition)."""
    model.finalize_embedding_grads(grad=_main_grad)  # (before finish(): the embedding's bucket waits)
    if overlapped is not None:
        overlapped.finish()
    else:
        reduce_data_parallel_grads(buffers, ps, partition)
    held = [p for p in buffers.params if partition is None or partition.mine(p)]
    model.partial_grads.reduce(held, cp_summed=True, grad=_main_grad)

"""Gradient synchronisation between the backward passes and the optimizer step.

1. Partial gradients over the TP group: SP-region parameters and key/value heads held in copies,
   summed by the model's `partial_grads` (tensor_parallel/partial_grads.py, which the model's
   full_grad_dict uses too).
2. Data and context parallelism: every gradient is averaged over the DP group and summed over the
   CP group (each CP rank saw its part of every sequence; the loss is the whole sequence's mean), in
   one all-reduce over the DP×CP group per flat bucket, so that a few large all-reduces replace one
   per parameter. With `OverlappedGradSync` a bucket's all-reduce starts during the last
   micro-batch's backward as soon as all its gradients are final, and runs while autograd computes
   the gradients of earlier layers.
The sums act on different groups and commute; the DP×CP one goes first because the overlapped
buckets captured the gradients before either sum.

With the distributed optimizer's `partition` (training/distributed_optimizer.py) a bucket holds
one owner's parameters and is reduced to that owner instead of all-reduced; the other replicas set
those gradients to None.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.parallel_state import ParallelState

BUCKET_BYTES = 25 * 1024 * 1024


def _buckets(tensors, bucket_bytes, owner=None):
    """Consecutive groups of same-dtype tensors of about bucket_bytes each (and of one owner)."""
    by_key = {}
    for t in tensors:
        by_key.setdefault((t.dtype, owner(t) if owner else None), []).append(t)
    for same in by_key.values():
        bucket, size = [], 0
        for t in same:
            bucket.append(t)
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket


def _replicas(ps) -> int:
    """Ranks holding the same shards: DP replicas × CP ranks."""
    return ps.dp_size * ps.cp_size


def _average_flat(params, ps, async_op=False, partition=None):
    """Sum over DP×CP (divided by the DP size in _scatter_back: CP parts add up, DP replicas
    average): all-reduced, or reduced to the parameters' owner with a partition."""
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    group = ps.dp_cp_group if ps.cp_size > 1 else ps.dp_group
    if partition is None:
        handle = dist.all_reduce(flat, group=group, async_op=async_op)
    else:
        dst = partition.global_rank(partition.owner(params[0]))
        handle = dist.reduce(flat, dst=dst, group=group, async_op=async_op)
    return flat, handle


def _scatter_back(flat, params, dp_size, partition=None):
    if partition is not None and not partition.mine(params[0]):
        for p in params:  # another replica owns (and steps) these parameters
            p.grad = None
        return
    flat.div_(dp_size)
    grads = [p.grad for p in params]
    torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in grads]), grads)])


def all_reduce_data_parallel_grads(params, ps: ParallelState, bucket_bytes: int = BUCKET_BYTES, partition=None):
    """Averages gradients over DP (and sums over CP) after the backward (one all-reduce, or one
    reduce to the owner, per bucket)."""
    if _replicas(ps) == 1:
        return
    owner = partition.owner if partition is not None else None
    for bucket in _buckets([p for p in params if p.grad is not None], bucket_bytes, owner):
        flat, _ = _average_flat(bucket, ps, partition=partition)
        _scatter_back(flat, bucket, ps.dp_size, partition)


class OverlappedGradSync:
    """DP gradient averaging overlapped with the last micro-batch's backward.

    Buckets follow the reverse order of parameter creation (roughly the order in which backward
    finishes them). `arm()` before the last micro-batch's backward; each parameter's
    post-accumulate-grad hook marks it final and launches its bucket's asynchronous all-reduce once
    the bucket is complete; `finish()` launches what is left (parameters that got no gradient),
    waits, averages and writes the results back into `.grad`.
    """

    def __init__(self, model, ps: ParallelState, bucket_bytes: int = BUCKET_BYTES, partition=None):
        self.ps, self.armed, self.partition = ps, False, partition
        params = [p for p in reversed(list(model.parameters())) if p.requires_grad]
        self.buckets = list(_buckets(params, bucket_bytes, partition.owner if partition is not None else None))
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self._reset()

    def _reset(self):
        self.ready = [set() for _ in self.buckets]
        self.launched = {}

    def arm(self):
        self.armed = True

    def _on_grad_ready(self, param):
        if not self.armed or _replicas(self.ps) == 1:
            return
        i = self.bucket_of[id(param)]
        self.ready[i].add(id(param))
        if len(self.ready[i]) == len(self.buckets[i]):
            self._launch(i)

    def _launch(self, i):
        params = [p for p in self.buckets[i] if p.grad is not None]
        if params:
            self.launched[i] = (params, *_average_flat(params, self.ps, async_op=True, partition=self.partition))

    def finish(self):
        if _replicas(self.ps) > 1:
            for i in range(len(self.buckets)):
                if i not in self.launched:
                    self._launch(i)
            for params, flat, handle in self.launched.values():
                handle.wait()
                _scatter_back(flat, params, self.ps.dp_size, self.partition)
        self.armed = False
        self._reset()

    def remove(self):
        for h in self._hooks:
            h.remove()


def finalize_model_grads(model, ps: ParallelState, overlapped: OverlappedGradSync | None = None, partition=None):
    """Everything between the last backward and the optimizer step, except clipping: the DP
    average (summing over CP too), then the partial sums over TP (model.partial_grads)."""
    if overlapped is not None:  # first: its buffers hold the gradients as backward left them
        overlapped.finish()
    else:
        all_reduce_data_parallel_grads(list(model.parameters()), ps, partition=partition)
    model.partial_grads.reduce(model.parameters(), cp_summed=True)

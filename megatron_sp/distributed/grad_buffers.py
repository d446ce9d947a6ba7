"""Megatron's param-and-grad buffer: every parameter's gradient accumulates into `param.main_grad`, a
view of one contiguous buffer per bucket, in fp32 whatever the parameter's dtype (bf16 with
--grad-reduce-in-bf16), and the data-parallel reduction runs on those buffers in place
(distributed/grad_sync.py): no gradient is copied into a flat tensor and back.

    bucket i    buffer [numel_i], one dtype        its parameters in backward order (reverse creation
                                                   order), about BUCKET_BYTES of gradients each, all
                                                   of one replica group (parallel_state.replica_role)
                                                   and of one owner with the distributed optimizer
    parameter   main_grad = buffer[offset : offset + numel].view(param.shape)

Accumulation: a post-accumulate-grad hook on each parameter adds the `.grad` autograd has just
produced (the parameter's dtype) into main_grad and frees it, so between backwards a parameter holds
no `.grad` and micro-batches sum in the buffer's dtype. Listeners (the overlapped DP sync) are told
once a parameter's gradient is in its buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_sp.parallel_state import REPLICAS, replica_role

BUCKET_BYTES = 25 * 1024 * 1024


@dataclass
class Bucket:
    """Consecutive parameters whose gradients share one buffer (one replica group, one owner)."""

    params: list
    buffer: torch.Tensor  # [sum of numels], the gradients' dtype
    owner: Optional[int] = None  # the replica that steps them (distributed optimizer), or None
    index: int = 0
    views: list = field(default_factory=list)  # params' main_grad, in order
    role: str = REPLICAS  # the parameters' replica role: the group the bucket is reduced over


def _groups(params, bucket_bytes: int, itemsize: int, owner):
    """Consecutive runs of params of one replica role and one owner, each about bucket_bytes of
    gradients: ((role, owner), run)."""
    by_owner = {}
    for p in params:
        by_owner.setdefault((replica_role(p), owner(p) if owner else None), []).append(p)
    for who, same in by_owner.items():
        run, size = [], 0
        for p in same:
            run.append(p)
            size += p.numel() * itemsize
            if size >= bucket_bytes:
                yield who, run
                run, size = [], 0
        if run:
            yield who, run


class GradBuffers:
    """The gradient buffers of `model`'s trainable parameters (see the module docstring).

    dtype: the buffers' dtype (fp32; bf16 for --grad-reduce-in-bf16); owner: the distributed
    optimizer's partition.owner, so that a bucket holds one replica's parameters.
    """

    def __init__(self, model, *, dtype=torch.float32, bucket_bytes: int = BUCKET_BYTES, owner: Callable = None):
        self.dtype = dtype
        params = [p for p in reversed(list(model.parameters())) if p.requires_grad]
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.buckets = []
        for (role, who), run in _groups(params, bucket_bytes, itemsize, owner):
            buffer = torch.zeros(sum(p.numel() for p in run), dtype=dtype, device=run[0].device)
            bucket = Bucket(run, buffer, who, len(self.buckets), role=role)
            offset = 0
            for p in run:
                p.main_grad = buffer[offset : offset + p.numel()].view(p.shape)
                bucket.views.append(p.main_grad)
                offset += p.numel()
            self.buckets.append(bucket)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.listeners: list[Callable] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self.accumulate) for p in params]

    @property
    def params(self) -> list:
        return [p for b in self.buckets for p in b.params]

    def accumulate(self, param) -> None:
        """param.grad into its main_grad, then the listeners told (autograd's hook; a pipeline's zero-
        bubble weight pass, which writes `.grad` directly, calls it for each parameter it left one)."""
        param.main_grad.add_(param.grad)
        param.grad = None
        for listener in self.listeners:
            listener(param)

    def zero(self) -> None:
        """Before the first micro-batch of a step."""
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def numel(self) -> int:
        return sum(b.buffer.numel() for b in self.buckets)

    def nbytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def remove(self) -> None:
        """Detaches the hooks (the model's backward then leaves `.grad` as plain autograd does)."""
        for hook in self._hooks:
            hook.remove()
        for p in self.params:
            del p.main_grad

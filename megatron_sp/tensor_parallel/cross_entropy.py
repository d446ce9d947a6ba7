"""Cross entropy over vocab-parallel logits, without ever gathering the [s, b, V] tensor.

    logits_shard  [s, b, V/t]  this rank's slice of the (padded) vocabulary
    target        [s, b]       global token ids
    returns       [s, b]       per-token loss, identical on every TP rank

Three all-reduces over the TP group: max (stability), the target logit (held by one rank) and the
sum of exponentials. Padded vocabulary entries (ids >= vocab_size) are set to -inf before all of
it, so they never count. The backward is local: softmax minus one-hot, on this rank's slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(x, group, op=dist.ReduceOp.SUM):
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, vocab_size, group):
        ctx.in_dtype = logits.dtype
        logits = logits.float()
        local_v = logits.shape[-1]
        valid_cols = max(0, min(local_v, vocab_size - vocab_start))
        if valid_cols < local_v:  # padded ids live on the last ranks
            logits = logits.clone()
            logits[..., valid_cols:] = float("-inf")
        logits_max = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)
        outside = (target < vocab_start) | (target >= vocab_start + local_v)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = _all_reduce(target_logit.masked_fill(outside, 0.0), group)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), group)
        loss = sum_exp.log() - target_logit
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax  # reused in place: saved once
        onehot = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, target: torch.Tensor, *, vocab_start: int, vocab_size: int, group=None
) -> torch.Tensor:
    """Per-token loss [s, b] from vocab-sharded logits; vocab_size is the unpadded vocabulary."""
    return _VocabParallelCrossEntropy.apply(logits_shard, target, vocab_start, vocab_size, group)

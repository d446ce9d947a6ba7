"""Gradients that a backward through the parallel model leaves as partial sums, and their reduction.

    parameter                                       saw                            summed over
    SP-region (norms, row-parallel biases,          its rank's sequence shard      the TP group
      positions; marked `sequence_parallel`)
    key/value heads held in copies (GQA with        its rank's query heads         the TP ranks holding
      fewer key/value heads than TP ranks)                                         the same copy
    every parameter, under context parallelism      its rank's part of the         the CP group
                                                    sequence (the loss is the
                                                    whole sequence's mean)

`PartialGrads` is the one owner of "which sums are still pending": the model's forward calls
`expect()`, and whoever needs final gradients calls `reduce()` (the model's full_grad_dict, the
training loop's finalize_model_grads), which sums what is pending exactly once. The training loop
sums over CP together with the data-parallel average (one all-reduce over the DP×CP group) and says
so with `reduce(params, cp_summed=True)`; its gradients are the parameters' `main_grad` (the
gradient buffers), which it names with `grad=`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.parallel_state import EXPERT_REPLICAS, ParallelState, replica_role
from megatron_sp.tensor_parallel.sharding import split_local


class PartialGrads:
    """The partial sums pending since the last reduction, for one model on the ranks of `ps`."""

    def __init__(self, ps: ParallelState):
        self.ps = ps
        self.tp_pending = False
        self.cp_pending = False

    def expect(self) -> None:
        """A forward with gradients enabled ran: its backward leaves partial sums."""
        self.tp_pending = True
        self.cp_pending = self.ps.cp_size > 1

    @torch.no_grad()
    def reduce(self, params, *, cp_summed: bool = False, grad=None) -> None:
        """Sums the pending partial gradients of `params` (collective over the TP and CP groups);
        cp_summed: the caller has already summed every gradient over CP; grad(p): the tensor that
        holds p's gradient (default p.grad; None: p has none)."""
        grad = grad if grad is not None else _grad
        pairs = [(p, grad(p)) for p in params]
        pairs = [(p, g) for p, g in pairs if g is not None]
        experts = [g for p, g in pairs if replica_role(p) == EXPERT_REPLICAS]
        pairs = [(p, g) for p, g in pairs if replica_role(p) != EXPERT_REPLICAS]
        if self.cp_pending and not cp_summed and pairs:
            _sum_flat([g for _, g in pairs], self.ps.cp_group)
        if self.tp_pending:
            _sum_over_tp(pairs, self.ps)
        if self.tp_pending and not cp_summed and experts:
            _reduce_experts(experts, self.ps)
        self.tp_pending = self.cp_pending = False


def _grad(p):
    return p.grad


def _reduce_experts(grads, ps: ParallelState) -> None:
    """Expert gradients: summed over the expert-DP ranks (the other token sets routed to the same
    experts), divided by DP (the data-parallel mean, which the dense gradients take afterwards)."""
    if ps.edp_size > 1:
        _sum_flat(grads, ps.edp_group)
    if ps.dp_size > 1:
        torch._foreach_div_(grads, float(ps.dp_size))


def _sum_flat(tensors, group) -> None:
    """All-reduces the tensors in place as one flat buffer."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    torch._foreach_copy_(
        tensors, [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
    )


def _copied_segments(pairs, ps: ParallelState):
    """(gradient view, shard) of every parameter segment held in copies by several TP ranks."""
    out = []
    for p, grad in pairs:
        spec = getattr(p, "shard_spec", None)
        if spec is None or not spec.segments:
            continue
        out += [(view, shard) for shard, view in split_local(grad, spec, ps.tp_rank, ps.tp_size) if shard.copies > 1]
    return out


def _sum_over_tp(pairs, ps: ParallelState) -> None:
    """SP-region gradients and copies, in one all-reduce over the TP group. Copies: every rank
    writes its piece into its part's slot of a zeroed [parts, piece] buffer, so the sum leaves each
    slot holding the sum over that part's copies."""
    if ps.tp_size == 1:
        return
    whole = [g for p, g in pairs if getattr(p, "sequence_parallel", False)]
    slots = []
    for view, shard in _copied_segments(pairs, ps):
        buffer = view.new_zeros((shard.full // shard.size,) + tuple(view.shape))  # [parts, piece]
        buffer[shard.offset // shard.size] = view
        slots.append((view, shard, buffer))
    tensors = whole + [buffer for _, _, buffer in slots]
    if not tensors:
        return
    _sum_flat(tensors, ps.tp_group)
    for view, shard, buffer in slots:
        view.copy_(buffer[shard.offset // shard.size])

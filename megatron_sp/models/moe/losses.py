"""The router's auxiliary losses, defined over tokens rather than ranks, and how their gradients join
the language-model loss's.

    loss              statistics over                          value (E experts, top-k, coeff c)
    aux_loss          the micro-batch: every sample of every   E·c/(k T²) Σ_e P_e f_e, T tokens, P_e the
                      DP rank (Megatron: each DP rank's own)   summed scores, f_e the tokens routed to e
    seq_aux_loss      each sample (DeepSeek-V2)                the same per sample, averaged over samples
    global_aux_loss   aux_loss's, f_e averaged over the        (Megatron's, over TP × CP × DP)
                      step's micro-batches
    z_loss            each token: c · mean (logsumexp logits)² (ST-MoE)

Each rank computes its share (its tokens' P_e with the counts summed over the ranks holding the
rest: `MoEGroups`), so the shares add up to the serial model's loss over the same tokens. aux_loss
and global_aux_loss shares are multiplied by the DP size because data-parallel gradients are averaged.

The shares are kept in `seq.moe_losses` ({(layer, name): tensor}; a recomputed layer writes the same
keys) and `attach` hands them to the language-model loss: forward returns the loss unchanged, backward
gives every share the loss's own gradient (its micro-batch weight and loss scale; Megatron's
MoEAuxLossAutoScaler), so the logged lm loss stays the cross entropy alone.

A pipeline stage other than the last has no loss: `attach_to_output` hands its layers' shares to the
hidden states it sends on, and gives them, in the backward, the gradient the micro-batch's loss
receives on the last stage (its weight × the loss scale: `weight`), so every stage back-propagates its
own layers' auxiliary losses, scaled as the serial model scales them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class MoEGroups:
    """The ranks whose tokens a routing statistic sums over (all None in the serial model).

    sp          the router runs in the SP region (its weight's gradient is a partial sum over TP)
    seq_group   the ranks holding the other tokens of this rank's samples: TP (under SP) × CP
    batch_group every rank of the pipeline stage: TP × CP × DP (the micro-batch's tokens)
    """

    sp: bool = False
    seq_group: Optional[object] = None
    seq_size: int = 1
    batch_group: Optional[object] = None
    batch_size: int = 1
    dp_size: int = 1

    def sum_seq(self, t):
        return _all_reduce(t, self.seq_group)

    def sum_all(self, t):
        return _all_reduce(t, self.batch_group)


def _all_reduce(t, group):
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


BALANCING_LOSS_NAMES = {  # --moe-router-load-balancing-type -> the loss's logged name (Megatron's)
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def recorded_losses(cfg) -> tuple:
    """The names of the losses every router of cfg's model records in a training step."""
    kind, names = cfg.moe_router_load_balancing_type, ()
    if kind in BALANCING_LOSS_NAMES and cfg.moe_aux_loss_coeff > 0:
        names += (BALANCING_LOSS_NAMES[kind],)
    return names + (("z_loss",) if cfg.moe_z_loss_coeff else ())


def scores_for_aux(logits, cfg):
    """(scores [n, E], map [n, E]) the balancing loss sees: softmax, or sigmoid normalised over every
    expert, and their plain top-k (no groups, no bias: Megatron's compute_routing_scores_for_aux_loss)."""
    if cfg.moe_router_score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    top = torch.topk(scores, k=cfg.moe_router_topk, dim=1)[1]
    return scores, torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)


def switch_loss(scores, tokens_per_expert, total_tokens: int, cfg):
    """E·c/(k T²) Σ_e P_e f_e (Megatron's switch_load_balancing_loss_func) of this rank's scores."""
    e, k = cfg.num_experts, cfg.moe_router_topk
    return (scores.sum(0) * tokens_per_expert).sum() * (e * cfg.moe_aux_loss_coeff / (k * total_tokens**2))


def add_balancing_loss(seq, router, logits, n: int) -> None:
    """The configured load-balancing loss's share of this rank's n tokens ([s_sp, b] flattened)."""
    cfg, groups = router.cfg, router.stats
    kind = cfg.moe_router_load_balancing_type
    scores, routing_map = scores_for_aux(logits, cfg)
    if kind == "seq_aux_loss":
        b = seq.sp_index.sample_ids.numel()
        s_local = n // b
        counts = groups.sum_seq(routing_map.view(s_local, -1).sum(0).float())  # [b·E]: per sample
        share = switch_loss(scores.reshape(s_local, -1), counts, s_local * groups.seq_size, cfg) / b
        _record(seq, router, BALANCING_LOSS_NAMES[kind], share, share * 1.0)
        return
    counts = groups.sum_all(routing_map.sum(0).float())
    if kind == "global_aux_loss":
        router.global_tokens += counts
        router.ga_steps += 1
        counts = router.global_tokens / router.ga_steps
    share = switch_loss(scores, counts, n * groups.batch_size, cfg)
    _record(seq, router, BALANCING_LOSS_NAMES[kind], share, share * groups.dp_size)


def add_z_loss(seq, router, logits) -> None:
    """c · mean(logsumexp²) over this rank's tokens, divided by the ranks sharing the samples."""
    z = torch.square(torch.logsumexp(logits.float(), dim=-1)).mean()
    share = z * (router.cfg.moe_z_loss_coeff / router.stats.seq_size)
    _record(seq, router, "z_loss", share, share)


def _record(seq, router, name: str, share, attached) -> None:
    """share: this rank's part of the loss (logged, summed over the ranks); attached: what joins the
    lm loss's backward."""
    seq.moe_losses[(router.layer, name)] = attached
    router.last_losses[name] = share.detach()
    if torch._C._current_graph_task_id() == -1:  # not a recomputation inside the backward
        total, count = router.step_losses.get(name, (0.0, 0))
        router.step_losses[name] = (total + attached.detach().float(), count + 1)


class _Attach(torch.autograd.Function):
    """forward: the loss; backward: the loss's gradient to it and to every auxiliary share."""

    @staticmethod
    def forward(ctx, loss, *shares):
        ctx.like = [(s.shape, s.dtype) for s in shares]
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(grad.to(dtype).expand(shape) for shape, dtype in ctx.like))


class _AttachWeighted(torch.autograd.Function):
    """forward: the hidden states; backward: their gradient, and `weight` to every auxiliary share."""

    @staticmethod
    def forward(ctx, hidden, weight, *shares):
        ctx.weight, ctx.like = weight, [(s.shape, s.dtype) for s in shares]
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad):
        shares = (torch.full(shape, ctx.weight, dtype=dtype, device=grad.device) for shape, dtype in ctx.like)
        return (grad, None, *shares)


def attach_to_output(hidden, seq, weight: float):
    """A pipeline stage's output [s_sp, b, h] with seq's shares attached, `weight` their gradient."""
    if not seq.moe_losses:
        return hidden
    return _AttachWeighted.apply(hidden, float(weight), *seq.moe_losses.values())


def attach(loss, seq):
    """The lm loss with seq's auxiliary shares attached (see the module docstring)."""
    if not seq.moe_losses:
        return loss
    return _Attach.apply(loss, *seq.moe_losses.values())

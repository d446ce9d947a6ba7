"""The router: gating logits, top-k choice and the load-balancing losses (Megatron's TopKRouter).

    logits   [n, E]  x [n, h] @ router.weight [E, h]^T (+ router.bias [E] with --add-bias-linear, as
                     Megatron's TopKRouter: gpt-oss's), in --moe-router-dtype (default x's)
    probs    [n, E]  the chosen experts' weights, zero elsewhere
    map      [n, E]  bool: the chosen experts

Score functions (moe_utils.topk_routing_with_score_function): softmax over the k chosen logits
(default), softmax over all E before the choice (--moe-router-pre-softmax), or sigmoid renormalised
over the k chosen (k > 1). Group-limited routing picks --moe-router-group-topk of
--moe-router-num-groups expert groups by the sum of each group's top (k / group_topk) scores, then
k experts inside them. The expert bias (aux-loss-free balancing, sigmoid only) shifts the scores used
for the choice, never the weights.

Sinkhorn routing (--moe-router-load-balancing-type sinkhorn, Megatron's sinkhorn_load_balancing): in
training the k experts of a token are the top-k of exp(logits) rescaled per token and per expert until
every token's row sums to 1/T and every expert's column to 1/E (T tokens, E experts; Megatron's
moe_utils.sinkhorn, stopped when the expert scales move by less than 1e-4 on average); a column's sum
runs over every token of the micro-batch (the ranks holding them add theirs: `MoEGroups.sum_all`), so
the choice is the serial model's at any layout. The weights are sigmoid(logit) for k = 1, else the
softmax over all E (not renormalised over the k); in evaluation the top-k of those weights is the
choice.

Load-balancing statistics are those of every token the loss is defined over, summed over the ranks
that hold them (`stats`: models/moe/losses.py), so the losses equal the serial model's at any layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_sp.models.moe import losses
from megatron_sp.tensor_parallel.layers import mark

_ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class Router(nn.Module):
    """forward(x [n, h], seq) -> (probs [n, E], map [n, E]); the losses go to `seq.moe_losses`.

    weight [E, h] and bias [E] (with add_bias_linear) live in the SP region (each rank routes its own
    tokens: a partial gradient over TP); the bias is drawn N(0, std), as Megatron's and transformers'.
    expert_bias [E] fp32 buffer (checkpointed); tokens_per_expert [E] the step's counts for its update."""

    def __init__(self, cfg, *, layer, builder, stats):
        super().__init__()
        self.cfg, self.layer, self.stats = cfg, layer, stats
        e = cfg.num_experts
        self.weight = mark(nn.Parameter(torch.empty(e, cfg.hidden_size)), sequence_parallel=stats.sp, init="normal")
        self.bias = None
        if cfg.add_bias_linear:
            self.bias = mark(nn.Parameter(torch.empty(e)), sequence_parallel=stats.sp, init="normal")
        if cfg.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32, device="cpu"))
            self.register_buffer(
                "tokens_per_expert", torch.zeros(e, dtype=torch.float32, device="cpu"), persistent=False
            )
        else:
            self.expert_bias = None
        if cfg.moe_router_load_balancing_type == "global_aux_loss":
            self.register_buffer("global_tokens", torch.zeros(e, dtype=torch.float32, device="cpu"), persistent=False)
            self.register_buffer("ga_steps", torch.zeros((), dtype=torch.float32, device="cpu"), persistent=False)
        self.last_losses = {}  # name -> this rank's share of the last forward's loss (detached)
        self.step_losses = {}  # name -> (sum of the step's attached shares, micro-batches): the logged losses

    def gating(self, x):
        dtype = _ROUTER_DTYPES.get(self.cfg.moe_router_dtype, x.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), self.weight.to(dtype), bias)  # [n, E]

    def forward(self, x, seq):
        logits = self.gating(x)
        record = seq.training and torch.is_grad_enabled()
        if record and self.cfg.moe_z_loss_coeff:
            losses.add_z_loss(seq, self, logits)
        if self.cfg.moe_router_load_balancing_type == "sinkhorn":
            probs, routing_map = sinkhorn_routing(logits, self.cfg, self.stats, training=seq.training)
        else:
            probs, routing_map = topk_routing(logits, self.cfg, self.expert_bias)
        if record and self.cfg.moe_router_load_balancing_type != "none" and self.cfg.moe_aux_loss_coeff > 0:
            losses.add_balancing_loss(seq, self, logits, x.shape[0])
        if record and self.expert_bias is not None:
            self.tokens_per_expert += routing_map.sum(0).float()
        return probs, routing_map

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """After a step: bias += rate · sign(mean load - load), the loads summed over every rank that
        routed tokens (Megatron's get_updated_expert_bias); then the counts restart."""
        counts = self.stats.sum_all(self.tokens_per_expert.clone())
        offset = counts.mean() - counts
        self.expert_bias += torch.sign(offset) * self.cfg.moe_router_bias_update_rate
        self.tokens_per_expert.zero_()

    def reset_step(self) -> None:
        """A new step: global_aux_loss's averaged counts restart (Megatron's reset_global_aux_loss_tracker)."""
        self.step_losses = {}
        if hasattr(self, "global_tokens"):
            self.global_tokens.zero_()
            self.ga_steps.zero_()


def _topk(scores, cfg):
    """(values, indices) [n, k] of the top-k, group-limited when configured."""
    k, groups, group_topk = cfg.moe_router_topk, cfg.moe_router_num_groups, cfg.moe_router_group_topk
    if not group_topk:
        return torch.topk(scores, k=k, dim=1)
    n, e = scores.shape
    group_scores = scores.view(n, groups, e // groups).topk(k // group_topk, dim=-1)[0].sum(dim=-1)  # [n, G]
    chosen = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen, True)
    expert_mask = group_mask.unsqueeze(-1).expand(n, groups, e // groups).reshape(n, e)
    return torch.topk(scores.masked_fill(~expert_mask, float("-inf")), k=k, dim=-1)


def topk_routing(logits, cfg, expert_bias=None):
    """(probs [n, E], map [n, E]) of the top-k choice (see the module docstring)."""
    k = cfg.moe_router_topk
    if cfg.moe_router_score_function == "softmax":
        if cfg.moe_router_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, top = _topk(scores, cfg)
        else:
            chosen, top = _topk(logits, cfg)
            probs = torch.softmax(chosen, dim=-1, dtype=torch.float32).type_as(logits)
    else:
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, top = _topk(scores + expert_bias, cfg)
            probs = torch.gather(scores, 1, top)
        else:
            probs, top = _topk(scores, cfg)
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else probs
    if cfg.moe_router_topk_scaling_factor:
        probs = probs * cfg.moe_router_topk_scaling_factor
    dense = torch.zeros_like(logits).scatter(1, top, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return dense, routing_map


SINKHORN_TOL, _SINKHORN_EPS = 1e-4, 1e-8  # Megatron's tolerance and epsilon


@torch.no_grad()
def sinkhorn(logits, stats=None):
    """exp(logits) [n, E] balanced (the module docstring), in fp32; the column sums and the token count
    are over every rank of `stats.batch_group` (stats None: these n tokens are all)."""
    cost = torch.exp(logits.float())
    total = cost.shape[0] * (stats.batch_size if stats is not None else 1)
    e = cost.shape[1]
    d1 = torch.ones(e, dtype=cost.dtype, device=cost.device)
    while True:
        d0 = (1.0 / total) / ((d1 * cost).sum(1) + _SINKHORN_EPS)
        columns = (d0.unsqueeze(1) * cost).sum(0)
        if stats is not None:
            columns = stats.sum_all(columns)
        new = (1.0 / e) / (columns + _SINKHORN_EPS)
        error = torch.mean(torch.abs(d1 - new))  # (the same on every rank: d1 is reduced)
        d1 = new
        if not error > SINKHORN_TOL:  # (a NaN ends it too, as Megatron's `while error > tol`)
            return d1 * cost * d0.unsqueeze(1)


def sinkhorn_routing(logits, cfg, stats=None, training=True):
    """(probs [n, E], map [n, E]) of Sinkhorn routing (the module docstring); stats: the ranks holding
    the micro-batch's other tokens (None: the serial model)."""
    k = cfg.moe_router_topk
    if k == 1:
        weights = torch.sigmoid(logits)
    else:
        weights = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    top = torch.topk(sinkhorn(logits, stats) if training else weights, k=k, dim=1)[1]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    return weights * routing_map, routing_map

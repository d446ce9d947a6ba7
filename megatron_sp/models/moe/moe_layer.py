"""The MoE layer: a block's `mlp` slot on the layers --moe-layer-freq chooses (BlockSpec.moe).

    x        [s_sp, b, h]   SP region (this rank's tokens; all of them in the serial model)
    tokens   [n, h]         n = s_sp · b, in [s_sp, b] order
    router   probs, map [n, E]; the load-balancing and z losses to seq.moe_losses (models/moe/losses.py)
    capacity the drops of the whole sample (models/moe/capacity.py)
    dispatch the tokens to their experts' ranks and back (the builder's: none serially,
             expert_parallel/ with EP), each token the sum of its experts' weighted outputs
    shared   + a dense MLP every token goes through (--moe-shared-expert-intermediate-size), TP-split
             as the dense MLP; with --moe-shared-expert-gate its output times sigmoid(x · gate_weight^T),
             gate_weight [1, h] in the SP region (Megatron's SharedExpertMLP, Qwen2-MoE's shared_expert_gate)

forward(x, seq) -> [s_sp, b, h] before `output_bias` (the shared expert's fc2 bias, or None).
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_sp.models.blocks import MLP
from megatron_sp.models.moe.capacity import apply_capacity
from megatron_sp.models.moe.experts import Experts
from megatron_sp.models.moe.router import Router
from megatron_sp.tensor_parallel.layers import mark


class MoELayer(nn.Module):
    def __init__(self, cfg, *, layer, builder, block_spec):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg, layer=layer, builder=builder, stats=builder.moe_groups())
        self.experts = Experts(cfg, builder=builder, expert_ids=builder.local_experts(cfg))
        self.dispatcher = builder.token_dispatcher(cfg)
        self.shared_experts = None
        if cfg.moe_shared_expert_intermediate_size:
            slot = dict(layer=layer, builder=builder, block_spec=block_spec)
            self.shared_experts = SharedExpertMLP(cfg, **slot, sp=self.router.stats.sp)

    @property
    def output_bias(self):
        return self.shared_experts.output_bias if self.shared_experts is not None else None

    def forward(self, x, seq):
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        probs, routing_map = self.router(tokens, seq)
        probs, routing_map = apply_capacity(self.cfg, probs, routing_map, seq, self.router.stats)
        out = self.dispatcher(tokens, probs, routing_map, self.experts).view(s, b, h)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class SharedExpertMLP(MLP):
    """The dense MLP of width --moe-shared-expert-intermediate-size, gated when --moe-shared-expert-gate."""

    def __init__(self, cfg, *, layer, builder, block_spec, sp):
        super().__init__(
            cfg,
            layer=layer,
            builder=builder,
            block_spec=block_spec,
            ffn_hidden_size=cfg.moe_shared_expert_intermediate_size,
        )
        self.gate_weight = None
        if cfg.moe_shared_expert_gate:  # each rank gates its own tokens: a partial gradient over TP under SP
            self.gate_weight = mark(nn.Parameter(torch.empty(1, cfg.hidden_size)), sequence_parallel=sp, init="normal")

    def forward(self, x, seq=None):
        out = super().forward(x, seq)  # [s_sp, b, h]
        if self.gate_weight is None:
            return out
        return out * torch.sigmoid(nn.functional.linear(x, self.gate_weight.to(x.dtype)))  # [s_sp, b, 1]

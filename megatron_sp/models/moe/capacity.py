"""Expert capacity: which routed tokens an expert drops (--moe-expert-capacity-factor).

The drop unit is one sample: each expert takes at most

    capacity = ceil(s · k / E · factor)          s the sequence length, k top-k, E experts

tokens of every sample, chosen over the whole sequence: its highest-probability routed tokens
(--moe-token-drop-policy probs; equal probabilities: the earlier position first) or its earliest
routed ones (position). With --moe-pad-expert-input-to-capacity an expert takes exactly `capacity`
tokens of each sample, unrouted ones with probability 0 (as Megatron, when capacity < s).

Megatron decides on each rank's local tokens (its SP and CP shard of the micro-batch, with the
capacity of those tokens), so which tokens drop there depends on the layout. Here a rank gathers the
keys of its samples' other tokens (over TP under SP, and CP: `MoEGroups.seq_group`), so the same
tokens drop at every layout and the serial model defines which.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def capacity(cfg, s: int) -> int:
    return math.ceil(s * cfg.moe_router_topk / cfg.num_experts * cfg.moe_expert_capacity_factor)


def _whole_sequence(local, positions, s: int, groups):
    """[s_local, b, E] rows of this rank at global `positions` -> [s, b, E] of the whole sequence."""
    if groups.seq_group is None:
        full = local.new_zeros((s,) + tuple(local.shape[1:]))
        full[positions] = local
        return full
    parts = [torch.empty_like(local) for _ in range(groups.seq_size)]
    where = [torch.empty_like(positions) for _ in range(groups.seq_size)]
    dist.all_gather(parts, local.contiguous(), group=groups.seq_group)
    dist.all_gather(where, positions.contiguous(), group=groups.seq_group)
    full = local.new_zeros((s,) + tuple(local.shape[1:]))
    full[torch.cat(where)] = torch.cat(parts)
    return full


@torch.no_grad()
def _kept(cfg, keys, positions, s: int, groups):
    """bool [s_local, b, E]: the tokens each expert keeps of its samples (keys [s_local, b, E])."""
    cap = capacity(cfg, s)
    if cap > s:
        return torch.ones_like(keys, dtype=torch.bool)
    full = _whole_sequence(keys, positions, s, groups)  # [s, b, E], in position order
    order = torch.sort(full, dim=0, descending=True, stable=True).indices  # ties: earlier first
    keep = torch.zeros_like(full, dtype=torch.bool).scatter_(0, order[:cap], True)
    return keep[positions]


def apply_capacity(cfg, probs, routing_map, seq, groups):
    """(probs, map) [n, E] after the drops; n = s_sp · b tokens in [s_sp, b] order."""
    if cfg.moe_expert_capacity_factor is None:
        return probs, routing_map
    positions = seq.sp_index.token_positions.to(probs.device)  # [s_sp] global positions of this rank's rows
    b = seq.sp_index.sample_ids.numel()
    s = seq.whole.tokens.shape[1] if seq.whole is not None else seq.tokens.shape[1]
    e = probs.shape[-1]
    keys = probs if cfg.moe_token_drop_policy == "probs" else routing_map.to(probs.dtype)
    keep = _kept(cfg, keys.detach().view(-1, b, e), positions, s, groups).view(-1, e)
    final_map = keep if cfg.moe_pad_expert_input_to_capacity else routing_map & keep
    return probs * final_map, final_map

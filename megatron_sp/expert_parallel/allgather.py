"""The all-gather token dispatcher (--moe-token-dispatcher-type allgather; Megatron's
MoEAllGatherTokenDispatcher): every rank of the EP × expert-TP group sees every token of the group.

    all-gather   tokens [G·n, h] and probabilities [G·n, E] over the G = EP × expert-TP ranks
    permute      the rows of this rank's experts only
    experts      on this rank's shards
    unpermute    [G·n, h]: this rank's experts' part of every token's output
    reduce-scatter  each rank's tokens summed over the other experts' ranks and the shards
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.expert_parallel.permute import permute, unpermute
from megatron_sp.tensor_parallel import mappings


class AllGatherDispatcher:
    def __init__(self, num_experts: int, ps, expert_ids):
        self.ps, self.columns = ps, list(expert_ids)

    def __call__(self, tokens, probs, routing_map, experts):
        group = self.ps.expert_group
        x = mappings.gather_from_sequence_parallel_region(tokens, group)  # [G·n, h]
        p = mappings.gather_from_sequence_parallel_region(probs, group)  # [G·n, E]
        chosen = routing_map.to(torch.uint8)  # (gloo gathers no bool)
        maps = [torch.empty_like(chosen) for _ in range(dist.get_world_size(group))]
        dist.all_gather(maps, chosen.contiguous(), group=group)
        cols = self.columns
        rows, row_probs, token, counts = permute(x, p[:, cols], torch.cat(maps)[:, cols].bool())
        out = unpermute(experts(rows, counts.tolist(), row_probs), token, x.shape[0])
        return mappings.reduce_scatter_to_sequence_parallel_region(out, group)

"""Experts in full state dicts: a rank holds its EP rank's experts, a full (serial) state dict every
expert, under the same names (`...mlp.experts.local_experts.{e}.fc1.weight`, e the global index).

    expert_of(name)              e, or None for a parameter that is no expert's
    gather_experts(full, ps, names_shapes)   every expert's full tensors on every rank of the EP group
                                 (each broadcast from its owner), added to `full`
"""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist

_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


def expert_of(name: str) -> Optional[int]:
    match = _EXPERT.search(name)
    return int(match.group(1)) if match else None


def renamed(name: str, expert: int) -> str:
    """`name` of another expert."""
    return _EXPERT.sub(f".experts.local_experts.{expert}.", name, count=1)


@torch.no_grad()
def gather_experts(full: dict, ps, num_experts: int) -> dict:
    """`full` (this rank's experts' full tensors among the rest) with every expert's, collective over
    the EP group: each expert broadcast from the EP rank holding it, in the same order on every rank."""
    if ps.ep_size == 1:
        return full
    local = num_experts // ps.ep_size
    mine = {n: t for n, t in full.items() if expert_of(n) is not None}
    template = {}  # (name of local expert 0-relative slot, tensor) of this rank's first expert
    for name, tensor in mine.items():
        slot = expert_of(name) - ps.ep_rank * local
        template.setdefault(slot, []).append((name, tensor))
    out = dict(full)
    for owner in range(ps.ep_size):
        src = dist.get_global_rank(ps.ep_group, owner)
        for slot in sorted(template):
            for name, tensor in template[slot]:
                target = renamed(name, owner * local + slot)
                buffer = tensor.contiguous() if owner == ps.ep_rank else torch.empty_like(tensor)
                dist.broadcast(buffer, src=src, group=ps.ep_group)
                out[target] = buffer
    return out

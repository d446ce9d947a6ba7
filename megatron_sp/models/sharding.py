"""Moving parameters between their full (serial) shape and this rank's TP shard (see ShardSpec).

    shard_full   full [.., F, ..]  ->  local [.., F_pad/t, ..]   pads F to the model's padded size
    gather_full  local             ->  full  [.., F, ..]          collective over the TP group

With ShardSpec.groups = g the split dim is viewed as [g, F/g] and each rank keeps a slice of every
group (fused QKV keeps whole q, k and v heads).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.tensor_parallel.layers import ShardSpec


def shard_full(full: torch.Tensor, spec: ShardSpec, local_shape, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of a full tensor (padding the split dim with zeros to tp_size × local)."""
    if spec.dim is None:
        return full
    dim = spec.dim % full.dim()
    padded = local_shape[dim] * tp_size
    if full.shape[dim] < padded:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    moved = full.movedim(dim, 0)                                   # [F_pad, ...]
    grouped = moved.reshape(spec.groups, tp_size, -1, *moved.shape[1:])  # [g, t, F/(g t), ...]
    local = grouped[:, tp_rank].reshape(-1, *moved.shape[1:])
    return local.movedim(0, dim).contiguous()


def gather_full(local: torch.Tensor, spec: ShardSpec, group) -> torch.Tensor:
    """The full tensor from every rank's shard (collective); padding stripped to spec.full.
    Always a new tensor (never a view of the parameter)."""
    if spec.dim is None:
        return local.clone()
    tp_size = 1 if group is None else dist.get_world_size(group)
    dim = spec.dim % local.dim()
    moved = local.movedim(dim, 0).contiguous()                     # [F_local, ...]
    parts = [torch.empty_like(moved) for _ in range(tp_size)]
    if tp_size == 1:
        parts = [moved]
    else:
        dist.all_gather(parts, moved, group=group)
    stacked = torch.stack([p.reshape(spec.groups, -1, *moved.shape[1:]) for p in parts], dim=1)
    full = stacked.reshape(-1, *moved.shape[1:])                   # [g * t * F/(g t), ...]
    if spec.full is not None:
        full = full[: spec.full]
    return full.movedim(0, dim).contiguous()

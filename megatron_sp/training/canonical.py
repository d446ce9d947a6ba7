"""The canonical (TP-independent) layout of every parameter, and this rank's slice of it.

Canonical tensor = the ReferenceGPT tensor, unpadded, with a grouped split dim viewed as
[groups, F/groups] (only the fused QKV: [3, h, h] and [3, h]). A TP rank's shard is then one contiguous block of it:

    canonical  [.., g, F/g, ..]      local block  [.., g, F/(g t), ..] at offset r·F/(g t) on the F/g axis

(the padded vocabulary rows are cut off, so the last ranks may hold fewer rows, or none). At TP=1
the canonical tensor is a plain tensor; at TP>1 it is declared to DCP as a ShardedTensor with the
block's global offsets, which is what lets DCP reshard on load.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def _split_axis(p):
    """(axis of the F/g block in the canonical view, groups) or None for replicated parameters."""
    spec = p.shard_spec
    if spec.dim is None:
        return None
    return spec.dim % p.dim() + (1 if spec.groups > 1 else 0), spec.groups


def _grouped_view(t, p):
    spec = p.shard_spec
    if spec.groups == 1:
        return t
    d = spec.dim % p.dim()
    shape = list(t.shape)
    return t.reshape(shape[:d] + [spec.groups, shape[d] // spec.groups] + shape[d + 1:])


def _valid_rows(p, ps):
    """(offset on the F/g axis, rows of the local block that are real, not padding)."""
    spec = p.shard_spec
    local = p.shape[spec.dim % p.dim()] // spec.groups
    full = (spec.full if spec.full is not None else local * ps.tp_size * spec.groups) // spec.groups
    offset = ps.tp_rank * local
    return offset, max(0, min(local, full - offset)), full


def local_block(t, p, ps):
    """This rank's real (unpadded) block of a local tensor shaped like p, in the grouped view."""
    axis, _ = _split_axis(p)
    _, rows, _ = _valid_rows(p, ps)
    return _grouped_view(t, p).narrow(axis, 0, rows)


def _sharded(block, p, ps):
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
    axis, _ = _split_axis(p)
    offset, rows, full = _valid_rows(p, ps)
    global_shape = list(block.shape)
    global_shape[axis] = full
    offsets = [0] * block.dim()
    offsets[axis] = offset
    shards = []
    if rows > 0:
        placement = f"rank:{dist.get_rank()}/{block.device}"
        shards = [Shard(block.contiguous(), ShardMetadata(offsets, list(block.shape), placement))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return init_from_local_shards(shards, global_shape, process_group=ps.tp_group)


def to_dcp_tensor(t, p, ps):
    """What DCP saves for tensor t (a parameter or its optimizer state) of parameter p."""
    if _split_axis(p) is None:
        return t.detach()
    block = local_block(t.detach(), p, ps)
    return block.contiguous() if ps.tp_size == 1 else _sharded(block, p, ps)


def empty_dcp_target(p, ps):
    """A zero tensor of the layout to_dcp_tensor gives, for DCP to load into."""
    return to_dcp_tensor(torch.zeros_like(p, dtype=torch.float32), p, ps)


def from_canonical_local(loaded, p, ps):
    """Back from a loaded DCP tensor to the local parameter layout (padding rows zero)."""
    if _split_axis(p) is None:
        return loaded
    if not torch.is_tensor(loaded) or type(loaded) is not torch.Tensor:
        shards = loaded.local_shards()
        loaded = shards[0].tensor if shards else None
    out = torch.zeros_like(p, dtype=torch.float32)
    if loaded is not None:
        axis, _ = _split_axis(p)
        _grouped_view(out, p).narrow(axis, 0, loaded.shape[axis]).copy_(loaded)
    return out

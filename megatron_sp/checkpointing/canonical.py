"""The canonical (TP-independent) layout of every parameter in a checkpoint, and this rank's slice of it.

Canonical tensor = the ReferenceGPT tensor, unpadded, stored so that a TP rank's shard is one
contiguous block of one entry (what DCP's resharding needs):

    plain or single-segment     [.., F, ..]              rank block at offset r·F_local (padded vocab
                                                         rows cut off: the last ranks may hold fewer, or none)
    equal segments (QKV of MHA, [.., g, F/g, ..]         block [.., g, F/(g t), ..] at offset r·F/(g t)
    SwiGLU gate/up)
    unequal segments (GQA QKV)  {"segment<i>": [.., F_i, ..]}   one entry per segment; a segment held in
                                                         copies is written by its first copy, and read
                                                         whole by every rank, which keeps its part
At TP=1 an entry is a plain tensor; at TP>1 it is declared to DCP as a ShardedTensor with the
block's global offsets. `canonical_to_full` / `full_to_canonical` convert a whole state dict (tools).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from megatron_sp.tensor_parallel.sharding import split_local


def _layout(spec) -> str:
    if spec is None or spec.dim is None:
        return "replicated"
    if len(spec.segments) <= 1:
        return "single"
    return "grouped" if len(set(spec.segments)) == 1 else "segments"


def _coords(spec, ps) -> tuple:
    """(rank, size, group) of the ranks `spec`'s dim is split over (TP; expert-TP for experts)."""
    rank, size = ps.coords(spec.group)
    return rank, size, ps.group(spec.group)


def _sharded(block, global_shape, offsets, include: bool, group):
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    shards = []
    if include and block.numel() > 0:
        placement = f"rank:{dist.get_rank()}/{block.device}"
        shards = [Shard(block.contiguous(), ShardMetadata(list(offsets), list(block.shape), placement))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return init_from_local_shards(shards, list(global_shape), process_group=group)


def _entry(block, axis, offset, full, include, ps, spec):
    """block: this rank's piece along `axis` at `offset` of a canonical tensor `full` rows long."""
    _, size, group = _coords(spec, ps)
    if size == 1:
        return block.contiguous()
    shape = list(block.shape)
    shape[axis] = full
    offsets = [0] * block.dim()
    offsets[axis] = offset
    return _sharded(block, shape, offsets, include, group)


def _single(t, spec, ps):
    """(axis, valid block, offset, full rows) of a single-segment parameter (vocab padding cut)."""
    dim = spec.dim % t.dim()
    rank, size, _ = _coords(spec, ps)
    ((shard, view),) = split_local(t, spec, rank, size)
    rows = max(0, min(shard.size, shard.full - shard.offset))
    return dim, view.narrow(dim, 0, rows), shard.offset, shard.full


def _grouped(t, spec, ps):
    """(axis, block, offset, rows per group) of equal segments viewed as [g, F/g]."""
    dim = spec.dim % t.dim()
    g = len(spec.segments)
    shape = list(t.shape)
    block = t.reshape(shape[:dim] + [g, shape[dim] // g] + shape[dim + 1 :])
    local = shape[dim] // g
    return dim + 1, block, _coords(spec, ps)[0] * local, spec.segments[0]


def to_dcp_tensor(t, p, ps):
    """What DCP saves for tensor t (a parameter or its optimizer state) of parameter p."""
    t, spec = t.detach(), getattr(p, "shard_spec", None)
    layout = _layout(spec)
    if layout == "replicated":
        return t
    if layout == "single":
        axis, block, offset, full = _single(t, spec, ps)
        return _entry(block, axis, offset, full, True, ps, spec)
    if layout == "grouped":
        axis, block, offset, full = _grouped(t, spec, ps)
        return _entry(block, axis, offset, full, True, ps, spec)
    dim = spec.dim % t.dim()
    rank, size, _ = _coords(spec, ps)
    return {
        f"segment{i}": _entry(view, dim, shard.offset, shard.full, shard.first_copy, ps, spec)
        for i, (shard, view) in enumerate(split_local(t, spec, rank, size))
    }


def empty_dcp_target(p, ps):
    """Zero tensors of the layout DCP loads into (segments held in copies: the whole segment)."""
    zeros = torch.zeros_like(p, dtype=torch.float32)
    spec = getattr(p, "shard_spec", None)
    if _layout(spec) != "segments":
        return to_dcp_tensor(zeros, p, ps)
    dim = spec.dim % p.dim()
    out = {}
    rank, size, _ = _coords(spec, ps)
    for i, (shard, view) in enumerate(split_local(zeros, spec, rank, size)):
        if shard.copies > 1:
            shape = list(view.shape)
            shape[dim] = shard.full
            out[f"segment{i}"] = torch.zeros(shape, dtype=torch.float32, device=p.device)
        else:
            out[f"segment{i}"] = _entry(view, dim, shard.offset, shard.full, True, ps, spec)
    return out


def _local_tensor(loaded):
    if torch.is_tensor(loaded) and type(loaded) is torch.Tensor:
        return loaded
    shards = loaded.local_shards()
    return shards[0].tensor if shards else None


def from_canonical_local(loaded, p, ps):
    """Back from what DCP loaded (empty_dcp_target's layout) to the local parameter (padding zero)."""
    spec = getattr(p, "shard_spec", None)
    layout = _layout(spec)
    if layout == "replicated":
        return loaded
    out = torch.zeros_like(p, dtype=torch.float32)
    dim = spec.dim % p.dim()
    if layout == "segments":
        rank, size, _ = _coords(spec, ps)
        for i, (shard, view) in enumerate(split_local(out, spec, rank, size)):
            piece = _local_tensor(loaded[f"segment{i}"])
            if shard.copies > 1:
                piece = piece.narrow(dim, shard.offset, shard.size)
            view.copy_(piece)
        return out
    piece = _local_tensor(loaded)
    if piece is not None:
        if layout == "single":
            out.narrow(dim, 0, piece.shape[dim]).copy_(piece)
        else:
            _, block, _, _ = _grouped(out, spec, ps)
            block.copy_(piece)
    return out


# ---- whole state dicts (tools, one process) ------------------------------------------------------


def full_to_canonical(state: dict, specs: dict) -> dict:
    """ReferenceGPT state dict -> canonical entries (nested dicts for segmented parameters)."""
    from megatron_sp.parallel_state import ParallelState

    serial = ParallelState()
    return {name: to_dcp_tensor(t, _Like(t, specs.get(name)), serial) for name, t in state.items()}


def canonical_to_full(entries: dict, specs: dict) -> dict:
    """Canonical entries (nested or flattened "name.segment<i>" keys) -> ReferenceGPT state dict."""
    nested: dict = {}
    for key, t in entries.items():
        base, _, last = key.rpartition(".")
        if last.startswith("segment") and base in specs:
            nested.setdefault(base, {})[last] = t
        else:
            nested[key] = t
    out = {}
    for name, value in nested.items():
        spec = specs.get(name)
        layout = _layout(spec)
        if layout == "segments":
            out[name] = torch.cat([value[f"segment{i}"] for i in range(len(spec.segments))], dim=spec.dim)
        elif layout == "grouped":
            dim = spec.dim % value.dim()
            out[name] = value.flatten(dim, dim + 1)
        else:
            out[name] = value
    return out


class _Like:
    """A stand-in parameter (shape and spec) for converting whole tensors at TP=1."""

    def __init__(self, t, spec):
        self.shape, self.shard_spec = t.shape, spec

    def dim(self):
        return len(self.shape)

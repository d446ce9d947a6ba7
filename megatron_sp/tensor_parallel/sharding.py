"""Where a rank's parameter shard sits in the full (serial) parameter, and moving between the two.

A parameter's `ShardSpec` says which dimension is split across the t ranks of a group: the one its
`group` role names (parallel_state.ROLES), the TP group for every layer today. A fused
layer concatenates several *segments* along that dimension (QKV: q, k, v; SwiGLU: gate, up), and
each segment is split on its own, so a rank holds matching slices of every segment:

    full   [q0 q1 q2 q3 | k0 k1 | v0 v1]          segments (4d, 2d, 2d), units (4, 2, 2) heads, t = 4
    rank r [q_r | k_{r//2} | v_{r//2}]            k, v: 2 heads < 4 ranks -> one head per rank, each
                                                  held by 2 ranks ("copies"; GQA as vLLM/Megatron do)

A segment with `units` u (indivisible pieces such as heads) and t ranks has min(u, t) parts; rank
r holds part r * parts // t, so with u < t consecutive groups of t/u ranks hold copies of one part.
Copies have partial gradients (each rank's own query heads only), summed over the
copies (tensor_parallel/partial_grads.py), and count once in norms and checkpoints (the first copy).

    shard_full   full [.., F, ..]  ->  local [.., F_local, ..]   (pads a single segment to t × local)
    gather_full  local             ->  full  [.., F, ..]         collective over the TP group
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_sp.parallel_state import TENSOR


@dataclass(frozen=True)
class ShardSpec:
    """How a local parameter relates to the full one.

    dim       dimension split across TP ranks (None: the parameter is replicated)
    segments  full sizes of the consecutive segments of `dim` in a fused layer; () = one segment
    units     per segment, indivisible units (heads) it is made of; () = no constraint (parts = t)
    full      size of `dim` in the serial model when it is padded here (the vocabulary); one segment
    group     the role of the ranks `dim` is split over ("tp"; an expert's weights will name expert-TP)
    """

    dim: Optional[int] = None
    segments: tuple = ()
    units: tuple = ()
    full: Optional[int] = None
    group: str = TENSOR

    def __post_init__(self):
        if self.units and len(self.units) != len(self.segments):
            raise ValueError(f"ShardSpec.units {self.units} must give one count per segment {self.segments}.")
        if self.full is not None and len(self.segments) > 1:
            raise ValueError("ShardSpec.full (padding) applies to single-segment parameters only.")

    @property
    def split(self) -> bool:
        return self.dim is not None


@dataclass(frozen=True)
class SegmentShard:
    """One segment on one rank: rows [offset, offset + size) of the full segment, which is
    `full` rows long; `copies` ranks hold the same rows, `first_copy` says whether this is the one
    that counts."""

    full: int
    size: int
    offset: int
    copies: int
    first_copy: bool


def segment_shards(spec: ShardSpec, local_size: int, tp_rank: int, tp_size: int) -> list[SegmentShard]:
    """This rank's piece of every segment of `spec.dim` (local_size: the local dim's length)."""
    if not spec.segments:
        full = spec.full if spec.full is not None else local_size * tp_size
        return [SegmentShard(full, local_size, tp_rank * local_size, 1, True)]
    out = []
    for i, seg in enumerate(spec.segments):
        units = spec.units[i] if spec.units else None
        parts = tp_size if units is None else min(units, tp_size)
        if seg % parts != 0 or tp_size % parts != 0 or (units is not None and units % parts != 0):
            raise ValueError(f"segment of {seg} rows ({units} units) cannot be split over {tp_size} ranks.")
        part, copies = tp_rank * parts // tp_size, tp_size // parts
        size = seg // parts
        out.append(SegmentShard(seg, size, part * size, copies, tp_rank % copies == 0))
    return out


def local_dim_size(spec: ShardSpec, full_size: int, tp_size: int) -> int:
    """Length of the split dim on a rank (full_size: padded single segment, or sum of segments)."""
    if not spec.segments:
        return full_size // tp_size
    return sum(s.size for s in segment_shards(spec, 0, 0, tp_size))


def full_dim_size(spec: ShardSpec, local_size: int, tp_size: int) -> int:
    """Length of the split dim in the serial model (unpadded)."""
    if spec.segments:
        return sum(spec.segments)
    return spec.full if spec.full is not None else local_size * tp_size


def split_local(t: torch.Tensor, spec: ShardSpec, tp_rank: int, tp_size: int):
    """[(shard, view of t)] per segment of a local tensor shaped like the parameter."""
    dim = spec.dim % t.dim()
    shards = segment_shards(spec, t.shape[dim], tp_rank, tp_size)
    views = t.split([s.size for s in shards], dim=dim)
    return list(zip(shards, views))


def shard_full(full: torch.Tensor, spec: ShardSpec, local_shape, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of a full tensor (a single segment is zero-padded to tp_size × local)."""
    if spec.dim is None:
        return full
    dim = spec.dim % full.dim()
    shards = segment_shards(spec, local_shape[dim], tp_rank, tp_size)
    padded = local_shape[dim] * tp_size
    if not spec.segments and full.shape[dim] < padded:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    sizes = [s.full for s in shards] if spec.segments else [full.shape[dim]]
    pieces = [seg.narrow(dim, s.offset, s.size) for s, seg in zip(shards, full.split(sizes, dim=dim))]
    return torch.cat(pieces, dim=dim).contiguous()


def gather_full(local: torch.Tensor, spec: ShardSpec, group) -> torch.Tensor:
    """The full tensor from every rank's shard (collective); padding stripped. Always a new tensor
    (never a view of the parameter). Segments held in copies are taken from their first copy."""
    if spec.dim is None:
        return local.clone()
    tp_size = 1 if group is None else dist.get_world_size(group)
    dim = spec.dim % local.dim()
    moved = local.movedim(dim, 0).contiguous()  # [F_local, ...]
    parts = [moved]
    if tp_size > 1:
        parts = [torch.empty_like(moved) for _ in range(tp_size)]
        dist.all_gather(parts, moved, group=group)
    by_rank = [split_local(p, dataclasses.replace(spec, dim=0), r, tp_size) for r, p in enumerate(parts)]
    segments = []
    for i in range(len(by_rank[0])):
        segments.append(torch.cat([view for shard, view in (rank[i] for rank in by_rank) if shard.first_copy]))
    full = torch.cat(segments)
    if not spec.segments:
        full = full[: by_rank[0][0][0].full]
    return full.movedim(0, dim).contiguous()

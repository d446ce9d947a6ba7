"""Hierarchical context parallelism (Megatron-LM's --cp-comm-type a2a+p2p with
--hierarchical-context-parallel-sizes A P): Ulysses' all-to-all inside groups of A adjacent CP ranks
(one node's NVLink in practice), ring attention across the P groups (the network).

CP rank g·A + i (group g, place i) holds zigzag chunks g·A + i and 2c-1-g·A-i of 2c (split.py). The
all-to-all over its group gives it n/A of its heads over the group's 2A chunks, which, put in
position order, are chunks [g·A, (g+1)·A) and their mirror: exactly the zigzag chunks of rank g in a
split over P ranks with chunks A times longer. So the ring over the P ranks of place i (parallel_state's
outer groups) runs unchanged on them, and the causal work stays balanced at both levels.

    q, k, v  [b, n, s/c, d]  --a2a over A, position order-->  [b, n/A, s/P, d]  --ring over P-->
    out      [b, n/A, s/P, d]  --a2a back-->  [b, n, s/c, d]

The sliding window, the sink (the heads' slice, merged once after the ring) and the dropout are the
ring's; head_offset moves by the heads of place i.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from megatron_sp.context_parallel.ring import RingAttention
from megatron_sp.context_parallel.split import CPSplit
from megatron_sp.context_parallel.ulysses import check_heads, gather_heads, head_slice, repeat_kv, scatter_heads


class HierarchicalAttention(nn.Module):
    """The core for --cp-comm-type a2a+p2p: q, k, v [b, heads, s/c, d], this rank's zigzag chunks."""

    def __init__(self, cfg, layer: int, ps):
        super().__init__()
        if len(ps.hierarchical_cp_groups) != 2:
            raise ValueError(
                "cp_comm_type a2a+p2p needs the hierarchical CP groups: initialise the model parallel groups "
                "with hierarchical_context_parallel_sizes."
            )
        (self.inner_size, self.outer_size), (self.inner_group, outer) = (
            ps.hierarchical_cp_sizes,
            ps.hierarchical_cp_groups,
        )
        self.inner_rank, self.outer_rank = ps.cp_rank % self.inner_size, ps.cp_rank // self.inner_size
        self.fused = cfg.use_fused_kernels
        self.ring = RingAttention(cfg, layer, outer)

    def forward(self, q, k, v, seq, head_offset: int, sink=None):
        a, nq = self.inner_size, q.shape[1]
        check_heads(nq, a, "the a2a level of hierarchical_context_parallel_sizes")
        k, v = repeat_kv(k, v, nq, a)
        q, k, v = (gather_heads(t, a, self.inner_group, self.fused, zigzag=True) for t in (q, k, v))
        split = seq.cp_split
        outer = CPSplit(split.seq_length, self.outer_size, self.outer_rank, True, split.whole_document_ids)
        heads = nq // a
        offset = head_offset + self.inner_rank * heads
        out = self.ring(q, k, v, replace(seq, cp_split=outer), offset, **head_slice(sink, self.inner_rank, heads))
        return scatter_heads(out, a, self.inner_group, self.fused, zigzag=True)

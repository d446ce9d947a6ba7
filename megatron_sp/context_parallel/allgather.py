"""All-gather context parallelism (Megatron-LM's --cp-comm-type allgather; Llama 3's long-context
runs): every rank gathers the whole sequence's keys and values over the CP group and attends with
its own queries, the zigzag chunks r and 2p-1-r (split.py), so the causal work stays balanced.

    k, v   [b, n_kv, s/p, d] this rank's chunks  --all-gather, back in position order-->  [b, n_kv, s, d]
    q      [b, n_q, s/p, d]  attends over them in planned blocks (ops/attention_runs.py): per query
           chunk the keys before it (unmasked), its own chunk (causal), the window's edge (masked)
    dK, dV [b, n_kv, s, d]   reduce-scattered (fp32, as the ring's travel) back to the chunks' owners

The gather is one collective, not overlapped with the compute (as in Megatron); it moves the whole
sequence's keys and values to every rank once forward and their gradients once backward. Documents,
GQA (the key/value heads are gathered as they are), the sliding window, the attention sink (merged
once per query) and the dropout (keyed by global positions) are the blocks'.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_sp import ops
from megatron_sp.layer_options import layer_window
from megatron_sp.ops.attention_runs import Keys, Run, runs_attention
from megatron_sp.ops.flash_attention import AttentionDropout


class _GatherSequence(torch.autograd.Function):
    """forward: [s/p, b, n, d] -> [s, b, n, d] in position order; backward: the gradient summed over
    the ranks (in fp32) and split back to each rank's chunks."""

    @staticmethod
    def forward(ctx, x, group, p, fused):
        ctx.group, ctx.p, ctx.fused = group, p, fused
        gathered = x.new_empty((p * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(gathered, x.contiguous(), group=group)  # the ranks' chunks in turn
        return ops.zigzag_reorder(gathered, p, dim=0, inverse=True, fused=fused)

    @staticmethod
    def backward(ctx, grad):
        laid = ops.zigzag_reorder(grad.contiguous(), ctx.p, dim=0, fused=ctx.fused).float()
        mine = laid.new_empty((laid.shape[0] // ctx.p, *laid.shape[1:]))
        dist.reduce_scatter_tensor(mine, laid, group=ctx.group)
        return mine.to(grad.dtype), None, None, None


def gather_sequence(t, group, p: int, fused: bool):
    """[b, n, s/p, d] this rank's zigzag chunks -> [b, n, s, d] the whole sequence (differentiable)."""
    return _GatherSequence.apply(t.permute(2, 0, 1, 3), group, p, fused).permute(1, 2, 0, 3)


class AllGatherAttention(nn.Module):
    """The core for --cp-comm-type allgather: q, k, v [b, heads, s/p, d], this rank's zigzag chunks."""

    def __init__(self, cfg, layer: int, ps):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.group, self.p, self.rank = ps.cp_group, ps.cp_size, ps.cp_rank
        self.window = layer_window(cfg, layer)

    def forward(self, q, k, v, seq, head_offset: int, sink=None):
        p = self.cfg.attention_dropout if seq.training else 0.0
        fused, split = self.cfg.use_fused_kernels, seq.cp_split
        k, v = (gather_sequence(t, self.group, self.p, fused) for t in (k, v))
        s = split.seq_length
        whole = Keys(torch.arange(s, device=q.device), split.whole_document_ids)
        drop = AttentionDropout(p, self.cfg.seed, self.layer, head_offset)
        q_runs, k_runs = split.runs(self.rank), (Run(0, 0, s),)
        sample_ids = seq.tp_index.sample_ids
        qx = split.keys(self.rank, q.device)
        return runs_attention(
            q, k, v, q_runs, k_runs, qx, whole, sample_ids, drop, fused=fused, window=self.window, sink=sink
        )

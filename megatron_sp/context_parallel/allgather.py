"""All-gather context parallelism (Megatron-LM's --cp-comm-type allgather; Llama 3's long-context
runs): every rank gathers the whole sequence's keys and values over the CP group and attends with
its own queries, the zigzag chunks r and 2p-1-r (split.py), so the causal work stays balanced.

    k, v   [b, n_kv, s/p, d] this rank's chunks  --all-gather, back in position order-->  [b, n_kv, s, d]
    q      [b, n_q, s/p, d]  attends over them in planned blocks (ops/attention_runs.py): per query
           chunk the keys before it (unmasked), its own chunk (causal), the window's edge (masked)
    dK, dV [b, n_kv, s, d]   reduce-scattered (fp32, as the ring's travel) back to the chunks' owners

The gather is one collective, not overlapped with the compute (as in Megatron). Only the rank's own
chunks are saved: the backward gathers the keys and values again, so a layer holds the whole
sequence's only while it runs. Per layer a rank sends (c-1)·(2e + 4)·(s/c)·b·2·n_kv·d bytes
(e: the activation's bytes; two gathers, one fp32 reduce-scatter). Documents,
GQA (the key/value heads are gathered as they are), the sliding window, the attention sink (merged
once per query) and the dropout (keyed by global positions) are the blocks'.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_sp import ops
from megatron_sp.layer_options import layer_window
from megatron_sp.ops.attention_runs import (
    Keys,
    Run,
    add_sink,
    blocks_backward,
    blocks_forward,
    empty_out,
    plan_blocks,
    sink_grad,
)
from megatron_sp.ops.flash_attention import AttentionDropout
from megatron_sp.tensor_parallel import mappings


def _gather(t, group, p: int, fused: bool):
    """[b, n, s/p, d] this rank's zigzag chunks -> [b, n, s, d] the whole sequence, in position order."""
    x = t.permute(2, 0, 1, 3).contiguous()  # [s/p, b, n, d]
    gathered = x.new_empty((p * x.shape[0], *x.shape[1:]))
    mappings.all_gather_into(gathered, x, group)  # the ranks' chunks in turn
    return ops.zigzag_reorder(gathered, p, dim=0, inverse=True, fused=fused).permute(1, 2, 0, 3)


def _reduce_scatter(grad, group, p: int, fused: bool):
    """_gather's adjoint on an fp32 gradient [b, n, s, d]: summed over the ranks, this rank's chunks."""
    laid = ops.zigzag_reorder(grad.permute(2, 0, 1, 3).contiguous(), p, dim=0, fused=fused)
    mine = laid.new_empty((laid.shape[0] // p, *laid.shape[1:]))
    mappings.reduce_scatter_into(mine, laid, group)
    return mine.permute(1, 2, 0, 3)


class _AllGatherAttention(torch.autograd.Function):
    """Keys and values gathered for the forward and again for the backward (only this rank's chunks
    are saved: the whole sequence's would cost c times the memory of every layer)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, group, p, qx, kx, blocks, sample_ids, drop, fused, window):
        k_all, v_all = (_gather(t, group, p, fused) for t in (k, v))
        out, lse = blocks_forward(q, k_all, v_all, qx, kx, blocks, sample_ids, drop, fused, window, *empty_out(q))
        if sink is not None:
            out, lse = add_sink(out, lse, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink, sample_ids)
        ctx.settings = (group, p, qx, kx, blocks, drop, fused, window)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink, sample_ids = ctx.saved_tensors
        group, p, qx, kx, blocks, drop, fused, window = ctx.settings
        dout = dout.contiguous()
        k_all, v_all = (_gather(t, group, p, fused) for t in (k, v))
        grads = tuple(torch.zeros_like(t, dtype=torch.float32) for t in (q, k_all, v_all))
        dq, dk, dv = blocks_backward(dout, q, k_all, v_all, out, lse, qx, kx, blocks, sample_ids, drop, fused,
                                     window, grads)  # fmt: skip
        dk, dv = (_reduce_scatter(g, group, p, fused) for g in (dk, dv))
        dsink = sink_grad(dout, out, lse, sink).to(sink.dtype) if sink is not None and ctx.needs_input_grad[3] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, *(None,) * 9


class AllGatherAttention(nn.Module):
    """The core for --cp-comm-type allgather: q, k, v [b, heads, s/p, d], this rank's zigzag chunks."""

    def __init__(self, cfg, layer: int, ps):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.group, self.p, self.rank = ps.cp_group, ps.cp_size, ps.cp_rank
        self.window = layer_window(cfg, layer)

    def forward(self, q, k, v, seq, head_offset: int, sink=None):
        p = self.cfg.attention_dropout if seq.training else 0.0
        split, s = seq.cp_split, seq.cp_split.seq_length
        whole = Keys(torch.arange(s, device=q.device), split.whole_document_ids)
        blocks = plan_blocks(split.runs(self.rank), (Run(0, 0, s),), self.window)
        drop = AttentionDropout(p, self.cfg.seed, self.layer, head_offset)
        qx, fused = split.keys(self.rank, q.device), self.cfg.use_fused_kernels
        args = (self.group, self.p, qx, whole, blocks, seq.tp_index.sample_ids, drop, fused, self.window)
        return _AllGatherAttention.apply(q.contiguous(), k, v, sink, *args)

"""Ring attention over the CP group (Liu et al. 2023; Megatron-LM's p2p context parallelism).

Each rank keeps its queries and passes its key/value block around the ring: at step i it attends to
the block of rank (r - i) mod p (ops/attention_lse.py: torch's flash kernels without attention
dropout, our blockwise kernel with the invariant dropout; both return the log-sum-exp), while the next
block is already in flight (isend/irecv, overlapped with the compute), and merges the partial
results by log-sum-exp. Zigzag split (split.py): rank r holds sequence chunks r and 2p-1-r, so
against the block of rank j its work is always half a block pair:

    j == r   its own block, causal (same tokens, increasing)  q [c_r | c_2p-1-r] × k [c_r | c_2p-1-r]
    j <  r   both query chunks see only the block's first chunk     q [both] × k [c_j]
    j >  r   only the second query chunk sees anything, all of it   q [c_2p-1-r] × k [both]

(ops/attention_runs.py plans these blocks from the chunks' positions.) With a sliding window the
plan also drops the chunk pairs the window cannot reach (their compute is skipped; the block still
travels, the next ranks need it) and masks the pairs its edge crosses. An attention sink is merged
into each query's log-sum-exp once, after the last block, and its gradient is this rank's queries'
share (summed over CP with every other gradient).

The backward walks the ring again from the saved q, k, v, merged out and log-sum-exp: each rank adds
its query's contribution to the travelling block's dK, dV, which arrive at their owner after p steps
(the incoming partial sums overlap the compute of the next contribution). Dropout masks are keyed by
global (sample, head, query, key) positions, so every rank draws the serial model's bits.

Forward and backward are one custom op each (megatron_sp::ring_attention[_backward]), so that
torch.compile keeps a layer in one graph: it cannot trace the point-to-point calls, and sees the
whole ring as one opaque call (its fake gives the shapes).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatron_sp.context_parallel.split import CPSplit
from megatron_sp.layer_options import layer_window
from megatron_sp.ops.attention_runs import add_sink, blocks_backward, blocks_forward, empty_out, plan_blocks, sink_grad
from megatron_sp.ops.flash_attention import AttentionDropout


class _Ring:
    """Point-to-point neighbours in the CP group; exchanges post send and receive together."""

    def __init__(self, group, rank, size):
        ranks = dist.get_process_group_ranks(group)
        self.group, self.size = group, size
        self.next, self.prev = ranks[(rank + 1) % size], ranks[(rank - 1) % size]

    def shift(self, tensors, tag: int = 0):
        """Sends `tensors` to the next rank, receives the previous rank's; returns (handles, received).
        Key/value blocks and gradient sums travel on different tags (gloo matches by tag; NCCL by
        order, which every rank keeps the same)."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group, tag + i) for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group, tag + i) for i, r in enumerate(received)]
        return dist.batch_isend_irecv(ops), received


def _wait(handles):
    for h in handles:
        h.wait()


def _ring_forward(q, k, v, split, sample_ids, drop, fused, ring, window):
    """(out [b, n, s, d] laid out [s, b, n, d], lse [b, n, s] fp32) of this rank's queries over the ring."""
    r, p = split.rank, split.size
    q_runs, qx = split.runs(r), split.keys(r, q.device)
    out, lse = empty_out(q)
    kv = (k, v)
    for step in range(p):
        handles, incoming = ring.shift(kv) if step < p - 1 else ([], None)
        j = (r - step) % p
        blocks = plan_blocks(q_runs, split.runs(j), window)  # none: the window ends before this block
        if blocks:
            blocks_forward(q, *kv, qx, split.keys(j, q.device), blocks, sample_ids, drop, fused, window, out, lse)
        _wait(handles)
        kv = incoming
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, split, sample_ids, drop, fused, ring, window):
    """(dq, dk, dv): the ring walked again; each block's dK, dV travel with it back to their owner."""
    r, p = split.rank, split.size
    dout = dout.contiguous()
    q_runs, qx = split.runs(r), split.keys(r, q.device)
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv, pending = (k, v), None
    for step in range(p):
        handles, incoming = ring.shift(kv) if step < p - 1 else ([], None)
        j = (r - step) % p
        dkv = torch.zeros(2, *kv[0].shape, dtype=torch.float32, device=q.device)  # this block's dK, dV
        blocks = plan_blocks(q_runs, split.runs(j), window)
        if blocks:
            grads = (dq, dkv[0], dkv[1])
            blocks_backward(dout, q, *kv, out, lse, qx, split.keys(j, q.device), blocks, sample_ids, drop, fused,
                            window, grads)  # fmt: skip
        if pending is not None:  # the partial sums of the ranks before us
            _wait(pending[0])
            dkv += pending[1][0]
        # towards the block's next holder, then home (a ring of one: home already)
        pending = ring.shift([dkv], tag=2) if p > 1 else ([], [dkv])
        _wait(handles)
        kv = incoming
    _wait(pending[0])
    dk, dv = pending[1][0]  # views of one buffer: a custom op's outputs may not alias, hence copies
    return dq.to(q.dtype), dk.to(k.dtype, copy=True), dv.to(v.dtype, copy=True)


# ---- the ring as one custom op: torch.compile keeps it whole (no graph break at the p2p calls) ----


def _setting(seq_length, group_name, document_ids, p, seed, layer, head_offset):
    """(CPSplit, _Ring, AttentionDropout) from the op's plain arguments."""
    group = dist.distributed_c10d._resolve_process_group(group_name)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    split = CPSplit(seq_length, size, rank, True, document_ids)
    return split, _Ring(group, rank, size), AttentionDropout(p, seed, layer, head_offset)


@torch.library.custom_op("megatron_sp::ring_attention", mutates_args=())
def ring_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: Optional[torch.Tensor],
    sample_ids: torch.Tensor,
    document_ids: Optional[torch.Tensor],
    seq_length: int,
    group_name: str,
    p: float,
    seed: int,
    layer: int,
    head_offset: int,
    fused: bool,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of ring attention; document_ids [b, s] of the whole sequence or None; sink [n] logits
    merged once after the ring, or None; window < 0: none."""
    split, ring, drop = _setting(seq_length, group_name, document_ids, p, seed, layer, head_offset)
    out, lse = _ring_forward(q, k, v, split, sample_ids, drop, fused, ring, None if window < 0 else window)
    return add_sink(out, lse, sink) if sink is not None else (out, lse)


@torch.library.custom_op("megatron_sp::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sample_ids: torch.Tensor,
    document_ids: Optional[torch.Tensor],
    seq_length: int,
    group_name: str,
    p: float,
    seed: int,
    layer: int,
    head_offset: int,
    fused: bool,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the final (sink merged) out and lse."""
    split, ring, drop = _setting(seq_length, group_name, document_ids, p, seed, layer, head_offset)
    return _ring_backward(dout, q, k, v, out, lse, split, sample_ids, drop, fused, ring, None if window < 0 else window)


@ring_attention_op.register_fake
def _(q, k, v, sink, sample_ids, document_ids, seq_length, group_name, p, seed, layer, head_offset, fused, window):
    b, n, s, d = q.shape
    return q.new_empty(s, b, n, d).permute(1, 2, 0, 3), q.new_empty((b, n, s), dtype=torch.float32)


@ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, *settings):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, sink, sample_ids, document_ids, *settings = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(q, k, v, sink, output[0], output[1], sample_ids, document_ids)
    ctx.settings = settings


def _backward(ctx, dout, _dlse):
    q, k, v, sink, out, lse, sample_ids, document_ids = ctx.saved_tensors
    grads = ring_attention_backward_op(dout, q, k, v, out, lse, sample_ids, document_ids, *ctx.settings)
    dsink = None
    if sink is not None and ctx.needs_input_grad[3]:  # this rank's queries' share; summed over CP with the rest
        dsink = sink_grad(dout, out, lse, sink).to(sink.dtype)
    return (*grads, dsink) + (None,) * 10


ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


class RingAttention(nn.Module):
    """The core for --cp-comm-type p2p: q, k, v [b, heads, s/p, d], this rank's zigzag chunks over the
    ring of `group` (the CP group; a2a+p2p: its outer level, on the inner level's gathered tokens)."""

    def __init__(self, cfg, layer: int, group):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.group_name = group.group_name
        self.window = layer_window(cfg, layer)

    def forward(self, q, k, v, seq, head_offset: int, sink=None):
        p = self.cfg.attention_dropout if seq.training else 0.0
        split = seq.cp_split
        out, _ = ring_attention_op(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            sink,
            seq.tp_index.sample_ids,
            split.whole_document_ids,
            split.seq_length,
            self.group_name,
            float(p),
            int(self.cfg.seed),
            int(self.layer),
            int(head_offset),
            bool(self.cfg.use_fused_kernels),
            -1 if self.window is None else int(self.window),
        )
        return out

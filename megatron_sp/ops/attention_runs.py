"""Attention of query runs over key runs, merged by log-sum-exp: the one engine behind every attention
that is not a single SDPA call (a sliding window, an attention sink, all-gathered keys, the ring's
blocks).

A *run* is a stretch of rows holding consecutive global positions (a zigzag chunk, the whole
sequence). Each (query run, key run) pair is planned on the host from integers alone:

    skip     no key of the run is visible to any query of the other (later, or behind the window)
    causal   the same positions on both sides, nothing cut by the window: the kernel's causal mask
    full     every key before every query and inside every query's window: no mask
    masked   the window's edge (or a partial overlap) crosses the block: a mask of positions

The vendor kernels (ops/attention_lse.py) run each planned block at attention dropout 0; our
blockwise kernel runs them with dropout, its mask keyed by global positions as everywhere. Blocks of
the same queries merge by `merge_partials`; the backward of every block takes the final out and lse.

A sink (Megatron's --softmax-type off-by-one / learnable: one logit per head that joins every
denominator and has no value) is merged once, after all blocks: lse' = logaddexp(lse, sink),
out' = out · exp(lse − lse'). With out' and lse' the blocks' backward formulas are unchanged
(P = exp(S − lse'), D = rowsum(dO ⊙ O')), and d sink = −Σ_rows exp(sink − lse') · D.

    q [b, n_q, s_q, d]   k, v [b, n_kv, s_k, d]   sink [n_q] or None   window: earlier keys a query sees
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_sp.ops.attention_lse import block_attention_bwd, block_attention_fwd
from megatron_sp.ops.flash_attention import AttentionDropout, merge_partials


@dataclass(frozen=True)
class Run:
    """Rows [row, row + length) of a tensor hold global positions [start, start + length)."""

    row: int
    start: int
    length: int


@dataclass(frozen=True)
class Block:
    """One kernel call: query rows q, key rows k, and how it is masked (see the module docstring)."""

    q: slice
    k: slice
    kind: str  # "causal" | "full" | "masked"


def runs_of(starts, length: int) -> tuple:
    """Runs of `length` rows each, laid one after another, starting at the given positions."""
    return tuple(Run(i * length, start, length) for i, start in enumerate(starts))


def _pair_blocks(qr: Run, kr: Run, window: Optional[int]) -> list:
    """The blocks of one (query run, key run) pair, in key order."""
    qa, qb, ka, kb = qr.start, qr.start + qr.length, kr.start, kr.start + kr.length
    w = window if window is not None else qb  # no window: every earlier position
    lo, hi = max(ka, qa - w), min(kb, qb)
    if lo >= hi:
        return []
    edge = qb - 1 - w  # keys from here on are inside every query's window
    pieces = [
        ((lo, min(hi, qa, edge)), "masked"),  # the window's edge
        ((max(lo, edge), min(hi, qa)), "full"),  # wholly earlier, wholly inside
    ]
    diagonal = (max(lo, qa), hi)
    pieces.append((diagonal, "causal" if diagonal == (qa, qb) and w >= qb - qa - 1 else "masked"))
    rows = slice(qr.row, qr.row + qr.length)
    return [Block(rows, slice(kr.row + a - ka, kr.row + b - ka), kind) for (a, b), kind in pieces if a < b]


def _merge_full(blocks: list) -> list:
    """Unmasked blocks that share their keys (or queries) and abut on the other side become one call."""
    merged = True
    while merged:
        merged = False
        for i, x in enumerate(blocks):
            for j, y in enumerate(blocks):
                if i == j or x.kind != "full" or y.kind != "full":
                    continue
                if x.k == y.k and x.q.stop == y.q.start:
                    joined = Block(slice(x.q.start, y.q.stop), x.k, "full")
                elif x.q == y.q and x.k.stop == y.k.start:
                    joined = Block(x.q, slice(x.k.start, y.k.stop), "full")
                else:
                    continue
                blocks = [b for n, b in enumerate(blocks) if n not in (i, j)] + [joined]
                merged = True
                break
            if merged:
                break
    return blocks


def plan_blocks(q_runs, k_runs, window: Optional[int] = None) -> list:
    """The kernel calls of q_runs' queries over k_runs' keys (each tuple ordered by position)."""
    if q_runs == k_runs:  # the same tokens: one causal call when the window cuts nothing
        span = q_runs[-1].start + q_runs[-1].length - 1 - q_runs[0].start
        last = q_runs[-1].row + q_runs[-1].length
        if window is None or window >= span:
            return [Block(slice(q_runs[0].row, last), slice(k_runs[0].row, last), "causal")]
    return _merge_full([blk for qr in q_runs for kr in k_runs for blk in _pair_blocks(qr, kr, window)])


@dataclass(frozen=True)
class Keys:
    """Positions [s] and document ids [b, s] (or None) of one side of the attention."""

    positions: torch.Tensor
    segments: Optional[torch.Tensor]

    def rows(self, sl: slice):
        return self.positions[sl], None if self.segments is None else self.segments[:, sl]


def blocks_forward(q, k, v, qx: Keys, kx: Keys, blocks, sample_ids, drop, fused, window, out, lse):
    """Adds the blocks' attention into out [b, n, s_q, d] and lse [b, n, s_q] fp32 (in place)."""
    for blk in blocks:
        (qp, qs), (kp, ks) = qx.rows(blk.q), kx.rows(blk.k)
        part, part_lse = block_attention_fwd(
            q[:, :, blk.q], k[:, :, blk.k], v[:, :, blk.k], qp, kp, qs, ks, sample_ids, drop, fused,
            causal=blk.kind == "causal", window=window, masked=blk.kind == "masked",
        )  # fmt: skip
        out[:, :, blk.q], lse[:, :, blk.q] = merge_partials(out[:, :, blk.q], lse[:, :, blk.q], part, part_lse.float())
    return out, lse


def blocks_backward(dout, q, k, v, out, lse, qx: Keys, kx: Keys, blocks, sample_ids, drop, fused, window, grads):
    """Adds the blocks' gradients into grads = (dq [like q], dk, dv [like k]) fp32 (in place)."""
    dq, dk, dv = grads
    for blk in blocks:
        (qp, qs), (kp, ks) = qx.rows(blk.q), kx.rows(blk.k)
        dq_b, dk_b, dv_b = block_attention_bwd(
            dout[:, :, blk.q], q[:, :, blk.q], k[:, :, blk.k], v[:, :, blk.k], out[:, :, blk.q], lse[:, :, blk.q],
            qp, kp, qs, ks, sample_ids, drop, fused,
            causal=blk.kind == "causal", window=window, masked=blk.kind == "masked",
        )  # fmt: skip
        dq[:, :, blk.q] += dq_b.float()
        dk[:, :, blk.k] += dk_b.float()
        dv[:, :, blk.k] += dv_b.float()
    return grads


def empty_out(q):
    """(out [b, n, s, d] laid out [s, b, n, d], lse -inf [b, n, s] fp32): what no key has been merged into."""
    b, n, s, d = q.shape  # [s, b, n, d] in memory: the projection's input is a view of it
    out = torch.zeros(s, b, n, d, dtype=q.dtype, device=q.device).permute(1, 2, 0, 3)
    return out, torch.full((b, n, s), float("-inf"), dtype=torch.float32, device=q.device)


def add_sink(out, lse, sink):
    """(out, lse) with the sink's logit [n] merged into each row's softmax denominator (once)."""
    logit = sink.float().view(1, -1, 1)
    merged = torch.logaddexp(lse, logit.expand_as(lse))
    scaled = out.float() * torch.exp(lse - merged).unsqueeze(-1)
    b, n, s, d = out.shape
    laid = torch.empty(s, b, n, d, dtype=out.dtype, device=out.device).permute(1, 2, 0, 3)
    laid.copy_(scaled)
    return laid, merged


def sink_grad(dout, out, lse, sink):
    """d loss / d sink [n] (fp32) from the final out and lse (the sink merged)."""
    delta = (dout.float() * out.float()).sum(-1)  # [b, n, s]
    return -(torch.exp(sink.float().view(1, -1, 1) - lse) * delta).sum((0, 2))


class RunsAttention(torch.autograd.Function):
    """Local attention of q's runs over k's runs (all here: no communication), sink merged once."""

    @staticmethod
    def forward(ctx, q, k, v, sink, qx, kx, blocks, sample_ids, drop, fused, window):
        out, lse = blocks_forward(q, k, v, qx, kx, blocks, sample_ids, drop, fused, window, *empty_out(q))
        if sink is not None:
            out, lse = add_sink(out, lse, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink, sample_ids)
        ctx.settings = (qx, kx, blocks, drop, fused, window)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink, sample_ids = ctx.saved_tensors
        qx, kx, blocks, drop, fused, window = ctx.settings
        dout = dout.contiguous()
        grads = tuple(torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
        dq, dk, dv = blocks_backward(dout, q, k, v, out, lse, qx, kx, blocks, sample_ids, drop, fused, window, grads)
        dsink = sink_grad(dout, out, lse, sink).to(sink.dtype) if sink is not None and ctx.needs_input_grad[3] else None
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, *(None,) * 7


def runs_attention(
    q,
    k,
    v,
    q_runs,
    k_runs,
    qx: Keys,
    kx: Keys,
    sample_ids,
    drop: AttentionDropout,
    *,
    fused: bool = True,
    window: Optional[int] = None,
    sink: Optional[torch.Tensor] = None,
):
    """Differentiable attention of q (rows in q_runs) over k, v (rows in k_runs); returns out."""
    blocks = plan_blocks(q_runs, k_runs, window)
    return RunsAttention.apply(q, k, v, sink, qx, kx, blocks, sample_ids, drop, fused, window)

"""Blockwise (flash-style) attention with the parallelism-invariant dropout: no s×s tensor is kept.

    q            [b, n_q, s_q, d]      k, v  [b, n_kv, s_k, d]   (query head i uses kv head i // (n_q/n_kv))
    q_positions  [s_q] int64, k_positions [s_k] int64   global positions: key j is visible to query i
                                                        iff k_positions[j] <= q_positions[i] (causal)
    q_segments   [b, s_q] / k_segments [b, s_k] int64 or None   documents: visible only within one
    window       int or None                            sliding window: visible only if q - k <= window
    sample_ids   [b] int64                              global sample indices (dropout keys)
    returns      out [b, n_q, s_q, d] (q's dtype; laid out [s_q, b, n_q, d] in memory), lse [b, n_q, s_q]
                 fp32 (log-sum-exp of the scaled scores; -inf for a query that sees no key, whose output is 0)

Forward per query block: scores of one key block at a time, online softmax (running max m, sum row_sum,
accumulator), dropout on the normalised probabilities with the mask regenerated from Philox for the
block's global (sample, head, query, key) coordinates, exactly `attention_keep_mask`'s bits.
Backward per block from (q, k, v, out, lse): P = exp(S - lse) recomputed, the same mask redrawn,
D = rowsum(dO * O), dS = P * (dP - D). Outputs of the same queries over disjoint key sets merge
exactly with `merge_partials` (ring attention), and the backward of one key set needs only the
merged out/lse, so blocks of keys can live on other ranks.

This file is the reference (plain torch, block loops in Python); csrc/ implements the same function
(megatron_sp::flash_attention_fwd/_bwd) when built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_sp.ops._extension import register_op, use_fused
from megatron_sp.ops.philox import DropoutIndex, attention_keep_mask

BLOCK = 64  # query and key rows per block


@dataclass(frozen=True)
class AttentionDropout:
    """What keys the attention-probability dropout: p, seed, layer, global head of local head 0."""

    p: float = 0.0
    seed: int = 0
    layer: int = 0
    head_offset: int = 0


def visible(q_pos, k_pos, q_seg=None, k_seg=None, window=None):
    """[b or 1, 1, s_q, s_k] bool: key visible to query (causal by position, within the sliding window
    of `window` earlier tokens if given, within a document)."""
    allowed = k_pos.view(1, 1, 1, -1) <= q_pos.view(1, 1, -1, 1)
    if window is not None:
        allowed = allowed & (q_pos.view(1, 1, -1, 1) - k_pos.view(1, 1, 1, -1) <= window)
    if q_seg is not None:
        allowed = allowed & (q_seg[:, None, :, None] == k_seg[:, None, None, :])
    return allowed


def _keep(drop: AttentionDropout, shape, q_pos, k_pos, sample_ids):
    index = DropoutIndex(q_pos, sample_ids)
    return attention_keep_mask(shape, drop.p, drop.seed, drop.layer, index, drop.head_offset, k_pos)


def _expand_kv(t, rep):
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def _acc(t):
    """Accumulation dtype: fp32, or fp64 for fp64 inputs (tests)."""
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def flash_attention_fwd_reference(
    q,
    k,
    v,
    q_positions,
    k_positions,
    q_segments,
    k_segments,
    sample_ids,
    drop: AttentionDropout,
    block: int = BLOCK,
    window: Optional[int] = None,
):
    b, nq, sq, d = q.shape
    rep = nq // k.shape[1]
    kf, vf = _acc(_expand_kv(k, rep)), _acc(_expand_kv(v, rep))
    scale = 1.0 / math.sqrt(d)
    # [s, b, n, d] in memory: the caller's permute back to [s, b, n d] for the projection is a view
    out = torch.zeros(sq, b, nq, d, dtype=kf.dtype, device=q.device).permute(1, 2, 0, 3)
    lse = torch.full((b, nq, sq), float("-inf"), dtype=kf.dtype, device=q.device)
    for q0 in range(0, sq, block):
        qs = slice(q0, min(q0 + block, sq))
        qb = _acc(q[:, :, qs])
        m = torch.full(qb.shape[:-1], float("-inf"), dtype=qb.dtype, device=q.device)
        row_sum = torch.zeros_like(m)
        acc = torch.zeros_like(qb)
        for k0 in range(0, k.shape[2], block):
            ks = slice(k0, min(k0 + block, k.shape[2]))
            s = torch.matmul(qb, kf[:, :, ks].transpose(-1, -2)) * scale  # [b, n, bq, bk]
            seg = (q_segments[:, qs], k_segments[:, ks]) if q_segments is not None else (None, None)
            s = s.masked_fill(~visible(q_positions[qs], k_positions[ks], *seg, window), float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            base = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows seeing nothing
            p = torch.exp(s - base.unsqueeze(-1))
            correction = torch.exp(m - base)
            row_sum = row_sum * correction + p.sum(-1)
            if drop.p > 0.0:
                p = p * _keep(drop, tuple(p.shape), q_positions[qs], k_positions[ks], sample_ids) / (1.0 - drop.p)
            acc = acc * correction.unsqueeze(-1) + torch.matmul(p, vf[:, :, ks])
            m = m_new
        seen = row_sum > 0
        out[:, :, qs] = torch.where(seen.unsqueeze(-1), acc / row_sum.clamp(min=1e-30).unsqueeze(-1), 0.0)
        lse[:, :, qs] = torch.where(seen, m + torch.log(row_sum.clamp(min=1e-30)), float("-inf"))
    out = out if out.dtype == q.dtype else out.permute(2, 0, 1, 3).to(q.dtype).permute(1, 2, 0, 3)
    return out, lse if q.dtype == torch.float64 else lse.float()


def flash_attention_bwd_reference(
    dout,
    q,
    k,
    v,
    out,
    lse,
    q_positions,
    k_positions,
    q_segments,
    k_segments,
    sample_ids,
    drop: AttentionDropout,
    block: int = BLOCK,
    window: Optional[int] = None,
):
    """(dq, dk, dv) of the keys given, from the final (possibly merged over key sets) out and lse."""
    b, nq, sq, d = q.shape
    nkv, sk = k.shape[1], k.shape[2]
    rep = nq // nkv
    kf, vf = _acc(_expand_kv(k, rep)), _acc(_expand_kv(v, rep))
    scale = 1.0 / math.sqrt(d)
    dof, qf = _acc(dout), _acc(q)
    delta = (dof * _acc(out)).sum(-1)  # D = rowsum(dO * O)
    dq = torch.zeros_like(qf)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    for q0 in range(0, sq, block):
        qs = slice(q0, min(q0 + block, sq))
        for k0 in range(0, sk, block):
            ks = slice(k0, min(k0 + block, sk))
            s = torch.matmul(qf[:, :, qs], kf[:, :, ks].transpose(-1, -2)) * scale
            seg = (q_segments[:, qs], k_segments[:, ks]) if q_segments is not None else (None, None)
            seen = visible(q_positions[qs], k_positions[ks], *seg, window)
            p = torch.exp(s - safe_lse[:, :, qs].unsqueeze(-1)).masked_fill(~seen, 0.0)
            p = p.masked_fill(torch.isinf(lse[:, :, qs]).unsqueeze(-1), 0.0)
            dp = torch.matmul(dof[:, :, qs], vf[:, :, ks].transpose(-1, -2))
            if drop.p > 0.0:
                keep = _keep(drop, tuple(p.shape), q_positions[qs], k_positions[ks], sample_ids)
                pd = p * keep / (1.0 - drop.p)
                dp = dp * keep / (1.0 - drop.p)
            else:
                pd = p
            dv[:, :, ks] += torch.matmul(pd.transpose(-1, -2), dof[:, :, qs])
            ds = p * (dp - delta[:, :, qs].unsqueeze(-1))
            dq[:, :, qs] += torch.matmul(ds, kf[:, :, ks]) * scale
            dk[:, :, ks] += torch.matmul(ds.transpose(-1, -2), qf[:, :, qs]) * scale
    if rep > 1:
        dk = dk.view(b, nkv, rep, sk, d).sum(2)
        dv = dv.view(b, nkv, rep, sk, d).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Attention of the same queries over two disjoint key sets -> over their union (fp32 math)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return (_acc(out_a) * wa + _acc(out_b) * wb).to(out_a.dtype), lse


def _use_kernel(fused, q):
    return use_fused(fused, q) and _BUILT and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


def flash_attention_fwd(
    q,
    k,
    v,
    q_positions,
    k_positions,
    q_segments,
    k_segments,
    sample_ids,
    drop: AttentionDropout,
    fused: bool = True,
    window: Optional[int] = None,
):
    """(out, lse); the fused op when built for q's device, else the reference."""
    if _use_kernel(fused, q):
        return torch.ops.megatron_sp.flash_attention_fwd(
            q,
            k,
            v,
            q_positions,
            k_positions,
            q_segments,
            k_segments,
            sample_ids,
            float(drop.p),
            int(drop.seed),
            int(drop.layer),
            int(drop.head_offset),
            _window_arg(window),
        )
    return flash_attention_fwd_reference(
        q, k, v, q_positions, k_positions, q_segments, k_segments, sample_ids, drop, window=window
    )


def flash_attention_bwd(
    dout,
    q,
    k,
    v,
    out,
    lse,
    q_positions,
    k_positions,
    q_segments,
    k_segments,
    sample_ids,
    drop: AttentionDropout,
    fused: bool = True,
    window: Optional[int] = None,
):
    """(dq, dk, dv); the fused op when built for q's device, else the reference."""
    if _use_kernel(fused, q):
        return torch.ops.megatron_sp.flash_attention_bwd(
            dout,
            q,
            k,
            v,
            out,
            lse,
            q_positions,
            k_positions,
            q_segments,
            k_segments,
            sample_ids,
            float(drop.p),
            int(drop.seed),
            int(drop.layer),
            int(drop.head_offset),
            _window_arg(window),
        )
    return flash_attention_bwd_reference(
        dout, q, k, v, out, lse, q_positions, k_positions, q_segments, k_segments, sample_ids, drop, window=window
    )


def _window_arg(window: Optional[int]) -> int:
    """The fused op's window: -1 for none."""
    return -1 if window is None else int(window)


class FlashAttention(torch.autograd.Function):
    """Autograd of the blockwise attention: saves q, k, v, out, lse (no s×s tensor)."""

    @staticmethod
    def forward(ctx, q, k, v, q_positions, k_positions, q_segments, k_segments, sample_ids, drop, fused, window=None):
        out, lse = flash_attention_fwd(
            q, k, v, q_positions, k_positions, q_segments, k_segments, sample_ids, drop, fused, window
        )
        ctx.save_for_backward(q, k, v, out, lse, q_positions, k_positions, sample_ids, q_segments, k_segments)
        ctx.drop, ctx.fused, ctx.window = drop, fused, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, q_pos, k_pos, samples, q_seg, k_seg = ctx.saved_tensors
        dq, dk, dv = flash_attention_bwd(
            dout.contiguous(), q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, samples, ctx.drop, ctx.fused, ctx.window
        )
        return dq, dk, dv, None, None, None, None, None, None, None, None


def flash_attention(
    q,
    k,
    v,
    q_positions,
    k_positions,
    sample_ids,
    drop: AttentionDropout,
    q_segments: Optional[torch.Tensor] = None,
    k_segments: Optional[torch.Tensor] = None,
    fused: bool = True,
    window: Optional[int] = None,
):
    """Differentiable blockwise causal attention (see the module docstring); returns out."""
    return FlashAttention.apply(
        q, k, v, q_positions, k_positions, q_segments, k_segments, sample_ids, drop, fused, window
    )


# ---- the fused op (csrc/flash_attention.cpp, csrc/cuda/flash_attention.cu) ------------------


def _seq_major(shape, like, dtype=None):
    """An empty [b, n, s, d] tensor laid out [s, b, n, d] in memory, as the kernels return them."""
    b, n, s, d = shape
    return like.new_empty((s, b, n, d), dtype=dtype).permute(1, 2, 0, 3)


def _fake_fwd(
    q, k, v, q_positions, k_positions, q_segments, k_segments, sample_ids, p, seed, layer, head_offset, window=-1
):
    return _seq_major(q.shape, q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _fake_bwd(
    dout,
    q,
    k,
    v,
    out,
    lse,
    q_positions,
    k_positions,
    q_segments,
    k_segments,
    sample_ids,
    p,
    seed,
    layer,
    head_offset,
    window=-1,
):
    return _seq_major(q.shape, q), _seq_major(k.shape, k), _seq_major(v.shape, v)


def _setup_context(ctx, inputs, output):
    q, k, v, q_pos, k_pos, q_seg, k_seg, samples, *dropout_and_window = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)  # the backward of lse itself is not implemented
    ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos, samples, q_seg, k_seg)
    ctx.dropout_args = tuple(dropout_and_window)  # p, seed, layer, head_offset, window


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, q_pos, k_pos, samples, q_seg, k_seg = ctx.saved_tensors
    dq, dk, dv = torch.ops.megatron_sp.flash_attention_bwd(
        dout, q, k, v, out, lse, q_pos, k_pos, q_seg, k_seg, samples, *ctx.dropout_args
    )
    return (dq, dk, dv) + (None,) * (5 + len(ctx.dropout_args))


_BUILT = register_op("flash_attention", _fake_fwd, _fake_bwd, _backward, _setup_context)

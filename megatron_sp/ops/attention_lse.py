"""Attention that returns its log-sum-exp, for ring attention's merge: torch's own kernels at attention
dropout 0, our blockwise kernel (ops/flash_attention.py) only for the parallelism-invariant dropout.

    q        [b, n_q, s_q, d]      k, v  [b, n_kv, s_k, d]   (query head i uses kv head i // (n_q/n_kv))
    causal   q and k are the same tokens in the same (increasing) order: key j visible to query i iff j <= i;
             otherwise every key precedes every query (all visible)
    allowed  [b or 1, 1, s_q, s_k] bool, True = visible (documents), or None; when given it is the
             whole visibility, causality included, and `causal` is ignored
    returns  out [b, n_q, s_q, d] (q's dtype), lse [b, n_q, s_q] fp32: -inf (and out 0) for a query
             that sees no key here, so that `merge_partials` merges it away

The vendor kernels by device (all compute softmax(q kᵀ / √d) v with an fp32 log-sum-exp):

    cpu    aten::_scaled_dot_product_flash_attention_for_cpu (+ _backward); a mask as an additive bias
    cuda   aten::_scaled_dot_product_flash_attention (bf16/fp16, head dim ≤ 256 and a multiple of 8, no
           mask), else aten::_scaled_dot_product_efficient_attention with the mask as an additive bias

They take equal query and key/value head counts, so grouped key/value heads are repeated to the query
heads here and their gradients summed back. The backward is given the final (merged over the ring)
out and lse, as the kernels' own backward ops allow, so one key block's gradients need no other block.

FlexAttention (document block masks) was not taken: on torch 2.13's CPU build it is either compiled
by inductor per shape and mask or run as its unfused math fallback (with a warning, ~3 s for one
[1, 4, 256, 64] call), while the ops above take the documents as an additive mask, return the
log-sum-exp as they are, and need no compilation on either device.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_sp.ops.flash_attention import AttentionDropout, flash_attention_bwd, flash_attention_fwd, visible

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)
_BIAS_ALIGN = 16  # the memory-efficient kernel wants the bias rows aligned (torch pads to 8; 16 is safe)
_LSE_ALIGN = 32  # ... and returns / takes its log-sum-exp padded to a multiple of 32 queries


def _backend(q, allowed) -> str:
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda":
        d = q.shape[-1]
        return "cuda_flash" if allowed is None and q.dtype in _HALF and d % 8 == 0 and d <= 256 else "cuda_efficient"
    raise ValueError(f"no vendor attention kernel with a log-sum-exp for device {q.device.type!r}; use cpu or cuda.")


def _repeat_kv(t, rep):
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)  # [b, n_kv, s, d] -> [b, n_q, s, d]


def _sum_kv(grad, rep):
    if rep == 1:
        return grad
    b, nq, s, d = grad.shape
    return grad.view(b, nq // rep, rep, s, d).sum(2)  # [b, n_kv, s, d]


def _bias(allowed, dtype, align: int = 1):
    """Additive bias [b|1, 1, s_q, s_k] of `dtype`: 0 where visible, -inf elsewhere; rows padded to
    `align` elements in memory (the padding is sliced off, only the strides keep it)."""
    sq, sk = allowed.shape[-2:]
    padded = -(-sk // align) * align
    bias = torch.full((*allowed.shape[:-1], padded), float("-inf"), dtype=dtype, device=allowed.device)
    return bias[..., :sk].masked_fill(allowed, 0.0)


def _pad_lse(lse):
    sq = lse.shape[-1]
    padded = -(-sq // _LSE_ALIGN) * _LSE_ALIGN
    return torch.nn.functional.pad(lse, (0, padded - sq)) if padded != sq else lse.contiguous()


def _forward(q, k, v, causal, allowed):
    """The vendor kernel on equal head counts: (out, lse [b, n, s_q] fp32)."""
    scale, sq = 1.0 / math.sqrt(q.shape[-1]), q.shape[2]
    backend = _backend(q, allowed)
    if backend == "cpu":
        bias = None if allowed is None else _bias(allowed, q.dtype)
        return aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal and bias is None, attn_mask=bias, scale=scale
        )
    if backend == "cuda_flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse[..., :sq]
    bias = None if allowed is None else _bias(allowed, q.dtype, _BIAS_ALIGN).expand(q.shape[0], q.shape[1], -1, -1)
    out, lse = aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, causal and bias is None, scale=scale
    )[:2]
    return out, lse[..., :sq]


def _backward(dout, q, k, v, out, lse, causal, allowed):
    """(dq, dk, dv) on equal head counts from the final out and lse (lse finite: see below)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    backend = _backend(q, allowed)
    if backend == "cpu":
        bias = None if allowed is None else _bias(allowed, q.dtype)
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal and bias is None, attn_mask=bias, scale=scale
        )
    no_rng = torch.empty((), dtype=torch.long)  # the kernels read their RNG state only with dropout
    if backend == "cuda_flash":
        sq, sk = q.shape[2], k.shape[2]
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, sq, sk, 0.0, causal, no_rng, no_rng, scale=scale
        )
    bias = None if allowed is None else _bias(allowed, q.dtype, _BIAS_ALIGN).expand(q.shape[0], q.shape[1], -1, -1)
    causal = causal and bias is None
    grads = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, _pad_lse(lse), no_rng, no_rng, 0.0, [True, True, True, False], causal, scale=scale
    )
    return grads[:3]


def attention_with_lse(q, k, v, *, causal: bool, allowed: Optional[torch.Tensor] = None):
    """(out, lse) of the vendor kernel (see the module docstring); no dropout."""
    rep = q.shape[1] // k.shape[1]
    out, lse = _forward(q, _repeat_kv(k, rep), _repeat_kv(v, rep), causal, allowed)
    lse = lse.float()
    if allowed is not None:  # a query that sees no key here: out 0, lse -inf (kernels differ on these rows)
        unseen = ~allowed.any(-1)  # [b|1, 1, s_q]
        out = out.masked_fill(unseen.unsqueeze(-1), 0.0)
        lse = lse.masked_fill(unseen, float("-inf"))
    return out, lse


def attention_with_lse_backward(dout, q, k, v, out, lse, *, causal: bool, allowed: Optional[torch.Tensor] = None):
    """(dq, dk, dv) of attention_with_lse's keys, from the final out and lse (merged over key sets)."""
    rep = q.shape[1] // k.shape[1]
    # A query that sees no key at all has lse -inf (never in causal attention, where it sees itself);
    # 0 keeps exp(score - lse) finite there and its masked scores still give 0.
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    dq, dk, dv = _backward(
        dout.contiguous(), q, _repeat_kv(k, rep), _repeat_kv(v, rep), out.to(q.dtype), lse, causal, allowed
    )
    return dq, _sum_kv(dk, rep), _sum_kv(dv, rep)


# ---- one block of keys, as ring attention needs it ----------------------------------------------


def block_attention_fwd(
    q,
    k,
    v,
    q_positions,
    k_positions,
    q_segments,
    k_segments,
    sample_ids,
    drop: AttentionDropout,
    fused,
    *,
    causal,
    window=None,
    masked=False,
):
    """(out, lse) of q over one key block: the vendor kernel without dropout, ours with it (the
    invariant mask). Positions/segments as in ops/flash_attention.py; `causal` must agree with them
    (q and k the same tokens) and saves deriving it on the host. window: the sliding window (our kernel
    takes it from the positions; the vendor kernels as a mask when `masked`, which the caller sets
    where the window cuts the block, or where the block needs a mask of positions for another reason)."""
    if drop.p > 0.0:
        return flash_attention_fwd(
            q, k, v, q_positions, k_positions, q_segments, k_segments, sample_ids, drop, fused, window
        )
    allowed = _allowed(q_positions, k_positions, q_segments, k_segments, window, masked)
    return attention_with_lse(q, k, v, causal=causal, allowed=allowed)


def block_attention_bwd(
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
    drop,
    fused,
    *,
    causal,
    window=None,
    masked=False,
):
    """(dq, dk, dv) of one key block, the kernel chosen as in block_attention_fwd."""
    if drop.p > 0.0:
        return flash_attention_bwd(
            dout, q, k, v, out, lse, q_positions, k_positions, q_segments, k_segments, sample_ids, drop, fused, window
        )
    allowed = _allowed(q_positions, k_positions, q_segments, k_segments, window, masked)
    return attention_with_lse_backward(dout, q, k, v, out, lse, causal=causal, allowed=allowed)


def _allowed(q_positions, k_positions, q_segments, k_segments, window, masked):
    if q_segments is None and not masked:
        return None
    return visible(q_positions, k_positions, q_segments, k_segments, window if masked else None)

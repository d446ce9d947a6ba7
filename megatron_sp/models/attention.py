"""Causal self-attention core shared by the serial and the parallel model.

    q, k, v  [b, n, s, d]  (n: the heads this rank holds)  ->  [b, n, s, d]

Without attention dropout it is F.scaled_dot_product_attention (flash / memory-efficient kernels,
no s² tensor kept). With attention dropout it is the explicit softmax, because the dropout mask must
be the parallelism-invariant one (tensor_parallel/random.py), which SDPA cannot take.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_sp.tensor_parallel.random import DropoutIndex, apply_keep_mask, attention_keep_mask


def allowed_mask(attention_mask: Optional[torch.Tensor], s: int, device) -> Optional[torch.Tensor]:
    """Megatron's mask (True = masked out, [b, 1, s, s]) combined with causality, as True = allowed."""
    if attention_mask is None:
        return None
    causal = torch.ones(s, s, dtype=torch.bool, device=device).tril()
    return causal & ~attention_mask.bool()


def causal_attention(q, k, v, *, attention_mask=None, dropout_p: float = 0.0, seed: int = 0,
                     layer: int = 0, index: Optional[DropoutIndex] = None, head_offset: int = 0):
    """Causal attention; attention_mask [b, 1, s, s] bool with True = masked out (documents)."""
    s = q.shape[-2]
    allowed = allowed_mask(attention_mask, s, q.device)
    if dropout_p == 0.0:
        if allowed is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    if allowed is None:
        allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))  # [b, n, s, s]
    scores = scores.float().masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    keep = attention_keep_mask(tuple(probs.shape), dropout_p, seed, layer, index, head_offset,
                               index.token_positions)
    return torch.matmul(apply_keep_mask(probs, keep, dropout_p), v)

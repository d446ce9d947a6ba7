"""Parallelism-invariant dropout: every mask bit is a pure function of where the element lives in
the *global* (serial) tensor, never of which rank holds it.

Generator: Philox4x32-10 (Salmon et al., SC'11), counter-based, so any element can be drawn
without drawing the ones before it. For one element

    key     = (seed mod 2^32, layer * 16 + site)
    counter = (feature // 4, token_position, sample_id mod 2^32, sample_id div 2^32)
    bits    = Philox(key, counter)[feature % 4]        # one 32-bit word
    keep    = bits >= round(p * 2^32)                  # P(drop) = p; kept values scaled by 1/(1-p)

where `token_position` is the global position in the sequence (the query position for attention
probabilities), `feature` the global feature index (hidden unit; for attention probabilities
head * seq_len + key_position) and `sample_id` the sample's global index (the training loop passes
consumed-samples offsets so that masks change every step and agree across data-parallel ranks).
A TP=4+SP rank draws exactly the bits the TP=1 model draws for the same elements.

This file is the reference; its C++/CUDA twin is csrc/philox.h (bit-identical), used by the fused ops
(dropout_add, flash_attention) beside this one.
All arithmetic is on int64 tensors holding uint32 values; products of two uint32 fit the 64 bits
(two's complement wrap keeps the low 64 bits exact), and hi/lo words are extracted with masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
MASK32 = 0xFFFFFFFF
ROUNDS = 10

# Dropout sites inside one layer (the key's low 4 bits). Embedding dropout uses layer 0, site EMBEDDING.
SITE_EMBEDDING, SITE_ATTENTION_PROBS, SITE_ATTENTION_OUT, SITE_MLP_OUT = 0, 1, 2, 3


def _mulhilo(a: torch.Tensor, m: int):
    prod = a * m  # exact low 64 bits of a 32x32 product
    return (prod >> 32) & MASK32, prod & MASK32


def philox4x32(c0, c1, c2, c3, k0: int, k1: int):
    """Philox4x32-10 on broadcastable int64 tensors of uint32 values; returns four uint32 words."""
    for _ in range(ROUNDS):
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W0) & MASK32, (k1 + PHILOX_W1) & MASK32
    return c0, c1, c2, c3


def dropout_key(seed: int, layer: int, site: int):
    return seed & MASK32, ((layer * 16 + site) & MASK32)


def random_bits(
    seed: int, layer: int, site: int, token_position: torch.Tensor, feature: torch.Tensor, sample_id: torch.Tensor
) -> torch.Tensor:
    """32-bit random words (int64) for broadcastable global index tensors (int64)."""
    k0, k1 = dropout_key(seed, layer, site)
    zero = torch.zeros((), dtype=torch.int64, device=feature.device)
    c0 = (feature // 4) + zero
    c1 = token_position & MASK32
    c2, c3 = sample_id & MASK32, (sample_id >> 32) & MASK32
    words = philox4x32(c0, c1 + zero, c2 + zero, c3 + zero, k0, k1)
    lane = feature % 4
    out = torch.where(lane == 0, words[0], words[1])
    out = torch.where(lane == 2, words[2], out)
    return torch.where(lane == 3, words[3], out)


def drop_threshold(p: float) -> int:
    """Elements whose 32-bit word is below this are dropped."""
    return min(int(round(p * 4294967296.0)), MASK32)


@dataclass(frozen=True)
class DropoutIndex:
    """Where a [s, b, h] (or attention-prob) shard sits in the global tensor.

    token_positions  [s_local] int64  global sequence positions of this shard's rows
    sample_ids       [b]       int64  global sample indices of the micro-batch
    """

    token_positions: torch.Tensor
    sample_ids: torch.Tensor


def hidden_keep_mask(
    shape, p: float, seed: int, layer: int, site: int, index: DropoutIndex, feature_offset: int = 0
) -> torch.Tensor:
    """Boolean keep-mask for an activation [s, b, h_local] whose features start at feature_offset."""
    s, b, h = shape
    device = index.token_positions.device
    pos = index.token_positions.view(s, 1, 1).to(torch.int64)
    sample = index.sample_ids.view(1, b, 1).to(device=device, dtype=torch.int64)
    feature = torch.arange(feature_offset, feature_offset + h, device=device).view(1, 1, h)
    return random_bits(seed, layer, site, pos, feature, sample) >= drop_threshold(p)


def attention_keep_mask(
    shape, p: float, seed: int, layer: int, index: DropoutIndex, head_offset: int, key_positions: torch.Tensor
) -> torch.Tensor:
    """Keep-mask for attention probabilities [b, n_local, s_q, s_k].

    index.token_positions are the query positions [s_q]; key_positions [s_k]; the feature index is
    global_head * key_span + key_position with key_span = 2^20 (so it does not depend on s).
    """
    b, n, sq, sk = shape
    device = key_positions.device
    sample = index.sample_ids.view(b, 1, 1, 1).to(device=device, dtype=torch.int64)
    head = torch.arange(head_offset, head_offset + n, device=device).view(1, n, 1, 1)
    query = index.token_positions.view(1, 1, sq, 1).to(torch.int64)
    feature = head * (1 << 20) + key_positions.view(1, 1, 1, sk).to(torch.int64)
    return random_bits(seed, layer, SITE_ATTENTION_PROBS, query, feature, sample) >= drop_threshold(p)


class _KeepMaskScale(torch.autograd.Function):
    """y = x * keep * scale that saves only the boolean mask (1 byte per element, as in Megatron),
    not a copy of it in x's dtype; the same two roundings as the plain expression in both passes."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return x * keep.to(x.dtype) * scale

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * ctx.scale * keep.to(grad.dtype), None, None


def apply_keep_mask(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted dropout with a given boolean mask; differentiable in x. Autograd keeps the bool
    mask for the backward (1 byte per element)."""
    if keep.dtype != torch.bool:
        raise TypeError(f"apply_keep_mask expects a bool mask, got {keep.dtype}")
    return _KeepMaskScale.apply(x, keep, 1.0 / (1.0 - p))


def dropout(
    x: torch.Tensor,
    p: float,
    seed: int,
    layer: int,
    site: int,
    index: DropoutIndex,
    feature_offset: int = 0,
    training: bool = True,
) -> torch.Tensor:
    """Parallelism-invariant dropout of an [s, b, h_local] activation (reference implementation)."""
    if not training or p == 0.0:
        return x
    keep = hidden_keep_mask(tuple(x.shape), p, seed, layer, site, index, feature_offset)
    return apply_keep_mask(x, keep, p)


def default_index(seq_length: int, batch_size: int, device=None) -> DropoutIndex:
    """Positions 0..s-1 and sample ids 0..b-1: what a forward without explicit ids uses."""
    return DropoutIndex(torch.arange(seq_length, device=device), torch.arange(batch_size, device=device))

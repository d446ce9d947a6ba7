"""Fused blockwise attention (C++ CPU op) against the reference of ops/flash_attention.py: forward
(out, lse) and backward (dq, dk, dv) with dropout (the mask bits show as fp32 agreement), GQA,
document segments, ring-style offset and disjoint key ranges (rows that see nothing), strided
inputs, the key-block split of the backward, the sliding window, merge_partials, opcheck,
torch.compile; and the reference against the explicit softmax of models/attention.py."""

import pytest
import torch

from megatron_sp.models.attention import causal_attention
from megatron_sp.ops.flash_attention import (
    AttentionDropout,
    FlashAttention,
    flash_attention_bwd,
    flash_attention_bwd_reference,
    flash_attention_fwd,
    flash_attention_fwd_reference,
    merge_partials,
)
from megatron_sp.ops.philox import DropoutIndex
from megatron_sp.testing import FLOAT_DTYPES, assert_close_dtype

MSP = torch.ops.megatron_sp
needs_op = pytest.mark.extension("flash_attention_fwd")


def _qkv(b, nq, nkv, sq, sk, d, dtype, gen, strided=False):
    """q [b, nq, sq, d], k, v [b, nkv, sk, d]; strided: views of fused [s, b, heads * d] slabs, as
    the model's QKV projection gives them (no dimension of stride 1 but d)."""
    if not strided:
        return tuple(
            torch.randn(shape, generator=gen).to(dtype) for shape in ((b, nq, sq, d), (b, nkv, sk, d), (b, nkv, sk, d))
        )
    slab_q = torch.randn(sq, b, (nq + 1) * d, generator=gen).to(dtype)
    slab_kv = torch.randn(sk, b, 2 * nkv * d + 3, generator=gen).to(dtype)
    q = slab_q[..., d:].view(sq, b, nq, d).permute(1, 2, 0, 3)
    k = slab_kv[..., 3 : 3 + nkv * d].view(sk, b, nkv, d).permute(1, 2, 0, 3)
    v = slab_kv[..., 3 + nkv * d :].view(sk, b, nkv, d).permute(1, 2, 0, 3)
    return q, k, v


def _segments(b, s, gen):
    return torch.randint(0, 3, (b, s), generator=gen).sort(-1).values


def _compare(q, k, v, q_pos, k_pos, q_seg, k_seg, samples, drop, gen, window=None):
    """Fused vs reference: out, lse, then (dq, dk, dv) from the reference's out and lse."""
    dtype = q.dtype
    out, lse = flash_attention_fwd(q, k, v, q_pos, k_pos, q_seg, k_seg, samples, drop, window=window)
    ref_out, ref_lse = flash_attention_fwd_reference(q, k, v, q_pos, k_pos, q_seg, k_seg, samples, drop, window=window)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == q.shape
    assert out.permute(2, 0, 1, 3).is_contiguous(), "out must be laid out [s, b, n, d]"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows that see nothing differ"
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    _close(out, ref_out, dtype, sums=False)
    dout = torch.randn(q.shape, generator=gen).to(dtype)
    args = (q_pos, k_pos, q_seg, k_seg, samples, drop)
    got = flash_attention_bwd(dout, q, k, v, ref_out, ref_lse, *args, window=window)
    want = flash_attention_bwd_reference(dout, q, k, v, ref_out, ref_lse, *args, window=window)
    for name, a, e, like in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert a.dtype == like.dtype and a.shape == like.shape, name
        _close(a, e, dtype)
    return out, lse


def _close(actual, expected, dtype, sums=True):
    """fp32: 1e-5 (the fused op sums in another order); bf16/fp16: the dtype tolerance, atol
    widened by the magnitude of the sums for the gradients (they sum over keys and query heads)."""
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        scale = 2 * (1 + expected.float().abs().max().item()) if sums else 1.0
        assert_close_dtype(actual, expected, dtype, scale=scale)


# b, nq, nkv, sq, sk, d: single element, partial blocks, GQA (rep 2 and 4), d not a multiple of 16.
SHAPES = [(1, 1, 1, 1, 1, 1), (2, 2, 2, 70, 70, 16), (1, 4, 2, 130, 130, 24), (2, 4, 1, 65, 65, 7)]


@needs_op
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_fp32_matches_reference(shape, p):
    gen = torch.Generator().manual_seed(sum(shape) + int(10 * p))
    b, nq, nkv, sq, sk, d = shape
    q, k, v = _qkv(*shape, torch.float32, gen)
    pos = torch.arange(sq) + 17
    samples = torch.randint(0, 1 << 40, (b,), generator=gen)
    _compare(q, k, v, pos, pos, None, None, samples, AttentionDropout(p, 2**33 + 5, 3, 2), gen)


@needs_op
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_dtypes_strided_segments_dropout(dtype):
    """bf16/fp16/fp32 with the model's strided views, documents and dropout together."""
    gen = torch.Generator().manual_seed(7)
    b, nq, nkv, s, d = 2, 4, 2, 100, 32
    q, k, v = _qkv(b, nq, nkv, s, s, d, dtype, gen, strided=True)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    seg = _segments(b, s, gen)
    pos = torch.arange(s)
    _compare(q, k, v, pos, pos, seg, seg, torch.tensor([3, 1 << 33]), AttentionDropout(0.2, 11, 1, 6), gen)


@needs_op
@pytest.mark.parametrize(
    "window,dtype", [(0, torch.float32), (9, torch.float32), (70, torch.bfloat16), (200, torch.float32)]
)
def test_sliding_window(window, dtype):
    """A sliding window of 0 (each query itself), 9 and 70 keys over 3 blocks (pairs skipped, cut, whole)
    and one wider than the sequence (nothing cut): GQA, documents, strided views, dropout."""
    gen = torch.Generator().manual_seed(window)
    b, nq, nkv, s, d = 2, 4, 2, 150, 16
    q, k, v = _qkv(b, nq, nkv, s, s, d, dtype, gen, strided=True)
    seg, pos = _segments(b, s, gen), torch.arange(s) + 3
    drop = AttentionDropout(0.2, 5, 1, 2)
    out, _ = _compare(q, k, v, pos, pos, seg, seg, torch.tensor([4, 1 << 33]), drop, gen, window=window)
    plain, _ = flash_attention_fwd(q, k, v, pos, pos, seg, seg, torch.tensor([4, 1 << 33]), drop)
    longest = max(int(torch.unique_consecutive(row, return_counts=True)[1].max()) for row in seg)
    assert torch.equal(out, plain) == (window >= longest - 1)  # it changes what it cuts, only that


@needs_op
@pytest.mark.parametrize("k_start,sk", [(0, 64), (130, 40), (40, 90), (96, 70)])
def test_ring_blocks_offset_and_disjoint_keys(k_start, sk):
    """Queries at 96..195 against keys elsewhere (another rank's block): all visible, none
    visible (out 0, lse -inf), or partly (early query rows see nothing)."""
    gen = torch.Generator().manual_seed(k_start)
    q, k, v = _qkv(1, 2, 1, 100, sk, 16, torch.float32, gen)
    q_pos, k_pos = torch.arange(96, 196), torch.arange(k_start, k_start + sk)
    out, lse = _compare(q, k, v, q_pos, k_pos, None, None, torch.tensor([5]), AttentionDropout(0.1, 3, 2, 0), gen)
    blind = k_pos.min() > q_pos  # queries before every key
    assert torch.isinf(lse[:, :, blind]).all() and (out[:, :, blind] == 0).all()


@needs_op
def test_zigzag_positions_and_unseen_segments():
    """Non-consecutive key positions (a zigzag chunk pair: the scalar Philox path) and documents
    that start in the queries but have no key (rows that see nothing inside a visible block)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = _qkv(2, 2, 2, 48, 48, 16, torch.float32, gen)
    pos = torch.cat([torch.arange(0, 24), torch.arange(72, 96)])
    q_seg = torch.tensor([[0] * 10 + [1] * 38, [2] * 48])
    k_seg = torch.tensor([[1] * 48, [2] * 20 + [3] * 28])
    out, lse = _compare(q, k, v, pos, pos, q_seg, k_seg, torch.tensor([1, 2]), AttentionDropout(0.25, 9, 4, 1), gen)
    assert torch.isinf(lse[0, :, :10]).all() and (out[0, :, :10] == 0).all()


@needs_op
def test_backward_key_block_split():
    """One (batch, key/value head) and several key blocks: the backward splits the key blocks over
    chunks, each with its own fp32 dQ copy (csrc/flash_attention_bwd.cpp)."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = _qkv(1, 3, 1, 200, 200, 16, torch.float32, gen)
    pos = torch.arange(200)
    _compare(q, k, v, pos, pos, None, None, torch.tensor([0]), AttentionDropout(0.1, 1, 0, 0), gen)


@needs_op
def test_merge_partials_of_two_key_halves_equals_the_whole():
    gen = torch.Generator().manual_seed(11)
    q, k, v = _qkv(2, 2, 2, 80, 80, 16, torch.float32, gen)
    pos, samples, drop = torch.arange(80), torch.tensor([4, 9]), AttentionDropout(0.2, 5, 1, 0)
    whole, whole_lse = flash_attention_fwd(q, k, v, pos, pos, None, None, samples, drop)
    halves = [
        flash_attention_fwd(q, k[:, :, ks], v[:, :, ks], pos, pos[ks], None, None, samples, drop)
        for ks in (slice(0, 50), slice(50, None))
    ]
    merged, merged_lse = merge_partials(*halves[0], *halves[1])
    torch.testing.assert_close(merged, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged_lse, whole_lse, rtol=1e-5, atol=1e-6)


@needs_op
def test_autograd_matches_reference_backward():
    """FlashAttention (fused both ways) against its fused=False twin, and the op's own autograd."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (t.requires_grad_() for t in _qkv(2, 4, 2, 40, 40, 8, torch.float32, gen, strided=True))
    pos, samples, drop = torch.arange(40), torch.tensor([1, 2]), AttentionDropout(0.1, 4, 0, 0)
    dout = torch.randn(q.shape, generator=gen)
    grads = []
    for fused in (True, False):
        out = FlashAttention.apply(q, k, v, pos, pos, None, None, samples, drop, fused)
        grads.append(torch.autograd.grad(out, (q, k, v), dout))
    out, _ = MSP.flash_attention_fwd(q, k, v, pos, pos, None, None, samples, 0.1, 4, 0, 0)
    grads.append(torch.autograd.grad(out, (q, k, v), dout))
    for fused_grads in (grads[0], grads[2]):
        for a, e in zip(fused_grads, grads[1]):
            torch.testing.assert_close(a, e, rtol=2e-5, atol=2e-5)


@needs_op
def test_opcheck():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (t.requires_grad_() for t in _qkv(2, 2, 1, 20, 20, 8, torch.float32, gen, strided=True))
    pos, samples = torch.arange(20), torch.tensor([0, 1])
    seg = _segments(2, 20, gen)
    for segs, p in (((None, None), 0.2), ((seg, seg), 0.0)):
        torch.library.opcheck(MSP.flash_attention_fwd, (q, k, v, pos, pos, *segs, samples, p, 3, 1, 2))
    torch.library.opcheck(MSP.flash_attention_fwd, (q, k, v, pos, pos, None, None, samples, 0.2, 3, 1, 2, 5))
    out, lse = MSP.flash_attention_fwd(q, k, v, pos, pos, None, None, samples, 0.2, 3, 1, 2)
    dout = torch.randn(q.shape, generator=gen)
    torch.library.opcheck(
        MSP.flash_attention_bwd,
        (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, pos, pos, None, None, samples, 0.2, 3, 1, 2),
    )


@needs_op
def test_compile_fullgraph():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, 24, 24, 8, torch.float32, gen))
    q_pos, k_pos = torch.arange(24), torch.arange(24)  # distinct tensors: Dynamo refuses aliases
    samples, drop = torch.tensor([3]), AttentionDropout(0.2, 1, 0, 0)
    fn = lambda q, k, v: FlashAttention.apply(q, k, v, q_pos, k_pos, None, None, samples, drop, True)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    assert torch.equal(out, fn(q, k, v))
    out.sum().backward()
    assert q.grad is not None and k.grad is not None


@needs_op
def test_bad_inputs_raise_one_sentence():
    q, k = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8)
    pos, samples = torch.arange(4), torch.tensor([0])
    with pytest.raises(RuntimeError, match="multiple of the key/value heads"):
        MSP.flash_attention_fwd(q, k, k, pos, pos, None, None, samples, 0.0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="q_positions must be int64"):
        MSP.flash_attention_fwd(q, q, q, pos.int(), pos, None, None, samples, 0.0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="together"):
        MSP.flash_attention_fwd(q, q, q, pos, pos, pos.view(1, 4), None, samples, 0.0, 0, 0, 0)


@pytest.mark.parametrize("gqa,window", [(False, None), (True, None), (True, 7)])
def test_reference_matches_explicit_softmax(gqa, window):
    """The reference against causal_attention(explicit=True) (s x s softmax, the same dropout bits
    through attention_keep_mask), with documents and a sliding window: outputs and gradients."""
    gen = torch.Generator().manual_seed(6)
    b, nq, s, d = 2, 4, 70, 16
    q, k, v = (t.requires_grad_() for t in _qkv(b, nq, 2 if gqa else nq, s, s, d, torch.float32, gen))
    seg = _segments(b, s, gen)
    index = DropoutIndex(torch.arange(s) + 5, torch.tensor([2, 1 << 34]))
    mask = seg[:, None, :, None] != seg[:, None, None, :]  # True = masked out
    drop = AttentionDropout(0.2, 8, 3, 4)
    ref = FlashAttention.apply(
        q, k, v, index.token_positions, index.token_positions, seg, seg, index.sample_ids, drop, False, window
    )
    explicit = causal_attention(
        q, k, v, attention_mask=mask, dropout_p=0.2, seed=8, layer=3, index=index, head_offset=4, explicit=True,
        window=window,
    )  # fmt: skip
    torch.testing.assert_close(ref, explicit, rtol=1e-5, atol=1e-5)
    dout = torch.randn(ref.shape, generator=gen)
    for a, e in zip(torch.autograd.grad(ref, (q, k, v), dout), torch.autograd.grad(explicit, (q, k, v), dout)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=2e-5)

"""The vendor attention with log-sum-exp (ops/attention_lse.py) against the blockwise reference of
ops/flash_attention.py at dropout 0: out, lse and (dq, dk, dv) for ring attention's three block kinds
(causal own block, all-visible earlier block, documents with queries that see nothing), GQA, and the
backward given the merged out/lse of two key blocks; the planned blocks of ops/attention_runs.py (the
ring's kinds, the pairs a sliding window skips) and their attention with a window, a sink and
documents against the explicit softmax. On CPU always; on CUDA too when one is present
(bench/gpu_check.sh runs this file), where bf16 takes the flash kernel and fp32 or masks the
memory-efficient one."""

import pytest
import torch

from megatron_sp.ops.attention_lse import block_attention_bwd, block_attention_fwd
from megatron_sp.ops.attention_runs import Block, Keys, Run, plan_blocks, runs_attention, runs_of
from megatron_sp.ops.flash_attention import (
    AttentionDropout,
    flash_attention_bwd_reference,
    flash_attention_fwd_reference,
    merge_partials,
)
from megatron_sp.ops.philox import DropoutIndex
from megatron_sp.testing import assert_close_dtype

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NO_DROPOUT = AttentionDropout()


def _close(actual, expected, dtype, scale=1.0):
    if dtype == torch.float32:  # the CUDA kernels sum in another order than the CPU ones
        tol = 2e-5 if actual.device.type == "cpu" else 1e-4
        torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)
    else:
        assert_close_dtype(actual, expected.to(actual.dtype), dtype, scale=scale)


def _case(kind, b, nq, nkv, c, d, dtype, device, gen):
    """q, k, v, positions and segments of one ring block pair (zigzag chunks of c tokens, p = 2):
    rank 0's own block (chunks 0 and 3, causal), or rank 1's queries (chunks 1, 2) against the first
    chunk of rank 0's block (all visible by position)."""
    own = torch.cat([torch.arange(c), torch.arange(3 * c, 4 * c)])
    q_pos, k_pos = (own, own) if kind == "causal" else (torch.arange(c, 3 * c), torch.arange(c))
    docs = torch.randint(0, 3, (b, 4 * c), generator=gen).sort(-1).values if kind == "documents" else None
    q = torch.randn(b, nq, q_pos.numel(), d, generator=gen)
    k, v = (torch.randn(b, nkv, k_pos.numel(), d, generator=gen) for _ in range(2))
    q_seg = None if docs is None else docs[:, q_pos]
    k_seg = None if docs is None else docs[:, k_pos]
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return [t.to(device, dtype) for t in (q, k, v)] + [move(t) for t in (q_pos, k_pos, q_seg, k_seg)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,nkv", [("causal", 4), ("causal", 2), ("earlier", 1), ("documents", 2)])
def test_block_matches_reference(device, dtype, kind, nkv):
    gen = torch.Generator().manual_seed(0)
    q, k, v, q_pos, k_pos, q_seg, k_seg = _case(kind, 2, 4, nkv, 24, 16, dtype, device, gen)
    samples = torch.arange(2, device=device)
    args = (q_pos, k_pos, q_seg, k_seg, samples, NO_DROPOUT)
    out, lse = block_attention_fwd(q, k, v, *args, False, causal=kind == "causal")
    ref_out, ref_lse = flash_attention_fwd_reference(q, k, v, *args)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == q.shape
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "queries that see nothing differ"
    if kind == "documents":
        assert torch.isinf(ref_lse).any(), "the case must have queries that see no key of the block"
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=1e-4)
    _close(out, ref_out, dtype)
    dout = torch.randn(q.shape, generator=gen).to(device, dtype)
    # the merged lse of a whole ring is finite: every query sees itself in its own block
    final_lse = torch.where(torch.isinf(ref_lse), torch.zeros_like(ref_lse), ref_lse)
    got = block_attention_bwd(dout, q, k, v, ref_out, final_lse, *args, False, causal=kind == "causal")
    want = flash_attention_bwd_reference(dout, q, k, v, ref_out, final_lse, *args)
    for name, a, e, like in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert a.shape == like.shape, name
        _close(a, e, dtype, scale=2 * (1 + e.float().abs().max().item()))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_from_merged_lse_of_two_blocks(device):
    """Two key blocks merged by log-sum-exp, then each block's backward from the merged out/lse: the
    gradients sum to those of attention over the union (what ring attention relies on)."""
    gen = torch.Generator().manual_seed(1)
    b, n, c, d = 1, 2, 16, 8
    pos = torch.arange(2 * c, device=device)
    q, k, v = (torch.randn(b, n, 2 * c, d, generator=gen).to(device) for _ in range(3))
    k_late, v_late, k_early, v_early = k[:, :, c:], v[:, :, c:], k[:, :, :c], v[:, :, :c]
    q_late = q[:, :, c:]
    args = lambda kp: (pos[c:], kp, None, None, torch.zeros(1, dtype=torch.long, device=device), NO_DROPOUT)  # noqa: E731
    out_a, lse_a = block_attention_fwd(q_late, k_late, v_late, *args(pos[c:]), False, causal=True)
    out_b, lse_b = block_attention_fwd(q_late, k_early, v_early, *args(pos[:c]), False, causal=False)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    whole_args = (pos[c:], pos, None, None, torch.zeros(1, dtype=torch.long, device=device), NO_DROPOUT)
    ref_out, ref_lse = flash_attention_fwd_reference(q_late, k, v, *whole_args)
    torch.testing.assert_close(out, ref_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-5, atol=2e-5)
    dout = torch.randn(out.shape, generator=gen).to(device)
    dq_a, dk_a, dv_a = block_attention_bwd(dout, q_late, k_late, v_late, out, lse, *args(pos[c:]), False, causal=True)
    dq_b, dk_b, dv_b = block_attention_bwd(
        dout, q_late, k_early, v_early, out, lse, *args(pos[:c]), False, causal=False
    )
    dq, dk, dv = flash_attention_bwd_reference(dout, q_late, k, v, ref_out, ref_lse, *whole_args)
    torch.testing.assert_close(dq_a + dq_b, dq, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(torch.cat([dk_b, dk_a], 2), dk, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(torch.cat([dv_b, dv_a], 2), dv, rtol=2e-5, atol=2e-5)


# ---- planned blocks (ops/attention_runs.py): the window's skipped pairs, the sink merged once ------


def test_plan_gives_the_ring_blocks_and_skips_what_the_window_cannot_see():
    """Zigzag chunks of 4 tokens, p = 4 (rank r: chunks r, 7-r). Without a window: the ring's three
    kinds (own block causal; earlier block: both query chunks x its first chunk; later block: the
    second query chunk x both), one call each. A window of 3 tokens: rank 2's queries see nothing of
    rank 0's block (chunks 0, 7) and only the edge of rank 1's first chunk."""
    runs = {r: runs_of([4 * r, 4 * (7 - r)], 4) for r in range(4)}
    own, earlier, later = (plan_blocks(runs[2], runs[j]) for j in (2, 1, 3))
    assert own == [Block(slice(0, 8), slice(0, 8), "causal")]
    assert earlier == [Block(slice(0, 8), slice(0, 4), "full")]
    assert later == [Block(slice(4, 8), slice(0, 8), "full")]
    assert plan_blocks(runs[2], runs[0], window=3) == []
    assert plan_blocks(runs[2], runs[1], window=3) == [Block(slice(0, 4), slice(1, 4), "masked")]
    assert [b.kind for b in plan_blocks(runs[2], runs[2], window=3)] == ["causal", "causal"]  # chunks far apart
    whole = (Run(0, 0, 32),)  # all-gathered keys: per query chunk the keys before it and its own chunk
    assert sorted((b.k.stop, b.kind) for b in plan_blocks(runs[1], whole)) == [
        (4, "full"),
        (8, "causal"),
        (24, "full"),
        (28, "causal"),
    ]


def _explicit(q, k, v, s, positions, drop, window, sink, documents):
    """The serial definition (models/attention.py's explicit softmax) over the whole sequence."""
    from megatron_sp.models.attention import causal_attention, document_mask

    index = DropoutIndex(positions, torch.tensor([5, 1 << 35]))
    mask = None if documents is None else document_mask(documents)
    return causal_attention(
        q, k, v, attention_mask=mask, dropout_p=drop.p, seed=drop.seed, layer=drop.layer, index=index,
        head_offset=drop.head_offset, explicit=True, window=window, sink=sink,
    )  # fmt: skip


@pytest.mark.parametrize(
    "p,window,sink,documents",
    [
        (0.0, 5, True, False),
        (0.0, None, True, True),
        (0.2, 6, True, True),
        (0.2, 3, False, False),
        (0.0, 10, False, True),
    ],
)
def test_runs_attention_is_the_explicit_softmax(p, window, sink, documents):
    """Zigzag query chunks of rank 1 of 2 over the whole sequence (all-gathered keys) and the whole
    sequence over itself, GQA, with a window, a learnt sink and documents, dropout off (torch's
    kernels) and on (ours): out and the gradients of q, k, v and the sink equal the explicit softmax
    over the whole sequence, the sink's taken once per query."""
    gen = torch.Generator().manual_seed(int(10 * p) + (window or 0))
    b, nq, nkv, s, d = 2, 4, 2, 40, 8
    q, k, v = (torch.randn(b, n, s, d, generator=gen).requires_grad_() for n in (nq, nkv, nkv))
    logits = (torch.randn(nq, generator=gen) if sink else torch.zeros(nq)).requires_grad_()
    docs = torch.randint(0, 3, (b, s), generator=gen).sort(-1).values if documents else None
    positions, drop = torch.arange(s), AttentionDropout(p, 9, 2, 4)
    want = _explicit(q, k, v, s, positions, drop, window, logits, docs)
    dout = torch.randn(want.shape, generator=gen)
    want_grads = torch.autograd.grad(want, (q, k, v, logits), dout, retain_graph=True)
    rows = torch.cat([torch.arange(10, 20), torch.arange(20, 30)])  # rank 1 of 2: chunks 1, 2 of 4
    for q_runs, q_rows in ((runs_of([10, 20], 10), rows), ((Run(0, 0, s),), torch.arange(s))):
        whole = Keys(positions, docs)
        mine = Keys(positions[q_rows], None if docs is None else docs[:, q_rows])
        q_mine = q[:, :, q_rows]
        args = (q_runs, (Run(0, 0, s),), mine, whole, torch.tensor([5, 1 << 35]), drop)
        got = runs_attention(q_mine, k, v, *args, fused=False, window=window, sink=logits)
        torch.testing.assert_close(got, want[:, :, q_rows], rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad(got, (q, k, v, logits), dout[:, :, q_rows])
        partial = torch.autograd.grad(want[:, :, q_rows], (q, k, v, logits), dout[:, :, q_rows], retain_graph=True)
        for name, a, e in zip(("dq", "dk", "dv", "dsink"), grads, partial):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=name)
    assert window is None or not torch.equal(want, _explicit(q, k, v, s, positions, drop, None, logits, docs))
    assert want_grads[3].abs().sum() > 0  # the sink's gradient is real (zero logits too: off-by-one)

"""The vendor attention with log-sum-exp (ops/attention_lse.py) against the blockwise reference of
ops/flash_attention.py at dropout 0: out, lse and (dq, dk, dv) for ring attention's three block kinds
(causal own block, all-visible earlier block, documents with queries that see nothing), GQA, and the
backward given the merged out/lse of two key blocks. On CPU always; on CUDA too when one is present
(bench/gpu_check.sh runs this file), where bf16 takes the flash kernel and fp32 or masks the
memory-efficient one."""

import pytest
import torch

from megatron_sp.ops.attention_lse import block_attention_bwd, block_attention_fwd
from megatron_sp.ops.flash_attention import (
    AttentionDropout,
    flash_attention_bwd_reference,
    flash_attention_fwd_reference,
    merge_partials,
)
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

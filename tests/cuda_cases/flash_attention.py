"""Cases of flash_attention's CUDA kernels (csrc/cuda/flash_attention*.cu) and binding: the forward,
then the backward kernels from the reference's out and lse. fp32 runs the SIMT kernels, bf16/fp16
the tensor-core ones (the emulator reports an sm_90 device). fp32 results agree with the reference
within 2e-5 (the kernels sum in another order), which also shows that the dropout bits match;
bf16/fp16 within their tolerances; rows that see nothing give out 0, lse -inf. The mask cases read
the dropout mask itself out of the forward (V one-hot per key: out[q, k] is 0 exactly where key k
is dropped or hidden) and compare it bit for bit with attention_keep_mask."""

from __future__ import annotations

import importlib

import torch

from cuda_cases import DTYPE_NAME, Case, cpu, opcheck
from megatron_sp.ops.philox import DropoutIndex, attention_keep_mask
from megatron_sp.testing import assert_close_dtype, assert_same_error

fa = importlib.import_module("megatron_sp.ops.flash_attention")  # ops.flash_attention is the function
CPU_OPS = torch.ops.megatron_sp
FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
DROP = (1234, 3, 2)  # seed, layer, head_offset


def _inputs(target, shape, dtype, gen, layout):
    """q, k, v on the target: contiguous, 'strided' (views of fused [s, b, heads * d] slabs, as the
    model's QKV projection gives them) or 'misaligned' (one element past a 16-byte boundary)."""
    b, nq, nkv, sq, sk, d = shape
    if layout == "strided":
        slab_q = target.put(torch.randn(sq, b, (nq + 1) * d, generator=gen).to(dtype))
        slab_kv = target.put(torch.randn(sk, b, 2 * nkv * d + 1, generator=gen).to(dtype))
        return (
            slab_q[..., d:].view(sq, b, nq, d).permute(1, 2, 0, 3),
            slab_kv[..., 1 : 1 + nkv * d].view(sk, b, nkv, d).permute(1, 2, 0, 3),
            slab_kv[..., 1 + nkv * d :].view(sk, b, nkv, d).permute(1, 2, 0, 3),
        )
    shapes = ((b, nq, sq, d), (b, nkv, sk, d), (b, nkv, sk, d))
    return tuple(target.put(torch.randn(s, generator=gen).to(dtype), misaligned=layout == "misaligned") for s in shapes)


def _index(gen, b, sq, sk, positions, segments):
    if positions == "causal":
        q_pos, k_pos = torch.arange(sq), torch.arange(sk)
    elif positions == "ring":  # keys start after the first queries: blind rows
        q_pos, k_pos = torch.arange(40, 40 + sq), torch.arange(45, 45 + sk)
    else:  # zigzag: two chunks, not consecutive
        q_pos = k_pos = torch.cat([torch.arange(sq // 2), torch.arange(3 * sq, 3 * sq + sq - sq // 2)])
    q_seg = torch.randint(0, 3, (b, sq), generator=gen).sort(-1).values if segments else None
    samples = torch.randint(0, 1 << 40, (b,), generator=gen)
    return q_pos, k_pos, q_seg, q_seg, samples


def results_case(target, shape, dtype, p, positions="causal", segments=False, layout="contiguous", window=None):
    """window: a sliding window of that many earlier keys (tile pairs skipped, cut, or left whole)."""
    b, nq, nkv, sq, sk, d = shape
    gen = torch.Generator().manual_seed(sq * 1000 + sk * 10 + d)
    q, k, v = _inputs(target, shape, dtype, gen, layout)
    index = _index(gen, b, sq, sk, positions, segments)
    index_on = tuple(target.put(t) for t in index)
    w = -1 if window is None else window
    out, lse = map(cpu, target.ops.flash_attention_fwd(q, k, v, *index_on, p, *DROP, w))
    qc, kc, vc = map(cpu, (q, k, v))
    drop = fa.AttentionDropout(p, *DROP)
    ref_out, ref_lse = fa.flash_attention_fwd_reference(qc, kc, vc, *index, drop, window=window)
    assert out.permute(2, 0, 1, 3).is_contiguous(), "out must be laid out [s, b, n, d]"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows that see nothing differ"
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert_close_dtype(out, ref_out, dtype)
    assert (out[torch.isinf(ref_lse)] == 0).all(), "blind rows must be 0"

    dout = torch.randn(q.shape, generator=gen).to(dtype)
    grads = target.ops.flash_attention_bwd(
        target.put(dout), q, k, v, target.put(ref_out), target.put(ref_lse), *index_on, p, *DROP, w
    )
    want = fa.flash_attention_bwd_reference(dout, qc, kc, vc, ref_out, ref_lse, *index, drop, window=window)
    for got, e in zip(grads, want):
        assert got.permute(2, 0, 1, 3).is_contiguous(), "gradients must be laid out [s, b, n, d]"
        scale = (1.0 if dtype == FP32 else 2.0) * (1 + e.float().abs().max().item())
        assert_close_dtype(cpu(got), e, dtype, scale=scale)


def mask_case(target, shape, dtype, p, positions="causal"):
    """The kernel's dropout mask against attention_keep_mask, element by element: V = one-hot rows
    (sk <= d), so out[.., q, k] = P[q, k] keep[q, k] / (1 - p) is 0 exactly where k is dropped or
    hidden (the probabilities of visible keys do not underflow at these sizes)."""
    b, nq, nkv, sq, sk, d = shape
    assert sk <= d
    gen = torch.Generator().manual_seed(sq * 31 + d)
    q = torch.randn(b, nq, sq, d, generator=gen).to(dtype)
    k = torch.randn(b, nkv, sk, d, generator=gen).to(dtype)
    v = torch.eye(sk, d).to(dtype).expand(b, nkv, sk, d).contiguous()
    index = _index(gen, b, sq, sk, positions, False)
    out, _ = target.ops.flash_attention_fwd(*map(target.put, (q, k, v)), *(target.put(t) for t in index), p, *DROP)
    seed, layer, head_offset = DROP
    drop_index = DropoutIndex(index[0], index[4])
    keep = attention_keep_mask((b, nq, sq, sk), p, seed, layer, drop_index, head_offset, index[1])
    visible = (index[1].view(1, 1, 1, -1) <= index[0].view(1, 1, -1, 1)).expand_as(keep)
    nonzero = cpu(out)[..., :sk] != 0
    assert torch.equal(nonzero, keep & visible), f"{int((nonzero != (keep & visible)).sum())} mask bits differ"
    assert 0 < int(keep.sum()) < keep.numel(), "the case must drop some elements and keep others"


def cpu_kernel_case(target, shape, dtype, p, segments, strided):
    """The same call on the target and on the C++ CPU op (itself tested against the reference,
    tests/test_ops_flash_attention.py): out, lse, dq, dk, dv."""
    b, nq, nkv, s, _, d = shape
    gen = torch.Generator().manual_seed(s * 7 + d)
    q, k, v = _inputs(target, shape, dtype, gen, "strided" if strided else "contiguous")
    pos = torch.arange(s) + 11
    seg = torch.randint(0, 3, (b, s), generator=gen).sort(-1).values if segments else None
    index = (pos, pos, seg, seg, torch.randint(0, 1 << 40, (b,), generator=gen))
    index_on = tuple(target.put(t) for t in index)
    out, lse = target.ops.flash_attention_fwd(q, k, v, *index_on, p, 77, 3, 2)
    qc, kc, vc = map(cpu, (q, k, v))
    out_cpu, lse_cpu = CPU_OPS.flash_attention_fwd(qc, kc, vc, *index, p, 77, 3, 2)
    assert out.permute(2, 0, 1, 3).is_contiguous() and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(cpu(lse)), torch.isinf(lse_cpu))
    torch.testing.assert_close(cpu(lse), lse_cpu, rtol=1e-5, atol=1e-5)
    assert_close_dtype(cpu(out), out_cpu, dtype)
    dout = torch.randn(q.shape, generator=gen).to(dtype)
    got = target.ops.flash_attention_bwd(target.put(dout), q, k, v, out, lse, *index_on, p, 77, 3, 2)
    want = CPU_OPS.flash_attention_bwd(dout, qc, kc, vc, cpu(out), cpu(lse), *index, p, 77, 3, 2)
    for a, e in zip(got, want):
        assert a.dtype == dtype and a.shape == e.shape
        assert_close_dtype(cpu(a), e, dtype, scale=2 * (1 + e.float().abs().max().item()))


def binding_case(target, dtype):
    """Against the CPU op: strided inputs, GQA, segments, dropout; layouts and dtypes of the outputs;
    opcheck; the same error as the CPU op; the head-dim limit of the CUDA kernels."""
    gen = torch.Generator().manual_seed(5)
    b, nq, nkv, s, d = 2, 2, 1, 18, 12
    q, k, v = _inputs(target, (b, nq, nkv, s, s, d), dtype, gen, "strided")
    qc, kc, vc = map(cpu, (q, k, v))
    pos, samples = torch.arange(s), torch.tensor([7, 1 << 36])
    seg = torch.randint(0, 2, (b, s), generator=gen).sort(-1).values
    index = (pos, pos, seg, seg, samples)
    args, args_on = (*index, 0.25, 9, 2, 1), (*(target.put(t) for t in index), 0.25, 9, 2, 1)
    out, lse = target.ops.flash_attention_fwd(q, k, v, *args_on)
    out_cpu, lse_cpu = CPU_OPS.flash_attention_fwd(qc, kc, vc, *args)
    assert out.dtype == dtype and out.stride() == out_cpu.stride() and lse.dtype == torch.float32
    assert_close_dtype(cpu(out), out_cpu, dtype)
    torch.testing.assert_close(cpu(lse), lse_cpu, rtol=1e-5, atol=1e-5)
    dout = torch.randn(q.shape, generator=gen).to(dtype)
    out_on, lse_on, dout_on = target.put(out_cpu), target.put(lse_cpu), target.put(dout)
    got = target.ops.flash_attention_bwd(dout_on, q, k, v, out_on, lse_on, *args_on)
    want = CPU_OPS.flash_attention_bwd(dout, qc, kc, vc, out_cpu, lse_cpu, *args)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and a.shape == e.shape and a.stride() == e.stride()
        assert_close_dtype(cpu(a), e, dtype, scale=2 * (1 + e.float().abs().max().item()))
    opcheck(target.ops.flash_attention_fwd, (q, k, v, *args_on))
    opcheck(target.ops.flash_attention_bwd, (dout_on, q, k, v, out_on, lse_on, *args_on))
    assert_same_error(
        lambda: target.ops.flash_attention_fwd(q, k[:, :, 1:], v, *args_on),
        lambda: CPU_OPS.flash_attention_fwd(qc, kc[:, :, 1:], vc, *args),
    )
    big = target.put(torch.zeros(1, 1, 4, 256, dtype=dtype))
    small = tuple(target.put(t) for t in (pos[:4], pos[:4]))
    try:
        target.ops.flash_attention_fwd(big, big, big, *small, None, None, target.put(samples[:1]), 0.0, 0, 0, 0)
    except RuntimeError as e:
        assert "head dims up to 128" in str(e), e
    else:
        raise AssertionError("a head dim over 128 must be refused")


def cases() -> list:
    emulated = {
        # b, nq, nkv, sq, sk, d: two key tiles and partial query tiles (37), GQA rep 2 with dropout
        "flash-37-gqa-dropout-fp32": ((1, 4, 2, 37, 37, 16), FP32, 0.3),
        "flash-20-segments-bf16": ((2, 2, 1, 20, 20, 8), BF16, 0.2, "causal", True),
        "flash-ring-blind-rows-fp16": ((1, 2, 2, 12, 30, 8), FP16, 0.1, "ring"),
        "flash-zigzag-strided-fp32": ((2, 2, 1, 16, 16, 8), FP32, 0.25, "zigzag", False, "strided"),
        # odd head dims: one column per lane with a tail (33 -> 2 per lane), 4 per lane (100)
        "flash-odd-misaligned-fp32": ((1, 1, 1, 9, 9, 33), FP32, 0.0, "causal", False, "misaligned"),
        "flash-d100-bf16": ((1, 1, 1, 5, 5, 100), BF16, 0.5),
        # a sliding window of 9 keys over two key tiles, with documents (the window cuts inside tiles)
        "flash-window-70-segments-dropout-fp32": ((1, 2, 1, 70, 70, 8), FP32, 0.2, "causal", True, "contiguous", 9),
    }
    # the tensor-core kernels: 64-key tiles, 128-row query blocks (sms=1) or 64-row ones (sms=132, which
    # also leaves fully visible tile pairs unmasked), partial tiles, GQA, head dims 64 and 128
    # (cp.async and plain loads), one Philox call per 4 keys (causal) or per element (ring, zigzag)
    mma = {
        "flash-mma-72-gqa-dropout-bf16": (((1, 2, 1, 72, 72, 64), BF16, 0.1), 1),
        "flash-mma-130-segments-narrow-fp16": (((1, 1, 1, 130, 130, 32), FP16, 0.2, "causal", True), 132),
        "flash-mma-70-zigzag-d128-strided-bf16": (((1, 1, 1, 70, 70, 128), BF16, 0.25, "zigzag", False, "strided"), 1),
        "flash-mma-70-ring-fp16": (((1, 1, 1, 70, 70, 16), FP16, 0.1, "ring"), 1),
        # a window of 70 keys over 200: tile pairs skipped (too far back), cut, and whole (64-row blocks)
        "flash-mma-200-window-bf16": (((1, 1, 1, 200, 200, 32), BF16, 0.1, "causal", False, "contiguous", 70), 132),
    }
    # the SIMT kernels (fp32) and the tensor-core ones (bf16/fp16; one with several tiles) under
    # ThreadSanitizer
    race = ("flash-37-gqa-dropout-fp32", "flash-mma-70-ring-fp16")
    out = [Case(name, results_case, args, race=name in race) for name, args in emulated.items()]
    out += [Case(name, results_case, args, sms=sms, race=name in race) for name, (args, sms) in mma.items()]
    out += [
        Case("flash-mask-causal-bf16", mask_case, ((1, 2, 1, 96, 128, 128), BF16, 0.3)),
        Case("flash-mask-ring-fp16", mask_case, ((1, 1, 1, 40, 64, 64), FP16, 0.5, "ring")),
        Case("flash-mask-zigzag-fp32", mask_case, ((1, 1, 1, 16, 16, 16), FP32, 0.5, "zigzag")),
    ]
    # GPU only, against the CPU op: partial tiles, GQA, d = 128 (4 columns per lane), odd d, one row
    for shape, segments, strided, p in [
        ((2, 4, 4, 300, 300, 64), False, True, 0.1),
        ((1, 8, 2, 129, 129, 128), True, True, 0.2),
        ((2, 2, 1, 77, 77, 40), True, False, 0.0),
        ((1, 1, 1, 1, 1, 7), False, False, 0.5),
    ]:
        for dtype in (FP32, BF16, FP16):
            name = f"flash-cpu-kernel-{'x'.join(map(str, shape))}-{DTYPE_NAME[dtype]}"
            out.append(Case(name, cpu_kernel_case, (shape, dtype, p, segments, strided), sms=132, emulate=False))
    for dtype in (FP32, BF16):
        out.append(Case(f"binding-flash-{DTYPE_NAME[dtype]}", binding_case, (dtype,)))
    return out

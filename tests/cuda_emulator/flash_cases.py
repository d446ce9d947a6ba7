"""Emulator cases of the CUDA blockwise attention (csrc/cuda/flash_attention.cu), merged into
run_cases.CASES: the launchers through the C API with exactly sized host tensors (forward, then the
three backward kernels from the reference's out and lse), and the torch binding. fp32 results agree
with the reference within 2e-5 (the kernels sum in another order), which also shows that the
dropout bits match; bf16/fp16 within their tolerances; rows that see nothing give out 0, lse -inf.
"""

from __future__ import annotations

import ctypes
import importlib

import torch

from megatron_sp import ops
from megatron_sp.testing import assert_close_dtype, assert_same_error

fa = importlib.import_module("megatron_sp.ops.flash_attention")  # ops.flash_attention is the function

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
i64, i32, f64, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_double, ctypes.c_void_p
SCALARS = [vp, i32, f64, i64, i64, i64]  # sizes, dtype, p, seed, layer, head_offset
SIGNATURES = {
    "emu_flash_bwd_scratch": (i64, [i64, i64, i64]),
    "emu_flash_fwd": (i32, [vp] * 11 + SCALARS),
    "emu_flash_bwd": (i32, [vp] * 16 + SCALARS),
}
DROP = (0.0, 1234, 3, 2)  # p (replaced per case), seed, layer, head_offset


def _ptr(t):
    return None if t is None else t.data_ptr()


def _longs(values):
    return torch.tensor([int(v) for v in values], dtype=torch.int64)


def _strides(*tensors):
    """4 strides per tensor (lse: 3 and a 0)."""
    return _longs([s for t in tensors for s in (tuple(t.stride()) + (0,))[:4]])


def _inputs(shape, dtype, gen, layout):
    """q, k, v: contiguous, 'strided' (views of fused [s, b, heads * d] slabs, as the model's QKV
    projection gives them) or 'misaligned' (contiguous, one element past a 16-byte boundary)."""
    b, nq, nkv, sq, sk, d = shape
    if layout == "strided":
        slab_q = torch.randn(sq, b, (nq + 1) * d, generator=gen).to(dtype)
        slab_kv = torch.randn(sk, b, 2 * nkv * d + 1, generator=gen).to(dtype)
        return (
            slab_q[..., d:].view(sq, b, nq, d).permute(1, 2, 0, 3),
            slab_kv[..., 1 : 1 + nkv * d].view(sk, b, nkv, d).permute(1, 2, 0, 3),
            slab_kv[..., 1 + nkv * d :].view(sk, b, nkv, d).permute(1, 2, 0, 3),
        )
    out = []
    for s in ((b, nq, sq, d), (b, nkv, sk, d), (b, nkv, sk, d)):
        t = torch.randn(s, generator=gen).to(dtype)
        if layout == "misaligned":
            flat = torch.empty(t.numel() + 1, dtype=dtype)
            t = flat[1:].view(s).copy_(t)
        out.append(t)
    return tuple(out)


def flash_case(lib, shape, dtype, p, positions="causal", segments=False, layout="contiguous"):
    b, nq, nkv, sq, sk, d = shape
    gen = torch.Generator().manual_seed(sq * 1000 + sk * 10 + d)
    q, k, v = _inputs(shape, dtype, gen, layout)
    if positions == "causal":
        q_pos, k_pos = torch.arange(sq), torch.arange(sk)
    elif positions == "ring":  # keys start after the first queries: blind rows
        q_pos, k_pos = torch.arange(40, 40 + sq), torch.arange(45, 45 + sk)
    else:  # zigzag: two chunks, not consecutive
        q_pos = k_pos = torch.cat([torch.arange(sq // 2), torch.arange(3 * sq, 3 * sq + sq - sq // 2)])
    q_seg = torch.randint(0, 3, (b, sq), generator=gen).sort(-1).values if segments else None
    k_seg = q_seg if segments else None
    samples = torch.randint(0, 1 << 40, (b,), generator=gen)
    drop = fa.AttentionDropout(p, *DROP[1:])
    sizes = _longs(shape)
    index = (_ptr(q_pos), _ptr(k_pos), _ptr(q_seg), _ptr(k_seg), _ptr(samples))
    scalars = (DTYPE_CODE[dtype], p, *DROP[1:])

    out = torch.empty(sq, b, nq, d, dtype=dtype)
    lse = torch.empty(b, nq, sq)
    strides = _strides(q, k, v)  # kept alive: the launcher reads it
    assert (
        lib.emu_flash_fwd(_ptr(q), _ptr(k), _ptr(v), _ptr(strides), *index, _ptr(out), _ptr(lse), _ptr(sizes), *scalars)
        == 0
    ), "flash_attention_fwd launch"
    ref_out, ref_lse = fa.flash_attention_fwd_reference(q, k, v, q_pos, k_pos, q_seg, k_seg, samples, drop)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows that see nothing differ"
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert_close_dtype(out.permute(1, 2, 0, 3), ref_out, dtype)
    assert (out.permute(1, 2, 0, 3)[torch.isinf(ref_lse)] == 0).all(), "blind rows must be 0"

    dout = torch.randn(q.shape, generator=gen).to(dtype)
    grads = [torch.empty(s, b, n, d, dtype=dtype) for s, n in ((sq, nq), (sk, nkv), (sk, nkv))]
    scratch = torch.empty(lib.emu_flash_bwd_scratch(b, nq, sq))
    strides = _strides(dout, q, k, v, ref_out, ref_lse)
    assert (
        lib.emu_flash_bwd(
            _ptr(dout),
            _ptr(q),
            _ptr(k),
            _ptr(v),
            _ptr(ref_out),
            _ptr(ref_lse),
            _ptr(strides),
            *index,
            *(_ptr(g) for g in grads),
            _ptr(scratch),
            _ptr(sizes),
            *scalars,
        )
        == 0
    ), "flash_attention_bwd launch"
    want = fa.flash_attention_bwd_reference(dout, q, k, v, ref_out, ref_lse, q_pos, k_pos, q_seg, k_seg, samples, drop)
    for name, got, e in zip(("dq", "dk", "dv"), grads, want):
        scale = (1.0 if dtype == torch.float32 else 2.0) * (1 + e.float().abs().max().item())
        assert_close_dtype(got.permute(1, 2, 0, 3), e, dtype, scale=scale)


def binding_flash_case(dtype):
    """The binding (csrc/cuda/ops_cuda.cpp) against the CPU op: strided inputs, GQA, segments,
    dropout; layouts and dtypes of the outputs; opcheck; the same error as the CPU op."""
    assert ops.extension_available(), "the binding cases compare with megatron_sp._C's CPU ops"
    E, M = torch.ops.megatron_sp_emulated, torch.ops.megatron_sp
    gen = torch.Generator().manual_seed(5)
    b, nq, nkv, s, d = 2, 2, 1, 18, 12
    q, k, v = _inputs((b, nq, nkv, s, s, d), dtype, gen, "strided")
    pos, samples = torch.arange(s), torch.tensor([7, 1 << 36])
    seg = torch.randint(0, 2, (b, s), generator=gen).sort(-1).values
    args = (pos, pos, seg, seg, samples, 0.25, 9, 2, 1)
    out, lse = E.flash_attention_fwd(q, k, v, *args)
    out_cpu, lse_cpu = M.flash_attention_fwd(q, k, v, *args)
    assert out.dtype == dtype and out.stride() == out_cpu.stride() and lse.dtype == torch.float32
    assert_close_dtype(out, out_cpu, dtype)
    torch.testing.assert_close(lse, lse_cpu, rtol=1e-5, atol=1e-5)
    dout = torch.randn(q.shape, generator=gen).to(dtype)
    got = E.flash_attention_bwd(dout, q, k, v, out_cpu, lse_cpu, *args)
    want = M.flash_attention_bwd(dout, q, k, v, out_cpu, lse_cpu, *args)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype and a.shape == e.shape and a.stride() == e.stride()
        assert_close_dtype(a, e, dtype, scale=2 * (1 + e.float().abs().max().item()))
    utils = ("test_schema", "test_faketensor")
    torch.library.opcheck(E.flash_attention_fwd, (q, k, v, *args), test_utils=utils)
    torch.library.opcheck(E.flash_attention_bwd, (dout, q, k, v, out_cpu, lse_cpu, *args), test_utils=utils)
    assert_same_error(
        lambda: E.flash_attention_fwd(q, k[:, :, 1:], v, *args), lambda: M.flash_attention_fwd(q, k[:, :, 1:], v, *args)
    )


def register_binding_fakes(ns: str) -> None:
    torch.library.register_fake(ns + "flash_attention_fwd")(fa._fake_fwd)
    torch.library.register_fake(ns + "flash_attention_bwd")(fa._fake_bwd)


def cases() -> dict:
    """name -> (SMs, fn, args); fn(lib, *args), or fn(*args) for names starting with binding-."""
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    out = {
        # b, nq, nkv, sq, sk, d: two key tiles and partial query tiles (37), GQA rep 2 with dropout
        "flash-37-gqa-dropout-fp32": ((1, 4, 2, 37, 37, 16), f32, 0.3),
        "flash-20-segments-bf16": ((2, 2, 1, 20, 20, 8), bf16, 0.2, "causal", True),
        "flash-ring-blind-rows-fp16": ((1, 2, 2, 12, 30, 8), f16, 0.1, "ring"),
        "flash-zigzag-strided-fp32": ((2, 2, 1, 16, 16, 8), f32, 0.25, "zigzag", False, "strided"),
        # odd head dims: one column per lane with a tail (33 -> 2 per lane), 4 per lane (100)
        "flash-odd-misaligned-fp32": ((1, 1, 1, 9, 9, 33), f32, 0.0, "causal", False, "misaligned"),
        "flash-d100-bf16": ((1, 1, 1, 5, 5, 100), bf16, 0.5),
    }
    cases = {name: (1, flash_case, args) for name, args in out.items()}
    for dtype, name in ((f32, "fp32"), (bf16, "bf16")):
        cases[f"binding-flash-{name}"] = (1, binding_flash_case, (dtype,))
    return cases

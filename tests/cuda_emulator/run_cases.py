"""Runs the CUDA kernels of csrc/cuda/ on the CPU emulator against the references.

Each case calls one launcher (csrc/cuda/launchers.h) through the emulated library with exactly
sized host tensors (so AddressSanitizer sees any out-of-bounds access), then checks the result:
dropout masks and fp32/bias_dropout_add results bit for bit (against the Python reference and the
C++ CPU kernel), LayerNorm and the gradient sums within the dtype tolerances of the CUDA tests,
layouts exactly. The SM count the emulator reports is part of each case: 1 SM makes the persistent
grids small so every grid-stride loop runs several times; 132 is an H200's launch geometry.

    LD_PRELOAD=$(g++ -print-file-name=libasan.so) PYTHONPATH=tests python -m cuda_emulator.run_cases LIB OUT.json

tests/test_cuda_emulated.py builds the library (build.py), runs this once and asserts per case.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
import traceback

import torch
from cuda_emulator import flash_cases  # the blockwise attention cases, in a file of their own

from megatron_sp import ops
from megatron_sp.ops import layout
from megatron_sp.ops.bias_dropout_add import bias_dropout_add_reference
from megatron_sp.ops.layer_norm import layer_norm_reference
from megatron_sp.ops.philox import hidden_keep_mask
from megatron_sp.ops.rms_norm import rms_norm_reference
from megatron_sp.testing import assert_close_dtype, assert_same_error, random_index

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
i64, f32, f64, i32, vp = (ctypes.c_int64, ctypes.c_float, ctypes.c_double, ctypes.c_int, ctypes.c_void_p)
DROPOUT = [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_double] + [ctypes.c_int64] * 4
SIGNATURES = {
    "emu_set_sm_count": (None, [i32]),
    "emu_bda_bwd_scratch": (i64, [i64, i64, i64, i32]),
    "emu_bda_fwd": (i32, [vp] * 6 + DROPOUT),
    "emu_bda_bwd": (i32, [vp] * 6 + DROPOUT),
    "emu_ln_bwd_scratch": (i64, [i64, i64, i32]),
    "emu_ln_fwd": (i32, [vp] * 6 + [i64, i64, f32, i32, i32]),
    "emu_ln_bwd": (i32, [vp] * 8 + [i64, i64, i32, i32]),
    "emu_rms_bwd_scratch": (i64, [i64, i64, i32]),
    "emu_rms_fwd": (i32, [vp] * 4 + [i64, i64, f32, i32, i32]),
    "emu_rms_bwd": (i32, [vp] * 7 + [i64, i64, i32, i32]),
    "emu_block_transpose": (i32, [vp, vp, i64, i64, i64]),
    "emu_zigzag_reorder": (i32, [vp, vp, i64, i64, i64, i32]),
    "emu_traffic_watch": (i32, [vp, i64]),
    "emu_traffic_of": (None, [i32, ctypes.POINTER(ctypes.c_uint64)]),
    "emu_traffic_clear": (None, []),
    **flash_cases.SIGNATURES,
}


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    for name, (res, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def ptr(t):
    return None if t is None else t.data_ptr()


def check_launch(err: int, what: str) -> None:
    assert err == 0, f"{what}: the launcher returned cudaError {err}"


def misaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of t whose data pointer is one element past a 16-byte boundary (scalar paths)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)
    out = flat[1:].view(t.shape)
    out.copy_(t)
    return out


# ---- bias_dropout_add ---------------------------------------------------------------------------


def bda_case(lib, shape, offset, dtype, p, bias=True, align=True):
    s, b, h = shape
    gen = torch.Generator().manual_seed(hash((shape, offset, p)) % 2**31)
    x, res, grad = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    bias_t = torch.randn(h, generator=gen).to(dtype) if bias else None
    if not align:
        x, res, grad = misaligned(x), misaligned(res), misaligned(grad)
    index = random_index(s, b, generator=gen)
    pos, samples = index.token_positions.contiguous(), index.sample_ids.contiguous()
    drop = (p, 1234, 7, 3, offset)
    code = DTYPE_CODE[dtype]

    out = torch.empty(shape, dtype=dtype)
    check_launch(
        lib.emu_bda_fwd(ptr(x), ptr(bias_t), ptr(res), ptr(out), ptr(pos), ptr(samples), s, b, h, code, *drop),
        "bias_dropout_add_fwd",
    )
    # The mask: kept exactly where the reference keeps (inputs chosen so no kept value is 0).
    ones, zeros = torch.ones(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    mask_out = torch.empty(shape, dtype=dtype)
    check_launch(
        lib.emu_bda_fwd(ptr(ones), None, ptr(zeros), ptr(mask_out), ptr(pos), ptr(samples), s, b, h, code, *drop),
        "bias_dropout_add_fwd",
    )
    expected_keep = hidden_keep_mask(shape, p, 1234, 7, 3, index, offset)
    assert torch.equal(mask_out != 0, expected_keep), "dropout mask differs from the reference"

    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, bias_t, res)]
    ref = bias_dropout_add_reference(leaves[0], leaves[1], leaves[2], *drop[:4], index, offset)
    if dtype == torch.float32:
        assert torch.equal(out, ref.detach()), "fp32 forward not bit-identical to the reference"
    else:
        assert_close_dtype(out, ref.detach(), dtype)
    if ops.extension_available():  # the C++ kernel does the same fp32 math: bit for bit
        cpu = torch.ops.megatron_sp.bias_dropout_add_fwd(x, bias_t, res, pos, samples, *drop)
        assert torch.equal(out, cpu), "forward not bit-identical to the C++ CPU kernel"

    grad_x = torch.empty(shape, dtype=dtype)
    grad_bias = torch.empty(h, dtype=torch.float32) if bias else None
    scratch = torch.empty(lib.emu_bda_bwd_scratch(s, b, h, code) if bias else 0, dtype=torch.float32)
    check_launch(
        lib.emu_bda_bwd(
            ptr(grad), ptr(grad_x), ptr(grad_bias), ptr(scratch), ptr(pos), ptr(samples), s, b, h, code, *drop
        ),
        "bias_dropout_add_bwd",
    )
    ref.backward(grad)
    if dtype == torch.float32:
        assert torch.equal(grad_x, leaves[0].grad), "fp32 grad_x not bit-identical to reference"
    else:
        assert_close_dtype(grad_x, leaves[0].grad, dtype)
    if ops.extension_available():
        gx_cpu, gb_cpu = torch.ops.megatron_sp.bias_dropout_add_bwd(grad, pos, samples, *drop, bias)
        assert torch.equal(grad_x, gx_cpu), "grad_x not bit-identical to the C++ CPU kernel"
        if bias:
            torch.testing.assert_close(grad_bias, gb_cpu, rtol=1e-5, atol=1e-4 * (s * b) ** 0.5)
    if bias:
        expected = (grad.float() * expected_keep.float() * (1.0 / (1.0 - p))).sum((0, 1))
        assert_close_dtype(grad_bias, expected, dtype, scale=(s * b) ** 0.5)


# ---- layer_norm ---------------------------------------------------------------------------------


def ln_case(lib, rows, h, dtype, wdtype, align=True):
    gen = torch.Generator().manual_seed(rows * 100003 + h)
    x = (torch.randn(rows, h, generator=gen) * 2 + 0.5).to(dtype)
    w, b = torch.randn(h, generator=gen).to(wdtype), torch.randn(h, generator=gen).to(wdtype)
    dy = torch.randn(rows, h, generator=gen).to(dtype)
    if not align:
        x, dy = misaligned(x), misaligned(dy)
    code, wcode = DTYPE_CODE[dtype], DTYPE_CODE[wdtype]
    y, mean, rstd = (torch.empty(rows, h, dtype=dtype), torch.empty(rows), torch.empty(rows))
    check_launch(
        lib.emu_ln_fwd(ptr(x), ptr(w), ptr(b), ptr(y), ptr(mean), ptr(rstd), rows, h, 1e-5, code, wcode),
        "layer_norm_fwd",
    )
    x64 = x.double()
    torch.testing.assert_close(mean, x64.mean(1).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, (x64.var(1, unbiased=False) + 1e-5).rsqrt().float(), rtol=1e-5, atol=1e-5)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    ref = layer_norm_reference(*leaves, 1e-5)
    assert_close_dtype(y, ref.detach(), dtype)

    dx, sums = torch.empty(rows, h, dtype=dtype), torch.empty(2 * h)
    scratch = torch.empty(lib.emu_ln_bwd_scratch(rows, h, code))
    check_launch(
        lib.emu_ln_bwd(
            ptr(dy), ptr(x), ptr(w), ptr(mean), ptr(rstd), ptr(dx), ptr(sums), ptr(scratch), rows, h, code, wcode
        ),
        "layer_norm_bwd",
    )
    ref.backward(dy)
    assert_close_dtype(dx, leaves[0].grad, dtype, scale=4.0)
    assert_close_dtype(sums[:h], leaves[1].grad, dtype, scale=4 * rows**0.5)
    assert_close_dtype(sums[h:], leaves[2].grad, dtype, scale=4 * rows**0.5)


# ---- rms_norm -----------------------------------------------------------------------------------


def rms_case(lib, rows, h, dtype, wdtype, align=True):
    gen = torch.Generator().manual_seed(rows * 100003 + h + 7)
    x = (torch.randn(rows, h, generator=gen) * 2 + 0.5).to(dtype)
    w = torch.randn(h, generator=gen).to(wdtype)
    dy = torch.randn(rows, h, generator=gen).to(dtype)
    if not align:
        x, dy = misaligned(x), misaligned(dy)
    code, wcode = DTYPE_CODE[dtype], DTYPE_CODE[wdtype]
    y, rstd = torch.empty(rows, h, dtype=dtype), torch.empty(rows)
    check_launch(lib.emu_rms_fwd(ptr(x), ptr(w), ptr(y), ptr(rstd), rows, h, 1e-6, code, wcode), "rms_norm_fwd")
    x64 = x.double()
    torch.testing.assert_close(rstd, (x64.pow(2).mean(1) + 1e-6).rsqrt().float(), rtol=1e-5, atol=1e-5)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w)]
    ref = rms_norm_reference(*leaves, 1e-6)
    assert_close_dtype(y, ref.detach(), dtype)

    dx, grad_w = torch.empty(rows, h, dtype=dtype), torch.empty(h)
    scratch = torch.empty(lib.emu_rms_bwd_scratch(rows, h, code))
    check_launch(
        lib.emu_rms_bwd(ptr(dy), ptr(x), ptr(w), ptr(rstd), ptr(dx), ptr(grad_w), ptr(scratch), rows, h, code, wcode),
        "rms_norm_bwd",
    )
    if rows == 0:
        assert torch.equal(grad_w, torch.zeros(h)), "no rows: grad_weight must be zeros"
        return
    ref.backward(dy)
    assert_close_dtype(dx, leaves[0].grad, dtype, scale=4.0)
    assert_close_dtype(grad_w, leaves[1].grad, dtype, scale=4 * rows**0.5)


# ---- layouts ------------------------------------------------------------------------------------


def _transpose(lib, x, a, b, run, out_shape, align=True):
    if not align:
        x = misaligned(x)
    out = torch.empty(out_shape, dtype=x.dtype)
    check_launch(lib.emu_block_transpose(ptr(x), ptr(out), a, b, run * x.element_size()), "block_transpose")
    return out


def layout_case(lib, name, shape, k, dtype, align=True):
    x = torch.randint(0, 100, shape).to(dtype)
    if name == "ulysses_pack":  # [S, b, n, d] -> [p, S, b, n/p, d]
        S, b, n, d = shape
        got = _transpose(lib, x, S * b, k, n // k * d, (k, S, b, n // k, d), align)
    elif name == "ulysses_unpack":  # [p, S, b, n/p, d] -> [S, b, n, d]
        _, S, b, np_, d = shape
        got = _transpose(lib, x, k, S * b, np_ * d, (S, b, k * np_, d), align)
    elif name == "gather_to_last_dim":  # [t*s, ..., l] -> [s, ..., t*l]
        out_shape = (shape[0] // k, *shape[1:-1], shape[-1] * k)
        middle = x.numel() // (shape[0] * shape[-1])
        got = _transpose(lib, x, k, out_shape[0] * middle, shape[-1], out_shape, align)
    else:  # last_dim_to_gather: [s, ..., t*l] -> [t*s, ..., l]
        out_shape = (shape[0] * k, *shape[1:-1], shape[-1] // k)
        got = _transpose(lib, x, x.numel() // shape[-1], k, shape[-1] // k, out_shape, align)
    assert torch.equal(got, getattr(layout, name + "_reference")(x, k)), f"{name} differs"


def zigzag_case(lib, shape, p, dim, inverse, dtype=torch.bfloat16, align=True):
    x = torch.randn(shape).to(dtype)
    if not align:
        x = misaligned(x)
    outer = 1
    for size in shape[:dim]:
        outer *= size
    run = x.numel() // outer // (2 * p)
    out = torch.empty(shape, dtype=dtype)
    check_launch(
        lib.emu_zigzag_reorder(ptr(x), ptr(out), outer, p, run * x.element_size(), int(inverse)), "zigzag_reorder"
    )
    assert torch.equal(out, layout.zigzag_reorder_reference(x, p, dim, inverse)), "zigzag differs"


# ---- the torch binding (csrc/cuda/ops_cuda.cpp) ---------------------------------------------------
# Built with build(..., binding=True) and registered for CPU tensors as megatron_sp_emulated::*: the
# binding's argument checks, contiguity handling, output allocation, scratch sizing and gradient
# copies run as they would on the GPU, and are compared with the C++ CPU ops (megatron_sp::*).


def _emulated():
    return torch.ops.megatron_sp_emulated


def register_binding_fakes():
    """The fake (meta) functions of megatron_sp's ops, for the emulated library (opcheck)."""
    import importlib

    bda = importlib.import_module("megatron_sp.ops.bias_dropout_add")
    ln = importlib.import_module("megatron_sp.ops.layer_norm")
    ns = "megatron_sp_emulated::"
    torch.library.register_fake(ns + "bias_dropout_add_fwd")(bda._fake_fwd)
    torch.library.register_fake(ns + "bias_dropout_add_bwd")(bda._fake_bwd)
    torch.library.register_fake(ns + "layer_norm_fwd")(ln._fake_fwd)
    torch.library.register_fake(ns + "layer_norm_bwd")(ln._fake_bwd)
    rms = importlib.import_module("megatron_sp.ops.rms_norm")
    torch.library.register_fake(ns + "rms_norm_fwd")(rms._fake_fwd)
    torch.library.register_fake(ns + "rms_norm_bwd")(rms._fake_bwd)
    flash_cases.register_binding_fakes(ns)
    for name, shape in [
        ("ulysses_pack", layout._pack_shape),
        ("ulysses_unpack", layout._unpack_shape),
        ("gather_to_last_dim", layout._gather_shape),
        ("last_dim_to_gather", layout._split_shape),
        ("zigzag_reorder", lambda x, p, dim, inverse: x.shape),
    ]:
        torch.library.register_fake(ns + name)(lambda x, *args, shape=shape: x.new_empty(shape(x, *args)))


def binding_bda_case(shape, offset, dtype):
    assert ops.extension_available(), "the binding cases compare with megatron_sp._C's CPU ops"
    E, M = _emulated(), torch.ops.megatron_sp
    s, b, h = shape
    gen = torch.Generator().manual_seed(s * 1000 + h)
    x = torch.randn(shape, generator=gen).to(dtype)
    res = torch.randn(b, s, h, generator=gen).to(dtype).transpose(0, 1)  # not contiguous
    bias = torch.randn(h, generator=gen).to(dtype)
    index = random_index(s, b, generator=gen)
    args = (index.token_positions, index.sample_ids, 0.25, 77, 3, 1, offset)
    for bias_arg in (bias, None):
        got = E.bias_dropout_add_fwd(x, bias_arg, res, *args)
        assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
        assert torch.equal(got, M.bias_dropout_add_fwd(x, bias_arg, res, *args))
    grad = torch.randn(shape, generator=gen).to(dtype)
    for bias_grad in (True, False):
        gx, gb = E.bias_dropout_add_bwd(grad, *args, bias_grad)
        gx_cpu, gb_cpu = M.bias_dropout_add_bwd(grad, *args, bias_grad)
        assert torch.equal(gx, gx_cpu)
        assert gb.dtype == torch.float32 and gb.shape == gb_cpu.shape
        torch.testing.assert_close(gb, gb_cpu, rtol=1e-5, atol=1e-4 * (s * b) ** 0.5)
    torch.library.opcheck(E.bias_dropout_add_fwd, (x, bias, res, *args), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(E.bias_dropout_add_bwd, (grad, *args, True), test_utils=("test_schema", "test_faketensor"))
    assert_same_error(
        lambda: E.bias_dropout_add_fwd(x, bias[:-1], res, *args),
        lambda: M.bias_dropout_add_fwd(x, bias[:-1], res, *args),
    )


def binding_ln_case(shape, dtype, wdtype, align=True):
    assert ops.extension_available(), "the binding cases compare with megatron_sp._C's CPU ops"
    E, M = _emulated(), torch.ops.megatron_sp
    h = shape[-1]
    gen = torch.Generator().manual_seed(h)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
    if not align:
        x = misaligned(x)
    w, b = torch.randn(h, generator=gen).to(wdtype), torch.randn(h, generator=gen).to(wdtype)
    y, mean, rstd = E.layer_norm_fwd(x, w, b, 1e-5)
    y_cpu, mean_cpu, rstd_cpu = M.layer_norm_fwd(x, w, b, 1e-5)
    assert (y.dtype, y.shape, mean.dtype, mean.shape) == (dtype, x.shape, torch.float32, mean_cpu.shape)
    assert_close_dtype(y, y_cpu, dtype)
    torch.testing.assert_close(mean, mean_cpu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, rstd_cpu, rtol=1e-5, atol=1e-5)
    grad = torch.randn(shape, generator=gen).to(dtype)
    dx, gw, gb = E.layer_norm_bwd(grad, x, w, mean, rstd)
    dx_cpu, gw_cpu, gb_cpu = M.layer_norm_bwd(grad, x, w, mean_cpu, rstd_cpu)
    rows = x.numel() // h
    assert dx.dtype == dtype and gw.dtype == gb.dtype == wdtype
    assert gw.untyped_storage().data_ptr() != gb.untyped_storage().data_ptr(), (
        "grad_weight and grad_bias share one storage"
    )
    assert_close_dtype(dx, dx_cpu, dtype, scale=4.0)
    assert_close_dtype(gw, gw_cpu, dtype, scale=4 * rows**0.5)
    assert_close_dtype(gb, gb_cpu, dtype, scale=4 * rows**0.5)
    torch.library.opcheck(E.layer_norm_fwd, (x, w, b, 1e-5), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(E.layer_norm_bwd, (grad, x, w, mean, rstd), test_utils=("test_schema", "test_faketensor"))
    assert_same_error(
        lambda: E.layer_norm_fwd(x, w[:-1], b[:-1], 1e-5), lambda: M.layer_norm_fwd(x, w[:-1], b[:-1], 1e-5)
    )


def binding_rms_case(shape, dtype, wdtype, align=True):
    assert ops.extension_available(), "the binding cases compare with megatron_sp._C's CPU ops"
    E, M = _emulated(), torch.ops.megatron_sp
    h = shape[-1]
    gen = torch.Generator().manual_seed(h + 1)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
    x = misaligned(x) if not align else x.transpose(0, 1).contiguous().transpose(0, 1)  # strided
    w = torch.randn(h, generator=gen).to(wdtype)
    y, rstd = E.rms_norm_fwd(x, w, 1e-6)
    y_cpu, rstd_cpu = M.rms_norm_fwd(x, w, 1e-6)
    assert (y.dtype, y.shape, rstd.dtype, rstd.shape) == (dtype, x.shape, torch.float32, rstd_cpu.shape)
    assert_close_dtype(y, y_cpu, dtype)
    torch.testing.assert_close(rstd, rstd_cpu, rtol=1e-5, atol=1e-5)
    grad = torch.randn(shape, generator=gen).to(dtype)
    dx, gw = E.rms_norm_bwd(grad, x, w, rstd)
    dx_cpu, gw_cpu = M.rms_norm_bwd(grad, x, w, rstd_cpu)
    assert dx.dtype == dtype and gw.dtype == wdtype and gw.shape == (h,)
    assert_close_dtype(dx, dx_cpu, dtype, scale=4.0)
    assert_close_dtype(gw, gw_cpu, dtype, scale=4 * (x.numel() // h) ** 0.5)
    torch.library.opcheck(E.rms_norm_fwd, (x, w, 1e-6), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(E.rms_norm_bwd, (grad, x, w, rstd), test_utils=("test_schema", "test_faketensor"))
    assert_same_error(lambda: E.rms_norm_fwd(x, w[:-1], 1e-6), lambda: M.rms_norm_fwd(x, w[:-1], 1e-6))
    assert_same_error(lambda: E.rms_norm_bwd(grad, x, w, rstd[:-1]), lambda: M.rms_norm_bwd(grad, x, w, rstd_cpu[:-1]))


def binding_layout_case(dtype):
    assert ops.extension_available(), "the binding cases compare with megatron_sp._C's CPU ops"
    E, M = _emulated(), torch.ops.megatron_sp
    x4 = torch.randint(0, 100, (6, 3, 8, 5)).to(dtype)
    x5 = torch.randint(0, 100, (4, 6, 3, 2, 5)).to(dtype)
    x3 = torch.randint(0, 100, (12, 3, 10)).to(dtype)
    calls = [
        ("ulysses_pack", x4, (4,)),
        ("ulysses_pack", x4.transpose(0, 1).contiguous().transpose(0, 1), (2,)),
        ("ulysses_unpack", x5, (4,)),
        ("gather_to_last_dim", x3, (3,)),
        ("gather_to_last_dim", x3[:, :, 1:9], (4,)),
        ("last_dim_to_gather", x3, (5,)),
        ("zigzag_reorder", x3, (3, 0, False)),
        ("zigzag_reorder", x3, (5, -1, True)),
        ("zigzag_reorder", x3[::2], (1, 0, True)),
    ]
    for name, x, args in calls:
        got, expected = getattr(E, name)(x, *args), getattr(M, name)(x, *args)
        assert got.dtype == expected.dtype and torch.equal(got, expected), (name, x.shape, args)
        torch.library.opcheck(getattr(E, name), (x, *args), test_utils=("test_schema", "test_faketensor"))
    assert_same_error(lambda: E.ulysses_pack(x4, 3), lambda: M.ulysses_pack(x4, 3))
    assert_same_error(lambda: E.zigzag_reorder(x3, 4, 0, False), lambda: M.zigzag_reorder(x3, 4, 0, False))


# ---- the cases ----------------------------------------------------------------------------------


def _cases():
    cases = {}
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    # [s, b, h], feature offset, SMs: vector path (h % 8 == 0, offset % 4 == 0) with long
    # grid-stride loops (1 SM) and with an H200's grid; scalar fallbacks (odd h, offset not a
    # multiple of 4); one element.
    for shape, offset, sms in [
        ((64, 4, 256), 0, 1),
        ((33, 3, 256), 512, 132),
        ((5, 3, 7), 3, 1),
        ((17, 2, 40), 2, 132),
        ((1, 1, 1), 0, 1),
        ((9, 2, 2056), 4096, 1),
    ]:
        for dtype in dtypes:
            cases[f"bda-{'x'.join(map(str, shape))}-off{offset}-{DTYPE_NAME[dtype]}-sm{sms}"] = (
                sms,
                bda_case,
                (shape, offset, dtype, 0.3),
            )
    cases["bda-no-bias-p0-bf16"] = (1, bda_case, ((8, 2, 64), 0, torch.bfloat16, 0.0, False))
    cases["bda-misaligned-fp32"] = (1, bda_case, ((9, 2, 64), 4, torch.float32, 0.4, True, False))
    # rows x h: cached vector path with 4 and 8 vectors per thread (16384 fp32, 24576 bf16),
    # uncached vector path (rows too long for registers: 40960; the 24576 backward), scalar path
    # (odd h, h = 1, misaligned); 40 rows on 1 SM make the backward's persistent grid loop.
    fp32, bf16, fp16 = dtypes
    every = [(fp32, fp32), (bf16, bf16), (bf16, fp32), (fp16, fp16), (fp16, fp32)]
    for rows, h, sms, combos in [
        (40, 1024, 1, every),
        (7, 999, 1, every),
        (3, 1, 132, every),
        # long rows (slow to emulate: fewer dtype combinations)
        (3, 16384, 132, [(fp32, fp32), (fp16, fp32)]),
        (5, 24576, 1, [(bf16, bf16), (bf16, fp32)]),
        (2, 40960, 1, [(fp32, fp32), (fp16, fp16)]),
    ]:
        for dtype, wdtype in combos:
            cases[f"ln-{rows}x{h}-{DTYPE_NAME[dtype]}-w{DTYPE_NAME[wdtype]}-sm{sms}"] = (
                sms,
                ln_case,
                (rows, h, dtype, wdtype),
            )
    cases["ln-misaligned-bf16"] = (1, ln_case, (5, 64, torch.bfloat16, torch.bfloat16, False))
    # RMSNorm, the same paths as LayerNorm with fewer dtype combinations (the kernels share
    # row_norm.cuh): cached vector path with row groups (1024) and the persistent-grid loop (40 rows
    # on 1 SM), scalar (999, 1), 8-vector forward cache with the uncached vector backward (8200
    # fp32: 5 vectors per thread), uncached forward (16400 fp32: 9), no rows, misaligned.
    for rows, h, sms, combos in [
        (40, 1024, 1, [(fp32, fp32), (fp16, fp32)]),
        (7, 999, 1, [(bf16, bf16)]),
        (3, 1, 132, [(fp16, fp16)]),
        (2, 8200, 132, [(fp32, fp32)]),
        (1, 16400, 1, [(fp32, fp32)]),
        (0, 64, 1, [(fp32, fp32)]),
    ]:
        for dtype, wdtype in combos:
            cases[f"rms-{rows}x{h}-{DTYPE_NAME[dtype]}-w{DTYPE_NAME[wdtype]}-sm{sms}"] = (
                sms,
                rms_case,
                (rows, h, dtype, wdtype),
            )
    cases["rms-misaligned-bf16"] = (1, rms_case, (5, 64, torch.bfloat16, torch.bfloat16, False))
    for name, shape, k in [
        ("ulysses_pack", (16, 2, 8, 64), 4),
        ("ulysses_pack", (5, 3, 6, 7), 3),
        ("ulysses_unpack", (4, 8, 2, 2, 64), 4),
        ("ulysses_unpack", (3, 5, 2, 2, 7), 3),
        ("gather_to_last_dim", (64, 3, 32), 4),
        ("gather_to_last_dim", (6, 5, 9), 2),
        ("last_dim_to_gather", (16, 3, 128), 4),
        ("last_dim_to_gather", (3, 5, 10), 5),
    ]:
        for dtype in (torch.float32, torch.bfloat16, torch.uint8):
            cases[f"{name}-{'x'.join(map(str, shape))}-{str(dtype)[6:]}"] = (1, layout_case, (name, shape, k, dtype))
    cases["ulysses_pack-misaligned-bf16"] = (1, layout_case, ("ulysses_pack", (4, 2, 4, 16), 2, torch.bfloat16, False))
    for shape, p, dim in [((512, 2, 64), 4, 0), ((2, 24, 3), 3, 1), ((3, 2, 10), 5, 2), ((8, 1), 2, 0)]:
        for inverse in (False, True):
            cases[f"zigzag-{'x'.join(map(str, shape))}-p{p}-dim{dim}-{'inv' if inverse else 'fwd'}"] = (
                132,
                zigzag_case,
                (shape, p, dim, inverse),
            )
    cases["zigzag-misaligned"] = (1, zigzag_case, ((8, 3), 2, 0, False, torch.bfloat16, False))
    for dtype in dtypes:
        cases[f"binding-bda-{DTYPE_NAME[dtype]}"] = (1, binding_bda_case, ((9, 2, 64), 4, dtype))
        cases[f"binding-bda-odd-{DTYPE_NAME[dtype]}"] = (132, binding_bda_case, ((5, 3, 7), 3, dtype))
        cases[f"binding-ln-{DTYPE_NAME[dtype]}"] = (1, binding_ln_case, ((4, 3, 64), dtype, dtype))
        cases[f"binding-ln-odd-{DTYPE_NAME[dtype]}-wfp32"] = (
            132,
            binding_ln_case,
            ((7, 99), dtype, torch.float32, False),
        )
    cases["binding-rms-fp32"] = (1, binding_rms_case, ((4, 3, 64), fp32, fp32))
    cases["binding-rms-odd-fp16-wfp32"] = (132, binding_rms_case, ((7, 99), fp16, fp32, False))
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        cases[f"binding-layout-{str(dtype)[6:]}"] = (1, binding_layout_case, (dtype,))
    cases.update(flash_cases.cases())
    return cases


CASES = _cases()
BINDING_CASES = [name for name in CASES if name.startswith("binding-")]


def main():
    lib_path, out_path = sys.argv[1], sys.argv[2]
    only = sys.argv[3:]
    lib = load(lib_path)
    torch.ops.load_library(lib_path)  # registers megatron_sp_emulated::* if built with binding
    try:
        _emulated().ulysses_pack
        has_binding = True
    except (AttributeError, RuntimeError):
        has_binding = False
    if has_binding:
        register_binding_fakes()
    results = {}
    for name, (sms, fn, args) in CASES.items():
        if only and not any(o in name for o in only):
            continue
        t0 = time.perf_counter()
        lib.emu_set_sm_count(sms)
        try:
            if name in BINDING_CASES:
                assert has_binding, "the library was built without the binding (binding=True)"
                fn(*args)
            else:
                fn(lib, *args)
            results[name] = {"ok": True, "detail": ""}
        except AssertionError:
            results[name] = {"ok": False, "detail": traceback.format_exc(limit=3)}
        results[name]["seconds"] = round(time.perf_counter() - t0, 3)
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'} ({results[name]['seconds']} s)", flush=True)
        with open(out_path, "w") as f:  # rewritten after each case: a crash keeps the rest
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

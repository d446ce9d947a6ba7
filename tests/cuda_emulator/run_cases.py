"""Runs the CUDA kernels of csrc/cuda/ on the CPU emulator against the references.

Each case calls one launcher (csrc/cuda/launchers.h) through the emulated library with exactly
sized host tensors (so AddressSanitizer sees any out-of-bounds access), then checks the result:
dropout masks and fp32/bias_dropout_add results bit for bit (against the Python reference and the
C++ CPU kernel), LayerNorm and the gradient sums within the dtype tolerances of the CUDA tests,
layouts exactly. The SM count the emulator reports is part of each case: 1 SM makes the persistent
grids small so every grid-stride loop runs several times; 132 is an H200's launch geometry.

    LD_PRELOAD=$(g++ -print-file-name=libasan.so) python tests/cuda_emulator/run_cases.py LIB OUT.json

tests/test_cuda_emulated.py builds the library (build.py), runs this once and asserts per case.
"""
from __future__ import annotations

import ctypes
import json
import sys
import time
import traceback

import torch

from megatron_sp import ops
from megatron_sp.ops import layout
from megatron_sp.ops.bias_dropout_add import bias_dropout_add_reference
from megatron_sp.ops.layer_norm import layer_norm_reference
from megatron_sp.ops.testing import assert_close_dtype, random_index
from megatron_sp.tensor_parallel.random import hidden_keep_mask

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
i64, f32, f64, i32, vp = (ctypes.c_int64, ctypes.c_float, ctypes.c_double, ctypes.c_int,
                          ctypes.c_void_p)
DROPOUT = [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_double] + [ctypes.c_int64] * 4
SIGNATURES = {
    "emu_set_sm_count": (None, [i32]),
    "emu_bda_bwd_scratch": (i64, [i64, i64, i64, i32]),
    "emu_bda_fwd": (i32, [vp] * 6 + DROPOUT),
    "emu_bda_bwd": (i32, [vp] * 6 + DROPOUT),
    "emu_ln_bwd_scratch": (i64, [i64, i64, i32]),
    "emu_ln_fwd": (i32, [vp] * 6 + [i64, i64, f32, i32, i32]),
    "emu_ln_bwd": (i32, [vp] * 8 + [i64, i64, i32, i32]),
    "emu_block_transpose": (i32, [vp, vp, i64, i64, i64]),
    "emu_zigzag_reorder": (i32, [vp, vp, i64, i64, i64, i32]),
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
    check_launch(lib.emu_bda_fwd(ptr(x), ptr(bias_t), ptr(res), ptr(out), ptr(pos), ptr(samples),
                                 s, b, h, code, *drop), "bias_dropout_add_fwd")
    # The mask: kept exactly where the reference keeps (inputs chosen so no kept value is 0).
    ones, zeros = torch.ones(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    mask_out = torch.empty(shape, dtype=dtype)
    check_launch(lib.emu_bda_fwd(ptr(ones), None, ptr(zeros), ptr(mask_out), ptr(pos),
                                 ptr(samples), s, b, h, code, *drop), "bias_dropout_add_fwd")
    expected_keep = hidden_keep_mask(shape, p, 1234, 7, 3, index, offset)
    assert torch.equal(mask_out != 0, expected_keep), "dropout mask differs from the reference"

    leaves = [t.detach().clone().requires_grad_() if t is not None else None
              for t in (x, bias_t, res)]
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
    scratch = torch.empty(lib.emu_bda_bwd_scratch(s, b, h, code) if bias else 0,
                          dtype=torch.float32)
    check_launch(lib.emu_bda_bwd(ptr(grad), ptr(grad_x), ptr(grad_bias), ptr(scratch), ptr(pos),
                                 ptr(samples), s, b, h, code, *drop), "bias_dropout_add_bwd")
    ref.backward(grad)
    if dtype == torch.float32:
        assert torch.equal(grad_x, leaves[0].grad), "fp32 grad_x not bit-identical to reference"
    else:
        assert_close_dtype(grad_x, leaves[0].grad, dtype)
    if ops.extension_available():
        gx_cpu, gb_cpu = torch.ops.megatron_sp.bias_dropout_add_bwd(grad, pos, samples, *drop,
                                                                   bias)
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
    y, mean, rstd = (torch.empty(rows, h, dtype=dtype), torch.empty(rows),
                     torch.empty(rows))
    check_launch(lib.emu_ln_fwd(ptr(x), ptr(w), ptr(b), ptr(y), ptr(mean), ptr(rstd), rows, h,
                                1e-5, code, wcode), "layer_norm_fwd")
    x64 = x.double()
    torch.testing.assert_close(mean, x64.mean(1).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, (x64.var(1, unbiased=False) + 1e-5).rsqrt().float(),
                               rtol=1e-5, atol=1e-5)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    ref = layer_norm_reference(*leaves, 1e-5)
    assert_close_dtype(y, ref.detach(), dtype)

    dx, sums = torch.empty(rows, h, dtype=dtype), torch.empty(2 * h)
    scratch = torch.empty(lib.emu_ln_bwd_scratch(rows, h, code))
    check_launch(lib.emu_ln_bwd(ptr(dy), ptr(x), ptr(w), ptr(mean), ptr(rstd), ptr(dx), ptr(sums),
                                ptr(scratch), rows, h, code, wcode), "layer_norm_bwd")
    ref.backward(dy)
    assert_close_dtype(dx, leaves[0].grad, dtype, scale=4.0)
    assert_close_dtype(sums[:h], leaves[1].grad, dtype, scale=4 * rows ** 0.5)
    assert_close_dtype(sums[h:], leaves[2].grad, dtype, scale=4 * rows ** 0.5)


# ---- layouts ------------------------------------------------------------------------------------

def _transpose(lib, x, a, b, run, out_shape, align=True):
    if not align:
        x = misaligned(x)
    out = torch.empty(out_shape, dtype=x.dtype)
    check_launch(lib.emu_block_transpose(ptr(x), ptr(out), a, b, run * x.element_size()),
                 "block_transpose")
    return out


def layout_case(lib, name, shape, k, dtype, align=True):
    x = torch.randint(0, 100, shape).to(dtype)
    if name == "ulysses_pack":        # [S, b, n, d] -> [p, S, b, n/p, d]
        S, b, n, d = shape
        got = _transpose(lib, x, S * b, k, n // k * d, (k, S, b, n // k, d), align)
    elif name == "ulysses_unpack":    # [p, S, b, n/p, d] -> [S, b, n, d]
        _, S, b, np_, d = shape
        got = _transpose(lib, x, k, S * b, np_ * d, (S, b, k * np_, d), align)
    elif name == "gather_to_last_dim":  # [t*s, ..., l] -> [s, ..., t*l]
        out_shape = (shape[0] // k, *shape[1:-1], shape[-1] * k)
        middle = x.numel() // (shape[0] * shape[-1])
        got = _transpose(lib, x, k, out_shape[0] * middle, shape[-1], out_shape, align)
    else:                             # last_dim_to_gather: [s, ..., t*l] -> [t*s, ..., l]
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
    check_launch(lib.emu_zigzag_reorder(ptr(x), ptr(out), outer, p, run * x.element_size(),
                                        int(inverse)), "zigzag_reorder")
    assert torch.equal(out, layout.zigzag_reorder_reference(x, p, dim, inverse)), "zigzag differs"


# ---- the cases ----------------------------------------------------------------------------------

def _cases():
    cases = {}
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    # [s, b, h], feature offset, SMs: vector path (h % 8 == 0, offset % 4 == 0) with long
    # grid-stride loops (1 SM) and with an H200's grid; scalar fallbacks (odd h, offset not a
    # multiple of 4); one element.
    for shape, offset, sms in [((64, 4, 256), 0, 1), ((33, 3, 256), 512, 132), ((5, 3, 7), 3, 1),
                               ((17, 2, 40), 2, 132), ((1, 1, 1), 0, 1), ((9, 2, 2056), 4096, 1)]:
        for dtype in dtypes:
            cases[f"bda-{'x'.join(map(str, shape))}-off{offset}-{DTYPE_NAME[dtype]}-sm{sms}"] = (
                sms, bda_case, (shape, offset, dtype, 0.3))
    cases["bda-no-bias-p0-bf16"] = (1, bda_case, ((8, 2, 64), 0, torch.bfloat16, 0.0, False))
    cases["bda-misaligned-fp32"] = (1, bda_case, ((9, 2, 64), 4, torch.float32, 0.4, True, False))
    # rows x h: cached vector path with 4 and 8 vectors per thread (16384 fp32, 24576 bf16),
    # uncached vector path (rows too long for registers: 40960; the 24576 backward), scalar path
    # (odd h, h = 1, misaligned); 40 rows on 1 SM make the backward's persistent grid loop.
    fp32, bf16, fp16 = dtypes
    every = [(fp32, fp32), (bf16, bf16), (bf16, fp32), (fp16, fp16), (fp16, fp32)]
    for rows, h, sms, combos in [(40, 1024, 1, every), (7, 999, 1, every), (3, 1, 132, every),
                                 # long rows (slow to emulate: fewer dtype combinations)
                                 (3, 16384, 132, [(fp32, fp32), (fp16, fp32)]),
                                 (5, 24576, 1, [(bf16, bf16), (bf16, fp32)]),
                                 (2, 40960, 1, [(fp32, fp32), (fp16, fp16)])]:
        for dtype, wdtype in combos:
            cases[f"ln-{rows}x{h}-{DTYPE_NAME[dtype]}-w{DTYPE_NAME[wdtype]}-sm{sms}"] = (
                sms, ln_case, (rows, h, dtype, wdtype))
    cases["ln-misaligned-bf16"] = (1, ln_case, (5, 64, torch.bfloat16, torch.bfloat16, False))
    for name, shape, k in [("ulysses_pack", (16, 2, 8, 64), 4), ("ulysses_pack", (5, 3, 6, 7), 3),
                           ("ulysses_unpack", (4, 8, 2, 2, 64), 4),
                           ("ulysses_unpack", (3, 5, 2, 2, 7), 3),
                           ("gather_to_last_dim", (64, 3, 32), 4),
                           ("gather_to_last_dim", (6, 5, 9), 2),
                           ("last_dim_to_gather", (16, 3, 128), 4),
                           ("last_dim_to_gather", (3, 5, 10), 5)]:
        for dtype in (torch.float32, torch.bfloat16, torch.uint8):
            cases[f"{name}-{'x'.join(map(str, shape))}-{str(dtype)[6:]}"] = (
                1, layout_case, (name, shape, k, dtype))
    cases["ulysses_pack-misaligned-bf16"] = (1, layout_case, ("ulysses_pack", (4, 2, 4, 16), 2,
                                                              torch.bfloat16, False))
    for shape, p, dim in [((512, 2, 64), 4, 0), ((2, 24, 3), 3, 1), ((3, 2, 10), 5, 2),
                          ((8, 1), 2, 0)]:
        for inverse in (False, True):
            cases[f"zigzag-{'x'.join(map(str, shape))}-p{p}-dim{dim}-{'inv' if inverse else 'fwd'}"] = (
                132, zigzag_case, (shape, p, dim, inverse))
    cases["zigzag-misaligned"] = (1, zigzag_case, ((8, 3), 2, 0, False, torch.bfloat16, False))
    return cases


CASES = _cases()


def main():
    lib_path, out_path = sys.argv[1], sys.argv[2]
    only = sys.argv[3:]
    lib = load(lib_path)
    results = {}
    for name, (sms, fn, args) in CASES.items():
        if only and not any(o in name for o in only):
            continue
        t0 = time.perf_counter()
        lib.emu_set_sm_count(sms)
        try:
            fn(lib, *args)
            results[name] = {"ok": True, "detail": ""}
        except AssertionError:
            results[name] = {"ok": False, "detail": traceback.format_exc(limit=3)}
        results[name]["seconds"] = round(time.perf_counter() - t0, 3)
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'} "
              f"({results[name]['seconds']} s)", flush=True)
        with open(out_path, "w") as f:  # rewritten after each case: a crash keeps the rest
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

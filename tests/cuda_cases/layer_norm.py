"""Cases of layer_norm's CUDA kernels (csrc/cuda/layer_norm.cu, row_norm.cuh) and binding."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cuda_cases import DTYPE_NAME, Case, cpu, opcheck
from megatron_sp.ops.layer_norm import layer_norm_reference
from megatron_sp.testing import assert_close_dtype, assert_same_error

CPU_OPS = torch.ops.megatron_sp
FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
EVERY = [(FP32, FP32), (BF16, BF16), (BF16, FP32), (FP16, FP16), (FP16, FP32)]  # (activation, weight)


def results_case(target, shape, dtype, wdtype, align=True):
    """Statistics in fp64, the output and the three gradients against the reference."""
    h, rows = shape[-1], math.prod(shape[:-1])
    gen = torch.Generator().manual_seed(rows * 100003 + h)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
    w, b = torch.randn(h, generator=gen).to(wdtype), torch.randn(h, generator=gen).to(wdtype)
    dy = torch.randn(shape, generator=gen).to(dtype)
    x_on = target.put(x, misaligned=not align)
    y, mean, rstd = map(cpu, target.ops.layer_norm_fwd(x_on, target.put(w), target.put(b), 1e-5))
    x64 = x.double().reshape(rows, h)
    torch.testing.assert_close(mean, x64.mean(1).float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, (x64.var(1, unbiased=False) + 1e-5).rsqrt().float(), rtol=1e-5, atol=1e-5)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    ref = layer_norm_reference(*leaves, 1e-5)
    assert_close_dtype(y, ref.detach(), dtype)

    dy_on = target.put(dy, misaligned=not align)
    dx, gw, gb = map(cpu, target.ops.layer_norm_bwd(dy_on, x_on, target.put(w), target.put(mean), target.put(rstd)))
    ref.backward(dy)
    assert dx.dtype == dtype and gw.dtype == gb.dtype == wdtype
    assert_close_dtype(dx, leaves[0].grad, dtype, scale=4.0)
    assert_close_dtype(gw, leaves[1].grad, dtype, scale=4 * rows**0.5)
    assert_close_dtype(gb, leaves[2].grad, dtype, scale=4 * rows**0.5)


def native_case(target):
    """Close to torch's own LayerNorm in bf16."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(256, 2048, generator=gen).to(BF16)
    w, b = torch.randn(2048, generator=gen).to(BF16), torch.randn(2048, generator=gen).to(BF16)
    y = cpu(target.ops.layer_norm_fwd(target.put(x), target.put(w), target.put(b), 1e-5)[0])
    assert_close_dtype(y, F.layer_norm(x, (2048,), w, b, 1e-5), BF16)


def binding_case(target, shape, dtype, wdtype, align=True):
    """Against the CPU op: output dtypes and shapes, gradients in the weight dtype and in storages of
    their own, opcheck, and the same error as the CPU op."""
    h = shape[-1]
    gen = torch.Generator().manual_seed(h)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
    w, b = torch.randn(h, generator=gen).to(wdtype), torch.randn(h, generator=gen).to(wdtype)
    x_on, w_on, b_on = target.put(x, misaligned=not align), target.put(w), target.put(b)
    y, mean, rstd = target.ops.layer_norm_fwd(x_on, w_on, b_on, 1e-5)
    y_cpu, mean_cpu, rstd_cpu = CPU_OPS.layer_norm_fwd(x, w, b, 1e-5)
    assert (y.dtype, y.shape, mean.dtype, mean.shape) == (dtype, x.shape, torch.float32, mean_cpu.shape)
    assert_close_dtype(cpu(y), y_cpu, dtype)
    torch.testing.assert_close(cpu(mean), mean_cpu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu(rstd), rstd_cpu, rtol=1e-5, atol=1e-5)
    grad = torch.randn(shape, generator=gen).to(dtype)
    grad_on = target.put(grad)
    dx, gw, gb = target.ops.layer_norm_bwd(grad_on, x_on, w_on, mean, rstd)
    dx_cpu, gw_cpu, gb_cpu = CPU_OPS.layer_norm_bwd(grad, x, w, mean_cpu, rstd_cpu)
    rows = x.numel() // h
    assert dx.dtype == dtype and gw.dtype == gb.dtype == wdtype
    assert gw.untyped_storage().data_ptr() != gb.untyped_storage().data_ptr(), (
        "grad_weight and grad_bias share one storage"
    )
    assert_close_dtype(cpu(dx), dx_cpu, dtype, scale=4.0)
    assert_close_dtype(cpu(gw), gw_cpu, dtype, scale=4 * rows**0.5)
    assert_close_dtype(cpu(gb), gb_cpu, dtype, scale=4 * rows**0.5)
    opcheck(target.ops.layer_norm_fwd, (x_on, w_on, b_on, 1e-5))
    opcheck(target.ops.layer_norm_bwd, (grad_on, x_on, w_on, mean, rstd))
    assert_same_error(
        lambda: target.ops.layer_norm_fwd(x_on, w_on[:-1], b_on[:-1], 1e-5),
        lambda: CPU_OPS.layer_norm_fwd(x, w[:-1], b[:-1], 1e-5),
    )


def cases() -> list:
    out = []
    # shape (rows x h), SMs, combinations: cached vector path with 4 and 8 vectors per thread (16384
    # fp32, 24576 bf16), uncached vector path (rows too long for registers: 40960; the 24576
    # backward), scalar path (odd h, h = 1); 40 rows on 1 SM make the backward's persistent grid
    # loop. Long rows are slow to emulate: fewer dtype combinations there, more on the GPU.
    for shape, sms, combos, emulate in [
        ((40, 1024), 1, EVERY, True),
        ((7, 999), 1, EVERY, True),
        ((3, 1), 132, EVERY, True),
        ((3, 16384), 132, [(FP32, FP32), (FP16, FP32)], True),
        ((5, 24576), 1, [(BF16, BF16), (BF16, FP32)], True),
        ((2, 40960), 1, [(FP32, FP32), (FP16, FP16)], True),
        ((64, 1024), 132, EVERY, False),
        ((8, 4, 4096), 132, EVERY, False),
        ((16, 16384), 132, EVERY, False),
        ((4, 40960), 132, EVERY, False),
        ((2, 65536), 132, EVERY, False),
    ]:
        for dtype, wdtype in combos:
            name = f"ln-{'x'.join(map(str, shape))}-{DTYPE_NAME[dtype]}-w{DTYPE_NAME[wdtype]}-sm{sms}"
            race = name in ("ln-40x1024-fp32-wfp32-sm1", "ln-7x999-fp16-wfp16-sm1")
            out.append(Case(name, results_case, (shape, dtype, wdtype), sms, race, emulate))
    out.append(Case("ln-misaligned-bf16", results_case, ((5, 64), BF16, BF16, False)))
    out.append(Case("ln-native-bf16", native_case, (), sms=132, emulate=False))
    for dtype in (FP32, BF16, FP16):
        out.append(Case(f"binding-ln-{DTYPE_NAME[dtype]}", binding_case, ((4, 3, 64), dtype, dtype)))
        out.append(Case(f"binding-ln-odd-{DTYPE_NAME[dtype]}-wfp32", binding_case, ((7, 99), dtype, FP32, False), 132))
    return out

"""Cases of rms_norm's CUDA kernels (csrc/cuda/rms_norm.cu, row_norm.cuh) and binding: the same paths
as layer_norm with fewer dtype combinations (the kernels share row_norm.cuh)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cuda_cases import DTYPE_NAME, Case, cpu, opcheck
from megatron_sp.ops.rms_norm import rms_norm_reference
from megatron_sp.testing import assert_close_dtype, assert_same_error

CPU_OPS = torch.ops.megatron_sp
FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
EVERY = [(FP32, FP32), (BF16, BF16), (BF16, FP32), (FP16, FP16), (FP16, FP32)]  # (activation, weight)


def results_case(target, shape, dtype, wdtype, align=True):
    """rstd in fp64, the output and both gradients against the reference (and the C++ CPU kernel)."""
    h, rows = shape[-1], math.prod(shape[:-1])
    gen = torch.Generator().manual_seed(rows * 100003 + h + 7)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
    w = torch.randn(h, generator=gen).to(wdtype)
    dy = torch.randn(shape, generator=gen).to(dtype)
    x_on, w_on = target.put(x, misaligned=not align), target.put(w)
    y, rstd = map(cpu, target.ops.rms_norm_fwd(x_on, w_on, 1e-6))
    x64 = x.double().reshape(rows, h)
    torch.testing.assert_close(rstd, (x64.pow(2).mean(1) + 1e-6).rsqrt().float(), rtol=1e-5, atol=1e-5)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w)]
    ref = rms_norm_reference(*leaves, 1e-6)
    assert_close_dtype(y, ref.detach(), dtype)

    dx, grad_w = map(cpu, target.ops.rms_norm_bwd(target.put(dy, misaligned=not align), x_on, w_on, target.put(rstd)))
    assert dx.dtype == dtype and grad_w.dtype == wdtype and grad_w.shape == (h,)
    if rows == 0:
        assert torch.equal(grad_w, torch.zeros(h, dtype=wdtype)), "no rows: grad_weight must be zeros"
        return
    ref.backward(dy)
    assert_close_dtype(dx, leaves[0].grad, dtype, scale=4.0)
    assert_close_dtype(grad_w, leaves[1].grad, dtype, scale=4 * rows**0.5)


def cpu_kernel_case(target, dtype):
    """Forward and backward close to the C++ CPU kernel."""
    gen = torch.Generator().manual_seed(13)
    x, w = torch.randn(33, 1000, generator=gen).to(dtype), torch.randn(1000, generator=gen).to(dtype)
    grad = torch.randn(33, 1000, generator=gen).to(dtype)
    y_cpu, rstd_cpu = CPU_OPS.rms_norm_fwd(x, w, 1e-6)
    y, rstd = target.ops.rms_norm_fwd(target.put(x), target.put(w), 1e-6)
    assert_close_dtype(cpu(y), y_cpu, dtype)
    torch.testing.assert_close(cpu(rstd), rstd_cpu, rtol=1e-5, atol=1e-6)
    dx_cpu, dw_cpu = CPU_OPS.rms_norm_bwd(grad, x, w, rstd_cpu)
    dx, dw = map(cpu, target.ops.rms_norm_bwd(target.put(grad), target.put(x), target.put(w), rstd))
    assert_close_dtype(dx, dx_cpu, dtype, scale=4.0)
    assert_close_dtype(dw, dw_cpu, dtype, scale=4 * 33**0.5)


def native_case(target):
    """Close to torch's own RMSNorm in bf16."""
    gen = torch.Generator().manual_seed(12)
    x, w = torch.randn(256, 2048, generator=gen).to(BF16), torch.randn(2048, generator=gen).to(BF16)
    y = cpu(target.ops.rms_norm_fwd(target.put(x), target.put(w), 1e-6)[0])
    assert_close_dtype(y, F.rms_norm(x, (2048,), w, 1e-6), BF16)


def binding_case(target, shape, dtype, wdtype, align=True):
    """Against the CPU op with a strided (or misaligned) input: output dtypes and shapes, the weight
    gradient in the weight dtype, opcheck, and the same errors as the CPU op."""
    h = shape[-1]
    gen = torch.Generator().manual_seed(h + 1)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(dtype)
    x = x if not align else x.transpose(0, 1).contiguous().transpose(0, 1)  # strided
    w = torch.randn(h, generator=gen).to(wdtype)
    x_on, w_on = target.put(x, misaligned=not align), target.put(w)
    y, rstd = target.ops.rms_norm_fwd(x_on, w_on, 1e-6)
    y_cpu, rstd_cpu = CPU_OPS.rms_norm_fwd(x, w, 1e-6)
    assert (y.dtype, y.shape, rstd.dtype, rstd.shape) == (dtype, x.shape, torch.float32, rstd_cpu.shape)
    assert_close_dtype(cpu(y), y_cpu, dtype)
    torch.testing.assert_close(cpu(rstd), rstd_cpu, rtol=1e-5, atol=1e-5)
    grad = torch.randn(shape, generator=gen).to(dtype)
    grad_on = target.put(grad)
    dx, gw = target.ops.rms_norm_bwd(grad_on, x_on, w_on, rstd)
    dx_cpu, gw_cpu = CPU_OPS.rms_norm_bwd(grad, x, w, rstd_cpu)
    assert dx.dtype == dtype and gw.dtype == wdtype and gw.shape == (h,)
    assert_close_dtype(cpu(dx), dx_cpu, dtype, scale=4.0)
    assert_close_dtype(cpu(gw), gw_cpu, dtype, scale=4 * (x.numel() // h) ** 0.5)
    opcheck(target.ops.rms_norm_fwd, (x_on, w_on, 1e-6))
    opcheck(target.ops.rms_norm_bwd, (grad_on, x_on, w_on, rstd))
    assert_same_error(
        lambda: target.ops.rms_norm_fwd(x_on, w_on[:-1], 1e-6), lambda: CPU_OPS.rms_norm_fwd(x, w[:-1], 1e-6)
    )
    assert_same_error(
        lambda: target.ops.rms_norm_bwd(grad_on, x_on, w_on, rstd[:-1]),
        lambda: CPU_OPS.rms_norm_bwd(grad, x, w, rstd_cpu[:-1]),
    )


def cases() -> list:
    out = []
    # cached vector path with row groups (1024) and the persistent-grid loop (40 rows on 1 SM), scalar
    # (999, 1), 8-vector forward cache with the uncached vector backward (8200 fp32: 5 vectors per
    # thread), uncached forward (16400 fp32: 9), no rows; GPU only: the layer_norm shapes, every dtype.
    for shape, sms, combos, emulate in [
        ((40, 1024), 1, [(FP32, FP32), (FP16, FP32)], True),
        ((7, 999), 1, [(BF16, BF16)], True),
        ((3, 1), 132, [(FP16, FP16)], True),
        ((2, 8200), 132, [(FP32, FP32)], True),
        ((1, 16400), 1, [(FP32, FP32)], True),
        ((0, 64), 1, [(FP32, FP32)], True),
        ((64, 1024), 132, EVERY, False),
        ((8, 4, 4096), 132, EVERY, False),
        ((16, 16384), 132, EVERY, False),
        ((4, 40960), 132, EVERY, False),
        ((2, 65536), 132, EVERY, False),
    ]:
        for dtype, wdtype in combos:
            name = f"rms-{'x'.join(map(str, shape))}-{DTYPE_NAME[dtype]}-w{DTYPE_NAME[wdtype]}-sm{sms}"
            race = name == "rms-40x1024-fp32-wfp32-sm1"
            out.append(Case(name, results_case, (shape, dtype, wdtype), sms, race, emulate))
    out.append(Case("rms-misaligned-bf16", results_case, ((5, 64), BF16, BF16, False)))
    out.append(Case("rms-native-bf16", native_case, (), sms=132, emulate=False))
    for dtype in (FP32, BF16, FP16):
        out.append(Case(f"rms-cpu-kernel-{DTYPE_NAME[dtype]}", cpu_kernel_case, (dtype,), sms=132, emulate=False))
    out.append(Case("binding-rms-fp32", binding_case, ((4, 3, 64), FP32, FP32)))
    out.append(Case("binding-rms-odd-fp16-wfp32", binding_case, ((7, 99), FP16, FP32, False), sms=132))
    return out

"""Fused rms_norm (C++ CPU op) against the fp32 reference: output, dx and the weight grad; the
reference against a float64 formula; opcheck, torch.compile (the path without the extension:
tests/test_ops_extension.py)."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_sp.ops.rms_norm import rms_norm, rms_norm_reference
from megatron_sp.testing import FLOAT_DTYPES, assert_close_dtype, randn

needs_extension = pytest.mark.extension
MSP = torch.ops.megatron_sp

# Odd widths (scalar tails of every SIMD variant), h = 1, one row, and a wider row.
SHAPES = [(1, 1), (3, 5, 7), (17, 33), (4, 2, 256), (2, 1000)]


def _leaves(shape, dtype, wdtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (randn(shape, torch.float32, generator=g) * 3 + 1).to(dtype).requires_grad_()
    w = randn(shape[-1], wdtype, requires_grad=True, generator=g)
    return x, w


def _fwd_bwd(fn, x, w, grad):
    out = fn(x, w)
    out.backward(grad)
    return out.detach(), x.grad, w.grad


def _compare(x, w, grad, dtype):
    """Fused vs reference on twins of (x, w): output, dx, dw (in w's dtype)."""
    twins = tuple(t.detach().clone().requires_grad_() for t in (x, w))
    got = _fwd_bwd(lambda x, w: rms_norm(x, w, 1e-6), x, w, grad)
    want = _fwd_bwd(lambda x, w: rms_norm_reference(x, w, 1e-6), *twins, grad)
    rows = x.numel() // x.shape[-1]
    for i, (a, e) in enumerate(zip(got, want)):
        assert a.dtype == e.dtype and a.shape == e.shape
        # dw sums over rows; dx involves a row sum: widen atol accordingly.
        scale = rows**0.5 * 4 if i == 2 else (4.0 if i == 1 else 1.0)
        assert_close_dtype(a, e, dtype, scale=scale)


@needs_extension
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("wdtype", ["same", torch.float32])
def test_forward_backward_match_reference(shape, dtype, wdtype):
    wdtype = dtype if wdtype == "same" else wdtype
    x, w = _leaves(shape, dtype, wdtype, seed=len(shape) * 100 + shape[-1])
    _compare(x, w, torch.randn(shape).to(dtype), dtype)


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs(dtype):
    base = (torch.randn(6, 4, 40) * 2).to(dtype)
    x = base.transpose(0, 1)[..., 3:36].detach().requires_grad_()  # [4, 6, 33], strided
    w = torch.randn(66).to(dtype)[::2].detach().requires_grad_()  # stride 2
    grad = torch.randn(6, 4, 33).to(dtype).transpose(0, 1)  # not contiguous either
    assert not (x.is_contiguous() or w.is_contiguous() or grad.is_contiguous())
    _compare(x, w, grad, dtype)


@needs_extension
def test_rstd_is_fp32_and_matches():
    x = torch.randn(6, 40, dtype=torch.bfloat16)
    out, rstd = MSP.rms_norm_fwd(x, torch.ones(40, dtype=torch.bfloat16), 1e-6)
    assert rstd.dtype == torch.float32 and rstd.shape == (6,) and out.dtype == torch.bfloat16
    torch.testing.assert_close(rstd, (x.float().pow(2).mean(-1) + 1e-6).rsqrt())


def test_reference_matches_float64_formula():
    x, w = torch.randn(5, 3, 48, dtype=torch.float64) * 3, torch.randn(48, dtype=torch.float64)
    for dtype in FLOAT_DTYPES:
        xd, wd = x.to(dtype), w.to(dtype)
        x64, w64 = xd.double(), wd.double()  # the same (rounded) inputs, exact arithmetic
        expected = x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) / 48 + 1e-5) * w64
        got = rms_norm_reference(xd, wd, 1e-5)
        assert got.dtype == dtype
        assert_close_dtype(got, expected, dtype)


@needs_extension
def test_fused_gradients_match_float64_autograd():
    """gradcheck-like: the fused fp32 op's dx, dw against autograd of the float64 formula."""
    x = torch.randn(9, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(24, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(9, 24, dtype=torch.float64)
    (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w).backward(grad)
    xf, wf = (t.detach().float().requires_grad_() for t in (x, w))
    rms_norm(xf, wf, 1e-5).backward(grad.float())
    torch.testing.assert_close(xf.grad.double(), x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(wf.grad.double(), w.grad, rtol=1e-4, atol=1e-5)


@needs_extension
def test_opcheck():
    for dtype, wdtype in [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]:
        x = torch.randn(5, 24, dtype=dtype, requires_grad=True)
        w = torch.randn(24, dtype=wdtype, requires_grad=True)
        torch.library.opcheck(MSP.rms_norm_fwd, (x, w, 1e-6))
        _, rstd = MSP.rms_norm_fwd(x, w, 1e-6)
        torch.library.opcheck(
            MSP.rms_norm_bwd,
            (torch.randn_like(x), x.detach(), w.detach(), rstd),
            test_utils=("test_schema", "test_faketensor"),
        )


@needs_extension
def test_torch_compile_fullgraph_forward_backward():
    x, w = torch.randn(3, 4, 32, requires_grad=True), torch.randn(32, requires_grad=True)
    fn = torch.compile(lambda x, w: rms_norm(x, w, 1e-6), backend="aot_eager", fullgraph=True)
    out = fn(x, w)
    xr, wr = (t.detach().clone().requires_grad_() for t in (x, w))
    ref = rms_norm_reference(xr, wr, 1e-6)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


def test_unfused_path_is_the_reference():
    x, w = torch.randn(3, 16), torch.randn(16)
    assert torch.equal(rms_norm(x, w, 1e-6, fused=False), rms_norm_reference(x, w, 1e-6))


@needs_extension
def test_bad_arguments_raise():
    with pytest.raises(RuntimeError, match="rms_norm weight must have shape"):
        MSP.rms_norm_fwd(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="fp32 or the activation dtype"):
        MSP.rms_norm_fwd(torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.half), 1e-6)
    with pytest.raises(RuntimeError, match="rstd must be fp32 with one value per row"):
        MSP.rms_norm_bwd(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), torch.ones(3))


VARIANT_SCRIPT = r"""
import torch
from megatron_sp.ops.rms_norm import rms_norm, rms_norm_reference
for shape in [(5, 7), (4, 96), (3, 130)]:
    x, w = torch.randn(shape, requires_grad=True), torch.randn(shape[-1], requires_grad=True)
    xr, wr = (t.detach().clone().requires_grad_() for t in (x, w))
    rms_norm(x, w, 1e-6).sum().backward()
    rms_norm_reference(xr, wr, 1e-6).sum().backward()
    for a, e in [(x.grad, xr.grad), (w.grad, wr.grad)]:
        torch.testing.assert_close(a, e, rtol=2e-5, atol=8e-5)
print("OK")
"""


# The widest variant the CPU has runs in the tests above; these force the narrower ones.
_NARROWER = ["default"] + (["avx2"] if torch.backends.cpu.get_cpu_capability() == "AVX512" else [])


@needs_extension
@pytest.mark.parametrize("capability", _NARROWER)
def test_every_cpu_simd_variant(capability):
    env = dict(os.environ, MEGATRON_SP_CPU_CAPABILITY=capability)
    proc = subprocess.run([sys.executable, "-c", VARIANT_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr

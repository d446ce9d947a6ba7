"""Fused layer_norm (C++ CPU op) against the fp32 reference: output, dx, weight and bias grads."""

import pytest
import torch

from megatron_sp.ops.layer_norm import layer_norm, layer_norm_reference
from megatron_sp.testing import FLOAT_DTYPES, assert_close_dtype, randn

pytestmark = pytest.mark.extension

SHAPES = [(1, 1), (3, 5, 7), (17, 33), (4, 2, 256), (2, 1000)]


def _run(fn, x, w, b, grad):
    out = fn(x, w, b)
    out.backward(grad)
    return out.detach(), x.grad, w.grad, b.grad


def _leaves(shape, dtype, wdtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (randn(shape, torch.float32, generator=g) * 3 + 1).to(dtype).requires_grad_()
    w = randn(shape[-1], wdtype, requires_grad=True, generator=g)
    b = randn(shape[-1], wdtype, requires_grad=True, generator=g)
    return x, w, b


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("wdtype", ["same", torch.float32])
def test_forward_backward_match_reference(shape, dtype, wdtype):
    wdtype = dtype if wdtype == "same" else wdtype
    leaves = _leaves(shape, dtype, wdtype, seed=len(shape) * 100 + shape[-1])
    twins = tuple(t.detach().clone().requires_grad_() for t in leaves)
    # The upstream gradient has its own generator: under pytest-xdist the global RNG's state
    # depends on which tests ran earlier in the worker.
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    got = _run(lambda x, w, b: layer_norm(x, w, b, 1e-5), *leaves, grad)
    want = _run(lambda x, w, b: layer_norm_reference(x, w, b, 1e-5), *twins, grad)
    rows = leaves[0].numel() // shape[-1]
    # dx is rstd times a difference of row sums, so its rounding grows with rstd: at h=1 the row
    # is its own mean, dx is exactly 0 and both sides return rounding times 1/sqrt(eps) ~ 316.
    rstd = (leaves[0].detach().float().var(-1, unbiased=False) + 1e-5).rsqrt().max().item()
    for i, (a, e) in enumerate(zip(got, want)):
        assert a.dtype == e.dtype and a.shape == e.shape
        # weight/bias grads sum over rows; dx involves two row sums: widen atol accordingly.
        scale = rows**0.5 * 4 if i >= 2 else (4.0 * max(1.0, rstd) if i == 1 else 1.0)
        assert_close_dtype(a, e, dtype, scale=scale)  # inputs' precision bounds every grad


def test_statistics_are_fp32_and_match():
    x = torch.randn(6, 40, dtype=torch.bfloat16)
    w, b = torch.ones(40, dtype=torch.bfloat16), torch.zeros(40, dtype=torch.bfloat16)
    _, mean, rstd = torch.ops.megatron_sp.layer_norm_fwd(x, w, b, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float32
    xf = x.float()
    torch.testing.assert_close(mean, xf.mean(-1))
    torch.testing.assert_close(rstd, (xf.var(-1, unbiased=False) + 1e-5).rsqrt())


def test_opcheck():
    for dtype, wdtype in [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]:
        x = torch.randn(5, 24, dtype=dtype, requires_grad=True)
        w = torch.randn(24, dtype=wdtype, requires_grad=True)
        b = torch.randn(24, dtype=wdtype, requires_grad=True)
        torch.library.opcheck(torch.ops.megatron_sp.layer_norm_fwd, (x, w, b, 1e-5))


def test_torch_compile_fullgraph():
    x, w, b = torch.randn(3, 4, 32), torch.randn(32), torch.randn(32)
    fn = torch.compile(lambda x, w, b: layer_norm(x, w, b, 1e-5), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(fn(x, w, b), layer_norm_reference(x, w, b, 1e-5))


def test_unfused_path_is_the_reference():
    x, w, b = torch.randn(3, 16), torch.randn(16), torch.randn(16)
    assert torch.equal(layer_norm(x, w, b, 1e-5, fused=False), layer_norm_reference(x, w, b, 1e-5))


def test_bad_weight_shape_raises():
    with pytest.raises(RuntimeError, match="weight must have shape"):
        torch.ops.megatron_sp.layer_norm_fwd(torch.randn(2, 8), torch.ones(7), torch.zeros(8), 1e-5)


def test_weight_and_bias_grads_own_their_storage():
    x = torch.randn(4, 16, requires_grad=True)
    w, b = torch.ones(16, requires_grad=True), torch.zeros(16, requires_grad=True)
    layer_norm(x, w, b, 1e-5).sum().backward()
    assert w.grad.untyped_storage().data_ptr() != b.grad.untyped_storage().data_ptr()

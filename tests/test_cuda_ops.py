"""The CUDA kernels of megatron_sp._C on a GPU: the CUDA case list (tests/cuda_cases/, the cases the
emulator runs too, against the references and bit for bit against the CPU kernels where the math
allows, plus larger shapes), and what only a GPU shows: the public ops' dispatch and autograd on cuda
tensors, opcheck with autograd, torch.compile. Marked `cuda`: skipped without a GPU (tests/conftest.py)."""

import os

import pytest
import torch
from cuda_cases import CASES, gpu_target, run

from megatron_sp import ops
from megatron_sp.ops._extension import BUILT_DEVICES
from megatron_sp.ops.dropout_add import dropout_add, dropout_add_reference
from megatron_sp.ops.layer_norm import layer_norm, layer_norm_reference
from megatron_sp.ops.philox import DropoutIndex
from megatron_sp.ops.rms_norm import rms_norm, rms_norm_reference
from megatron_sp.testing import FLOAT_DTYPES, assert_close_dtype, random_index

pytestmark = pytest.mark.cuda
MSP = torch.ops.megatron_sp


@pytest.fixture(autouse=True)
def _cuda_kernels_built():
    if os.environ.get("MEGATRON_SP_SKIP_CUDA_BUILD") == "1":
        pytest.skip("CUDA build skipped by MEGATRON_SP_SKIP_CUDA_BUILD=1")
    assert ops.extension_available() and "cuda" in BUILT_DEVICES, (
        "megatron_sp._C has no CUDA kernels on a GPU machine: rebuild with a CUDA torch and nvcc"
    )


def _index(s, b, device):
    idx = random_index(s, b)
    return DropoutIndex(idx.token_positions.to(device), idx.sample_ids.to(device))


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_case(case):
    run(CASES[case], gpu_target())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_dropout_add_autograd_matches_reference(dtype):
    s, b, h = 48, 2, 264
    index = _index(s, b, "cuda")
    leaves = [torch.randn(shape, device="cuda").to(dtype).requires_grad_() for shape in ((s, b, h), (h,), (s, b, h))]
    twins = [t.detach().clone().requires_grad_() for t in leaves]
    grad = torch.randn(s, b, h, device="cuda").to(dtype)
    dropout_add(*leaves, 0.1, 5, 1, 2, index, 8).backward(grad)
    dropout_add_reference(*twins, 0.1, 5, 1, 2, index, 8).backward(grad)
    for a, e, scale in zip(leaves, twins, (1.0, s * b, 1.0)):
        assert_close_dtype(a.grad, e.grad, dtype, scale=scale)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("wdtype", ["same", torch.float32])
def test_norms_autograd_match_reference(dtype, wdtype):
    """layer_norm and rms_norm (dispatch, autograd formulas) on the GPU against the references."""
    wdtype = dtype if wdtype == "same" else wdtype
    x = (torch.randn(8, 4, 1024, device="cuda") * 2 + 0.5).to(dtype)
    w, b = (torch.randn(1024, device="cuda").to(wdtype) for _ in range(2))
    grad = torch.randn(x.shape, device="cuda").to(dtype)
    for fused, ref, params in ((layer_norm, layer_norm_reference, (w, b)), (rms_norm, rms_norm_reference, (w,))):
        leaves = [t.detach().clone().requires_grad_() for t in (x, *params)]
        twins = [t.detach().clone().requires_grad_() for t in (x, *params)]
        out, expected = fused(*leaves, 1e-5), ref(*twins, 1e-5)
        assert_close_dtype(out, expected, dtype)
        out.backward(grad)
        expected.backward(grad)
        assert_close_dtype(leaves[0].grad, twins[0].grad, dtype, scale=4.0)
        for a, e in zip(leaves[1:], twins[1:]):
            assert a.grad.dtype == wdtype
            assert_close_dtype(a.grad, e.grad, dtype, scale=4 * 32**0.5)


def test_opcheck_cuda():
    s, b, h = 6, 3, 16
    index = _index(s, b, "cuda")
    x = torch.randn(s, b, h, device="cuda", requires_grad=True)
    res, bias = torch.randn_like(x, requires_grad=True), torch.randn(h, device="cuda", requires_grad=True)
    torch.library.opcheck(MSP.dropout_add_fwd, (x, bias, res, index.token_positions, index.sample_ids, 0.2, 3, 1, 2, 4))
    w, bb = torch.randn(h, device="cuda", requires_grad=True), torch.randn(h, device="cuda", requires_grad=True)
    torch.library.opcheck(MSP.layer_norm_fwd, (x, w, bb, 1e-5))
    torch.library.opcheck(MSP.rms_norm_fwd, (x, w, 1e-6))
    torch.library.opcheck(MSP.ulysses_pack, (torch.randn(2, 3, 4, 8, device="cuda"), 2))
    torch.library.opcheck(MSP.zigzag_reorder, (torch.randn(8, 3, device="cuda"), 2, 0, False))


def test_torch_compile_inductor_block():
    """LayerNorm -> dropout_add (a bias and a residual) through inductor, fullgraph, forward and backward."""
    s, b, h = 32, 2, 256
    index = _index(s, b, "cuda")
    x = torch.randn(s, b, h, device="cuda", requires_grad=True)
    w, bias = torch.ones(h, device="cuda", requires_grad=True), torch.zeros(h, device="cuda", requires_grad=True)

    def block(x, w, bias):
        return dropout_add(layer_norm(x, w, bias, 1e-5), bias, x, 0.1, 1, 0, 2, index)

    compiled = torch.compile(block, fullgraph=True)
    out = compiled(x, w, bias)
    torch.testing.assert_close(out, block(x, w, bias))
    out.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_torch_compile_inductor_rms_norm():
    """rms_norm through inductor, fullgraph, forward and backward, against the reference."""
    x = torch.randn(32, 2, 256, device="cuda", requires_grad=True)
    w = torch.randn(256, device="cuda", requires_grad=True)
    xr, wr = (t.detach().clone().requires_grad_() for t in (x, w))
    out = torch.compile(lambda x, w: rms_norm(x, w, 1e-6), fullgraph=True)(x, w)
    ref = rms_norm_reference(xr, wr, 1e-6)
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-4, atol=1e-4)


# ---- flash_attention --------------------------------------------------------------------------------


def _flash_inputs(b, nq, nkv, s, d, dtype, strided):
    """q, k, v on the GPU; strided: views of one fused [s, b, (nq + 2 nkv) d] slab (the model's)."""
    if strided:
        qkv = torch.randn(s, b, (nq + 2 * nkv) * d, device="cuda").to(dtype)
        return tuple(t.view(s, b, -1, d).permute(1, 2, 0, 3) for t in qkv.split([nq * d, nkv * d, nkv * d], dim=-1))
    return (
        torch.randn(b, nq, s, d, device="cuda").to(dtype),
        torch.randn(b, nkv, s, d, device="cuda").to(dtype),
        torch.randn(b, nkv, s, d, device="cuda").to(dtype),
    )


def test_flash_attention_cuda_ring_blocks_and_autograd():
    """Disjoint key ranges (queries that see nothing: out 0, lse -inf) and FlashAttention's
    autograd on the GPU against the reference's backward."""
    from megatron_sp.ops.flash_attention import AttentionDropout, FlashAttention

    q, k, v = (t.requires_grad_() for t in _flash_inputs(1, 2, 1, 70, 32, torch.float32, False))
    q_pos, k_pos = torch.arange(100, 170, device="cuda"), torch.arange(130, 200, device="cuda")
    samples, drop = torch.tensor([3], device="cuda"), AttentionDropout(0.2, 5, 1, 0)
    out, lse = MSP.flash_attention_fwd(q, k, v, q_pos, k_pos, None, None, samples, 0.2, 5, 1, 0)
    blind = q_pos < 130
    assert torch.isinf(lse[:, :, blind]).all() and (out[:, :, blind] == 0).all()
    dout = torch.randn(q.shape, device="cuda")
    grads = [
        torch.autograd.grad(
            FlashAttention.apply(q, k, v, q_pos, k_pos, None, None, samples, drop, fused), (q, k, v), dout
        )
        for fused in (True, False)
    ]
    for a, e in zip(*grads):
        torch.testing.assert_close(a, e, rtol=2e-5, atol=2e-5)


def test_flash_attention_opcheck():
    q, k, v = (t.requires_grad_() for t in _flash_inputs(2, 2, 1, 20, 16, torch.float32, True))
    pos, samples = torch.arange(20, device="cuda"), torch.tensor([0, 1], device="cuda")
    torch.library.opcheck(MSP.flash_attention_fwd, (q, k, v, pos, pos, None, None, samples, 0.2, 3, 1, 0))

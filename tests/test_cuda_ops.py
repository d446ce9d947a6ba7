"""CUDA kernels of megatron_sp._C against the references (and against the CPU kernels, bit for
bit where the math allows). Marked `cuda`: skipped without a GPU (tests/conftest.py)."""

import os

import pytest
import torch
import torch.nn.functional as F

from megatron_sp import ops
from megatron_sp.ops import layout
from megatron_sp.ops._extension import BUILT_DEVICES
from megatron_sp.ops.bias_dropout_add import bias_dropout_add, bias_dropout_add_reference
from megatron_sp.ops.layer_norm import layer_norm, layer_norm_reference
from megatron_sp.ops.philox import DropoutIndex, hidden_keep_mask
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


def _misaligned(shape, dtype, device="cuda"):
    """A contiguous tensor whose data pointer is not 16-byte aligned (forces the scalar paths)."""
    n = 1
    for d in shape:
        n *= d
    return torch.randn(n + 1, device=device).to(dtype)[1:].view(shape)


# [s, b, h], feature offset: vector path (h % 8 == 0, offset % 4 == 0) and scalar fallbacks.
BDA_CASES = [
    ((64, 4, 1024), 0),
    ((33, 3, 256), 512),
    ((5, 3, 7), 3),
    ((17, 2, 40), 2),
    ((1, 1, 1), 0),
    ((300, 2, 4096), 4096),
]


@pytest.mark.parametrize("shape,offset", BDA_CASES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_bda_mask_bit_identical(shape, offset, dtype):
    index = _index(shape[0], shape[1], "cuda")
    ones = torch.ones(shape, device="cuda", dtype=dtype)
    out = MSP.bias_dropout_add_fwd(
        ones, None, torch.zeros_like(ones), index.token_positions, index.sample_ids, 0.3, 1234, 7, 3, offset
    )
    cpu_index = DropoutIndex(index.token_positions.cpu(), index.sample_ids.cpu())
    expected = hidden_keep_mask(shape, 0.3, 1234, 7, 3, cpu_index, offset)
    assert torch.equal((out != 0).cpu(), expected)


@pytest.mark.parametrize("shape,offset", BDA_CASES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_bda_cuda_equals_cpu_kernel_bitwise(shape, offset, dtype):
    s, b, h = shape
    x, res, bias, grad = (
        torch.randn(shape).to(dtype),
        torch.randn(shape).to(dtype),
        torch.randn(h).to(dtype),
        torch.randn(shape).to(dtype),
    )
    index = random_index(s, b)
    args = (0.2, 99, 3, 2, offset)
    cpu = MSP.bias_dropout_add_fwd(x, bias, res, index.token_positions, index.sample_ids, *args)
    gpu = MSP.bias_dropout_add_fwd(
        x.cuda(), bias.cuda(), res.cuda(), index.token_positions.cuda(), index.sample_ids.cuda(), *args
    )
    assert torch.equal(gpu.cpu(), cpu)
    gx_cpu, gb_cpu = MSP.bias_dropout_add_bwd(grad, index.token_positions, index.sample_ids, *args, True)
    gx, gb = MSP.bias_dropout_add_bwd(grad.cuda(), index.token_positions.cuda(), index.sample_ids.cuda(), *args, True)
    assert torch.equal(gx.cpu(), gx_cpu)
    torch.testing.assert_close(gb.cpu(), gb_cpu, rtol=1e-5, atol=1e-4 * (s * b) ** 0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_bda_autograd_matches_reference(dtype):
    s, b, h = 48, 2, 264
    index = _index(s, b, "cuda")
    leaves = [torch.randn(shape, device="cuda").to(dtype).requires_grad_() for shape in ((s, b, h), (h,), (s, b, h))]
    twins = [t.detach().clone().requires_grad_() for t in leaves]
    grad = torch.randn(s, b, h, device="cuda").to(dtype)
    bias_dropout_add(*leaves, 0.1, 5, 1, 2, index, 8).backward(grad)
    bias_dropout_add_reference(*twins, 0.1, 5, 1, 2, index, 8).backward(grad)
    for a, e, scale in zip(leaves, twins, (1.0, s * b, 1.0)):
        assert_close_dtype(a.grad, e.grad, dtype, scale=scale)


def test_bda_misaligned_and_noncontiguous_inputs():
    shape = (9, 2, 64)
    index = _index(9, 2, "cuda")
    x, res = _misaligned(shape, torch.float32), torch.randn(2, 9, 64, device="cuda").transpose(0, 1)
    bias = torch.randn(64, device="cuda")
    got = bias_dropout_add(x, bias, res, 0.4, 1, 2, 3, index, 4)
    assert torch.equal(got, bias_dropout_add_reference(x, bias, res, 0.4, 1, 2, 3, index, 4))


# rows x h: cached vector path (4 and 8 vectors per thread), uncached vector path, scalar path.
LN_SHAPES = [(64, 1024), (8, 4, 4096), (16, 16384), (4, 40960), (7, 999), (3, 1), (2, 65536)]


@pytest.mark.parametrize("shape", LN_SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("wdtype", ["same", torch.float32])
def test_layer_norm_matches_reference(shape, dtype, wdtype):
    wdtype = dtype if wdtype == "same" else wdtype
    h = shape[-1]
    x = (torch.randn(shape, device="cuda") * 2 + 0.5).to(dtype).requires_grad_()
    w = torch.randn(h, device="cuda").to(wdtype).requires_grad_()
    b = torch.randn(h, device="cuda").to(wdtype).requires_grad_()
    twins = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    grad = torch.randn(shape, device="cuda").to(dtype)
    out = layer_norm(x, w, b, 1e-5)
    ref = layer_norm_reference(*twins, 1e-5)
    assert_close_dtype(out, ref, dtype)
    out.backward(grad)
    ref.backward(grad)
    rows = x.numel() // h
    assert_close_dtype(x.grad, twins[0].grad, dtype, scale=4.0)
    for a, e in zip((w.grad, b.grad), twins[1:]):
        assert a.dtype == wdtype
        assert_close_dtype(a, e.grad, dtype, scale=4 * rows**0.5)


def test_layer_norm_close_to_native_bf16():
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    w, b = (
        torch.randn(2048, device="cuda", dtype=torch.bfloat16),
        torch.randn(2048, device="cuda", dtype=torch.bfloat16),
    )
    assert_close_dtype(layer_norm(x, w, b, 1e-5), F.layer_norm(x, (2048,), w, b, 1e-5), torch.bfloat16)


def test_layer_norm_misaligned():
    x = _misaligned((5, 64), torch.bfloat16)
    w, b = torch.randn(64, device="cuda", dtype=torch.bfloat16), torch.zeros(64, device="cuda", dtype=torch.bfloat16)
    assert_close_dtype(layer_norm(x, w, b, 1e-5), layer_norm_reference(x, w, b, 1e-5), torch.bfloat16)


@pytest.mark.parametrize("shape", LN_SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("wdtype", ["same", torch.float32])
def test_rms_norm_matches_reference(shape, dtype, wdtype):
    wdtype = dtype if wdtype == "same" else wdtype
    h = shape[-1]
    x = (torch.randn(shape, device="cuda") * 2 + 0.5).to(dtype).requires_grad_()
    w = torch.randn(h, device="cuda").to(wdtype).requires_grad_()
    twins = [t.detach().clone().requires_grad_() for t in (x, w)]
    grad = torch.randn(shape, device="cuda").to(dtype)
    out = rms_norm(x, w, 1e-6)
    ref = rms_norm_reference(*twins, 1e-6)
    assert_close_dtype(out, ref, dtype)
    out.backward(grad)
    ref.backward(grad)
    assert_close_dtype(x.grad, twins[0].grad, dtype, scale=4.0)
    assert w.grad.dtype == wdtype
    assert_close_dtype(w.grad, twins[1].grad, dtype, scale=4 * (x.numel() // h) ** 0.5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_cuda_close_to_cpu_kernel(dtype):
    x, w, grad = (torch.randn(33, 1000).to(dtype), torch.randn(1000).to(dtype), torch.randn(33, 1000).to(dtype))
    y_cpu, rstd_cpu = MSP.rms_norm_fwd(x, w, 1e-6)
    y, rstd = MSP.rms_norm_fwd(x.cuda(), w.cuda(), 1e-6)
    assert_close_dtype(y.cpu(), y_cpu, dtype)
    torch.testing.assert_close(rstd.cpu(), rstd_cpu, rtol=1e-5, atol=1e-6)
    dx_cpu, dw_cpu = MSP.rms_norm_bwd(grad, x, w, rstd_cpu)
    dx, dw = MSP.rms_norm_bwd(grad.cuda(), x.cuda(), w.cuda(), rstd)
    assert_close_dtype(dx.cpu(), dx_cpu, dtype, scale=4.0)
    assert_close_dtype(dw.cpu(), dw_cpu, dtype, scale=4 * 33**0.5)


def test_rms_norm_misaligned_and_noncontiguous():
    x = _misaligned((5, 64), torch.bfloat16)
    w = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    assert_close_dtype(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), torch.bfloat16)
    xt = torch.randn(64, 5, device="cuda").t()
    wf = w.float()
    torch.testing.assert_close(rms_norm(xt, wf, 1e-6), rms_norm_reference(xt, wf, 1e-6))


def test_rms_norm_close_to_native_bf16():
    x = torch.randn(256, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    assert_close_dtype(rms_norm(x, w, 1e-6), F.rms_norm(x, (2048,), w, 1e-6), torch.bfloat16)


LAYOUT_CASES = [
    ("ulysses_pack", (64, 2, 32, 128), 4),
    ("ulysses_pack", (5, 3, 6, 7), 3),
    ("ulysses_unpack", (4, 64, 2, 8, 128), 4),
    ("ulysses_unpack", (3, 5, 2, 2, 7), 3),
    ("gather_to_last_dim", (512, 3, 256), 4),
    ("gather_to_last_dim", (6, 5, 9), 2),
    ("last_dim_to_gather", (128, 3, 1024), 4),
    ("last_dim_to_gather", (3, 5, 10), 5),
]


@pytest.mark.parametrize("name,shape,k", LAYOUT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_layout_matches_reference(name, shape, k, dtype):
    x = torch.randint(0, 100, shape, device="cuda").to(dtype)
    got = getattr(MSP, name)(x, k)
    assert torch.equal(got, getattr(layout, name + "_reference")(x, k))


@pytest.mark.parametrize("shape,p,dim", [((4096, 2, 64), 4, 0), ((2, 24, 3), 3, 1), ((3, 2, 10), 5, 2), ((8, 1), 2, 0)])
@pytest.mark.parametrize("inverse", [False, True])
def test_zigzag_matches_reference(shape, p, dim, inverse):
    x = torch.randn(shape, device="cuda").to(torch.bfloat16)
    got = MSP.zigzag_reorder(x, p, dim, inverse)
    assert torch.equal(got, layout.zigzag_reorder_reference(x, p, dim, inverse))


def test_opcheck_cuda():
    s, b, h = 6, 3, 16
    index = _index(s, b, "cuda")
    x = torch.randn(s, b, h, device="cuda", requires_grad=True)
    res, bias = torch.randn_like(x, requires_grad=True), torch.randn(h, device="cuda", requires_grad=True)
    torch.library.opcheck(
        MSP.bias_dropout_add_fwd, (x, bias, res, index.token_positions, index.sample_ids, 0.2, 3, 1, 2, 4)
    )
    w, bb = torch.randn(h, device="cuda", requires_grad=True), torch.randn(h, device="cuda", requires_grad=True)
    torch.library.opcheck(MSP.layer_norm_fwd, (x, w, bb, 1e-5))
    torch.library.opcheck(MSP.rms_norm_fwd, (x, w, 1e-6))
    torch.library.opcheck(MSP.ulysses_pack, (torch.randn(2, 3, 4, 8, device="cuda"), 2))
    torch.library.opcheck(MSP.zigzag_reorder, (torch.randn(8, 3, device="cuda"), 2, 0, False))


def test_torch_compile_inductor_block():
    """LayerNorm -> bias_dropout_add through inductor, fullgraph, forward and backward."""
    s, b, h = 32, 2, 256
    index = _index(s, b, "cuda")
    x = torch.randn(s, b, h, device="cuda", requires_grad=True)
    w, bias = torch.ones(h, device="cuda", requires_grad=True), torch.zeros(h, device="cuda", requires_grad=True)

    def block(x, w, bias):
        return bias_dropout_add(layer_norm(x, w, bias, 1e-5), bias, x, 0.1, 1, 0, 2, index)

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


# ---- flash_attention (csrc/cuda/flash_attention.cu) ------------------------------------------------


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


# b, nq, nkv, s, d, segments, strided, p: partial tiles, GQA, d = 128 (4 columns per lane), odd d.
FLASH_CASES = [
    (2, 4, 4, 300, 64, False, True, 0.1),
    (1, 8, 2, 129, 128, True, True, 0.2),
    (2, 2, 1, 77, 40, True, False, 0.0),
    (1, 1, 1, 1, 7, False, False, 0.5),
]


@pytest.mark.parametrize("case", FLASH_CASES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_flash_attention_cuda_equals_cpu_kernel(case, dtype):
    """CUDA vs the C++ CPU op on the same inputs (and the CPU op is tested against the reference,
    tests/test_ops_flash_attention.py): out, lse, dq, dk, dv; out laid out [s, b, n, d]."""
    b, nq, nkv, s, d, segments, strided, p = case
    q, k, v = _flash_inputs(b, nq, nkv, s, d, dtype, strided)
    pos = torch.arange(s, device="cuda") + 11
    seg = torch.randint(0, 3, (b, s), device="cuda").sort(-1).values if segments else None
    samples = torch.randint(0, 1 << 40, (b,), device="cuda")
    args = (pos, pos, seg, seg, samples, p, 77, 3, 2)
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    out, lse = MSP.flash_attention_fwd(q, k, v, *args)
    out_cpu, lse_cpu = MSP.flash_attention_fwd(*(cpu(t) for t in (q, k, v)), *(cpu(a) for a in args[:5]), *args[5:])
    assert out.permute(2, 0, 1, 3).is_contiguous() and lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(lse_cpu))
    torch.testing.assert_close(lse.cpu(), lse_cpu, rtol=1e-5, atol=1e-5)
    assert_close_dtype(out.cpu(), out_cpu, dtype)
    dout = torch.randn(q.shape, device="cuda").to(dtype)
    got = MSP.flash_attention_bwd(dout, q, k, v, out, lse, *args)
    want = MSP.flash_attention_bwd(*(cpu(t) for t in (dout, q, k, v, out, lse)), *(cpu(a) for a in args[:5]), *args[5:])
    for a, e in zip(got, want):
        assert a.dtype == dtype and a.shape == e.shape
        assert_close_dtype(a.cpu(), e, dtype, scale=2 * (1 + e.float().abs().max().item()))


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


def test_flash_attention_opcheck_and_head_dim_limit():
    q, k, v = (t.requires_grad_() for t in _flash_inputs(2, 2, 1, 20, 16, torch.float32, True))
    pos, samples = torch.arange(20, device="cuda"), torch.tensor([0, 1], device="cuda")
    torch.library.opcheck(MSP.flash_attention_fwd, (q, k, v, pos, pos, None, None, samples, 0.2, 3, 1, 0))
    big = torch.randn(1, 1, 4, 256, device="cuda")
    with pytest.raises(RuntimeError, match="head dims up to 128"):
        MSP.flash_attention_fwd(big, big, big, pos[:4], pos[:4], None, None, samples[:1], 0.0, 0, 0, 0)

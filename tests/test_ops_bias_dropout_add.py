"""Fused bias_dropout_add (C++ CPU op) against the reference: masks bit-identical, fwd and bwd."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_sp.ops.bias_dropout_add import bias_dropout_add, bias_dropout_add_reference
from megatron_sp.ops.philox import dropout, hidden_keep_mask
from megatron_sp.testing import FLOAT_DTYPES, assert_close_dtype, randn, random_index

pytestmark = pytest.mark.extension

SHAPES = [(1, 1, 1), (5, 3, 7), (16, 2, 64), (9, 4, 130)]  # [s, b, h], odd sizes included
OFFSETS = [0, 3, 128]  # global index of local feature 0


def _fused_keep(shape, p, seed, layer, site, index, offset):
    """The fused op's mask: x = 1, no bias, residual = 0 gives exactly keep * scale."""
    ones, zeros = torch.ones(shape), torch.zeros(shape)
    out = torch.ops.megatron_sp.bias_dropout_add_fwd(
        ones, None, zeros, index.token_positions, index.sample_ids, p, seed, layer, site, offset
    )
    return out != 0


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_bit_identical_to_random_py(shape, offset, p):
    g = torch.Generator().manual_seed(hash((shape, offset, p)) % 2**31)
    index = random_index(shape[0], shape[1], generator=g)
    seed, layer, site = -7 + 2**33, 5, 3  # seed wraps mod 2^32 in both
    expected = hidden_keep_mask(shape, p, seed, layer, site, index, offset)
    assert torch.equal(_fused_keep(shape, p, seed, layer, site, index, offset), expected)


@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_forward_bitwise_equal(shape):
    s, b, h = shape
    x, res, bias = torch.randn(shape), torch.randn(shape), torch.randn(h)
    index = random_index(s, b)
    ref = bias_dropout_add_reference(x, bias, res, 0.3, 11, 2, 3, index, 5)
    assert torch.equal(bias_dropout_add(x, bias, res, 0.3, 11, 2, 3, index, 5), ref)


def _grads(fn, x, bias, res, grad=None):
    out = fn()
    grad = torch.randn(out.shape).to(out.dtype) if grad is None else grad
    out.backward(grad)
    return out.detach(), x.grad, None if bias is None else bias.grad, res.grad


def _leaves(shape, dtype, bias_dtype):
    x, res = randn(shape, dtype, requires_grad=True), randn(shape, dtype, requires_grad=True)
    bias = None if bias_dtype is None else randn(shape[2], bias_dtype, requires_grad=True)
    return x, bias, res


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("bias_dtype", ["same", torch.float32, None])  # fp32: reference path
@pytest.mark.parametrize("shape", [(5, 3, 7), (16, 2, 64)])
def test_forward_backward_match_reference(dtype, bias_dtype, shape):
    bias_dtype = dtype if bias_dtype == "same" else bias_dtype
    torch.manual_seed(0)
    index, args = random_index(shape[0], shape[1]), (0.25, 42, 1, 2)
    leaves_f = _leaves(shape, dtype, bias_dtype)
    leaves_r = tuple(None if t is None else t.detach().clone().requires_grad_() for t in leaves_f)
    torch.manual_seed(1)
    got = _grads(lambda: bias_dropout_add(leaves_f[0], leaves_f[1], leaves_f[2], *args, index, 6), *leaves_f)
    torch.manual_seed(1)
    want = _grads(lambda: bias_dropout_add_reference(leaves_r[0], leaves_r[1], leaves_r[2], *args, index, 6), *leaves_r)
    for i, (a, e) in enumerate(zip(got, want)):
        if e is None:
            assert a is None
            continue
        assert a.dtype == e.dtype
        assert_close_dtype(a, e, dtype, scale=shape[0] * shape[1] if i == 2 else 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_residual_beside_low_precision_activations(dtype):
    """--fp32-residual-connection: x, bias in bf16/fp16, the residual and the output fp32, grad_x back in
    x's dtype; the fused op (no rounding between the steps) within x's tolerance of the reference."""
    s, b, h = 16, 2, 64
    torch.manual_seed(0)
    index, args = random_index(s, b), (0.25, 42, 1, 2)
    x, bias = randn((s, b, h), dtype, requires_grad=True), randn(h, dtype, requires_grad=True)
    res = randn((s, b, h), torch.float32, requires_grad=True)
    twins = [t.detach().clone().requires_grad_() for t in (x, bias, res)]
    grad = torch.randn(s, b, h)
    got = _grads(lambda: bias_dropout_add(x, bias, res, *args, index, 6), x, bias, res, grad)
    want = _grads(lambda: bias_dropout_add_reference(*twins, *args, index, 6), *twins, grad)
    assert [t.dtype for t in got] == [torch.float32, dtype, dtype, torch.float32]
    for i, (a, e) in enumerate(zip(got, want)):
        assert_close_dtype(a, e, dtype, scale=s * b if i == 2 else 1.0)
    assert torch.equal(got[3], grad)  # the residual's gradient passes through


def test_eval_and_zero_p_are_plain_adds():
    x, res, bias = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(8)
    index = random_index(4, 2)
    expected = res + (x + bias)
    assert torch.equal(bias_dropout_add(x, bias, res, 0.5, 1, 0, 2, index, training=False), expected)
    assert torch.equal(bias_dropout_add(x, bias, res, 0.0, 1, 0, 2, index), expected)


def test_backward_saves_no_mask():
    """Only the [s] positions and [b] sample ids are kept for the backward (masks are redrawn)."""
    s, b, h = 8, 2, 32
    x = torch.randn(s, b, h, requires_grad=True)
    bias = torch.randn(h, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        bias_dropout_add(x, bias, torch.randn(s, b, h), 0.1, 1, 0, 2, random_index(s, b))
    assert sorted(tuple(t.shape) for t in saved) == [(b,), (s,)]
    assert all(t.dtype == torch.int64 for t in saved)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_reference_dropout_keeps_a_one_byte_mask(dtype):
    """The reference (unfused) dropout saves its mask as bool, and computes what the plain
    expression x * keep * scale computes, forward and backward, bit for bit."""
    s, b, h, p = 8, 2, 32, 0.3
    x = torch.randn(s, b, h).to(dtype).requires_grad_()
    twin = x.detach().clone().requires_grad_()
    grad = torch.randn(s, b, h).to(dtype)
    index = random_index(s, b)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = dropout(x, p, 1, 0, 2, index)
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(torch.bool, (s, b, h))]
    keep = hidden_keep_mask((s, b, h), p, 1, 0, 2, index)
    plain = twin * keep.to(dtype) * (1.0 / (1.0 - p))
    assert torch.equal(out, plain)
    out.backward(grad)
    plain.backward(grad)
    assert torch.equal(x.grad, twin.grad)


def test_opcheck():
    s, b, h = 6, 3, 12
    index = random_index(s, b)
    for dtype, bias in [(torch.float32, torch.randn(h)), (torch.bfloat16, None)]:
        x = torch.randn(s, b, h, dtype=dtype, requires_grad=True)
        res = torch.randn(s, b, h, dtype=dtype, requires_grad=True)
        bias = None if bias is None else bias.requires_grad_()
        torch.library.opcheck(
            torch.ops.megatron_sp.bias_dropout_add_fwd,
            (x, bias, res, index.token_positions, index.sample_ids, 0.2, 3, 1, 2, 4),
        )


def test_torch_compile_fullgraph():
    s, b, h = 4, 2, 16
    index = random_index(s, b)
    x, res, bias = torch.randn(s, b, h), torch.randn(s, b, h), torch.randn(h)
    fn = torch.compile(
        lambda x, bias, res: bias_dropout_add(x, bias, res, 0.3, 9, 1, 3, index), backend="aot_eager", fullgraph=True
    )
    assert torch.equal(fn(x, bias, res), bias_dropout_add_reference(x, bias, res, 0.3, 9, 1, 3, index))


def test_bad_arguments_raise_clear_errors():
    x = torch.randn(4, 2, 8)
    index = random_index(4, 2)
    with pytest.raises(RuntimeError, match="dropout probability"):
        torch.ops.megatron_sp.bias_dropout_add_fwd(x, None, x, index.token_positions, index.sample_ids, 1.5, 0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="token_positions"):
        torch.ops.megatron_sp.bias_dropout_add_fwd(
            x, None, x, index.token_positions[:3], index.sample_ids, 0.1, 0, 0, 0, 0
        )


VARIANT_SCRIPT = r"""
import torch
from megatron_sp.ops.bias_dropout_add import bias_dropout_add, bias_dropout_add_reference
from megatron_sp.ops.embedding_dropout import embedding_dropout, embedding_dropout_reference
from megatron_sp.ops.layer_norm import layer_norm, layer_norm_reference
from megatron_sp.testing import random_index
for (s, b, h), off in [((5, 3, 7), 3), ((4, 2, 96), 0), ((3, 2, 130), 6)]:
    x, res, bias = torch.randn(s, b, h), torch.randn(s, b, h), torch.randn(h)
    index = random_index(s, b)
    ref = bias_dropout_add_reference(x, bias, res, 0.3, 5, 1, 2, index, off)
    assert torch.equal(bias_dropout_add(x, bias, res, 0.3, 5, 1, 2, index, off), ref)
    xb, yb = x.bfloat16(), res.bfloat16()
    ref = embedding_dropout_reference(xb, yb, 0.3, 5, 0, 1, index, off, out_dtype=torch.float32)
    assert torch.equal(embedding_dropout(xb, yb, 0.3, 5, 0, 1, index, off, out_dtype=torch.float32), ref)
    torch.testing.assert_close(layer_norm(x, bias, bias, 1e-5),
                               layer_norm_reference(x, bias, bias, 1e-5))
print("OK")
"""


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_every_cpu_simd_variant_is_bit_identical(capability):
    """The AVX-512 variant runs above where the CPU has it; the AVX2 and baseline ones here (bias_dropout_add,
    embedding_dropout, layer_norm)."""
    env = dict(os.environ, MEGATRON_SP_CPU_CAPABILITY=capability)
    proc = subprocess.run([sys.executable, "-c", VARIANT_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr

"""Fused dropout_add (C++ CPU op) against its reference and against the formulas of the two ops it replaced
(bias_dropout_add's fused op, embedding_dropout's), bit for bit in every dtype, forward and backward."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_sp.ops.dropout_add import dropout_add, dropout_add_reference
from megatron_sp.ops.philox import dropout, hidden_keep_mask
from megatron_sp.testing import FLOAT_DTYPES, assert_close_dtype, randn, random_index

pytestmark = pytest.mark.extension

OPS = torch.ops.megatron_sp
SHAPES = [(1, 1, 1), (5, 3, 7), (9, 4, 130)]  # [s, b, h], odd sizes included
P, SEED, LAYER, SITE, OFFSET = 0.25, 42, 1, 2, 6
RESIDUALS = ["none", "same", torch.float32]  # none: the embedding; fp32: --fp32-residual-connection
Y_KINDS = ["bias", "addend", None]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so that -0.0 and 0.0, or two NaNs, are told apart)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_bit_identical(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(bits(a), bits(b))


def old_bias_dropout_add_op(x, bias, residual, keep, p):
    """The formula of the replaced fused bias_dropout_add: residual + (x + bias) * keep * scale in fp32, one
    rounding to the residual's dtype; grad_x = (grad * scale) * keep in fp32, rounded to x's dtype."""
    scale = 1.0 / (1.0 - p)
    summed = x.float() + (bias.float() if bias is not None else 0.0)
    return (residual.float() + summed * keep.float() * scale).to(residual.dtype)


def old_embedding_dropout_op(x, y, keep, p, out_dtype):
    """The formula of the replaced fused embedding_dropout (bit for bit its reference): x + y in x's dtype,
    then the masked value in out's."""
    summed = x if y is None else x + y
    return summed.to(out_dtype) * keep.to(out_dtype) * (1.0 / (1.0 - p))


def old_grad_x(grad, keep, p, dtype):
    return (grad.float() * (1.0 / (1.0 - p)) * keep.float()).to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("offset", [0, 3, 128])
@pytest.mark.parametrize("p", [0.1, 0.9])
def test_mask_bit_identical_to_philox_py(shape, offset, p):
    g = torch.Generator().manual_seed(hash((shape, offset, p)) % 2**31)
    index = random_index(shape[0], shape[1], generator=g)
    seed, layer, site = -7 + 2**33, 5, 3  # seed wraps mod 2^32 in both
    ones = torch.ones(shape)
    out = OPS.dropout_add_fwd(ones, None, None, index.token_positions, index.sample_ids, p, seed, layer, site, offset)
    assert torch.equal(out != 0, hidden_keep_mask(shape, p, seed, layer, site, index, offset))


def _inputs(shape, dtype, y_kind, residual):
    s, b, h = shape
    x = randn(shape, dtype, requires_grad=True)
    y = None if y_kind is None else randn((h,) if y_kind == "bias" else shape, dtype, requires_grad=True)
    res_dtype = None if residual == "none" else dtype if residual == "same" else residual
    res = None if res_dtype is None else randn(shape, res_dtype, requires_grad=True)
    return x, y, res


def _twins(leaves):
    return tuple(None if t is None else t.detach().clone().requires_grad_() for t in leaves)


def _run(fn, leaves, grad):
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), *(None if t is None else t.grad for t in leaves)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("y_kind", Y_KINDS)
@pytest.mark.parametrize("residual", RESIDUALS)
def test_bit_identical_to_the_replaced_ops(dtype, y_kind, residual):
    """With a residual: the old fused bias-dropout-add's bits (forward, grad_x; grad_residual = grad; the
    bias gradient is grad_x summed over rows in fp32). Without one: the old embedding dropout's bits
    (forward, and grad_x = grad_y), in x's dtype and with an fp32 output."""
    if (residual != "none") == (y_kind == "addend") and y_kind is not None:
        pytest.skip("neither op's use: an addend beside a residual, a bias without one")
    shape = (16, 2, 64)
    torch.manual_seed(0)
    index = random_index(shape[0], shape[1])
    keep = hidden_keep_mask(shape, P, SEED, LAYER, SITE, index, OFFSET)
    leaves = _inputs(shape, dtype, y_kind, residual)
    x, y, res = leaves
    for out_dtype in (None, torch.float32) if residual == "none" and dtype != torch.float32 else (None,):
        twins = _twins(leaves)
        wanted = out_dtype or (res.dtype if res is not None else dtype)
        grad = torch.randn(shape).to(wanted)
        got = _run(lambda *t: dropout_add(*t, P, SEED, LAYER, SITE, index, OFFSET, out_dtype=out_dtype), twins, grad)
        if res is not None:
            want_out = old_bias_dropout_add_op(x.detach(), None if y is None else y.detach(), res.detach(), keep, P)
        else:
            want_out = old_embedding_dropout_op(x.detach(), None if y is None else y.detach(), keep, P, wanted)
        assert_bit_identical(got[0], want_out)
        grad_x = old_grad_x(grad, keep, P, dtype)
        assert_bit_identical(got[1], grad_x)
        if y_kind == "addend":
            assert_bit_identical(got[2], grad_x)
        elif y_kind == "bias":  # the fp32 grad_x summed over rows (in the op's order), then x's dtype
            expected = (grad.float() * (1.0 / (1.0 - P)) * keep.float()).sum((0, 1)).to(dtype)
            assert got[2].dtype == dtype
            assert_close_dtype(got[2], expected, dtype, scale=shape[0] * shape[1])
        if res is not None:
            assert_bit_identical(got[3], grad)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("y_kind", Y_KINDS)
@pytest.mark.parametrize("residual", RESIDUALS)
def test_matches_the_reference(dtype, y_kind, residual):
    """The reference is the replaced references' expressions; the fused op is bit for bit it in fp32 and for
    the embedding's use, and within the dtype's tolerance where a bias or a residual is added (the fused op
    rounds once, the reference after every step)."""
    shape = (5, 3, 7)
    torch.manual_seed(1)
    index = random_index(shape[0], shape[1])
    leaves = _inputs(shape, dtype, y_kind, residual)
    twins = _twins(leaves)
    args = (P, SEED, LAYER, SITE, index, OFFSET)
    out_dtype = leaves[2].dtype if leaves[2] is not None else dtype
    grad = torch.randn(shape).to(out_dtype)
    got = _run(lambda *t: dropout_add(*t, *args), leaves, grad)
    want = _run(lambda *t: dropout_add_reference(*t, *args), twins, grad)
    x, y, res = (None if t is None else t.detach() for t in twins)
    summed = x if y is None else x + y
    old_reference = dropout(summed, *args) if res is None else res + dropout(summed, *args)
    assert_bit_identical(want[0], old_reference)
    exact = dtype == torch.float32 or (res is None and y_kind != "bias")  # the reference rounds every step
    for i, (a, e) in enumerate(zip(got, want)):
        if e is None:
            assert a is None
        elif exact and not (i == 2 and y_kind == "bias"):  # a bias gradient's sum order is the op's
            assert_bit_identical(a, e)
        else:
            assert_close_dtype(a, e, dtype, scale=shape[0] * shape[1] if i == 2 else 1.0)


def test_eval_and_zero_p_are_plain_adds():
    x, res, bias = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(8)
    index = random_index(4, 2)
    expected = res + (x + bias)
    assert torch.equal(dropout_add(x, bias, res, 0.5, 1, 0, 2, index, training=False), expected)
    assert torch.equal(dropout_add(x, bias, res, 0.0, 1, 0, 2, index), expected)
    xb, yb = x.bfloat16(), res.bfloat16()
    summed = (xb + yb).float()
    assert torch.equal(dropout_add(xb, yb, None, 0.5, 1, 0, 1, index, training=False, out_dtype=torch.float32), summed)


@pytest.mark.parametrize("y_kind", ["bias", "addend"])
def test_backward_saves_no_mask(y_kind):
    """Only the [s] positions and [b] sample ids are kept for the backward (masks are redrawn)."""
    s, b, h = 8, 2, 32
    x = torch.randn(s, b, h, requires_grad=True)
    y = torch.randn((h,) if y_kind == "bias" else (s, b, h), requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        dropout_add(x, y, torch.randn(s, b, h) if y_kind == "bias" else None, 0.1, 1, 0, 2, random_index(s, b))
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
    plain = twin * hidden_keep_mask((s, b, h), p, 1, 0, 2, index).to(dtype) * (1.0 / (1.0 - p))
    assert torch.equal(out, plain)
    out.backward(grad)
    plain.backward(grad)
    assert torch.equal(x.grad, twin.grad)


def test_opcheck_and_compile():
    s, b, h = 6, 3, 12
    index = random_index(s, b)
    pos, samples = index.token_positions, index.sample_ids
    for dtype, y_shape, res_dtype, out_dtype in [
        (torch.float32, (h,), torch.float32, None),
        (torch.bfloat16, None, torch.float32, None),
        (torch.bfloat16, (s, b, h), None, torch.float32),
        (torch.float16, (s, b, h), None, None),
    ]:
        x = torch.randn(s, b, h, dtype=dtype, requires_grad=True)
        y = None if y_shape is None else torch.randn(y_shape, dtype=dtype, requires_grad=True)
        res = None if res_dtype is None else torch.randn(s, b, h, dtype=res_dtype, requires_grad=True)
        torch.library.opcheck(OPS.dropout_add_fwd, (x, y, res, pos, samples, 0.2, 3, 1, 2, 4, out_dtype))
    x, res, bias = torch.randn(s, b, h), torch.randn(s, b, h), torch.randn(h)
    fn = torch.compile(
        lambda x, bias, res: dropout_add(x, bias, res, 0.3, 9, 1, 3, index), backend="aot_eager", fullgraph=True
    )
    assert torch.equal(fn(x, bias, res), dropout_add_reference(x, bias, res, 0.3, 9, 1, 3, index))


def test_bad_arguments_raise_clear_errors():
    x = torch.randn(4, 2, 8)
    index = random_index(4, 2)
    pos, samples = index.token_positions, index.sample_ids
    with pytest.raises(RuntimeError, match="y must be a bias"):
        OPS.dropout_add_fwd(x, x[0], None, pos, samples, 0.1, 1, 0, 1, 0)
    with pytest.raises(RuntimeError, match="y must have x's dtype"):
        OPS.dropout_add_fwd(x, x.double(), None, pos, samples, 0.1, 1, 0, 1, 0)
    with pytest.raises(RuntimeError, match="output dtype must be x's or fp32"):
        OPS.dropout_add_fwd(x.bfloat16(), None, None, pos, samples, 0.1, 1, 0, 1, 0, torch.float16)
    with pytest.raises(RuntimeError, match="residual must match x"):
        OPS.dropout_add_fwd(x.bfloat16(), None, x.bfloat16(), pos, samples, 0.1, 1, 0, 1, 0, torch.float32)
    with pytest.raises(RuntimeError, match="dropout probability"):
        OPS.dropout_add_fwd(x, None, x, pos, samples, 1.0, 1, 0, 1, 0)
    with pytest.raises(RuntimeError, match="token_positions"):
        OPS.dropout_add_fwd(x, None, x, pos[:3], samples, 0.1, 0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="grad_x_dtype must be"):
        OPS.dropout_add_bwd(x.bfloat16(), pos, samples, 0.1, 1, 0, 1, 0, False, torch.float32)


VARIANT_SCRIPT = r"""
import torch
from megatron_sp.ops.dropout_add import dropout_add, dropout_add_reference
from megatron_sp.ops.layer_norm import layer_norm, layer_norm_reference
from megatron_sp.testing import random_index
for (s, b, h), off in [((5, 3, 7), 3), ((4, 2, 96), 0), ((3, 2, 130), 6)]:
    x, res, bias = torch.randn(s, b, h), torch.randn(s, b, h), torch.randn(h)
    index = random_index(s, b)
    ref = dropout_add_reference(x, bias, res, 0.3, 5, 1, 2, index, off)
    assert torch.equal(dropout_add(x, bias, res, 0.3, 5, 1, 2, index, off), ref)
    xb, yb = x.bfloat16(), res.bfloat16()
    ref = dropout_add_reference(xb, yb, None, 0.3, 5, 0, 1, index, off, out_dtype=torch.float32)
    assert torch.equal(dropout_add(xb, yb, None, 0.3, 5, 0, 1, index, off, out_dtype=torch.float32), ref)
    torch.testing.assert_close(layer_norm(x, bias, bias, 1e-5),
                               layer_norm_reference(x, bias, bias, 1e-5))
print("OK")
"""


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_every_cpu_simd_variant_is_bit_identical(capability):
    """The AVX-512 variant runs above where the CPU has it; the AVX2 and baseline ones here (dropout_add as
    the bias-dropout-add and as the embedding dropout, layer_norm)."""
    env = dict(os.environ, MEGATRON_SP_CPU_CAPABILITY=capability)
    proc = subprocess.run([sys.executable, "-c", VARIANT_SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr

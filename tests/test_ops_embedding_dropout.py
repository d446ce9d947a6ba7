"""Fused embedding_dropout (C++ CPU op) against the reference: the same bits in every dtype, forward and
backward, with and without position embeddings, with an fp32 output (--fp32-residual-connection)."""

import pytest
import torch

from megatron_sp.ops.embedding_dropout import embedding_dropout, embedding_dropout_reference
from megatron_sp.ops.philox import hidden_keep_mask
from megatron_sp.testing import FLOAT_DTYPES, randn, random_index

pytestmark = pytest.mark.extension

OPS = torch.ops.megatron_sp


@pytest.mark.parametrize("shape,offset", [((1, 1, 1), 0), ((5, 3, 7), 3), ((9, 4, 130), 128)])
def test_mask_is_the_reference_mask(shape, offset):
    index = random_index(shape[0], shape[1], generator=torch.Generator().manual_seed(shape[2]))
    seed, layer, site, p = -7 + 2**33, 0, 1, 0.4  # the seed wraps mod 2^32 in both
    out = OPS.embedding_dropout_fwd(
        torch.ones(shape), None, index.token_positions, index.sample_ids, p, seed, layer, site, offset
    )
    assert torch.equal(out != 0, hidden_keep_mask(shape, p, seed, layer, site, index, offset))


def _run(fn, x, y, grad):
    out = fn()
    out.backward(grad)
    return out.detach(), x.grad, None if y is None else y.grad


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("with_y", [True, False])
def test_forward_backward_bit_identical_to_reference(dtype, out_dtype, with_y):
    """The op rounds where the reference does (x + y in x's dtype, the masked value in out's; the
    backward through out's dtype back to x's), so every dtype compares bit for bit."""
    s, b, h = 16, 2, 64
    torch.manual_seed(0)
    index, args = random_index(s, b), (0.25, 42, 0, 1, 6)
    leaves = [randn((s, b, h), dtype, requires_grad=True) for _ in range(2 if with_y else 1)]
    twins = [t.detach().clone().requires_grad_() for t in leaves]
    x, y = leaves[0], leaves[1] if with_y else None
    xr, yr = twins[0], twins[1] if with_y else None
    grad = torch.randn(s, b, h).to(out_dtype or dtype)
    got = _run(lambda: embedding_dropout(x, y, *args[:4], index, args[4], out_dtype=out_dtype), x, y, grad)
    want = _run(
        lambda: embedding_dropout_reference(xr, yr, *args[:4], index, args[4], out_dtype=out_dtype), xr, yr, grad
    )
    assert got[0].dtype == (out_dtype or dtype) and got[1].dtype == dtype
    for a, e in zip(got, want):
        assert (a is None and e is None) or torch.equal(a, e)


def test_eval_and_zero_p_are_plain_sums():
    x, y = torch.randn(4, 2, 8).to(torch.bfloat16), torch.randn(4, 2, 8).to(torch.bfloat16)
    index = random_index(4, 2)
    expected = (x + y).float()
    assert torch.equal(embedding_dropout(x, y, 0.5, 1, 0, 1, index, training=False, out_dtype=torch.float32), expected)
    assert torch.equal(embedding_dropout(x, y, 0.0, 1, 0, 1, index, out_dtype=torch.float32), expected)


def test_backward_saves_no_mask():
    """Only the [s] positions and [b] sample ids are kept for the backward (the mask is redrawn)."""
    s, b, h = 8, 2, 32
    x, y = torch.randn(s, b, h, requires_grad=True), torch.randn(s, b, h, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        embedding_dropout(x, y, 0.1, 1, 0, 1, random_index(s, b))
    assert sorted(tuple(t.shape) for t in saved) == [(b,), (s,)]


def test_opcheck_and_compile():
    s, b, h = 6, 3, 12
    index = random_index(s, b)
    for dtype, out_dtype in [(torch.bfloat16, torch.float32), (torch.float16, None)]:
        x = torch.randn(s, b, h, dtype=dtype, requires_grad=True)
        y = torch.randn(s, b, h, dtype=dtype, requires_grad=True)
        torch.library.opcheck(
            OPS.embedding_dropout_fwd, (x, y, index.token_positions, index.sample_ids, 0.2, 3, 0, 1, 4, out_dtype)
        )
    x, y = torch.randn(s, b, h), torch.randn(s, b, h)
    fn = torch.compile(lambda x, y: embedding_dropout(x, y, 0.3, 9, 0, 1, index), backend="aot_eager", fullgraph=True)
    assert torch.equal(fn(x, y), embedding_dropout_reference(x, y, 0.3, 9, 0, 1, index))


def test_bad_arguments_raise_clear_errors():
    x = torch.randn(4, 2, 8)
    index = random_index(4, 2)
    pos, samples = index.token_positions, index.sample_ids
    with pytest.raises(RuntimeError, match="y must match x"):
        OPS.embedding_dropout_fwd(x, x.double(), pos, samples, 0.1, 1, 0, 1, 0)
    with pytest.raises(RuntimeError, match="out_dtype must be x's dtype or fp32"):
        OPS.embedding_dropout_fwd(x.bfloat16(), None, pos, samples, 0.1, 1, 0, 1, 0, torch.float16)
    with pytest.raises(RuntimeError, match="dropout probability"):
        OPS.embedding_dropout_fwd(x, None, pos, samples, 1.0, 1, 0, 1, 0)
    with pytest.raises(RuntimeError, match="grad_dtype must be"):
        OPS.embedding_dropout_bwd(x.bfloat16(), pos, samples, 0.1, 1, 0, 1, 0, torch.float32)

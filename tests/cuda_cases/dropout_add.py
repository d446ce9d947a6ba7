"""Cases of dropout_add's CUDA kernels (csrc/cuda/dropout_add.cu) and binding, in both of the model's uses:
residual + dropout(x + bias) after attention and the MLP, and dropout(x + position embeddings) at the
embedding. Bit for bit against the C++ CPU kernel (and the dropout mask against the reference); the bias
gradient within fp32 summation order."""

from __future__ import annotations

import torch

from cuda_cases import DTYPE_NAME, Case, cpu, opcheck
from megatron_sp.ops.dropout_add import dropout_add_reference
from megatron_sp.ops.philox import hidden_keep_mask
from megatron_sp.testing import assert_close_dtype, assert_same_error, random_index

CPU_OPS = torch.ops.megatron_sp


def _close_bias_grad(got, want, rows):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * rows**0.5)


def results_case(target, shape, offset, dtype, p, bias=True, align=True, reference=True, wide=False):
    """Both uses, forward and backward, against the C++ CPU kernel and (`reference`) the reference; the
    dropout mask exactly (inputs chosen so that no kept value is 0). wide: the residual and outputs in fp32
    (--fp32-residual-connection). Over millions of fp16 elements a few differ from the reference (which
    rounds after every step) by more than the tolerance: the large GPU shapes compare with the CPU kernel,
    bit for bit, alone."""
    s, b, h = shape
    gen = torch.Generator().manual_seed(hash((shape, offset, p)) % 2**31)
    out_dtype = torch.float32 if wide else dtype
    x, addend = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    res, grad = (torch.randn(shape, generator=gen).to(out_dtype) for _ in range(2))
    bias_t = torch.randn(h, generator=gen).to(dtype) if bias else None
    index = random_index(s, b, generator=gen)
    pos, samples = index.token_positions, index.sample_ids
    drop = (p, 1234, 7, 3, offset)
    on = lambda t: target.put(t, misaligned=not align)  # noqa: E731
    index_on = (target.put(pos), target.put(samples))

    ones = torch.ones(shape, dtype=dtype)
    mask_out = cpu(target.ops.dropout_add_fwd(on(ones), None, None, *index_on, *drop))
    expected_keep = hidden_keep_mask(shape, p, 1234, 7, 3, index, offset)
    assert torch.equal(mask_out != 0, expected_keep), "dropout mask differs from the reference"

    for y, r, use in ((bias_t, res, "residual"), (addend, None, "embedding")):
        out = cpu(
            target.ops.dropout_add_fwd(
                on(x), target.put(y) if use == "residual" else on(y), on(r), *index_on, *drop, out_dtype
            )
        )
        assert out.dtype == out_dtype
        cpu_out = CPU_OPS.dropout_add_fwd(x, y, r, pos, samples, *drop, out_dtype)
        assert torch.equal(out, cpu_out), f"{use} forward not bit-identical to the C++ CPU kernel"
    grad_x, grad_bias = map(cpu, target.ops.dropout_add_bwd(on(grad), *index_on, *drop, bias, dtype))
    gx_cpu, gb_cpu = CPU_OPS.dropout_add_bwd(grad, pos, samples, *drop, bias, dtype)
    assert grad_x.dtype == dtype and torch.equal(grad_x, gx_cpu), "grad_x not bit-identical to the C++ CPU kernel"
    if bias:
        _close_bias_grad(grad_bias, gb_cpu, s * b)
    if reference:
        _against_reference(cpu_out, grad_x, grad_bias, (x, addend), grad, drop, index, expected_keep)


def _against_reference(emb_out, grad_x, grad_bias, inputs, grad, drop, index, expected_keep):
    """The embedding's use bit for bit (forward and grad_x, the gradient of both inputs); the bias
    gradient from the mask within the dtype's tolerance."""
    dtype, (s, b, _) = grad_x.dtype, grad_x.shape
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    ref = dropout_add_reference(*leaves, None, *drop[:4], index, drop[4], out_dtype=emb_out.dtype)
    assert torch.equal(emb_out, ref.detach()), "the embedding's forward not bit-identical to the reference"
    ref.backward(grad)
    assert torch.equal(grad_x, leaves[0].grad) and torch.equal(grad_x, leaves[1].grad), "grad_x vs the reference"
    if grad_bias.numel():
        expected = (grad.float() * expected_keep.float() * (1.0 / (1.0 - drop[0]))).sum((0, 1))
        assert_close_dtype(grad_bias, expected, dtype, scale=(s * b) ** 0.5)


def binding_case(target, shape, offset, dtype):
    """The binding's own work: non-contiguous inputs, each optional input absent, no bias gradient, output
    dtypes and layouts, opcheck, and the same errors as the CPU op."""
    s, b, h = shape
    gen = torch.Generator().manual_seed(s * 1000 + h)
    x = torch.randn(shape, generator=gen).to(dtype)
    res = torch.randn(b, s, h, generator=gen).to(dtype).transpose(0, 1)  # not contiguous
    bias = torch.randn(h, generator=gen).to(dtype)
    index = random_index(s, b, generator=gen)
    scalars = (0.25, 77, 3, 1, offset)
    args = (index.token_positions, index.sample_ids, *scalars)
    args_on = (target.put(index.token_positions), target.put(index.sample_ids), *scalars)
    x_on, res_on, bias_on = target.put(x), target.put(res), target.put(bias)
    for y, r in ((bias, res), (None, res), (res, None), (None, None)):
        got = target.ops.dropout_add_fwd(x_on, target.put(y), target.put(r), *args_on)
        assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
        assert torch.equal(cpu(got), CPU_OPS.dropout_add_fwd(x, y, r, *args))
    wide = target.ops.dropout_add_fwd(x_on, res_on, None, *args_on, torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(
        cpu(wide), CPU_OPS.dropout_add_fwd(x, res, None, *args, torch.float32)
    )
    grad = torch.randn(shape, generator=gen).to(dtype)
    for bias_grad in (True, False):
        gx, gb = map(cpu, target.ops.dropout_add_bwd(target.put(grad), *args_on, bias_grad))
        gx_cpu, gb_cpu = CPU_OPS.dropout_add_bwd(grad, *args, bias_grad)
        assert torch.equal(gx, gx_cpu)
        assert gb.dtype == torch.float32 and gb.shape == gb_cpu.shape
        _close_bias_grad(gb, gb_cpu, s * b)
    opcheck(target.ops.dropout_add_fwd, (x_on, bias_on, res_on, *args_on))
    opcheck(target.ops.dropout_add_fwd, (x_on, res_on, None, *args_on, torch.float32))
    opcheck(target.ops.dropout_add_bwd, (target.put(grad), *args_on, True))
    assert_same_error(
        lambda: target.ops.dropout_add_fwd(x_on, bias_on[:-1], res_on, *args_on),
        lambda: CPU_OPS.dropout_add_fwd(x, bias[:-1], res, *args),
    )


def cases() -> list:
    out = []
    # [s, b, h], feature offset, SMs: vector path (h % 8 == 0, offset % 4 == 0) with long grid-stride
    # loops (1 SM) and with an H200's grid; scalar fallbacks (odd h, offset not a multiple of 4); one
    # element; GPU only: a wide row and a long slab.
    for shape, offset, sms, emulate in [
        ((64, 4, 256), 0, 1, True),
        ((33, 3, 256), 512, 132, True),
        ((5, 3, 7), 3, 1, True),
        ((17, 2, 40), 2, 132, True),
        ((1, 1, 1), 0, 1, True),
        ((9, 2, 2056), 4096, 1, True),
        ((64, 4, 1024), 0, 132, False),
        ((300, 2, 4096), 4096, 132, False),
    ]:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            name = f"da-{'x'.join(map(str, shape))}-off{offset}-{DTYPE_NAME[dtype]}-sm{sms}"
            race = name in ("da-64x4x256-off0-bf16-sm1", "da-5x3x7-off3-fp32-sm1")
            args = (shape, offset, dtype, 0.3, True, True, emulate)  # the GPU-only shapes: no reference
            out.append(Case(name, results_case, args, sms, race, emulate))
    out.append(Case("da-no-bias-p0-bf16", results_case, ((8, 2, 64), 0, torch.bfloat16, 0.0, False)))
    out.append(Case("da-misaligned-fp32", results_case, ((9, 2, 64), 4, torch.float32, 0.4, True, False)))
    out.append(Case("da-misaligned-fp16", results_case, ((9, 2, 64), 4, torch.float16, 0.4, True, False)))
    for dtype in (torch.bfloat16, torch.float16):  # fp32 residual and outputs: vector path, and the scalar fallback
        name = f"da-fp32-out-{DTYPE_NAME[dtype]}"
        out.append(
            Case(name, results_case, ((16, 2, 64), 0, dtype, 0.3, True, True, True, True), race=dtype == torch.bfloat16)
        )
        out.append(Case(f"{name}-odd", results_case, ((5, 3, 7), 3, dtype, 0.3, True, True, True, True)))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out.append(Case(f"binding-da-{DTYPE_NAME[dtype]}", binding_case, ((9, 2, 64), 4, dtype)))
        out.append(Case(f"binding-da-odd-{DTYPE_NAME[dtype]}", binding_case, ((5, 3, 7), 3, dtype), sms=132))
    return out

"""Cases of embedding_dropout's CUDA kernels (csrc/cuda/embedding_dropout.cu) and binding: bit for bit
against the C++ CPU kernel (which is bit for bit the reference, tests/test_ops_embedding_dropout.py) in
every dtype, with and without position embeddings, with an fp32 output (--fp32-residual-connection)."""

from __future__ import annotations

import torch

from cuda_cases import DTYPE_NAME, Case, cpu, opcheck
from megatron_sp.ops.philox import hidden_keep_mask
from megatron_sp.testing import assert_same_error, random_index

CPU_OPS = torch.ops.megatron_sp


def results_case(target, shape, offset, dtype, out_dtype, with_y=True, p=0.3, align=True):
    s, b, h = shape
    gen = torch.Generator().manual_seed(hash((shape, offset, p)) % 2**31)
    x, y = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    y = y if with_y else None
    grad = torch.randn(shape, generator=gen).to(out_dtype or dtype)
    index = random_index(s, b, generator=gen)
    pos, samples = index.token_positions, index.sample_ids
    drop = (p, 1234, 0, 1, offset)
    on = lambda t: target.put(t, misaligned=not align)  # noqa: E731
    index_on = (target.put(pos), target.put(samples))

    out = cpu(target.ops.embedding_dropout_fwd(on(x), on(y), *index_on, *drop, out_dtype))
    assert out.dtype == (out_dtype or dtype)
    assert torch.equal(out, CPU_OPS.embedding_dropout_fwd(x, y, pos, samples, *drop, out_dtype)), "forward"
    ones = torch.ones(shape, dtype=dtype)
    mask_out = cpu(target.ops.embedding_dropout_fwd(on(ones), None, *index_on, *drop, None))
    assert torch.equal(mask_out != 0, hidden_keep_mask(shape, p, 1234, 0, 1, index, offset)), "dropout mask"

    grad_x = cpu(target.ops.embedding_dropout_bwd(on(grad), *index_on, *drop, dtype))
    assert grad_x.dtype == dtype
    assert torch.equal(grad_x, CPU_OPS.embedding_dropout_bwd(grad, pos, samples, *drop, dtype)), "backward"


def binding_case(target, shape, offset, dtype):
    """Non-contiguous inputs, opcheck of both ops, and the same errors as the CPU op."""
    s, b, h = shape
    gen = torch.Generator().manual_seed(s * 1000 + h)
    x = torch.randn(b, s, h, generator=gen).to(dtype).transpose(0, 1)  # not contiguous
    y = torch.randn(shape, generator=gen).to(dtype)
    index = random_index(s, b, generator=gen)
    args = (index.token_positions, index.sample_ids, 0.25, 77, 0, 1, offset)
    args_on = (target.put(index.token_positions), target.put(index.sample_ids), *args[2:])
    x_on, y_on = target.put(x), target.put(y)
    got = target.ops.embedding_dropout_fwd(x_on, y_on, *args_on, torch.float32)
    assert got.dtype == torch.float32 and got.shape == x.shape and got.is_contiguous()
    assert torch.equal(cpu(got), CPU_OPS.embedding_dropout_fwd(x, y, *args, torch.float32))
    opcheck(target.ops.embedding_dropout_fwd, (x_on, y_on, *args_on, None))
    opcheck(target.ops.embedding_dropout_bwd, (target.put(y.float()), *args_on, dtype))
    assert_same_error(
        lambda: target.ops.embedding_dropout_fwd(x_on, y_on[:-1], *args_on, None),
        lambda: CPU_OPS.embedding_dropout_fwd(x, y[:-1], *args, None),
    )


def cases() -> list:
    out = []
    # [s, b, h], feature offset, SMs: the vector path with long grid-stride loops (1 SM) and an H200's
    # grid, scalar fallbacks (odd h, offset not a multiple of 4), one element; GPU only: a long slab.
    for shape, offset, sms, emulate in [
        ((64, 4, 256), 0, 1, True),
        ((33, 3, 256), 512, 132, True),
        ((5, 3, 7), 3, 1, True),
        ((1, 1, 1), 0, 1, True),
        ((300, 2, 4096), 4096, 132, False),
    ]:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for out_dtype in {torch.float32: (None,), torch.bfloat16: (None, torch.float32)}.get(
                dtype, (torch.float32,)
            ):
                wide = "" if out_dtype is None else "-out-fp32"
                name = f"emb-{'x'.join(map(str, shape))}-off{offset}-{DTYPE_NAME[dtype]}{wide}-sm{sms}"
                race = name in ("emb-64x4x256-off0-bf16-out-fp32-sm1",)
                out.append(Case(name, results_case, (shape, offset, dtype, out_dtype), sms, race, emulate))
    out.append(Case("emb-no-y-p0-bf16", results_case, ((8, 2, 64), 0, torch.bfloat16, None, False, 0.0)))
    out.append(
        Case("emb-misaligned-fp16", results_case, ((9, 2, 64), 4, torch.float16, torch.float32, True, 0.4, False))
    )
    for dtype in (torch.float32, torch.bfloat16):
        out.append(Case(f"binding-emb-{DTYPE_NAME[dtype]}", binding_case, ((9, 2, 64), 4, dtype)))
        out.append(Case(f"binding-emb-odd-{DTYPE_NAME[dtype]}", binding_case, ((5, 3, 7), 3, dtype), sms=132))
    return out

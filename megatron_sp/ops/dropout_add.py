"""out = [residual +] dropout(x [+ y]): the model's one hidden-dropout op, with the parallelism-invariant
dropout of ops/philox.py (masks are a pure function of seed, layer, site and global indices).

    site                    x                   y                       residual   out
    embedding (layer 0)     word embeddings     position embeddings     None       x's dtype, or fp32
                            [s, b, h]           [s, b, h] or None                  (--fp32-residual-connection)
    attention / MLP output  the row-parallel    its bias [h] or None    [s, b, h]  the residual's
                            GEMM's [s, b, h]

The fused op (megatron_sp::dropout_add_fwd/_bwd, csrc/) draws the same Philox words as the reference, bit
for bit, and its backward draws them again instead of reading a stored mask: the autograd graph keeps only
the [s] token positions and [b] sample ids. It rounds where each use needs it:
- an addend y of x's shape: x + y in x's dtype, then the masked value in out's dtype: the reference's two
  roundings, so the embedding's dropout is the reference's bits in every dtype;
- a bias y [h] and the residual: everything in fp32 and one rounding at the end (bit for bit the
  reference in fp32; bf16/fp16 within their tolerance of the reference, which rounds after every step).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_sp.ops._extension import register_op, use_fused
from megatron_sp.ops.philox import DropoutIndex, dropout

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dropout_add_reference(
    x: torch.Tensor,
    y: Optional[torch.Tensor],
    residual: Optional[torch.Tensor],
    p: float,
    seed: int,
    layer: int,
    site: int,
    index: DropoutIndex,
    feature_offset: int = 0,
    training: bool = True,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Pure PyTorch; autograd through the mask multiply. Without a residual the sum is cast to out_dtype
    (default x's) before the dropout; with one, the dropped sum is added to it (PyTorch promotes)."""
    summed = x if y is None else x + y
    if residual is None:
        return dropout(summed.to(out_dtype or x.dtype), p, seed, layer, site, index, feature_offset, training)
    return residual + dropout(summed, p, seed, layer, site, index, feature_offset, training)


def _fusable(x, y, residual, out_dtype) -> bool:
    """x in fp32/bf16/fp16, y (a bias [h] or like x) in x's dtype, the output in x's dtype or fp32 and the
    residual in it; other mixes run the reference, which promotes."""
    if residual is not None and residual.dtype != out_dtype:
        return False
    return (
        x.dim() == 3
        and x.dtype in _DTYPES
        and (y is None or (y.dtype == x.dtype and y.shape in ((x.shape[2],), x.shape)))
        and out_dtype in (x.dtype, torch.float32)
    )


def dropout_add(
    x, y, residual, p, seed, layer, site, index, feature_offset=0, training=True, out_dtype=None, fused=True
) -> torch.Tensor:
    """[residual +] dropout(x [+ y]) for x [s, b, h_local]; y a bias [h_local], an addend like x, or None;
    residual like x or None (see the module docstring's table).

    index: DropoutIndex of the rows (global token positions [s], sample ids [b]); feature_offset: global
    index of local feature 0; out_dtype: the output's dtype (default the residual's, else x's). The fused op
    when `fused` and megatron_sp._C is built for x's device and the dtypes are as _fusable says, else the
    reference; both give the same masks.
    """
    out_dtype = out_dtype or (residual.dtype if residual is not None else x.dtype)
    if not (use_fused(fused, x) and _BUILT and _fusable(x, y, residual, out_dtype)):
        return dropout_add_reference(x, y, residual, p, seed, layer, site, index, feature_offset, training, out_dtype)
    positions = index.token_positions.to(device=x.device, dtype=torch.int64)
    samples = index.sample_ids.to(device=x.device, dtype=torch.int64)
    drop = (float(p) if training else 0.0, int(seed), int(layer), int(site), int(feature_offset))
    return torch.ops.megatron_sp.dropout_add_fwd(x, y, residual, positions, samples, *drop, out_dtype)


def _fake_fwd(x, y, residual, positions, samples, p, seed, layer, site, feature_offset, out_dtype=None):
    dtype = out_dtype or (residual.dtype if residual is not None else x.dtype)
    return x.new_empty(x.shape, dtype=dtype)


def _fake_bwd(grad, positions, samples, p, seed, layer, site, feature_offset, bias_grad, grad_x_dtype=None):
    grad_bias = grad.new_empty((grad.shape[2],) if bias_grad else (0,), dtype=torch.float32)
    return grad.new_empty(grad.shape, dtype=grad_x_dtype or grad.dtype), grad_bias


def _setup_context(ctx, inputs, output):
    x, y, residual, positions, samples, p, seed, layer, site, feature_offset, _ = inputs
    ctx.save_for_backward(positions, samples)  # all the backward needs: no mask
    ctx.dropout_args = (p, seed, layer, site, feature_offset)
    ctx.x_dtype, ctx.has_residual = x.dtype, residual is not None
    ctx.y_kind = None if y is None else ("bias" if y.dim() == 1 else "addend")


def _backward(ctx, grad):
    positions, samples = ctx.saved_tensors
    bias_grad = ctx.y_kind == "bias"
    grad_x, grad_bias = torch.ops.megatron_sp.dropout_add_bwd(
        grad, positions, samples, *ctx.dropout_args, bias_grad, ctx.x_dtype
    )
    grad_y = grad_bias.to(ctx.x_dtype) if bias_grad else grad_x if ctx.y_kind == "addend" else None
    grad_residual = grad if ctx.has_residual else None
    return grad_x, grad_y, grad_residual, None, None, None, None, None, None, None, None


_BUILT = register_op("dropout_add", _fake_fwd, _fake_bwd, _backward, _setup_context)

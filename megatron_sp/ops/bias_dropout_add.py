"""out = residual + dropout(x + bias), with the parallelism-invariant dropout of
ops/philox.py (masks are a pure function of seed, layer, site and global indices).

The fused op (megatron_sp::bias_dropout_add_fwd/_bwd, csrc/) draws the same Philox words as the
reference, bit for bit, and its backward draws them again instead of reading a stored mask: the
autograd graph keeps only the [s] token positions and [b] sample ids.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_sp.ops._extension import extension_available, use_fused
from megatron_sp.ops.philox import DropoutIndex, dropout


def bias_dropout_add_reference(
    x: torch.Tensor,
    bias: Optional[torch.Tensor],
    residual: torch.Tensor,
    p: float,
    seed: int,
    layer: int,
    site: int,
    index: DropoutIndex,
    feature_offset: int = 0,
    training: bool = True,
) -> torch.Tensor:
    """x, residual [s, b, h]; bias [h] or None. Pure PyTorch; autograd through the mask multiply."""
    if bias is not None:
        x = x + bias
    return residual + dropout(x, p, seed, layer, site, index, feature_offset, training)


def _fusable(x, bias, residual) -> bool:
    """One dtype for x and bias, the residual in it or fp32 (the fp32 residual stream beside bf16/fp16
    activations); other mixes run the reference, which promotes."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return (
        x.dim() == 3
        and x.dtype in dtypes
        and residual.dtype in (x.dtype, torch.float32)
        and (bias is None or bias.dtype == x.dtype)
    )


def bias_dropout_add(x, bias, residual, p, seed, layer, site, index, feature_offset=0, training=True, fused=True):
    """residual + dropout(x + bias) for x, residual [s, b, h_local], bias [h_local] or None.

    index: DropoutIndex of the rows (global token positions [s], sample ids [b]); feature_offset:
    global index of local feature 0. Fused op when `fused` and megatron_sp._C is built for x's
    device and x, bias share one of fp32/bf16/fp16 and the residual has it or fp32 (the output has the
    residual's dtype), else the reference; both give the same masks.
    """
    if not (use_fused(fused, x) and _fusable(x, bias, residual)):
        return bias_dropout_add_reference(x, bias, residual, p, seed, layer, site, index, feature_offset, training)
    positions = index.token_positions.to(device=x.device, dtype=torch.int64)
    samples = index.sample_ids.to(device=x.device, dtype=torch.int64)
    return torch.ops.megatron_sp.bias_dropout_add_fwd(
        x,
        bias,
        residual,
        positions,
        samples,
        float(p) if training else 0.0,
        int(seed),
        int(layer),
        int(site),
        int(feature_offset),
    )


def _fake_fwd(x, bias, residual, positions, samples, p, seed, layer, site, feature_offset):
    return residual.new_empty(x.shape)


def _fake_bwd(grad, positions, samples, p, seed, layer, site, feature_offset, bias_grad, grad_x_dtype=None):
    grad_bias = grad.new_empty((grad.shape[2],) if bias_grad else (0,), dtype=torch.float32)
    return grad.new_empty(grad.shape, dtype=grad_x_dtype or grad.dtype), grad_bias


def _setup_context(ctx, inputs, output):
    x, bias, _, positions, samples, p, seed, layer, site, feature_offset = inputs
    ctx.save_for_backward(positions, samples)  # all the backward needs: no mask
    ctx.dropout_args = (p, seed, layer, site, feature_offset)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.x_dtype = x.dtype


def _backward(ctx, grad):
    positions, samples = ctx.saved_tensors
    has_bias = ctx.bias_dtype is not None
    grad_x, grad_bias = torch.ops.megatron_sp.bias_dropout_add_bwd(
        grad, positions, samples, *ctx.dropout_args, has_bias, ctx.x_dtype
    )
    grad_bias = grad_bias.to(ctx.bias_dtype) if has_bias else None
    return grad_x, grad_bias, grad, None, None, None, None, None, None, None


if extension_available():
    torch.library.register_fake("megatron_sp::bias_dropout_add_fwd")(_fake_fwd)
    torch.library.register_fake("megatron_sp::bias_dropout_add_bwd")(_fake_bwd)
    torch.library.register_autograd("megatron_sp::bias_dropout_add_fwd", _backward, setup_context=_setup_context)

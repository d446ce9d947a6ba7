"""out = dropout(x + y) for the embedding layer: x the word embeddings [s, b, h], y the learned position
embeddings of the same tokens (or None), with the parallelism-invariant dropout of ops/philox.py
(layer 0, site SITE_EMBEDDING), the result in `out_dtype`: x's dtype, or fp32 for the fp32 residual
stream of --fp32-residual-connection (Megatron converts the embeddings before their dropout).

The fused op (megatron_sp::embedding_dropout_fwd/_bwd, csrc/) rounds the sum to x's dtype and then
the scaled, masked value to out_dtype, as the reference's two steps do, so it is bit-identical to the
reference in every dtype; its backward draws the mask again instead of keeping it (the autograd graph
keeps only the [s] token positions and [b] sample ids) and returns the one gradient of x and of y.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_sp.ops._extension import extension_available, use_fused
from megatron_sp.ops.philox import DropoutIndex, dropout

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# False with a megatron_sp._C built before this op existed (rebuild it): the reference runs.
_OP_BUILT = extension_available() and hasattr(torch.ops.megatron_sp, "embedding_dropout_fwd")


def embedding_dropout_reference(
    x: torch.Tensor,
    y: Optional[torch.Tensor],
    p: float,
    seed: int,
    layer: int,
    site: int,
    index: DropoutIndex,
    feature_offset: int = 0,
    training: bool = True,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """x, y [s, b, h] (y may be None). Pure PyTorch; autograd through the mask multiply."""
    summed = x if y is None else x + y
    return dropout(summed.to(out_dtype or x.dtype), p, seed, layer, site, index, feature_offset, training)


def _fusable(x, y, out_dtype) -> bool:
    return (
        x.dim() == 3
        and x.dtype in _DTYPES
        and (y is None or (y.dtype == x.dtype and y.shape == x.shape))
        and out_dtype in (x.dtype, torch.float32)
    )


def embedding_dropout(
    x, y, p, seed, layer, site, index, feature_offset=0, training=True, out_dtype=None, fused=True
) -> torch.Tensor:
    """dropout(x + y) in out_dtype (default x's) for x, y [s, b, h_local]; index: the DropoutIndex of
    the rows (global token positions [s], sample ids [b]); feature_offset: the global index of local
    feature 0. The fused op when `fused` and megatron_sp._C is built for x's device, else the
    reference; both give the same bits."""
    out_dtype = out_dtype or x.dtype
    if not (use_fused(fused, x) and _OP_BUILT and _fusable(x, y, out_dtype)):
        return embedding_dropout_reference(x, y, p, seed, layer, site, index, feature_offset, training, out_dtype)
    positions = index.token_positions.to(device=x.device, dtype=torch.int64)
    samples = index.sample_ids.to(device=x.device, dtype=torch.int64)
    p = float(p) if training else 0.0
    drop = (p, int(seed), int(layer), int(site), int(feature_offset))
    return torch.ops.megatron_sp.embedding_dropout_fwd(x, y, positions, samples, *drop, out_dtype)


def _fake_fwd(x, y, positions, samples, p, seed, layer, site, feature_offset, out_dtype=None):
    return x.new_empty(x.shape, dtype=out_dtype if out_dtype is not None else x.dtype)


def _fake_bwd(grad, positions, samples, p, seed, layer, site, feature_offset, grad_dtype):
    return grad.new_empty(grad.shape, dtype=grad_dtype)


def _setup_context(ctx, inputs, output):
    x, y, positions, samples, p, seed, layer, site, feature_offset, _ = inputs
    ctx.save_for_backward(positions, samples)  # all the backward needs: no mask
    ctx.dropout_args = (p, seed, layer, site, feature_offset)
    ctx.x_dtype, ctx.has_y = x.dtype, y is not None


def _backward(ctx, grad):
    positions, samples = ctx.saved_tensors
    grad_x = torch.ops.megatron_sp.embedding_dropout_bwd(grad, positions, samples, *ctx.dropout_args, ctx.x_dtype)
    return grad_x, grad_x if ctx.has_y else None, None, None, None, None, None, None, None, None


if _OP_BUILT:
    torch.library.register_fake("megatron_sp::embedding_dropout_fwd")(_fake_fwd)
    torch.library.register_fake("megatron_sp::embedding_dropout_bwd")(_fake_bwd)
    torch.library.register_autograd("megatron_sp::embedding_dropout_fwd", _backward, setup_context=_setup_context)

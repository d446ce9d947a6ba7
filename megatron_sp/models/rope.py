"""Rotary position embeddings (Su et al. 2021), in the non-interleaved ("rotate half") form that
Megatron-LM and Hugging Face Llama use:

    x [b, n, s, d], positions [b, s]
    theta_j = base^(-2j / r), j < r/2           (r = rotary channels: d × rotary_percent)
    angle   = position × theta, repeated twice  -> cos, sin [b, 1, s, r]
    out     = x_r cos + rotate_half(x_r) sin  (first r channels),  rest of x unchanged

Angles are computed in fp32 from the position ids the batch carries (document-reset positions
included) and cast to x's dtype, as Hugging Face does.
"""
from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """No parameters; `inv_freq` is a non-persistent buffer (not in the state dict)."""

    def __init__(self, cfg):
        super().__init__()
        self.dim = cfg.rotary_dim
        exponents = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
        self.register_buffer("inv_freq", 1.0 / (float(cfg.rotary_base) ** exponents), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x [b, n, s, d]; position_ids [b, s] (the global positions of x's s tokens)."""
        freqs = position_ids[:, None, :, None].float() * self.inv_freq.float()   # [b, 1, s, r/2]
        angles = torch.cat((freqs, freqs), dim=-1)                                 # [b, 1, s, r]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        if self.dim == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        rot, rest = x[..., : self.dim], x[..., self.dim:]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)

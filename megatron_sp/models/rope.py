"""Rotary position embeddings (Su et al. 2021), in the non-interleaved ("rotate half") form that
Megatron-LM and Hugging Face Llama use:

    x [b, n, s, d], positions [b, s]
    theta_j = base^(-2j / r), j < r/2           (r = rotary channels: d × rotary_percent)
    angle   = position × theta, repeated twice  -> cos, sin [b, 1, s, r]
    out     = x_r cos + rotate_half(x_r) sin  (first r channels),  rest of x unchanged

Angles are computed in fp32 from the position ids the batch carries (document-reset positions
included) and cast to x's dtype, as Hugging Face does.

Two ways of stretching a model to longer sequences change theta (and nothing else):
- linear interpolation (`rotary_seq_len_interpolation_factor` f; HF rope_type "linear"):
  theta_j / f, the same as positions / f;
- Llama 3.1 frequency scaling (`rope_scaling`; HF rope_type "llama3"; factor f, low/high frequency
  factors l < h, original context L): with wavelength w = 2 pi / theta_j,
      w < L / h            theta_j                      (high frequencies: unchanged)
      w > L / l            theta_j / f                  (low frequencies: interpolated)
      otherwise            (1 - a) theta_j / f + a theta_j,  a = (L / w - l) / (h - l)
"""

from __future__ import annotations

import math

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def inverse_frequencies(cfg) -> torch.Tensor:
    """theta [rotary_dim / 2] in fp32 (as Hugging Face computes it), with the config's scaling."""
    dim = cfg.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # (models build on meta)
    theta = 1.0 / (float(cfg.rotary_base) ** exponents)
    if cfg.rope_scaling:
        f, low, high = cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor
        context = cfg.rope_scaling_original_max_position_embeddings
        wavelength = 2 * math.pi / theta
        share = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)  # 1: w < L/h; 0: w > L/l
        theta = (1 - share) * theta / f + share * theta
    if cfg.rotary_seq_len_interpolation_factor is not None:
        theta = theta / cfg.rotary_seq_len_interpolation_factor
    return theta


class RotaryEmbedding(nn.Module):
    """No parameters; `inv_freq` is a non-persistent buffer (not in the state dict)."""

    def __init__(self, cfg):
        super().__init__()
        self.dim = cfg.rotary_dim
        self.register_buffer("inv_freq", inverse_frequencies(cfg), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x [b, n, s, d]; position_ids [b, s] (the global positions of x's s tokens)."""
        freqs = position_ids[:, None, :, None].float() * self.inv_freq.float()  # [b, 1, s, r/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [b, 1, s, r]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        if self.dim == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)

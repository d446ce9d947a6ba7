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

YaRN (Peng et al. 2023; `--position-embedding-type yarn`, Megatron's YarnRotaryEmbedding and HF
rope_type "yarn"; factor s, original context L, betas b_fast > b_slow): channel pair j is kept when
it turns more than b_fast times over L, interpolated (theta_j / s) when less than b_slow times, and
ramped linearly between, over the pairs [lo, hi] where pair j turns r times at
j = d ln(L / (2 pi r)) / (2 ln base) (lo, hi rounded outwards unless
--no-yarn-correction-range-round-to-int). Its attention scaling m = g(mscale) / g(mscale_all_dim),
g(x) = 0.1 x ln s + 1 (1 when s <= 1), multiplies cos and sin, so the scores by m².
"""

from __future__ import annotations

import math

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _yarn_pair(turns: float, dim: int, base: float, context: int) -> float:
    """The (fractional) channel pair that turns `turns` times over `context` positions."""
    return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(base))


def yarn_frequencies(cfg, powers: torch.Tensor) -> torch.Tensor:
    """YaRN's theta from base^(2j/d) (see the module docstring)."""
    dim, base, s = cfg.rotary_dim, float(cfg.rotary_base), cfg.yarn_rotary_scaling_factor
    context = cfg.yarn_original_max_position_embeddings
    lo = _yarn_pair(cfg.yarn_beta_fast, dim, base, context)
    hi = _yarn_pair(cfg.yarn_beta_slow, dim, base, context)
    if cfg.yarn_correction_range_round_to_int:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi + 0.001 if lo == hi else hi  # (a ramp of no width)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo)).clamp(0, 1)
    kept = 1 - ramp  # 1: the pair keeps theta_j; 0: theta_j / s
    return (1.0 / (s * powers)) * (1 - kept) + (1.0 / powers) * kept


def yarn_attention_scale(cfg) -> float:
    """YaRN's m, multiplying cos and sin (1.0 for plain RoPE)."""
    if cfg.position_embedding_type != "yarn":
        return 1.0
    s = cfg.yarn_rotary_scaling_factor

    def g(mscale):
        return 1.0 if s <= 1 else 0.1 * mscale * math.log(s) + 1.0

    return float(g(cfg.yarn_mscale) / g(cfg.yarn_mscale_all_dim))


def inverse_frequencies(cfg) -> torch.Tensor:
    """theta [rotary_dim / 2] in fp32 (as Hugging Face computes it), with the config's scaling."""
    dim = cfg.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # (models build on meta)
    if cfg.position_embedding_type == "yarn":
        return yarn_frequencies(cfg, float(cfg.rotary_base) ** exponents)
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
        self.dim, self.scale = cfg.rotary_dim, yarn_attention_scale(cfg)
        self.register_buffer("inv_freq", inverse_frequencies(cfg), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x [b, n, s, d]; position_ids [b, s] (the global positions of x's s tokens)."""
        freqs = position_ids[:, None, :, None].float() * self.inv_freq.float()  # [b, 1, s, r/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [b, 1, s, r]
        cos, sin = angles.cos(), angles.sin()
        if self.scale != 1.0:  # YaRN's attention scaling, in fp32 as Hugging Face applies it
            cos, sin = cos * self.scale, sin * self.scale
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.dim == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)

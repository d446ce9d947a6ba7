"""Deterministic initialisation of full (serial-shaped) tensors.

Every tensor is drawn from its own CPU generator seeded by (config seed, parameter name), on the full
serial shape; parallel models then slice their shard. So a model initialised at TP=4 equals the one
initialised at TP=1, and neither depends on the order in which parameters are created.
"""
from __future__ import annotations

import math
import zlib

import torch

from megatron_sp.config import GPTConfig

_SCALED = ("attn.proj.weight", "mlp.fc2.weight")   # output projections: std / sqrt(2 L) (GPT-2)
_NORMS = ("ln1.", "ln2.", "final_ln.")


def init_full_tensor(name: str, shape, cfg: GPTConfig) -> torch.Tensor:
    """The initial value of parameter `name` (a ReferenceGPT state-dict key) with full shape."""
    if any(name.startswith(n) or f".{n}" in name for n in _NORMS):
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    std = cfg.init_method_std
    if name.endswith(_SCALED):
        std = std / math.sqrt(2.0 * cfg.num_layers)
    gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.empty(shape).normal_(0.0, std, generator=gen)

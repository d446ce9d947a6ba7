"""Deterministic initialisation of full (serial-shaped) tensors from each parameter's init tag.

Every tensor is drawn from its own CPU generator seeded by (config seed, parameter name), on the full
serial shape; parallel models then slice their shard. So a model initialised at TP=4 equals the one
initialised at TP=1, and neither depends on the order in which parameters are created.

Tags (set where the parameter is created, tensor_parallel.layers.mark): "normal" N(0, std),
"scaled_normal" N(0, std / sqrt(2 L)) for the projections into the residual stream (GPT-2),
"embedding" N(0, embedding std) for the word and position embeddings, "ones", "zeros"; with
--init-method-xavier-uniform every normal one is Xavier-uniform instead (Megatron's). A parameter
without a tag is an error, never a silent default.
"""

from __future__ import annotations

import math
import zlib

import torch


def init_full_tensor(name: str, shape, tag: str, cfg) -> torch.Tensor:
    """The initial value of parameter `name` (a ReferenceGPT state-dict key) with full shape."""
    if tag == "ones":
        return torch.ones(shape)
    if tag == "zeros":
        return torch.zeros(shape)
    if tag not in ("normal", "scaled_normal", "embedding"):
        raise ValueError(f"parameter {name}: unknown init tag {tag!r}.")
    gen = torch.Generator().manual_seed((cfg.seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    if cfg.init_method_xavier_uniform:  # Megatron: every normal init becomes Xavier's, on the full tensor
        return torch.nn.init.xavier_uniform_(torch.empty(shape), generator=gen)
    return torch.empty(shape).normal_(0.0, _std(tag, cfg), generator=gen)


def _std(tag: str, cfg) -> float:
    """normal: --init-method-std; scaled_normal: / sqrt(2 L); embedding: --embedding-init-method-std."""
    if tag == "scaled_normal":
        return cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    if tag == "embedding" and cfg.embedding_init_method_std is not None:
        return cfg.embedding_init_method_std
    return cfg.init_method_std


def check_init_tags(module) -> None:
    """Every parameter must say how it is initialised."""
    untagged = [name for name, p in module.named_parameters() if getattr(p, "init_tag", None) is None]
    if untagged:
        raise ValueError(
            f"parameter {untagged[0]} has no init tag: create it with "
            f"megatron_sp.tensor_parallel.layers.mark(param, init=...) (normal, scaled_normal, "
            f"ones or zeros) or through the builder's column/row layers"
            f"{f' ({len(untagged) - 1} more untagged)' if len(untagged) > 1 else ''}."
        )

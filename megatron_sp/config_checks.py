"""GPTConfig's validation: each check raises ValueError with one sentence naming the field.

Called by GPTConfig.__post_init__ (config.py) once the derived fields are filled.
"""

from __future__ import annotations

import dataclasses

from megatron_sp.fields import info


def check_choices(cfg):
    for f in dataclasses.fields(cfg):
        value, choices = getattr(cfg, f.name), info(f).choices
        if choices and value not in choices and not (value is None and f.default is None):
            raise ValueError(f"GPTConfig.{f.name} must be one of {', '.join(choices)}, got {value!r}.")


def check_positive(cfg):
    for name in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "vocab_size",
        "seq_length",
        "ffn_hidden_size",
        "max_position_embeddings",
        "tensor_model_parallel_size",
        "context_parallel_size",
        "make_vocab_size_divisible_by",
        "num_query_groups",
        "kv_channels",
    ):
        value = getattr(cfg, name)
        if value is None and name in ("num_query_groups", "kv_channels"):
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
    if cfg.init_method_std <= 0 or cfg.layernorm_epsilon <= 0:
        raise ValueError("GPTConfig.init_method_std and layernorm_epsilon must be positive.")


def check_divisibility(cfg):
    h, n, t = cfg.hidden_size, cfg.num_attention_heads, cfg.tensor_model_parallel_size
    g = cfg.num_query_groups
    if cfg.kv_channels is None:
        raise ValueError(
            f"GPTConfig.hidden_size ({h}) must be divisible by num_attention_heads ({n}), or give kv_channels."
        )
    if n % t != 0:
        raise ValueError(f"GPTConfig.num_attention_heads ({n}) must be divisible by tensor_model_parallel_size ({t}).")
    if n % g != 0:
        raise ValueError(f"GPTConfig.num_query_groups ({g}) must divide num_attention_heads ({n}).")
    if g % t != 0 and t % g != 0:
        raise ValueError(
            f"GPTConfig.num_query_groups ({g}) must be divisible by tensor_model_parallel_size "
            f"({t}), or divide it (then each key/value head is replicated on {t} // {g} ranks)."
        )
    if cfg.ffn_hidden_size % t != 0:
        raise ValueError(
            f"GPTConfig.ffn_hidden_size ({cfg.ffn_hidden_size}) must be divisible by tensor_model_parallel_size ({t})."
        )
    c = cfg.context_parallel_size
    if cfg.sequence_parallel and cfg.seq_length % (t * c) != 0:
        raise ValueError(
            f"GPTConfig.seq_length ({cfg.seq_length}) must be divisible by "
            f"tensor_model_parallel_size ({t}){f' × context_parallel_size ({c})' if c > 1 else ''} "
            f"with sequence_parallel on."
        )
    if c > 1:
        _check_context_parallel(cfg, t, c)


def _check_context_parallel(cfg, t, c):
    parts = 2 * c if cfg.cp_comm_type == "p2p" else c
    if cfg.seq_length % parts != 0:
        raise ValueError(
            f"GPTConfig.seq_length ({cfg.seq_length}) must be divisible by {parts} "
            + (
                "(2 × context_parallel_size: ring attention's zigzag chunks)."
                if cfg.cp_comm_type == "p2p"
                else "(context_parallel_size)."
            )
        )
    heads = cfg.num_attention_heads // t
    if cfg.cp_comm_type == "a2a" and heads % c != 0:
        raise ValueError(
            f"GPTConfig.num_attention_heads per TP rank ({heads}) must be divisible by "
            f"context_parallel_size ({c}) for cp_comm_type a2a (Ulysses); use p2p."
        )


def check_ranges(cfg):
    for name in ("hidden_dropout", "attention_dropout"):
        p = getattr(cfg, name)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"GPTConfig.{name} must be in [0, 1), got {p}.")
    if cfg.max_position_embeddings < cfg.seq_length:
        raise ValueError(
            f"GPTConfig.max_position_embeddings ({cfg.max_position_embeddings}) is smaller than "
            f"seq_length ({cfg.seq_length}); raise it or shorten the sequence."
        )
    if cfg.position_embedding_type == "rope":
        if not 0.0 < cfg.rotary_percent <= 1.0:
            raise ValueError(f"GPTConfig.rotary_percent must be in (0, 1], got {cfg.rotary_percent}.")
        if cfg.rotary_dim % 2 != 0 or cfg.rotary_dim == 0:
            raise ValueError(
                f"GPTConfig.rotary_percent ({cfg.rotary_percent}) × kv_channels "
                f"({cfg.kv_channels}) must be a positive even number of channels."
            )
        if not cfg.rotary_base > 0:
            raise ValueError(f"GPTConfig.rotary_base must be positive, got {cfg.rotary_base}.")
        _check_rope_scaling(cfg)
    elif cfg.rope_scaling or cfg.rotary_seq_len_interpolation_factor is not None:
        raise ValueError(
            f"GPTConfig.rope_scaling / rotary_seq_len_interpolation_factor need "
            f"position_embedding_type rope, not {cfg.position_embedding_type}."
        )


def _check_rope_scaling(cfg):
    f = cfg.rotary_seq_len_interpolation_factor
    if f is not None and not f > 0:
        raise ValueError(f"GPTConfig.rotary_seq_len_interpolation_factor must be positive, got {f}.")
    if not cfg.rope_scaling:
        return
    if not cfg.rope_scaling_factor > 0:
        raise ValueError(f"GPTConfig.rope_scaling_factor must be positive, got {cfg.rope_scaling_factor}.")
    low, high = cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor
    if not 0 < low < high:
        raise ValueError(
            f"GPTConfig.rope_scaling_low_freq_factor ({low}) must be positive and smaller than "
            f"rope_scaling_high_freq_factor ({high})."
        )
    if not cfg.rope_scaling_original_max_position_embeddings > 0:
        raise ValueError(
            f"GPTConfig.rope_scaling_original_max_position_embeddings must be positive, got "
            f"{cfg.rope_scaling_original_max_position_embeddings}."
        )


def check_comm_overlap(cfg):
    """--tp-comm-overlap cuts SP's collectives into t chunks of the s/(t·c) rows each rank holds, which
    check_divisibility has made whole; without SP there is nothing to cut (Megatron refuses it too)."""
    if cfg.tp_comm_overlap and not cfg.sequence_parallel:
        raise ValueError(
            "GPTConfig.tp_comm_overlap needs sequence_parallel on (with tensor_model_parallel_size > 1): "
            "it overlaps the sequence-parallel all-gathers and reduce-scatters with the GEMMs."
        )


def check_recompute(cfg):
    g, m = cfg.recompute_granularity, cfg.recompute_method  # full: filled by GPTConfig
    if g != "full":
        if m is not None or cfg.recompute_num_layers is not None:
            raise ValueError("GPTConfig.recompute_method / recompute_num_layers need recompute_granularity full.")
        return
    n = cfg.recompute_num_layers
    if not isinstance(n, int) or not 1 <= n <= cfg.num_layers:
        raise ValueError(f"GPTConfig.recompute_num_layers must be in [1, num_layers={cfg.num_layers}], got {n!r}.")

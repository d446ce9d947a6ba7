"""GPTConfig's validation: each check raises ValueError with one sentence naming the field.

Called by GPTConfig.__post_init__ (config.py) once the derived fields are filled.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_sp.fields import info
from megatron_sp.layer_options import cp_comm_types, zigzag_split


def check_choices(cfg):
    for f in dataclasses.fields(cfg):
        value, choices = getattr(cfg, f.name), info(f).choices
        values = value if isinstance(value, tuple) and info(f).nargs else (value,)  # one per layer
        for one in values:
            if choices and one not in choices and not (one is None and f.default is None):
                raise ValueError(f"GPTConfig.{f.name} must be one of {', '.join(choices)}, got {one!r}.")


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
    if cfg.embedding_init_method_std is not None and not cfg.embedding_init_method_std > 0:
        raise ValueError(f"GPTConfig.embedding_init_method_std must be positive, got {cfg.embedding_init_method_std}.")


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
    check_cp_comm_type(cfg)
    if c > 1:
        _check_context_parallel(cfg, t, c)


def _check_context_parallel(cfg, t, c):
    types = set(cp_comm_types(cfg))
    zigzag = zigzag_split(cfg)
    parts = 2 * c if zigzag else c
    if cfg.seq_length % parts != 0:
        raise ValueError(
            f"GPTConfig.seq_length ({cfg.seq_length}) must be divisible by {parts} "
            + ("(2 × context_parallel_size: the zigzag chunks)." if zigzag else "(context_parallel_size).")
        )
    heads = cfg.num_attention_heads // t
    if "a2a" in types and heads % c != 0:
        raise ValueError(
            f"GPTConfig.num_attention_heads per TP rank ({heads}) must be divisible by "
            f"context_parallel_size ({c}) for cp_comm_type a2a (Ulysses); use p2p or allgather."
        )
    if "a2a+p2p" in types and heads % cfg.hierarchical_context_parallel_sizes[0] != 0:
        raise ValueError(
            f"GPTConfig.num_attention_heads per TP rank ({heads}) must be divisible by the a2a level of "
            f"hierarchical_context_parallel_sizes ({cfg.hierarchical_context_parallel_sizes[0]})."
        )


def check_cp_comm_type(cfg):
    """One type or one per layer; a2a+p2p only with two hierarchical sizes that multiply to the CP
    size (Megatron asserts the product; we never turn CP off silently)."""
    types, sizes, c = cfg.cp_comm_type, cfg.hierarchical_context_parallel_sizes, cfg.context_parallel_size
    if isinstance(types, tuple) and len(types) != cfg.num_layers:
        raise ValueError(
            f"GPTConfig.cp_comm_type gives {len(types)} types for {cfg.num_layers} layers; give one type, "
            f"or one per layer."
        )
    if sizes is not None:
        if len(sizes) != 2 or any(not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(
                f"GPTConfig.hierarchical_context_parallel_sizes must be two positive sizes (a2a inside, p2p "
                f"across), got {sizes!r}."
            )
        if sizes[0] * sizes[1] != c:
            raise ValueError(
                f"GPTConfig.hierarchical_context_parallel_sizes {list(sizes)} multiply to {sizes[0] * sizes[1]}, "
                f"not context_parallel_size ({c})."
            )
    if c > 1 and "a2a+p2p" in cp_comm_types(cfg) and sizes is None:
        raise ValueError(
            "GPTConfig.cp_comm_type a2a+p2p needs hierarchical_context_parallel_sizes "
            "(--hierarchical-context-parallel-sizes A P, A × P = context_parallel_size)."
        )


def check_attention_variants(cfg):
    """The sliding window (Megatron's (left, right), right 0 for a causal model) and which layers use it."""
    window, freq = cfg.window_size, cfg.window_attn_skip_freq
    if window is not None:
        if len(window) != 2 or not all(isinstance(w, int) for w in window) or window[0] < -1:
            raise ValueError(f"GPTConfig.window_size must be (left, right) with left >= -1, got {window!r}.")
        if window[1] != 0:
            raise ValueError(
                f"GPTConfig.window_size {tuple(window)}: right must be 0 (a causal decoder sees no later token)."
            )
    if freq is None:
        return
    if window is None:
        raise ValueError("GPTConfig.window_attn_skip_freq needs window_size (it chooses the windowed layers).")
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"GPTConfig.window_attn_skip_freq must be a positive integer, got {freq}.")
    elif len(freq) != cfg.num_layers or any(v not in (0, 1) for v in freq):
        raise ValueError(
            f"GPTConfig.window_attn_skip_freq must give 0 or 1 for each of the {cfg.num_layers} layers, got "
            f"{list(freq)}."
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
    if cfg.rotary:
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
        _check_yarn(cfg)
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


def _check_yarn(cfg):
    """YaRN is a scaling of its own over every channel (Megatron's YarnRotaryEmbedding)."""
    if cfg.position_embedding_type != "yarn":
        return
    if cfg.rope_scaling or cfg.rotary_seq_len_interpolation_factor is not None or cfg.rotary_percent != 1.0:
        raise ValueError(
            "GPTConfig.position_embedding_type yarn scales RoPE itself over every channel; drop rope_scaling, "
            "rotary_seq_len_interpolation_factor and rotary_percent < 1."
        )
    for name in ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_slow"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(cfg, name)}.")
    if not cfg.yarn_beta_fast > cfg.yarn_beta_slow:
        raise ValueError(
            f"GPTConfig.yarn_beta_fast ({cfg.yarn_beta_fast}) must be larger than yarn_beta_slow "
            f"({cfg.yarn_beta_slow})."
        )


def check_activation(cfg):
    """--glu-linear-offset needs a gated MLP; --activation-func-clamp-value needs --quick-geglu
    (Megatron clamps SwiGLU only inside MoE experts, which are not here yet)."""
    if cfg.glu_linear_offset != 0.0 and not cfg.gated_linear_unit:
        raise ValueError(
            f"GPTConfig.glu_linear_offset needs a gated MLP (swiglu or quick_geglu), not {cfg.activation}."
        )
    clamp = cfg.activation_func_clamp_value
    if clamp is None:
        return
    if cfg.activation != "quick_geglu":
        raise ValueError(f"GPTConfig.activation_func_clamp_value needs activation quick_geglu, not {cfg.activation}.")
    if not (math.isfinite(clamp) and clamp > 0):
        raise ValueError(f"GPTConfig.activation_func_clamp_value must be finite and positive, got {clamp}.")


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


_FP8_MISSING = {
    "blockwise": "needs blockwise FP8 GEMM kernels, which torchao provides through triton only (not installed "
    "here); use --fp8-recipe tensorwise, delayed, rowwise or mxfp8",
    "custom": "needs Transformer Engine's --fp8-quantizer-factory, which megatron_sp does not use; use "
    "--fp8-recipe tensorwise, delayed, rowwise or mxfp8",
}


def check_fp8(cfg):
    """FP8 settings that cannot run, each refused in one sentence."""
    if cfg.fp8 is None:
        if cfg.first_last_layers_bf16:
            raise ValueError("GPTConfig.first_last_layers_bf16 needs fp8 (--fp8-format): without it every layer is.")
        return
    if cfg.fp8_recipe in _FP8_MISSING:
        raise ValueError(f"GPTConfig.fp8_recipe {cfg.fp8_recipe} {_FP8_MISSING[cfg.fp8_recipe]}.")
    if cfg.fp8_amax_history_len < 1 or cfg.fp8_margin < 0:
        raise ValueError("GPTConfig.fp8_amax_history_len must be >= 1 and fp8_margin >= 0.")
    if cfg.tp_comm_overlap:
        raise ValueError("GPTConfig.fp8 does not run with tp_comm_overlap (its ring GEMMs are not FP8); drop one.")
    delayed = cfg.fp8_recipe == "delayed"
    if delayed and cfg.first_last_layers_bf16:  # Megatron-LM's refusal
        raise ValueError("GPTConfig.first_last_layers_bf16 does not run with fp8_recipe delayed (Megatron-LM's rule).")
    if delayed and cfg.recompute_granularity == "full":  # (selective recomputes the attention core: no FP8 GEMM)
        raise ValueError(
            "GPTConfig.fp8_recipe delayed does not run with recompute_granularity full: a recomputed forward "
            "would record its amaxes twice; use fp8_recipe tensorwise, selective recomputation or none."
        )
    if cfg.fp8_recipe == "mxfp8":
        _check_mx_blocks(cfg)
    for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        if not 0 <= getattr(cfg, name) <= cfg.num_layers:
            raise ValueError(f"GPTConfig.{name} must lie in [0, num_layers={cfg.num_layers}].")


def _check_mx_blocks(cfg, block: int = 32):
    """mxfp8 scales blocks of 32 along each GEMM's contraction; a block must lie within one shard of one
    fused part (q, k, v; gate, up), or TP would group other elements than TP=1 does."""
    t, d = cfg.tensor_model_parallel_size, cfg.kv_channels
    kv_local = cfg.num_query_groups * d // t if cfg.num_query_groups % t == 0 else d
    widths = dict(
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size // t,
        query_heads=cfg.num_attention_heads * d // t,
        key_value_heads=kv_local,
    )
    for name, width in widths.items():
        if width % block:
            raise ValueError(
                f"GPTConfig.fp8_recipe mxfp8 needs {block} | every GEMM width on a rank, but the {name} width "
                f"is {width} at tensor_model_parallel_size {t}; choose sizes divisible by {block} per rank."
            )

"""RoPE in a Hugging Face config.json <-> GPTConfig's RoPE fields, for every rotary family's adapter:
`rope_parameters` (transformers 5) and, for a scaled RoPE, `rope_scaling` as Llama 3.1's config.json
spells it (transformers 4; version 5 reads it too and prefers it). Scalings: Llama 3.1's (`llama3`),
linear and YaRN (`yarn`, = `--position-embedding-type yarn`: Qwen2.5's long-context recipe,
gpt-oss); others are refused in one sentence.

YaRN's attention scaling: transformers uses mscale / mscale_all_dim only when both are set and
non-zero, else 0.1 ln(factor) + 1, which is Megatron's defaults (mscale 1, mscale_all_dim 0); an
explicit `attention_factor` has no Megatron flag and is refused."""

from __future__ import annotations

from megatron_sp.models.hf.adapter import ConversionError

_YARN_KEYS = {  # HF rope parameter: (our field, transformers' default)
    "factor": ("yarn_rotary_scaling_factor", None),
    "original_max_position_embeddings": ("yarn_original_max_position_embeddings", None),
    "beta_fast": ("yarn_beta_fast", 32.0),
    "beta_slow": ("yarn_beta_slow", 1.0),
    "truncate": ("yarn_correction_range_round_to_int", True),
}

_LLAMA3_KEYS = {
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_scaling_low_freq_factor",
    "high_freq_factor": "rope_scaling_high_freq_factor",
    "original_max_position_embeddings": "rope_scaling_original_max_position_embeddings",
}


def check_rope(cfg, architecture: str) -> None:
    if cfg.rotary_percent != 1.0:
        raise ConversionError(f"{architecture} rotates every channel; --rotary-percent must be 1.")
    if cfg.position_embedding_type == "yarn" and cfg.yarn_mscale_all_dim == 0 and cfg.yarn_mscale != 1.0:
        raise ConversionError(
            "Hugging Face's YaRN reads --mscale only with a non-zero --mscale-all-dim; this model has "
            f"--mscale {cfg.yarn_mscale} alone."
        )
    if cfg.rope_scaling and cfg.rotary_seq_len_interpolation_factor is not None:
        raise ConversionError(
            "Hugging Face RoPE is scaled one way (rope_type llama3 or linear); this model "
            "has both --use-rope-scaling and --rotary-seq-len-interpolation-factor."
        )


def rope_config(cfg) -> dict:
    """rope_theta, rope_parameters and (scaled) rope_scaling of a config.json."""
    theta = float(cfg.rotary_base)
    if cfg.position_embedding_type == "yarn":
        scaling = {"rope_type": "yarn", **{hf: getattr(cfg, ours) for hf, (ours, _) in _YARN_KEYS.items()}}
        if cfg.yarn_mscale_all_dim:
            scaling.update(mscale=cfg.yarn_mscale, mscale_all_dim=cfg.yarn_mscale_all_dim)
    elif cfg.rope_scaling:
        scaling = {"rope_type": "llama3", **{hf: getattr(cfg, ours) for hf, ours in _LLAMA3_KEYS.items()}}
    elif cfg.rotary_seq_len_interpolation_factor is not None:
        scaling = {"rope_type": "linear", "factor": float(cfg.rotary_seq_len_interpolation_factor)}
    else:
        return {"rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta, "rope_parameters": dict(scaling, rope_theta=theta), "rope_scaling": scaling}


def rope_fields(c: dict, name: str) -> dict:
    """GPTConfig's RoPE fields from a config.json (transformers 4 or 5 spelling); `name` (the
    family, "Llama") is what a refusal calls the config."""
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}  # transformers' own precedence
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConversionError(f"{name} configs with partial_rotary_factor != 1 are not supported.")
    fields = {"rotary_base": float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))}
    if kind == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in rope]
        if missing:
            raise ConversionError(f"{name} rope_type 'llama3' needs {', '.join(missing)} in its RoPE parameters.")
        fields.update({ours: rope[hf] for hf, ours in _LLAMA3_KEYS.items()}, rope_scaling=True)
    elif kind == "linear":
        if "factor" not in rope:
            raise ConversionError(f"{name} rope_type 'linear' needs a factor in its RoPE parameters.")
        fields["rotary_seq_len_interpolation_factor"] = float(rope["factor"])
    elif kind == "yarn":
        fields.update(_yarn_fields(rope, name))
    elif kind not in ("default", None):
        raise ConversionError(f"{name} rope_type {kind!r} is not supported; default, linear, llama3 and yarn are.")
    return fields


def _yarn_fields(rope: dict, name: str) -> dict:
    if rope.get("attention_factor") is not None:
        raise ConversionError(f"{name} rope_type 'yarn' with an explicit attention_factor is not supported.")
    missing = [k for k, (_, default) in _YARN_KEYS.items() if default is None and rope.get(k) is None]
    if missing:
        raise ConversionError(f"{name} rope_type 'yarn' needs {', '.join(missing)} in its RoPE parameters.")
    fields = {ours: default if rope.get(hf) is None else rope[hf] for hf, (ours, default) in _YARN_KEYS.items()}
    if rope.get("mscale") and rope.get("mscale_all_dim"):  # transformers reads them only together
        fields.update(yarn_mscale=rope["mscale"], yarn_mscale_all_dim=rope["mscale_all_dim"])
    return dict(fields, position_embedding_type="yarn")

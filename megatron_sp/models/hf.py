"""Hugging Face <-> megatron_sp: GPT2LMHeadModel and LlamaForCausalLM weights and config.json.

    to_hf(state, cfg)          ReferenceGPT state dict -> (HF tensors, HF config dict)
    from_hf(tensors, config)   HF tensors + config.json -> (ReferenceGPT state dict, GPTConfig fields)

The architecture follows from the config, not the family name: LayerNorm + GELU + learned positions
is GPT-2, RMSNorm + SwiGLU + RoPE is Llama; anything neither can express (e.g. GQA in GPT-2, partial
RoPE, a Llama with biases on q/k/v only) is refused with one sentence. GPT-2's Conv1D weights are
stored [in, out], ours [out, in]; Llama's q/k/v and gate/up projections are our fused rows.
The config.json keys that map one to one onto a GPTConfig field are named in config.py's table
(`hf=`); the rest (activation, tying, biases, RoPE) is spelled out here. On import every tensor is
checked against the config before it is used (`check_tensors`: its name, its shape as `to_hf` of a
shape-only model gives it, floating point; the layer count first, so a hostile config builds nothing).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from megatron_sp.config import GPTConfig
from megatron_sp.fields import hf_names


class ConversionError(ValueError):
    """The model or config cannot be expressed on the other side: one sentence."""


# HF's own defaults (GPT2Config, LlamaConfig) for the table's keys a config.json may omit; None: the
# field's GPTConfig default. A key not listed is required.
_HF_DEFAULTS = {
    "gpt2": {
        "n_inner": None,
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.1,
        "attn_pdrop": 0.1,
        "initializer_range": 0.02,
    },
    "llama": {
        "num_key_value_heads": None,
        "head_dim": None,
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
    },
}


def _named_keys(cfg, arch: str) -> dict:
    """The config.json entries of the fields the table names for `arch`."""
    return {key: getattr(cfg, name) for name, key in hf_names(dataclasses.fields(GPTConfig), arch).items()}


def _named_fields(c: dict, arch: str) -> dict:
    """The GPTConfig fields of the config.json keys the table names (an omitted key: HF's default)."""
    fields = {}
    for name, key in hf_names(dataclasses.fields(GPTConfig), arch).items():
        if key not in c and key not in _HF_DEFAULTS[arch]:
            raise ConversionError(f"the {arch} config.json lacks {key}.")
        value = c.get(key, _HF_DEFAULTS[arch].get(key))
        if value is not None:
            fields[name] = value
    return fields


def architecture(cfg) -> str:
    if cfg.qk_layernorm or cfg.layernorm_zero_centered_gamma:
        flag = "--qk-layernorm" if cfg.qk_layernorm else "--apply-layernorm-1p"
        raise ConversionError(f"neither GPT2LMHeadModel nor LlamaForCausalLM can express {flag}.")
    if (cfg.normalization, cfg.position_embedding_type) == ("LayerNorm", "learned_absolute") and cfg.activation in (
        "gelu",
        "openai_gelu",
    ):
        if (
            cfg.num_query_groups != cfg.num_attention_heads
            or cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size
        ):
            raise ConversionError("GPT2LMHeadModel has no grouped-query attention or separate kv_channels.")
        if not (cfg.add_bias_linear and cfg.add_qkv_bias):
            raise ConversionError("GPT2LMHeadModel has biases in every linear layer; this model has none.")
        return "gpt2"
    if (cfg.normalization, cfg.activation, cfg.position_embedding_type) == ("RMSNorm", "swiglu", "rope"):
        if cfg.rotary_percent != 1.0:
            raise ConversionError("LlamaForCausalLM rotates every channel; --rotary-percent must be 1.")
        if cfg.add_bias_linear != cfg.add_qkv_bias:
            raise ConversionError(
                "LlamaForCausalLM has biases on all attention projections or none "
                "(attention_bias); --add-qkv-bias alone cannot be expressed."
            )
        return "llama"
    raise ConversionError(
        f"no Hugging Face architecture matches {cfg.normalization} + {cfg.activation} + "
        f"{cfg.position_embedding_type} positions (GPT-2: LayerNorm + gelu + learned_absolute; "
        f"Llama: RMSNorm + swiglu + rope)."
    )


# ---- GPT-2 ----------------------------------------------------------------------------------------

_GPT2_LAYER = {
    "ln_1": "ln1",
    "attn.c_attn": "attn.qkv",
    "attn.c_proj": "attn.proj",
    "ln_2": "ln2",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
}
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # weights stored [in, out]


def _gpt2_names(cfg):
    """(hf name, our name, transposed) for every tensor."""
    names = [
        ("transformer.wte.weight", "embedding.word_embeddings.weight", False),
        ("transformer.wpe.weight", "embedding.position_embeddings.weight", False),
        ("transformer.ln_f.weight", "final_ln.weight", False),
        ("transformer.ln_f.bias", "final_ln.bias", False),
    ]
    for i in range(cfg.num_layers):
        for hf, ours in _GPT2_LAYER.items():
            for kind in ("weight", "bias"):
                names.append(
                    (f"transformer.h.{i}.{hf}.{kind}", f"layers.{i}.{ours}.{kind}", kind == "weight" and hf in _CONV1D)
                )
    if cfg.untie_embeddings_and_output_weights:
        names.append(("lm_head.weight", "output_layer.weight", False))
    return names


def _gpt2_config(cfg) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **_named_keys(cfg, "gpt2"),
        "activation_function": "gelu_new" if cfg.activation == "openai_gelu" else "gelu",
        "embd_pdrop": cfg.hidden_dropout,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }


def _gpt2_fields(c: dict) -> dict:
    act = {"gelu_new": "openai_gelu", "gelu_pytorch_tanh": "openai_gelu", "gelu": "gelu"}.get(
        c.get("activation_function")
    )
    if act is None:
        raise ConversionError(
            f"GPT-2 activation_function {c.get('activation_function')!r} is not supported (gelu, gelu_new)."
        )
    if (
        c.get("scale_attn_by_inverse_layer_idx")
        or c.get("reorder_and_upcast_attn")
        or c.get("scale_attn_weights", True) is False
    ):
        raise ConversionError(
            "GPT-2 configs with scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn or "
            "without scale_attn_weights are not supported."
        )
    return dict(
        model="gpt2",
        **_named_fields(c, "gpt2"),
        activation=act,
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
    )


# ---- Llama ----------------------------------------------------------------------------------------


def _llama_config(cfg) -> dict:
    bias = bool(cfg.add_bias_linear)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_named_keys(cfg, "llama"),
        "hidden_act": "silu",
        "rope_theta": float(cfg.rotary_base),
        **_rope_config(cfg),
        "attention_bias": bias,
        "mlp_bias": bias,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
    }


_LLAMA3_KEYS = {
    "factor": "rope_scaling_factor",
    "low_freq_factor": "rope_scaling_low_freq_factor",
    "high_freq_factor": "rope_scaling_high_freq_factor",
    "original_max_position_embeddings": "rope_scaling_original_max_position_embeddings",
}


def _rope_config(cfg) -> dict:
    """rope_parameters (transformers 5) and, for a scaled RoPE, rope_scaling as Llama 3.1's
    config.json spells it (transformers 4; version 5 reads it too and prefers it)."""
    theta = float(cfg.rotary_base)
    if cfg.rope_scaling and cfg.rotary_seq_len_interpolation_factor is not None:
        raise ConversionError(
            "Hugging Face RoPE is scaled one way (rope_type llama3 or linear); this model "
            "has both --use-rope-scaling and --rotary-seq-len-interpolation-factor."
        )
    if cfg.rope_scaling:
        scaling = {"rope_type": "llama3", **{hf: getattr(cfg, ours) for hf, ours in _LLAMA3_KEYS.items()}}
    elif cfg.rotary_seq_len_interpolation_factor is not None:
        scaling = {"rope_type": "linear", "factor": float(cfg.rotary_seq_len_interpolation_factor)}
    else:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_parameters": dict(scaling, rope_theta=theta), "rope_scaling": scaling}


def _rope_fields(c: dict) -> dict:
    """GPTConfig's RoPE fields from a Llama config.json (transformers 4 or 5 spelling)."""
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}  # transformers' own precedence
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConversionError("Llama configs with partial_rotary_factor != 1 are not supported.")
    fields = {"rotary_base": float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))}
    if kind == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in rope]
        if missing:
            raise ConversionError(f"Llama rope_type 'llama3' needs {', '.join(missing)} in its RoPE parameters.")
        fields.update({ours: rope[hf] for hf, ours in _LLAMA3_KEYS.items()}, rope_scaling=True)
    elif kind == "linear":
        if "factor" not in rope:
            raise ConversionError("Llama rope_type 'linear' needs a factor in its RoPE parameters.")
        fields["rotary_seq_len_interpolation_factor"] = float(rope["factor"])
    elif kind not in ("default", None):
        raise ConversionError(f"Llama rope_type {kind!r} is not supported; default, linear and llama3 are.")
    return fields


def _llama_fields(c: dict) -> dict:
    if c.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"Llama hidden_act {c.get('hidden_act')!r} is not supported (silu).")
    attention_bias, mlp_bias = bool(c.get("attention_bias", False)), bool(c.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ConversionError("Llama configs with attention_bias != mlp_bias are not supported.")
    fields = _named_fields(c, "llama")
    fields.setdefault("kv_channels", fields["hidden_size"] // fields["num_attention_heads"])  # LlamaConfig's
    return dict(
        model="llama",
        **fields,
        **_rope_fields(c),
        hidden_dropout=0.0,  # Llama has none
        add_bias_linear=attention_bias,
        add_qkv_bias=attention_bias,
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
    )


def _llama_to_hf(state, cfg) -> dict:
    d, nq, g = cfg.kv_channels, cfg.num_attention_heads, cfg.num_query_groups
    out = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
        "model.norm.weight": state["final_ln.weight"],
    }
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output_layer.weight"]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        out[f"{hf}.input_layernorm.weight"] = state[f"{ours}.ln1.weight"]
        out[f"{hf}.post_attention_layernorm.weight"] = state[f"{ours}.ln2.weight"]
        kinds = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
        for kind in kinds:
            q, k, v = state[f"{ours}.attn.qkv.{kind}"].split([nq * d, g * d, g * d])
            out.update(
                {
                    f"{hf}.self_attn.q_proj.{kind}": q,
                    f"{hf}.self_attn.k_proj.{kind}": k,
                    f"{hf}.self_attn.v_proj.{kind}": v,
                    f"{hf}.self_attn.o_proj.{kind}": state[f"{ours}.attn.proj.{kind}"],
                    f"{hf}.mlp.down_proj.{kind}": state[f"{ours}.mlp.fc2.{kind}"],
                }
            )
            gate, up = state[f"{ours}.mlp.fc1.{kind}"].chunk(2)
            out.update({f"{hf}.mlp.gate_proj.{kind}": gate, f"{hf}.mlp.up_proj.{kind}": up})
    return out


def _llama_from_hf(t, cfg) -> dict:
    out = {
        "embedding.word_embeddings.weight": t["model.embed_tokens.weight"],
        "final_ln.weight": t["model.norm.weight"],
    }
    if cfg.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = t["lm_head.weight"]
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        out[f"{ours}.ln1.weight"] = t[f"{hf}.input_layernorm.weight"]
        out[f"{ours}.ln2.weight"] = t[f"{hf}.post_attention_layernorm.weight"]
        for kind in ("weight", "bias") if cfg.add_bias_linear else ("weight",):
            out[f"{ours}.attn.qkv.{kind}"] = torch.cat([t[f"{hf}.self_attn.{x}_proj.{kind}"] for x in "qkv"])
            out[f"{ours}.attn.proj.{kind}"] = t[f"{hf}.self_attn.o_proj.{kind}"]
            out[f"{ours}.mlp.fc1.{kind}"] = torch.cat([t[f"{hf}.mlp.gate_proj.{kind}"], t[f"{hf}.mlp.up_proj.{kind}"]])
            out[f"{ours}.mlp.fc2.{kind}"] = t[f"{hf}.mlp.down_proj.{kind}"]
    return out


# ---- both ---------------------------------------------------------------------------------------


def to_hf(state: dict, cfg) -> tuple[dict, dict]:
    """(HF tensors, config.json dict) of a ReferenceGPT state dict."""
    arch = architecture(cfg)
    if arch == "gpt2":
        tensors = {hf: (state[ours].t() if transposed else state[ours]) for hf, ours, transposed in _gpt2_names(cfg)}
        config = _gpt2_config(cfg)
    else:
        tensors, config = _llama_to_hf(state, cfg), _llama_config(cfg)
    return {k: v.contiguous() for k, v in tensors.items()}, config


def from_hf(tensors: dict, config: dict) -> tuple[dict, dict]:
    """(ReferenceGPT state dict, GPTConfig fields) from HF tensors and config.json; every tensor's
    name, shape and dtype checked against the config first (one sentence naming the tensor)."""
    if not isinstance(config, dict):
        raise ConversionError(f"config.json holds a {type(config).__name__}, not a JSON object.")
    kind = config.get("model_type")
    if kind not in ("gpt2", "llama"):
        raise ConversionError(
            f"model_type {kind!r} is not supported; GPT2LMHeadModel (gpt2) and LlamaForCausalLM (llama) are."
        )
    try:
        fields = _gpt2_fields(config) if kind == "gpt2" else _llama_fields(config)
        cfg = GPTConfig(seq_length=fields["max_position_embeddings"], tensor_model_parallel_size=1, **fields)
    except (TypeError, ZeroDivisionError, OverflowError, AttributeError) as err:
        raise ConversionError(f"the {kind} config.json holds a value of the wrong kind ({err}).") from None
    if kind == "gpt2":
        tensors = {
            (k if k.startswith(("transformer.", "lm_head")) else f"transformer.{k}"): v for k, v in tensors.items()
        }
    tensors = check_tensors(tensors, cfg)
    if kind == "gpt2":
        state = {ours: (tensors[hf].t() if transposed else tensors[hf]) for hf, ours, transposed in _gpt2_names(cfg)}
    else:
        state = _llama_from_hf(tensors, cfg)
    return {k: v.contiguous() for k, v in state.items()}, fields


# buffers some exports carry beside the weights (GPT-2's causal mask, Llama's RoPE frequencies)
_BUFFERS = re.compile(r"\.attn\.(bias|masked_bias)$|\.rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^(?:transformer\.h|model\.layers)\.(\d+)\.")


def check_tensors(tensors: dict, cfg) -> dict:
    """The HF tensors a config needs, each of the shape it needs and floating point; buffers and a
    tied lm_head equal to the embedding dropped. The layer count is compared before anything is
    built (a config of 10^9 layers builds nothing)."""
    layers = {int(m.group(1)) for m in map(_LAYER.match, tensors) if m}
    if len(layers) != cfg.num_layers or not all(0 <= i < cfg.num_layers for i in layers):  # = range(L)
        raise ConversionError(
            f"config.json has {cfg.num_layers} layers but the weights hold {len(layers)} "
            f"(layers {min(layers, default=0)}..{max(layers, default=-1)})."
        )
    from megatron_sp.models.reference import ReferenceGPT

    with torch.device("meta"):
        model = ReferenceGPT(cfg, initialise=False)
    expected, _ = to_hf(dict(model.named_parameters()), cfg)
    given = {k: v for k, v in tensors.items() if not _BUFFERS.search(k)}
    if not cfg.untie_embeddings_and_output_weights and "lm_head.weight" in given:
        embedding = "transformer.wte.weight" if "transformer.wte.weight" in expected else "model.embed_tokens.weight"
        tied = given.pop("lm_head.weight")
        if embedding in given and not torch.equal(tied, given[embedding]):
            raise ConversionError(
                "config.json ties the embeddings (tie_word_embeddings) but lm_head.weight differs from them."
            )
    for name in sorted(set(expected) | set(given)):
        if name not in given:
            raise ConversionError(f"the Hugging Face weights lack {name} for this config.")
        if name not in expected:
            raise ConversionError(f"the Hugging Face weights hold {name}, which this config has no place for.")
        t, want = given[name], list(expected[name].shape)
        if list(t.shape) != want:
            raise ConversionError(f"{name} has shape {list(t.shape)} but config.json needs {want}.")
        if not t.is_floating_point():
            raise ConversionError(f"{name} is {t.dtype}; weights must be floating point.")
    return given

"""GPT-2's Hugging Face adapter: GPT2LMHeadModel (model_type gpt2).

Its Conv1D weights are stored [in, out], ours [out, in]; its fused c_attn is our fused qkv as it is.
GPT2Model's bare names ("h.0.attn...") are read as GPT2LMHeadModel's ("transformer.h.0.attn...").
"""

from __future__ import annotations

import re

from megatron_sp.models.hf.adapter import (
    CausalLMAdapter,
    ConversionError,
    linear_kinds,
    per_layer,
    refuse_fields,
    same,
    transposed,
)

# our layer's module -> GPT-2's, and whether its weight is a Conv1D one ([in, out])
_LAYER = {
    "ln1": ("ln_1", False),
    "attn.qkv": ("attn.c_attn", True),
    "attn.proj": ("attn.c_proj", True),
    "ln2": ("ln_2", False),
    "mlp.fc1": ("mlp.c_fc", True),
    "mlp.fc2": ("mlp.c_proj", True),
}
_ACTIVATIONS = {"gelu_new": "openai_gelu", "gelu_pytorch_tanh": "openai_gelu", "gelu": "gelu"}


class GPT2Adapter(CausalLMAdapter):
    model_type = "gpt2"
    architecture = "GPT2LMHeadModel"
    signature = "LayerNorm + gelu/openai_gelu + learned_absolute"
    layers = "transformer.h"
    buffers = re.compile(r"\.attn\.(bias|masked_bias)$")  # the causal mask some exports carry
    config_keys = {
        "num_layers": "n_layer",
        "hidden_size": "n_embd",
        "num_attention_heads": "n_head",
        "vocab_size": "vocab_size",
        "ffn_hidden_size": "n_inner",
        "max_position_embeddings": "n_positions",
        "layernorm_epsilon": "layer_norm_epsilon",
        "hidden_dropout": "resid_pdrop",
        "attention_dropout": "attn_pdrop",
        "init_method_std": "initializer_range",
    }
    hf_defaults = {  # GPT2Config's
        "n_inner": None,
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.1,
        "attn_pdrop": 0.1,
        "initializer_range": 0.02,
    }

    def matches(self, cfg) -> bool:
        shape = (cfg.normalization, cfg.position_embedding_type) == ("LayerNorm", "learned_absolute")
        return shape and cfg.activation in ("gelu", "openai_gelu") and cfg.num_experts is None

    def check(self, cfg) -> None:
        refuse_fields(cfg, self.architecture, self.unsupported)
        if (
            cfg.num_query_groups != cfg.num_attention_heads
            or cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size
        ):
            raise ConversionError("GPT2LMHeadModel has no grouped-query attention or separate kv_channels.")
        if not (cfg.add_bias_linear and cfg.add_qkv_bias):
            raise ConversionError("GPT2LMHeadModel has biases in every linear layer; this model has none.")

    def config_to_hf(self, cfg) -> dict:
        return {
            "activation_function": "gelu_new" if cfg.activation == "openai_gelu" else "gelu",
            "embd_pdrop": cfg.hidden_dropout,
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }

    def config_from_hf(self, c: dict) -> dict:
        activation = _ACTIVATIONS.get(c.get("activation_function"))
        if activation is None:
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
            **self.named_fields(c),
            activation=activation,
            untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
        )

    def links(self, cfg) -> list:
        top = [
            same("embedding.word_embeddings.weight", "transformer.wte.weight"),
            same("embedding.position_embeddings.weight", "transformer.wpe.weight"),
            same("final_ln.weight", "transformer.ln_f.weight"),
            same("final_ln.bias", "transformer.ln_f.bias"),
        ]
        if cfg.untie_embeddings_and_output_weights:
            top.append(same("output_layer.weight", "lm_head.weight"))
        return top + per_layer(cfg.num_layers, self._layer_links)

    def _layer_links(self, i: int) -> list:
        links = []
        for ours, (hf, conv1d) in _LAYER.items():
            for kind in linear_kinds(True):
                link = transposed if conv1d and kind == "weight" else same
                links.append(link(f"layers.{i}.{ours}.{kind}", f"transformer.h.{i}.{hf}.{kind}"))
        return links

    def canonical(self, tensors: dict, cfg) -> dict:
        return {(k if k.startswith(("transformer.", "lm_head")) else f"transformer.{k}"): v for k, v in tensors.items()}


ADAPTER = GPT2Adapter()

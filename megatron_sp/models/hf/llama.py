"""Llama's Hugging Face adapter: LlamaForCausalLM (model_type llama).

Llama's q/k/v and gate/up projections are our fused rows (qkv: the query heads, then the key/value
groups; fc1: gate, then up); RoPE uses the same rotate-half layout as ours, so no permutation. A
Llama-like family subclasses this adapter and changes what differs (its model_type, its biases, its
extra tensors in `layer_links`, its config keys: `config_keys`, `variant_config` / `variant_fields`),
e.g. hf/qwen2.py and hf/qwen3.py.
"""

from __future__ import annotations

from megatron_sp.models.hf.adapter import (
    CausalLMAdapter,
    ConversionError,
    fused,
    linear_kinds,
    per_layer,
    refuse_fields,
    same,
)
from megatron_sp.models.hf.rope import check_rope, rope_config, rope_fields


def llama_shaped(cfg) -> bool:
    """RMSNorm + SwiGLU + RoPE: the shape of every Llama-like architecture."""
    return (cfg.normalization, cfg.activation, cfg.rotary) == ("RMSNorm", "swiglu", True)


class LlamaAdapter(CausalLMAdapter):
    model_type = "llama"
    architecture = "LlamaForCausalLM"
    name = "Llama"  # what a refusal calls a config.json of this architecture
    signature = "RMSNorm + swiglu + rope"
    config_keys = {
        "num_layers": "num_hidden_layers",
        "hidden_size": "hidden_size",
        "num_attention_heads": "num_attention_heads",
        "vocab_size": "vocab_size",
        "ffn_hidden_size": "intermediate_size",
        "kv_channels": "head_dim",
        "num_query_groups": "num_key_value_heads",
        "max_position_embeddings": "max_position_embeddings",
        "layernorm_epsilon": "rms_norm_eps",
        "attention_dropout": "attention_dropout",
        "init_method_std": "initializer_range",
    }
    hf_defaults = {  # LlamaConfig's
        "num_key_value_heads": None,
        "head_dim": None,
        "rms_norm_eps": 1e-6,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
    }

    def matches(self, cfg) -> bool:
        return llama_shaped(cfg) and cfg.num_experts is None  # (mixture of experts: hf/moe.py's adapters)

    def check(self, cfg) -> None:
        refuse_fields(cfg, self.architecture, self.unsupported)
        check_rope(cfg, self.architecture)
        self.check_biases(cfg)

    def check_biases(self, cfg) -> None:
        if cfg.add_bias_linear != cfg.add_qkv_bias:
            raise ConversionError(
                "LlamaForCausalLM has biases on all attention projections or none "
                "(attention_bias); --add-qkv-bias alone cannot be expressed."
            )

    def config_to_hf(self, cfg) -> dict:
        return {
            "hidden_act": "silu",
            **rope_config(cfg),
            **self.variant_config(cfg),
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        }

    def variant_config(self, cfg) -> dict:
        """The config.json entries in which Llama-like architectures differ (Llama's: its biases)."""
        bias = bool(cfg.add_bias_linear)
        return {"attention_bias": bias, "mlp_bias": bias}

    def config_from_hf(self, c: dict) -> dict:
        if c.get("hidden_act", "silu") != "silu":
            raise ConversionError(f"{self.name} hidden_act {c.get('hidden_act')!r} is not supported (silu).")
        fields = self.named_fields(c)
        fields.setdefault("kv_channels", fields["hidden_size"] // fields["num_attention_heads"])  # LlamaConfig's
        return dict(
            **fields,
            **rope_fields(c, self.name),
            hidden_dropout=0.0,  # Llama has none
            **self.variant_fields(c),
            untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
        )

    def variant_fields(self, c: dict) -> dict:
        """The GPTConfig fields of those entries."""
        attention_bias, mlp_bias = bool(c.get("attention_bias", False)), bool(c.get("mlp_bias", False))
        if attention_bias != mlp_bias:
            raise ConversionError("Llama configs with attention_bias != mlp_bias are not supported.")
        return dict(add_bias_linear=attention_bias, add_qkv_bias=attention_bias)

    def links(self, cfg) -> list:
        top = [
            same("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
            same("final_ln.weight", "model.norm.weight"),
        ]
        if cfg.untie_embeddings_and_output_weights:
            top.append(same("output_layer.weight", "lm_head.weight"))
        return top + per_layer(cfg.num_layers, lambda i: self.layer_links(cfg, i))

    def layer_links(self, cfg, i: int) -> list:
        """Layer i's tensors: norms, attention (q/k/v fused in ours), MLP (`mlp_links`)."""
        d = cfg.kv_channels
        qkv_rows = (cfg.num_attention_heads * d, cfg.num_query_groups * d, cfg.num_query_groups * d)
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        links = [
            same(f"{ours}.ln1.weight", f"{hf}.input_layernorm.weight"),
            same(f"{ours}.ln2.weight", f"{hf}.post_attention_layernorm.weight"),
        ]
        for kind in linear_kinds(cfg.add_qkv_bias):
            qkv = tuple(f"{hf}.self_attn.{x}_proj.{kind}" for x in "qkv")
            links.append(fused(f"{ours}.attn.qkv.{kind}", qkv, qkv_rows))
        for kind in linear_kinds(cfg.add_bias_linear):
            links.append(same(f"{ours}.attn.proj.{kind}", f"{hf}.self_attn.o_proj.{kind}"))
        return links + self.mlp_links(cfg, i)

    def mlp_links(self, cfg, i: int) -> list:
        """Layer i's MLP: gate/up fused in our fc1."""
        return gated_mlp_links(f"layers.{i}.mlp", f"model.layers.{i}.mlp", cfg.ffn_hidden_size, cfg.add_bias_linear)


def gated_mlp_links(
    ours: str, hf: str, f: int, bias: bool = False, names=("gate_proj", "up_proj", "down_proj")
) -> list:
    """A SwiGLU MLP of width f: HF's gate, up (our fc1's [gate; up] rows) and down projections, `names`."""
    gate, up, down = names
    links = []
    for kind in linear_kinds(bias):
        gate_up = (f"{hf}.{gate}.{kind}", f"{hf}.{up}.{kind}")
        links += [fused(f"{ours}.fc1.{kind}", gate_up, (f, f)), same(f"{ours}.fc2.{kind}", f"{hf}.{down}.{kind}")]
    return links


ADAPTER = LlamaAdapter()

"""Qwen3's Hugging Face adapter: Qwen3ForCausalLM (model_type qwen3, the dense models). Llama's
adapter with what differs: the per-head q/k RMSNorm weights (`self_attn.q_norm` / `k_norm`, our
`attn.q_norm` / `k_norm` of `--qk-layernorm`), an explicit head_dim (Qwen3Config's default 128, not
hidden / heads), no biases, and a sliding-window option that is refused (off in every release).

Qwen3's `attention_bias` puts biases on q, k, v and the output projection but never on the MLP, which
our fields cannot express (`--add-bias-linear` covers the MLP too): refused. Every released Qwen3
has none.
"""

from __future__ import annotations

from megatron_sp.models.hf.adapter import ConversionError, same
from megatron_sp.models.hf.llama import LlamaAdapter
from megatron_sp.models.hf.qwen2 import refuse_sliding_window


class Qwen3Adapter(LlamaAdapter):
    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    name = "Qwen3"
    signature = "RMSNorm + swiglu + rope + --qk-layernorm"
    hf_defaults = {**LlamaAdapter.hf_defaults, "head_dim": 128}  # Qwen3Config's
    unsupported = {k: v for k, v in LlamaAdapter.unsupported.items() if k != "qk_layernorm"}

    def matches(self, cfg) -> bool:
        return super().matches(cfg) and bool(cfg.qk_layernorm)

    def check_biases(self, cfg) -> None:
        if cfg.add_qkv_bias or cfg.add_bias_linear:
            raise ConversionError("Qwen3ForCausalLM has no biases in its MLP, so none can be expressed here.")

    def variant_config(self, cfg) -> dict:
        return {"attention_bias": False, "use_sliding_window": False}

    def variant_fields(self, c: dict) -> dict:
        if c.get("attention_bias", False):
            raise ConversionError(
                "Qwen3 configs with attention_bias are not supported (biases on q/k/v/o without the MLP's)."
            )
        refuse_sliding_window(c, self.name)
        return dict(add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True)

    def layer_links(self, cfg, i: int) -> list:
        hf, ours = f"model.layers.{i}.self_attn", f"layers.{i}.attn"
        norms = [same(f"{ours}.{x}_norm.weight", f"{hf}.{x}_norm.weight") for x in "qk"]
        return super().layer_links(cfg, i) + norms


ADAPTER = Qwen3Adapter()

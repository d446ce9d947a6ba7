"""Qwen2-MoE's Hugging Face adapter: Qwen2MoeForCausalLM (model_type qwen2_moe; Qwen1.5-MoE, Qwen2-57B-A14B).
Qwen2's layer (biases on q/k/v alone, here `qkv_bias`, true by default: hf/qwen2.py) with experts as
Qwen3-MoE's (hf/qwen3_moe.py) and, on every MoE layer, a shared expert of width
`shared_expert_intermediate_size` scaled by sigmoid(`shared_expert_gate` · x): our
--moe-shared-expert-intermediate-size with --moe-shared-expert-gate (Megatron's
`shared_experts.gate_weight`, here `layers.{i}.mlp.shared_experts.gate_weight` [1, h]).
"""

from __future__ import annotations

from megatron_sp.models.hf.adapter import ConversionError, same
from megatron_sp.models.hf.llama import gated_mlp_links
from megatron_sp.models.hf.moe import moe_keys
from megatron_sp.models.hf.qwen2 import Qwen2Adapter, refuse_sliding_window
from megatron_sp.models.hf.qwen3_moe import QwenMoEMixin


class Qwen2MoeAdapter(QwenMoEMixin, Qwen2Adapter):
    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    name = "Qwen2-MoE"
    signature = "RMSNorm + swiglu + rope + experts + --moe-shared-expert-gate"
    config_keys = {
        **Qwen2Adapter.config_keys,
        **moe_keys("num_experts", "moe_intermediate_size"),
        "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
    }
    hf_defaults = {  # Qwen2MoeConfig's
        **Qwen2Adapter.hf_defaults,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "router_aux_loss_coef": 0.001,
    }

    def matches(self, cfg) -> bool:
        return super().matches(cfg) and not cfg.qk_layernorm

    def check_biases(self, cfg) -> None:
        if cfg.add_bias_linear:
            raise ConversionError("Qwen2MoeForCausalLM has biases on q/k/v at most (qkv_bias), so none elsewhere.")

    def check_experts(self, cfg) -> None:
        if not (cfg.moe_shared_expert_intermediate_size and cfg.moe_shared_expert_gate):
            raise ConversionError(
                "Qwen2MoeForCausalLM has a gated shared expert on every MoE layer: it needs "
                "--moe-shared-expert-intermediate-size and --moe-shared-expert-gate."
            )

    def variant_config(self, cfg) -> dict:
        return {**super().variant_config(cfg), "qkv_bias": bool(cfg.add_qkv_bias)}

    def variant_fields(self, c: dict) -> dict:
        refuse_sliding_window(c, self.name)
        qkv_bias = c.get("qkv_bias", True)
        if not isinstance(qkv_bias, bool):
            raise ConversionError(f"Qwen2-MoE qkv_bias must be true or false, got {qkv_bias!r}.")
        if not c.get("shared_expert_intermediate_size", self.hf_defaults["shared_expert_intermediate_size"]):
            raise ConversionError("Qwen2-MoE configs without a shared expert are not supported.")
        fields = dict(super().variant_fields(c), add_qkv_bias=qkv_bias)
        return dict(fields, moe_shared_expert_gate=True)

    def shared_expert_links(self, cfg, i: int) -> list:
        hf, ours = f"model.layers.{i}.mlp", f"layers.{i}.mlp.shared_experts"
        links = gated_mlp_links(ours, f"{hf}.shared_expert", cfg.moe_shared_expert_intermediate_size)
        return links + [same(f"{ours}.gate_weight", f"{hf}.shared_expert_gate.weight")]


ADAPTER = Qwen2MoeAdapter()

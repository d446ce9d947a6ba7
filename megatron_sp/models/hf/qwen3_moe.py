"""Qwen3-MoE's Hugging Face adapter: Qwen3MoeForCausalLM (model_type qwen3_moe). Qwen3's layer (per-head
q/k RMSNorm, no biases: hf/qwen3.py) with experts (hf/moe.py): `num_experts` of width
`moe_intermediate_size`, top `num_experts_per_tok`, renormalised with `norm_topk_prob` (else
--moe-router-pre-softmax), no shared expert; the layers decoder_sparse_step / mlp_only_layers leave
dense are MLPs of width `intermediate_size`. Unlike dense Qwen3 its head_dim defaults to hidden / heads.
"""

from __future__ import annotations

from megatron_sp.models.hf.adapter import ConversionError
from megatron_sp.models.hf.moe import MoEAdapter, dense_layers, moe_keys, moe_layer_freq
from megatron_sp.models.hf.qwen3 import Qwen3Adapter


class QwenMoEMixin(MoEAdapter):
    """Qwen's MoE config keys (Qwen2-MoE and Qwen3-MoE alike)."""

    def check_experts(self, cfg) -> None:
        pass

    def moe_config(self, cfg) -> dict:
        return {
            "decoder_sparse_step": 1,
            "mlp_only_layers": dense_layers(cfg),
            "norm_topk_prob": not cfg.moe_router_pre_softmax,
        }

    def moe_fields(self, c: dict) -> dict:
        norm = c.get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            raise ConversionError(f"{self.name} norm_topk_prob must be true or false, got {norm!r}.")
        return dict(moe_layer_freq=moe_layer_freq(c, self.name), moe_router_pre_softmax=not norm)


class Qwen3MoeAdapter(QwenMoEMixin, Qwen3Adapter):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    name = "Qwen3-MoE"
    signature = "RMSNorm + swiglu + rope + --qk-layernorm + experts"
    config_keys = {**Qwen3Adapter.config_keys, **moe_keys("num_experts", "moe_intermediate_size")}
    hf_defaults = {  # Qwen3MoeConfig's
        **Qwen3Adapter.hf_defaults,
        "head_dim": None,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "router_aux_loss_coef": 0.001,
    }
    unsupported = {**Qwen3Adapter.unsupported, "moe_shared_expert_intermediate_size": "a shared expert"}

    def matches(self, cfg) -> bool:
        return super().matches(cfg) and bool(cfg.qk_layernorm)

    def config_from_hf(self, c: dict) -> dict:
        """transformers 5 writes the expert count as num_local_experts (its attribute_map), the
        releases and transformers 4 as num_experts, which an export writes (both read it)."""
        if "num_local_experts" in c:
            if c.get("num_experts", c["num_local_experts"]) != c["num_local_experts"]:
                raise ConversionError(
                    f"the Qwen3-MoE config.json says num_experts {c['num_experts']} and num_local_experts "
                    f"{c['num_local_experts']}; keep one."
                )
            c = {**c, "num_experts": c["num_local_experts"]}
        return super().config_from_hf(c)


ADAPTER = Qwen3MoeAdapter()

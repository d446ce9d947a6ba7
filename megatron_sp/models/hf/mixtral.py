"""Mixtral's Hugging Face adapter: MixtralForCausalLM (model_type mixtral). Mistral's layer (no biases,
an optional sliding window on every layer: hf/mistral.py) with experts on every layer (hf/moe.py):
`num_local_experts` experts of width `intermediate_size`, top `num_experts_per_tok`, the k chosen
probabilities renormalised (ours by default), no shared expert. Its per-expert files name the experts
`block_sparse_moe.experts.{e}.w1/w3/w2` (gate, up, down); transformers 5's fused tensors are read too.
`router_jitter_noise` (training noise on the router's input, Megatron's --moe-input-jitter-eps) is refused.
"""

from __future__ import annotations

import re

from megatron_sp.models.hf.adapter import ConversionError
from megatron_sp.models.hf.mistral import MistralAdapter
from megatron_sp.models.hf.moe import MoEAdapter, moe_keys

_FUSED_ROUTER = re.compile(r"^(model\.layers\.\d+)\.mlp\.gate\.weight$")


class MixtralAdapter(MoEAdapter, MistralAdapter):
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    name = "Mixtral"
    signature = "RMSNorm + swiglu + rope + experts on every layer (+ --window-size on every layer)"
    config_keys = {**MistralAdapter.config_keys, **moe_keys("num_local_experts", "intermediate_size")}
    hf_defaults = {  # MixtralConfig's
        **MistralAdapter.hf_defaults,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.001,
    }
    experts_key = "num_local_experts"
    moe = "block_sparse_moe"
    projections = ("w1", "w3", "w2")
    unsupported = {**MistralAdapter.unsupported, "moe_shared_expert_intermediate_size": "a shared expert"}

    def check_experts(self, cfg) -> None:
        if cfg.num_moe_layers() != cfg.num_layers:
            raise ConversionError(
                "MixtralForCausalLM has experts on every layer; --moe-layer-freq cannot be expressed."
            )
        if cfg.moe_router_pre_softmax:
            raise ConversionError(
                "MixtralForCausalLM renormalises the chosen experts' probabilities; --moe-router-pre-softmax "
                "cannot be expressed."
            )

    def moe_config(self, cfg) -> dict:
        return {"intermediate_size": cfg.moe_ffn_hidden_size, "router_jitter_noise": 0.0}

    def moe_fields(self, c: dict) -> dict:
        if c.get("router_jitter_noise", 0.0):
            raise ConversionError(
                "Mixtral configs with router_jitter_noise are not supported (Megatron's --moe-input-jitter-eps)."
            )
        return {}

    def file_name(self, name: str) -> str:
        return _FUSED_ROUTER.sub(r"\1.block_sparse_moe.gate.weight", name)


ADAPTER = MixtralAdapter()

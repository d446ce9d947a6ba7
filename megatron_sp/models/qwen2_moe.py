"""Qwen2-MoE: Qwen2's layer (models/qwen2.py: biases on q/k/v only) with a mixture of experts and a
shared expert every token goes through, scaled by a learnt sigmoid gate (`--moe-shared-expert-gate`;
models/moe/moe_layer.py), untied. Its GPTConfig defaults are data in megatron_sp/families.py; its
Hugging Face adapter is models/hf/qwen2_moe.py (Qwen2MoeForCausalLM)."""

from megatron_sp.models.spec import ModelSpec

SPEC = ModelSpec(name="qwen2_moe", description="Qwen2-MoE (Qwen team 2024): Qwen2 with sparse and shared experts")

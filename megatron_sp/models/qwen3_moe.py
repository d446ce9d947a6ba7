"""Qwen3-MoE: Qwen3's layer (models/qwen3.py: per-head q/k RMSNorm, no biases) with a mixture of experts
(models/moe/; 128 experts, top 8 in the releases), untied. Its GPTConfig defaults are data in
megatron_sp/families.py; its Hugging Face adapter is models/hf/qwen3_moe.py (Qwen3MoeForCausalLM)."""

from megatron_sp.models.spec import ModelSpec

SPEC = ModelSpec(name="qwen3_moe", description="Qwen3-MoE (Yang et al. 2025): Qwen3 with sparse experts")

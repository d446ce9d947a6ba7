"""Mixtral: Mistral's layer (models/mistral.py) with a mixture of experts on every layer, top-2 of 8 in
the releases (`--num-experts 8 --moe-router-topk 2`; models/moe/). Its GPTConfig defaults are data in
megatron_sp/families.py; its Hugging Face adapter is models/hf/mixtral.py (MixtralForCausalLM)."""

from megatron_sp.models.spec import ModelSpec

SPEC = ModelSpec(name="mixtral", description="Mixtral (Jiang et al. 2024): Mistral with sparse experts")

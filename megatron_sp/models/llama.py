"""Llama: RMSNorm, SwiGLU MLP (fused gate/up), rotary positions, grouped-query attention when
num_query_groups < num_attention_heads, no biases, untied output layer (Llama 2/3 layout).
Its GPTConfig defaults are data in megatron_sp/families.py; its Hugging Face adapter is models/hf/llama.py."""

from megatron_sp.models.spec import ModelSpec

SPEC = ModelSpec(name="llama", description="Llama 2/3 (Touvron et al. 2023; Grattafiori et al. 2024)")

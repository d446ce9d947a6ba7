"""Mistral: Llama's layer (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied) with
sliding-window attention on every layer (`--window-size L,0`, Megatron's meaning: a query sees
itself and the L tokens before it; Mistral 7B v0.1's config.json says sliding_window 4096, which is
L = 4095; later releases have none). Its GPTConfig defaults are data in megatron_sp/families.py; its
Hugging Face adapter is models/hf/mistral.py (MistralForCausalLM)."""

from megatron_sp.models.spec import ModelSpec

SPEC = ModelSpec(name="mistral", description="Mistral (Jiang et al. 2023): Llama with sliding-window attention")

"""Qwen3 (dense): Llama's layer without biases, plus an RMSNorm over each head's queries and keys
before RoPE (Megatron's `--qk-layernorm`, models/attention.py), and a head dim that need not be
hidden / heads (`--kv-channels`, 128 in the releases). Its GPTConfig defaults are data in
megatron_sp/families.py; its Hugging Face adapter is models/hf/qwen3.py (Qwen3ForCausalLM)."""

from megatron_sp.models.spec import ModelSpec

SPEC = ModelSpec(name="qwen3", description="Qwen3 dense (Yang et al. 2025): Llama with per-head q/k RMSNorm")

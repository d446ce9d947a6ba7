"""Qwen2 / Qwen2.5: Llama's layer (RMSNorm, SwiGLU, RoPE, grouped-query attention) with biases on the
query, key and value projections only (`--add-qkv-bias --disable-bias-linear`); RoPE's theta comes
from the checkpoint (1e6 in the releases). Its GPTConfig defaults are data in megatron_sp/families.py;
its Hugging Face adapter is models/hf/qwen2.py (Qwen2ForCausalLM)."""

from megatron_sp.models.spec import ModelSpec

SPEC = ModelSpec(name="qwen2", description="Qwen2 / Qwen2.5 (Yang et al. 2024): Llama with q/k/v biases")

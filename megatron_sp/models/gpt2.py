"""GPT-2: learned positions, pre-LayerNorm blocks, GELU MLP, biases, tied input/output embeddings.
(--openai-gelu selects GPT-2's tanh GELU; the default is the exact erf GELU, as in Megatron-LM.)
Its GPTConfig defaults are data in megatron_sp/families.py; its Hugging Face adapter is models/hf/gpt2.py."""

from megatron_sp.models.spec import ModelSpec

SPEC = ModelSpec(name="gpt2", description="GPT-2 (Radford et al. 2019) / Megatron-LM's default GPT")

"""gpt-oss: Llama's layer with biases on every linear, attention sinks (`--softmax-type learnable`), a
sliding window on alternate layers (`--window-size 127,0 --window-attn-skip-freq 2`), YaRN, and experts
of clamped quick-GeGLU on every layer (`--quick-geglu --glu-linear-offset 1.0
--activation-func-clamp-value 7.0`; 32 experts top 4 in gpt-oss-20b, 128 in gpt-oss-120b), the router
with its bias, the top k logits softmaxed. Its GPTConfig defaults are data in megatron_sp/families.py;
its Hugging Face adapter is models/hf/gpt_oss.py (GptOssForCausalLM)."""

from megatron_sp.models.spec import ModelSpec

SPEC = ModelSpec(name="gpt_oss", description="gpt-oss (OpenAI 2025): sinks, alternating windows, biased experts")

"""Qwen2's Hugging Face adapter: Qwen2ForCausalLM (model_type qwen2; Qwen2.5 checkpoints are the same
class). Llama's adapter with what differs: biases on q/k/v and nowhere else, always (config.json has
no bias keys), and a sliding-window option that is refused (off in every release).

Its tensors follow from the config (`linear_kinds(cfg.add_qkv_bias)` in LlamaAdapter.layer_links),
so a plain `--model llama --add-qkv-bias` run, which LlamaForCausalLM cannot express, exports as Qwen2.
"""

from __future__ import annotations

from megatron_sp.models.hf.adapter import ConversionError
from megatron_sp.models.hf.llama import LlamaAdapter


def refuse_sliding_window(c: dict, name: str) -> None:
    """Qwen configs may turn on a sliding window over their upper layers (from max_window_layers on),
    which no release does; not read yet (it would be a --window-attn-skip-freq pattern)."""
    if c.get("use_sliding_window"):
        raise ConversionError(f"{name} configs with use_sliding_window are not supported.")


class Qwen2Adapter(LlamaAdapter):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    name = "Qwen2"

    def check_biases(self, cfg) -> None:
        if not cfg.add_qkv_bias or cfg.add_bias_linear:
            raise ConversionError("Qwen2ForCausalLM has biases on q/k/v and nowhere else.")

    def variant_config(self, cfg) -> dict:
        return {"use_sliding_window": False}

    def variant_fields(self, c: dict) -> dict:
        refuse_sliding_window(c, self.name)
        return dict(add_bias_linear=False, add_qkv_bias=True)


ADAPTER = Qwen2Adapter()

"""Mistral's Hugging Face adapter: MistralForCausalLM (model_type mistral). Llama's adapter with what
differs: no biases (MistralConfig has no bias keys) and the sliding window, the same on every layer.

transformers' `sliding_window` W lets a query see W tokens, itself included (`kv > q - W`); our
`window_size` is Megatron's (left, 0), a query seeing itself and `left` tokens before it, so
W = left + 1 (Megatron's gpt-oss example gives `--window-size 127,0` for gpt-oss's 128). No window
is `sliding_window: null`, which an export always writes (MistralConfig's default is 4096).
"""

from __future__ import annotations

from megatron_sp.models.hf.adapter import ConversionError
from megatron_sp.models.hf.llama import LlamaAdapter


def sliding_window(cfg):
    """transformers' sliding_window of cfg's window (None: every key), the same on every layer."""
    if cfg.window_size is None or cfg.window_size[0] < 0:
        return None
    return cfg.window_size[0] + 1


def window_size(window, name: str):
    """GPTConfig's window_size of a config.json's sliding_window (None: no window)."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ConversionError(f"{name} sliding_window must be a positive integer or null, got {window!r}.")
    return (window - 1, 0)


class MistralAdapter(LlamaAdapter):
    model_type = "mistral"
    architecture = "MistralForCausalLM"
    name = "Mistral"
    signature = "RMSNorm + swiglu + rope (+ --window-size on every layer)"
    hf_defaults = {**LlamaAdapter.hf_defaults, "sliding_window": 4096}  # MistralConfig's
    unsupported = {k: v for k, v in LlamaAdapter.unsupported.items() if k != "window_size"}

    def check(self, cfg) -> None:
        super().check(cfg)
        if cfg.window_attn_skip_freq is not None:
            raise ConversionError(
                "MistralForCausalLM windows every layer alike; --window-attn-skip-freq cannot be expressed."
            )

    def check_biases(self, cfg) -> None:
        if cfg.add_qkv_bias or cfg.add_bias_linear:
            raise ConversionError("MistralForCausalLM has no biases, so none can be expressed here.")

    def variant_config(self, cfg) -> dict:
        return {"sliding_window": sliding_window(cfg)}

    def variant_fields(self, c: dict) -> dict:
        window = c.get("sliding_window", self.hf_defaults["sliding_window"])
        return dict(add_bias_linear=False, add_qkv_bias=False, window_size=window_size(window, self.name))


ADAPTER = MistralAdapter()

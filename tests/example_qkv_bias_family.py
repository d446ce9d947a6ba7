"""A Llama-like family with one extra option, as a new family is added: Llama with biases on q/k/v
only (`--add-qkv-bias --disable-bias-linear`), which is what Hugging Face's Qwen2ForCausalLM computes.

Its spec and its Hugging Face adapter are here; registering it is one line (in megatron_sp/families.py's
FAMILIES, or at run time):

    register_model("llama-qkv-bias", "example_qkv_bias_family:SPEC",
                   defaults=dict(families.FAMILIES["llama"].defaults, add_qkv_bias=True),
                   hf="example_qkv_bias_family:ADAPTER")

The blocks are the library's (their options are GPTConfig fields), so the spec names no class of its
own; the adapter is Llama's with what differs: the model_type, the bias keys of config.json (none:
Qwen2 always has q/k/v biases and no others) and the refusal of other bias layouts. Its tensors'
links follow from the config (`linear_kinds(cfg.add_qkv_bias)` in LlamaAdapter.layer_links).
tests/test_hf.py imports and exports it through transformers' Qwen2ForCausalLM.
"""

from megatron_sp.models.hf.adapter import ConversionError
from megatron_sp.models.hf.llama import LlamaAdapter
from megatron_sp.models.spec import ModelSpec

SPEC = ModelSpec(name="llama-qkv-bias", description="Llama with q/k/v biases (Qwen2's layout)")


class QkvBiasAdapter(LlamaAdapter):
    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    name = "Qwen2"

    def check_biases(self, cfg) -> None:
        if not cfg.add_qkv_bias or cfg.add_bias_linear:
            raise ConversionError("Qwen2ForCausalLM has biases on q/k/v and nowhere else.")

    def variant_config(self, cfg) -> dict:
        return {"use_sliding_window": False}

    def variant_fields(self, c: dict) -> dict:
        if c.get("use_sliding_window"):
            raise ConversionError("Qwen2 configs with use_sliding_window are not supported.")
        return dict(add_bias_linear=False, add_qkv_bias=True)


ADAPTER = QkvBiasAdapter()

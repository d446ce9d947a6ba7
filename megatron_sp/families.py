"""Model families by name (`--model NAME`, `GPTConfig(model=NAME)`): each family's GPTConfig defaults
as plain data, and where its ModelSpec and its Hugging Face adapter live.

    FAMILIES[name] = Family(spec="module:SPEC", defaults={...}, hf="module:ADAPTER")

The defaults are data, so GPTConfig fills a family's fields without importing any model code (DESIGN:
config imports no model code; tests/test_import_rules.py checks sys.modules). The spec is imported
when a model is built (models/registry.py's `get_spec`), the adapter only when a model is converted
(models/hf/). What no family sets is GPT-2's (`BASE`, Megatron-LM's default GPT).

A new family is its spec file, its adapter file and one entry here, or `register_model(...)` at run
time. `--model package.module:SPEC` names a spec outside the registry: its defaults are read from
the ModelSpec's own `defaults` at that point, which imports its module (and so megatron_sp.models).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

# The architecture fields a family sets (every field a family leaves at None is filled from BASE).
_LLAMA = dict(
    normalization="RMSNorm",
    activation="swiglu",
    position_embedding_type="rope",
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
)

# Qwen's small models tie the output layer to the embeddings, its large ones do not: tied by default
# (Megatron's), so both print as --model qwen2/qwen3 (untied: --untie-embeddings-and-output-weights).
_QWEN = {k: v for k, v in _LLAMA.items() if k != "untie_embeddings_and_output_weights"}


@dataclass(frozen=True)
class Family:
    """One model family: its ModelSpec, its GPTConfig defaults and its Hugging Face adapter."""

    spec: str  # "module:attribute" naming its ModelSpec (imported to build a model)
    defaults: Optional[dict] = None  # GPTConfig values over BASE's; None: the spec's ModelSpec.defaults
    hf: Optional[str] = None  # "module:attribute" naming its HFAdapter (models/hf/adapter.py); None: none


FAMILIES = {
    "gpt2": Family(
        "megatron_sp.models.gpt2:SPEC",
        dict(
            normalization="LayerNorm",
            activation="gelu",
            position_embedding_type="learned_absolute",
            untie_embeddings_and_output_weights=False,
            add_bias_linear=True,
            qk_layernorm=False,
        ),
        hf="megatron_sp.models.hf.gpt2:ADAPTER",
    ),
    "llama": Family("megatron_sp.models.llama:SPEC", _LLAMA, hf="megatron_sp.models.hf.llama:ADAPTER"),
    # Llama with biases on q/k/v only (the output and MLP projections have none)
    "qwen2": Family(
        "megatron_sp.models.qwen2:SPEC", dict(_QWEN, add_qkv_bias=True), hf="megatron_sp.models.hf.qwen2:ADAPTER"
    ),
    # Llama with an RMSNorm over each head's queries and keys before RoPE (Megatron's --qk-layernorm)
    "qwen3": Family(
        "megatron_sp.models.qwen3:SPEC", dict(_QWEN, qk_layernorm=True), hf="megatron_sp.models.hf.qwen3:ADAPTER"
    ),
    # Llama with a sliding window on every layer (--window-size L,0: from the checkpoint, none by default)
    "mistral": Family("megatron_sp.models.mistral:SPEC", _LLAMA, hf="megatron_sp.models.hf.mistral:ADAPTER"),
    # Mixture-of-experts families: the experts come from the --num-experts / --moe-* flags (the converter
    # prints them); a family gives its layer's defaults and its Hugging Face adapter (models/hf/moe.py).
    # Mistral's layer with experts on every layer
    "mixtral": Family("megatron_sp.models.mixtral:SPEC", _LLAMA, hf="megatron_sp.models.hf.mixtral:ADAPTER"),
    # Qwen3's layer with experts (untied, as every release)
    "qwen3_moe": Family(
        "megatron_sp.models.qwen3_moe:SPEC",
        dict(_LLAMA, qk_layernorm=True),
        hf="megatron_sp.models.hf.qwen3_moe:ADAPTER",
    ),
    # Qwen2's layer with experts and a gated shared expert (--moe-shared-expert-gate)
    "qwen2_moe": Family(
        "megatron_sp.models.qwen2_moe:SPEC",
        dict(_LLAMA, add_qkv_bias=True),
        hf="megatron_sp.models.hf.qwen2_moe:ADAPTER",
    ),
    # Llama's attention with biases and sinks, experts of clamped quick-GeGLU on every layer (the rest,
    # --glu-linear-offset, --activation-func-clamp-value, --softmax-type, the window and YaRN, are flags)
    "gpt_oss": Family(
        "megatron_sp.models.gpt_oss:SPEC",
        dict(_LLAMA, activation="quick_geglu", add_bias_linear=True),
        hf="megatron_sp.models.hf.gpt_oss:ADAPTER",
    ),
}
BASE = "gpt2"  # the family whose defaults fill what another family does not set


def register_model(name: str, spec: str, *, defaults: Optional[dict] = None, hf: Optional[str] = None) -> None:
    """Adds (or replaces) a family: `spec` is "module:attribute" naming a ModelSpec, `hf` one naming
    its Hugging Face adapter; without `defaults` they are read from the ModelSpec when first needed."""
    FAMILIES[name] = Family(spec, None if defaults is None else dict(defaults), hf)


def family(name: str) -> Family:
    """The registered family of that name, or of that spec path; a Family reading its defaults from
    the spec for any other "module:attribute" path; ValueError (one sentence) otherwise."""
    if name in FAMILIES:
        return FAMILIES[name]
    if ":" in name:
        return next((f for f in FAMILIES.values() if f.spec == name), Family(name))
    raise ValueError(
        f"unknown model {name!r}; registered: {', '.join(sorted(FAMILIES))} "
        f"(or give a spec as package.module:ATTRIBUTE)."
    )


def load(target: str, what: str, is_kind) -> object:
    """The object a "module:attribute" path names; ValueError (one sentence) when there is none or
    `is_kind(obj)` is false (`what` names the kind expected)."""
    module_name, _, attr = target.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot load {target} ({err}).") from None
    if not is_kind(obj):
        raise ValueError(f"{target} is a {type(obj).__name__}, not a {what}.")
    return obj


def _has_defaults(obj) -> bool:  # a ModelSpec, known without importing megatron_sp.models
    return isinstance(getattr(obj, "defaults", None), dict)


def family_defaults(name: str) -> dict:
    """The GPTConfig values for the fields a user left at None: the family's over BASE's."""
    entry = family(name)
    defaults = entry.defaults
    if defaults is None:
        try:
            defaults = load(entry.spec, "ModelSpec", _has_defaults).defaults
        except ValueError as err:
            raise ValueError(f"model {name!r}: {err}") from None
    return {**FAMILIES[BASE].defaults, **defaults}

"""What a model family's Hugging Face adapter is (`HFAdapter`), and the pieces adapters are made of.

An adapter holds everything one transformers architecture needs, in one file per family (hf/gpt2.py,
hf/llama.py), registered beside the family's spec in megatron_sp/families.py:

    model_type, architecture     config.json's "model_type" (how an import finds it) and class name
    matches(cfg) / check(cfg)    the config's shape is this architecture's / what within it HF cannot say
    config_keys, hf_defaults     the config.json keys that map one to one onto GPTConfig fields, and
                                 transformers' defaults for those a config.json may omit
    config_to_hf / _from_hf      the rest of the config translation, both ways
    links(cfg)                   every tensor: our names <-> HF names and the transforms between them
    layers, buffers, canonical   where HF numbers its layers, the buffers it saves, its name variants

The generic machinery (models/hf/__init__.py) turns these into `to_hf` / `from_hf` and checks every
imported tensor against `links` of a shape-only model. A `Link` ties some of our tensors to some HF
tensors: one to one (`same`, `transposed`), or our fused rows to HF's separate projections (`fused`:
q/k/v, gate/up); an expert's tensors to a stacked HF tensor is a Link with several names on one side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch


class ConversionError(ValueError):
    """The model or config cannot be expressed on the other side: one sentence."""


def _identity(*tensors):
    return tensors


@dataclass(frozen=True)
class Link:
    """Our tensors `ours` <-> HF tensors `hf`: `to_hf(*ours) -> hf tuple`, `from_hf(*hf) -> ours tuple`."""

    ours: tuple
    hf: tuple
    to_hf: Callable = _identity
    from_hf: Callable = _identity


def same(ours: str, hf: str) -> Link:
    return Link((ours,), (hf,))


def _transpose(t):
    return (t.t(),)


def transposed(ours: str, hf: str) -> Link:
    """A weight HF stores [in, out] (GPT-2's Conv1D), ours [out, in]."""
    return Link((ours,), (hf,), _transpose, _transpose)


def fused(ours: str, hf: tuple, sizes: tuple) -> Link:
    """Our one tensor whose rows are HF's tensors `hf` stacked in order, of `sizes` rows each."""
    return Link((ours,), tuple(hf), lambda t: tuple(t.split(list(sizes))), lambda *parts: (torch.cat(parts),))


@runtime_checkable
class HFAdapter(Protocol):
    """One family's Hugging Face architecture (see the module docstring)."""

    model_type: str  # config.json's "model_type": an import picks the adapter by it
    architecture: str  # the transformers class, config.json's "architectures"
    signature: str  # what `matches` accepts, in words ("RMSNorm + swiglu + rope"), for refusals
    config_keys: dict  # {GPTConfig field: config.json key}, in GPTConfig's field order
    hf_defaults: dict  # {config.json key: transformers' default}; None: the field's GPTConfig default
    layers: str  # the HF name prefix of the numbered layers ("model.layers")
    buffers: re.Pattern  # HF tensors that are buffers some exports carry (dropped on import)
    tied_output: str  # the HF output weight a tied model may carry as a copy of the embedding

    def matches(self, cfg) -> bool:
        """The config has this architecture's shape (norm, activation, positions)."""

    def check(self, cfg) -> None:
        """ConversionError (one sentence) for anything of cfg this architecture cannot express."""

    def config_to_hf(self, cfg) -> dict:
        """config.json's entries besides model_type, architectures and the `config_keys`."""

    def config_from_hf(self, config: dict) -> dict:
        """The GPTConfig fields of a config.json, the `config_keys` ones included (CausalLMAdapter's
        `named_fields` reads them); not `model`, which is the name the family is registered under."""

    def links(self, cfg) -> list:
        """Every tensor of a ReferenceGPT of cfg, as Links."""

    def canonical(self, tensors: dict, cfg) -> dict:
        """The HF tensors under the names `links` uses for cfg (e.g. GPT2Model's bare keys prefixed,
        transformers 5's fused 3-D expert tensors split per expert: hf/moe.py)."""


class CausalLMAdapter:
    """What most adapters share: reading the `config_keys`, HF's usual names, the refusals."""

    layers = "model.layers"
    buffers = re.compile(r"\.rotary_emb\.inv_freq$")
    tied_output = "lm_head.weight"
    config_keys: dict = {}
    hf_defaults: dict = {}
    # GPTConfig fields the architecture has no place for when set (true, or not their default:
    # a window, sinks): {field: its flag}, refused by `check`
    unsupported = {
        "qk_layernorm": "--qk-layernorm",
        "layernorm_zero_centered_gamma": "--apply-layernorm-1p",
        "window_size": "--window-size",
        "softmax_type": "--softmax-type off-by-one / learnable",
        "glu_linear_offset": "--glu-linear-offset",
    }

    def named_fields(self, config: dict) -> dict:
        """The GPTConfig fields of the `config_keys` (an omitted key: transformers' default)."""
        fields = {}
        for name, key in self.config_keys.items():
            if key not in config and key not in self.hf_defaults:
                raise ConversionError(f"the {self.model_type} config.json lacks {key}.")
            value = config.get(key, self.hf_defaults.get(key))
            if value is not None:
                fields[name] = value
        return fields

    def canonical(self, tensors: dict, cfg) -> dict:
        return tensors


_OFF = {"softmax_type": "vanilla"}  # a field whose default is a value, not False / None


def refuse_fields(cfg, architecture: str, flags: dict) -> None:
    """ConversionError naming the first of `flags` ({field: its flag}) that cfg sets."""
    for name, flag in flags.items():
        value = getattr(cfg, name)
        if value != _OFF.get(name) and value:
            raise ConversionError(f"{architecture} cannot express {flag}.")


def per_layer(num_layers: int, links_of_layer: Callable) -> list:
    """links_of_layer(i) for every layer i."""
    return [link for i in range(num_layers) for link in links_of_layer(i)]


def linear_kinds(bias: bool) -> tuple:
    return ("weight", "bias") if bias else ("weight",)

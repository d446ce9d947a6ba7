"""Hugging Face <-> megatron_sp: weights and config.json, through each family's adapter.

    to_hf(state, cfg)          ReferenceGPT state dict -> (HF tensors, HF config dict)
    from_hf(tensors, config)   HF tensors + config.json -> (ReferenceGPT state dict, GPTConfig fields)

Every family registered with an adapter (megatron_sp/families.py, `hf=`) is one architecture; what
each knows is in its file (hf/gpt2.py, hf/llama.py; the contract: hf/adapter.py). Export picks the
architecture from the config, not the family name: the family's own adapter first, then any other
whose shape the config has, so a `--model gpt2` run with RMSNorm + SwiGLU + RoPE exports as Llama;
what none can express is refused with one sentence. Import picks it by config.json's `model_type`.
On import every tensor is checked against the config before it is used (`check_tensors`: its name,
its shape as `to_hf` of a shape-only model gives it, floating point; the layer count first, so a
hostile config builds nothing).
"""

from __future__ import annotations

import re

import torch

from megatron_sp import families
from megatron_sp.config import GPTConfig
from megatron_sp.models.hf.adapter import ConversionError, HFAdapter

__all__ = ["ConversionError", "HFAdapter", "adapters", "check_tensors", "from_hf", "to_hf"]


def _is_adapter(obj) -> bool:
    return isinstance(obj, HFAdapter)  # every member of the Protocol present


def adapters() -> dict:
    """{family name: its HFAdapter} for every registered family with one, in registry order."""
    found = {}
    for name, entry in families.FAMILIES.items():
        if entry.hf is not None:
            try:
                found[name] = families.load(entry.hf, "Hugging Face adapter", _is_adapter)
            except ValueError as err:
                raise ConversionError(f"model {name!r}: {err}") from None
    return found


def _candidates(cfg) -> list:
    """The adapters to try for cfg: its family's own first (when it has one), then the others."""
    found = adapters()
    own = families.family(cfg.model)
    first = [families.load(own.hf, "Hugging Face adapter", _is_adapter)] if own.hf else []
    return list({id(a): a for a in first + list(found.values())}.values())


def adapter_for(cfg) -> HFAdapter:
    """The adapter that exports cfg; ConversionError (one sentence) when none can."""
    candidates = _candidates(cfg)
    matching = [a for a in candidates if a.matches(cfg)]
    if not matching:
        known = "; ".join(f"{a.architecture}: {a.signature}" for a in adapters().values())
        experts = " + mixture of experts" if cfg.num_experts is not None else ""
        raise ConversionError(
            f"no Hugging Face architecture matches {cfg.normalization} + {cfg.activation} + "
            f"{cfg.position_embedding_type} positions{experts} ({known})."
        )
    refusals = []
    for adapter in matching:
        try:
            adapter.check(cfg)
            return adapter
        except ConversionError as err:
            refusals.append(err)
    raise refusals[0]  # the family's own (or the first matching) architecture's reason


def _by_model_type(kind) -> tuple:
    """(family name, adapter) of a config.json's model_type."""
    found = adapters()
    for name, adapter in found.items():
        if adapter.model_type == kind:
            return name, adapter
    known = " and ".join(f"{a.architecture} ({a.model_type})" for a in found.values())
    raise ConversionError(f"model_type {kind!r} is not supported; {known} are.")


def _tensors_to_hf(links, state: dict) -> dict:
    out = {}
    for link in links:
        out.update(zip(link.hf, link.to_hf(*(state[name] for name in link.ours))))
    return out


def _tensors_from_hf(links, tensors: dict) -> dict:
    out = {}
    for link in links:
        out.update(zip(link.ours, link.from_hf(*(tensors[name] for name in link.hf))))
    return out


def _export(state: dict, cfg, adapter) -> tuple[dict, dict]:
    config = {
        "architectures": [adapter.architecture],
        "model_type": adapter.model_type,
        **{key: getattr(cfg, name) for name, key in adapter.config_keys.items()},
        **adapter.config_to_hf(cfg),
    }
    tensors = _tensors_to_hf(adapter.links(cfg), state)
    return {k: v.contiguous() for k, v in tensors.items()}, config


def to_hf(state: dict, cfg) -> tuple[dict, dict]:
    """(HF tensors, config.json dict) of a ReferenceGPT state dict."""
    return _export(state, cfg, adapter_for(cfg))


def from_hf(tensors: dict, config: dict) -> tuple[dict, dict]:
    """(ReferenceGPT state dict, GPTConfig fields) from HF tensors and config.json; every tensor's
    name, shape and dtype checked against the config first (one sentence naming the tensor)."""
    if not isinstance(config, dict):
        raise ConversionError(f"config.json holds a {type(config).__name__}, not a JSON object.")
    kind = config.get("model_type")
    family, adapter = _by_model_type(kind)
    try:
        fields = dict(model=family, **adapter.config_from_hf(config))
        cfg = GPTConfig(seq_length=fields["max_position_embeddings"], tensor_model_parallel_size=1, **fields)
    except (TypeError, ZeroDivisionError, OverflowError, AttributeError) as err:
        raise ConversionError(f"the {kind} config.json holds a value of the wrong kind ({err}).") from None
    tensors = check_tensors(adapter.canonical(tensors, cfg), cfg, adapter)
    state = _tensors_from_hf(adapter.links(cfg), tensors)
    return {k: v.contiguous() for k, v in state.items()}, fields


def _check_layer_count(tensors: dict, cfg, adapter) -> None:
    layer = re.compile(rf"^{re.escape(adapter.layers)}\.(\d+)\.")
    layers = {int(m.group(1)) for m in map(layer.match, tensors) if m}
    if len(layers) != cfg.num_layers or not all(0 <= i < cfg.num_layers for i in layers):  # = range(L)
        raise ConversionError(
            f"config.json has {cfg.num_layers} layers but the weights hold {len(layers)} "
            f"(layers {min(layers, default=0)}..{max(layers, default=-1)})."
        )


def _drop_tied_output(given: dict, expected: dict, cfg, adapter) -> None:
    """A tied model's exported output weight (some exports save both) must equal the embedding."""
    if cfg.untie_embeddings_and_output_weights or adapter.tied_output not in given:
        return
    embedding = next(link.hf[0] for link in adapter.links(cfg) if link.ours == ("embedding.word_embeddings.weight",))
    tied = given.pop(adapter.tied_output)
    if embedding in given and not torch.equal(tied, given[embedding]):
        raise ConversionError(
            f"config.json ties the embeddings (tie_word_embeddings) but {adapter.tied_output} differs from them."
        )


def check_tensors(tensors: dict, cfg, adapter=None) -> dict:
    """The HF tensors a config needs, each of the shape it needs and floating point; buffers and a
    tied output weight equal to the embedding dropped. The layer count is compared before anything
    is built (a config of 10^9 layers builds nothing)."""
    adapter = adapter if adapter is not None else adapter_for(cfg)
    _check_layer_count(tensors, cfg, adapter)
    from megatron_sp.models.reference import ReferenceGPT

    with torch.device("meta"):
        model = ReferenceGPT(cfg, initialise=False)
    expected, _ = _export(dict(model.named_parameters()), cfg, adapter)
    given = {k: v for k, v in tensors.items() if not adapter.buffers.search(k)}
    _drop_tied_output(given, expected, cfg, adapter)
    for name in sorted(set(expected) | set(given)):
        if name not in given:
            raise ConversionError(f"the Hugging Face weights lack {name} for this config.")
        if name not in expected:
            raise ConversionError(f"the Hugging Face weights hold {name}, which this config has no place for.")
        t, want = given[name], list(expected[name].shape)
        if list(t.shape) != want:
            raise ConversionError(f"{name} has shape {list(t.shape)} but config.json needs {want}.")
        if not t.is_floating_point():
            raise ConversionError(f"{name} is {t.dtype}; weights must be floating point.")
    return given

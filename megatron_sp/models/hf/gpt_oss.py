"""gpt-oss's Hugging Face adapter: GptOssForCausalLM (model_type gpt_oss; gpt-oss-20b, gpt-oss-120b).

Llama's attention (hf/llama.py: q/k/v fused in ours) with biases on q/k/v/o (`attention_bias`), one
learnt sink logit per head (`self_attn.sinks` = our `attn.softmax_offset`, --softmax-type learnable), a
sliding window on the layers `layer_types` calls `sliding_attention` (hf/mistral.py's rule: W =
--window-size's L + 1; gpt-oss's alternation is --window-attn-skip-freq 2), YaRN from its
`rope_parameters` (hf/rope.py), and experts on every layer:

    router      logits = x W^T + b (`mlp.router.weight/bias`: our router with --add-bias-linear); the
                top k logits, then a softmax over those k (our default routing)
    experts     `mlp.experts.gate_up_proj` [E, h, 2f] (x @ it; gate and up *interleaved* column by column:
                gate = [..., 0::2], up = [..., 1::2]) + `gate_up_proj_bias` [E, 2f] (interleaved alike);
                `down_proj` [E, f, h] + `down_proj_bias` [E, h]. Ours per expert: fc1 [2f, h] rows
                [gate; up] (split and transposed), fc2 [h, f] (transposed)
    activation  (clamp(up, -l, l) + 1) · g·sigmoid(1.702 g), g = clamp(gate, max=l), l = `swiglu_limit`:
                --quick-geglu --glu-linear-offset 1 --activation-func-clamp-value l
    weighting   each expert's output, down_proj's bias included, times its routing weight: ours
                (models/moe/experts.py, as Megatron's experts apply the probabilities)

The fused expert tensors are the file layout (save_pretrained writes them so); each is checked
against the config before anything is built. MXFP4 checkpoints (`*_blocks` / `*_scales`, the released
files) are refused: dequantise them first. What the class cannot say is refused on export: no biases
(its experts and router always have them), other activations' offsets, no clamp, another softmax,
other routing, dense layers, a shared expert.
"""

from __future__ import annotations

import re

import torch

from megatron_sp.layer_options import is_window_layer
from megatron_sp.models.hf.adapter import ConversionError, Link, same
from megatron_sp.models.hf.llama import LlamaAdapter
from megatron_sp.models.hf.mistral import sliding_window, window_size
from megatron_sp.models.hf.moe import MoEAdapter, moe_keys

ALPHA = 1.702  # quick GELU's gain: our --quick-geglu's, GptOssConfig's swiglu_alpha default
_EXPERT_KINDS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\w+)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_QUANTISED = re.compile(r"_(blocks|scales)$")
SLIDING, FULL = "sliding_attention", "full_attention"
_OWN = ("window_size", "softmax_type", "glu_linear_offset")
_DEFAULT_ROPE = {  # GptOssConfig's rope_parameters when config.json has none (its default_theta)
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


# ---- the expert tensors: ours per expert <-> HF's stacked, gate/up interleaved -----------------


def _interleave(t):
    """Our [gate; up] rows (dim 0, 2f) as HF's alternating gate, up, gate, up ... (dim 0)."""
    f = t.shape[0] // 2
    return torch.stack([t[:f], t[f:]], dim=1).reshape(t.shape)


def _deinterleave(t):
    return torch.cat([t[0::2], t[1::2]])


def _gate_up_to_hf(*fc1):
    return (torch.stack([_interleave(w).t() for w in fc1]),)  # [E, h, 2f]


def _gate_up_from_hf(t):
    return tuple(_deinterleave(w.t()) for w in t)  # E x [2f, h]


def _gate_up_bias_to_hf(*b1):
    return (torch.stack([_interleave(b) for b in b1]),)  # [E, 2f]


def _gate_up_bias_from_hf(t):
    return tuple(_deinterleave(b) for b in t)


def _down_to_hf(*fc2):
    return (torch.stack([w.t() for w in fc2]),)  # [E, f, h]


def _down_from_hf(t):
    return tuple(w.t() for w in t)  # E x [h, f]


def _stack(*tensors):
    return (torch.stack(tensors),)


def _unstack(t):
    return tuple(t.unbind(0))


_EXPERT_LINKS = {  # HF name: (our tensor of each expert, to_hf, from_hf)
    "gate_up_proj": ("fc1.weight", _gate_up_to_hf, _gate_up_from_hf),
    "gate_up_proj_bias": ("fc1.bias", _gate_up_bias_to_hf, _gate_up_bias_from_hf),
    "down_proj": ("fc2.weight", _down_to_hf, _down_from_hf),
    "down_proj_bias": ("fc2.bias", _stack, _unstack),
}


def expert_links(cfg, i: int) -> list:
    """Layer i's experts: each HF tensor one Link to that tensor of every expert."""
    ours, hf = f"layers.{i}.mlp.experts.local_experts", f"model.layers.{i}.mlp.experts"
    links = []
    for kind, (name, to_hf, from_hf) in _EXPERT_LINKS.items():
        each = tuple(f"{ours}.{e}.{name}" for e in range(cfg.num_experts))
        links.append(Link(each, (f"{hf}.{kind}",), to_hf, from_hf))
    return links


# ---- layer_types <-> --window-size / --window-attn-skip-freq ----------------------------------


def layer_types(cfg) -> list:
    windowed = sliding_window(cfg) is not None
    return [SLIDING if windowed and is_window_layer(cfg, i + 1) else FULL for i in range(cfg.num_layers)]


def window_fields(c: dict) -> dict:
    """window_size and window_attn_skip_freq of a config.json's layer_types and sliding_window."""
    n, types = c.get("num_hidden_layers"), c.get("layer_types")
    if types is None:  # GptOssConfig's: sliding, full, sliding, ... = every 2nd layer full
        windowed = True
        freq = 2 if isinstance(n, int) and n > 1 else None
    else:
        if not (isinstance(types, list) and len(types) == n and all(t in (SLIDING, FULL) for t in types)):
            raise ConversionError(
                f"gpt-oss layer_types must list {SLIDING!r} or {FULL!r} for each of the {n!r} layers, got {types!r}."
            )
        windowed = SLIDING in types
        pattern = tuple(int(t == SLIDING) for t in types)
        freq = None if all(pattern) else 2 if pattern == tuple(int(i % 2 != 0) for i in range(1, n + 1)) else pattern
    if not windowed:
        return dict(window_size=None, window_attn_skip_freq=None)
    window = c.get("sliding_window", 128)
    if window is None:
        raise ConversionError("gpt-oss layer_types has sliding_attention layers but sliding_window is null.")
    return dict(window_size=window_size(window, "gpt-oss"), window_attn_skip_freq=freq)


class GptOssAdapter(MoEAdapter, LlamaAdapter):
    model_type = "gpt_oss"
    architecture = "GptOssForCausalLM"
    name = "gpt-oss"
    signature = (
        "RMSNorm + quick_geglu (--glu-linear-offset 1, --activation-func-clamp-value) + rope/yarn + "
        "--softmax-type learnable + biases + experts on every layer"
    )
    config_keys = {**LlamaAdapter.config_keys, **moe_keys("num_local_experts", "intermediate_size")}
    hf_defaults = {  # GptOssConfig's
        **LlamaAdapter.hf_defaults,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "intermediate_size": 2880,
        "router_aux_loss_coef": 0.001,
    }
    experts_key = "num_local_experts"
    unsupported = {  # (the window, the sinks and the offset: gpt-oss's own, checked in check_experts)
        **{k: v for k, v in LlamaAdapter.unsupported.items() if k not in _OWN},
        "moe_shared_expert_intermediate_size": "a shared expert",
    }

    def matches(self, cfg) -> bool:
        shape = (cfg.normalization, cfg.activation, cfg.rotary)
        return shape == ("RMSNorm", "quick_geglu", True) and cfg.num_experts is not None

    def check_biases(self, cfg) -> None:
        if not (cfg.add_bias_linear and cfg.add_qkv_bias):
            raise ConversionError(
                "GptOssForCausalLM has biases on q/k/v/o, the router and the experts; --disable-bias-linear "
                "cannot be expressed."
            )

    def check_experts(self, cfg) -> None:
        refusals = (
            (cfg.num_moe_layers() != cfg.num_layers, "has experts on every layer; --moe-layer-freq"),
            (cfg.moe_router_pre_softmax, "takes the softmax over the chosen experts; --moe-router-pre-softmax"),
            (cfg.softmax_type != "learnable", f"has attention sinks; --softmax-type {cfg.softmax_type}"),
            (cfg.glu_linear_offset != 1.0, f"adds 1 to the linear unit; --glu-linear-offset {cfg.glu_linear_offset}"),
            (cfg.activation_func_clamp_value is None, "clamps its experts' GLU; no --activation-func-clamp-value"),
        )
        for refused, what in refusals:
            if refused:
                raise ConversionError(f"GptOssForCausalLM {what} cannot be expressed.")

    # ---- config.json ----

    def config_from_hf(self, c: dict) -> dict:
        if c.get("swiglu_alpha", ALPHA) != ALPHA:
            raise ConversionError(
                f"gpt-oss swiglu_alpha {c['swiglu_alpha']!r} is not supported (--quick-geglu's is {ALPHA})."
            )
        rope = c.get("rope_scaling") or c.get("rope_parameters")
        rope = _DEFAULT_ROPE if rope is None else {"rope_theta": c.get("rope_theta", 150000.0), **rope}
        # (hidden_act: GptOssConfig's "silu", which its experts never read)
        return super().config_from_hf({**c, "hidden_act": "silu", "rope_parameters": rope, "rope_scaling": None})

    def variant_config(self, cfg) -> dict:
        moe = {k: v for k, v in super().variant_config(cfg).items() if k != "mlp_bias"}  # (Llama's key)
        return {
            **moe,
            "attention_bias": True,
            "swiglu_alpha": ALPHA,
            "swiglu_limit": cfg.activation_func_clamp_value,
            "sliding_window": sliding_window(cfg),
            "layer_types": layer_types(cfg),
        }

    def variant_fields(self, c: dict) -> dict:
        if c.get("attention_bias", True) is not True:
            raise ConversionError(
                "gpt-oss configs with attention_bias false are not supported (its router and experts keep "
                "their biases, which --disable-bias-linear would drop too)."
            )
        limit = c.get("swiglu_limit", 7.0)
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
            raise ConversionError(f"gpt-oss swiglu_limit must be a positive number, got {limit!r}.")
        return dict(
            **self.moe_fields(c),
            **window_fields(c),
            add_bias_linear=True,
            add_qkv_bias=True,
            softmax_type="learnable",
            glu_linear_offset=1.0,
            activation_func_clamp_value=float(limit),
        )

    # ---- tensors ----

    def layer_links(self, cfg, i: int) -> list:
        sinks = same(f"layers.{i}.attn.softmax_offset", f"model.layers.{i}.self_attn.sinks")
        return super().layer_links(cfg, i) + [sinks]

    def mlp_links(self, cfg, i: int) -> list:
        ours, hf = f"layers.{i}.mlp.router", f"model.layers.{i}.mlp.router"
        return [same(f"{ours}.weight", f"{hf}.weight"), same(f"{ours}.bias", f"{hf}.bias")] + expert_links(cfg, i)

    def canonical(self, tensors: dict, cfg) -> dict:
        """The tensors as they are, once each layer's expert tensors are known to hold num_local_experts
        experts (so a config of 10^9 experts builds nothing) and none is MXFP4-quantised."""
        quantised = sorted(name for name in tensors if _QUANTISED.search(name))
        if quantised:
            raise ConversionError(
                f"the gpt-oss weights are MXFP4-quantised ({quantised[0]}); dequantise them first "
                "(transformers: Mxfp4Config(dequantize=True), then save_pretrained)."
            )
        layers = {int(m.group(1)) for m in map(_LAYER.match, tensors) if m}
        for i in sorted(layers):
            name = f"model.layers.{i}.mlp.experts.gate_up_proj"
            if name not in tensors:
                raise ConversionError(f"the Hugging Face weights lack {name}.")
        for name, t in tensors.items():
            match = _EXPERT.match(name)
            if match and match.group(2) in _EXPERT_KINDS and (t.dim() == 0 or t.shape[0] != cfg.num_experts):
                held = list(t.shape[:1])
                raise ConversionError(
                    f"config.json has {cfg.num_experts} experts (num_local_experts) but {name} holds {held}."
                )
        return tensors


ADAPTER = GptOssAdapter()

"""What the mixture-of-experts adapters share (hf/mixtral.py, hf/qwen3_moe.py, hf/qwen2_moe.py): the
experts' config.json keys, the router's semantics, which layers are MoE, and the two layouts of the
expert tensors. `MoEAdapter` goes before a Llama-like adapter in the bases and adds the experts.

**Layouts.** A checkpoint on disk keeps one tensor per expert and projection: Qwen's
`model.layers.{i}.mlp.experts.{e}.gate_proj/up_proj/down_proj.weight` and `mlp.gate.weight`,
Mixtral's `model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate, up, down) and
`block_sparse_moe.gate.weight`. transformers 5 holds the experts fused in memory,
`model.layers.{i}.mlp.experts.gate_up_proj` [E, 2f, h] (gate rows, then up) and
`mlp.experts.down_proj` [E, h, f] (Mixtral's router as `mlp.gate.weight`), and its save_pretrained
converts back, writing the per-expert layout. Both are read: `canonical` checks a fused tensor's shape
against the config and splits it per expert. An export writes the per-expert layout, as
save_pretrained does. Every expert tensor is accounted for: a MoE layer whose experts are not exactly
E, a tensor given in both layouts, or a key no link reads is an error naming it, never skipped.

**Routing.** HF's routers take the softmax over all E logits (fp32), then the top k:

    Mixtral, and Qwen with norm_topk_prob   renormalised over the k   = ours by default (softmax of the k logits)
    Qwen without norm_topk_prob             the k as they are         = --moe-router-pre-softmax

Our expert weights scale the activation before fc2, HF's the output after it: the same function, as
the experts have no biases. What HF's routers cannot say is refused on export: sigmoid scores, a
top-k scaling factor, group-limited routing, the expert bias, capacity (HF drops no token).

**MoE layers.** Qwen's decoder_sparse_step s and mlp_only_layers make layer i (0-based) MoE when
(i + 1) % s == 0 and i is not listed; ours is --moe-layer-freq (1: every layer; else a pattern). An
export writes decoder_sparse_step 1 and the dense layers as mlp_only_layers. Mixtral's are all MoE.

**The load-balancing loss.** config.json's router_aux_loss_coef is --moe-aux-loss-coeff both ways (the
recipe's coefficient, as Megatron's converters read it). transformers adds its loss only with
output_router_logits, over every layer's tokens pooled; ours is Megatron's, per layer
(--moe-router-load-balancing-type). It is a training loss only: the logits do not depend on it.
"""

from __future__ import annotations

import re

from megatron_sp.layer_options import is_moe_layer
from megatron_sp.models.hf.adapter import ConversionError, refuse_fields, same
from megatron_sp.models.hf.llama import gated_mlp_links, llama_shaped

_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
PATTERN_LIMIT = 1 << 16  # layers a decoder_sparse_step / mlp_only_layers pattern is built for at most

# what no HF MoE router here can say: {field: its flag}
ROUTER_UNSUPPORTED = {
    "moe_router_topk_scaling_factor": "--moe-router-topk-scaling-factor",
    "moe_router_num_groups": "--moe-router-num-groups (group-limited routing)",
    "moe_router_enable_expert_bias": "--moe-router-enable-expert-bias",
    "moe_expert_capacity_factor": "--moe-expert-capacity-factor (it drops no token)",
}


def moe_keys(experts: str, expert_ffn: str) -> dict:
    """The MoE config_keys of an architecture whose expert count is `experts` and expert width `expert_ffn`."""
    return {
        "num_experts": experts,
        "moe_router_topk": "num_experts_per_tok",
        "moe_ffn_hidden_size": expert_ffn,
        "moe_aux_loss_coeff": "router_aux_loss_coef",
    }


class MoEAdapter:
    """The experts of a Llama-like transformers MoE architecture (see the module docstring)."""

    experts_key = "num_experts"  # config.json's expert count
    moe = "mlp"  # the per-expert layout's module of a MoE layer ("block_sparse_moe": Mixtral's)
    projections = ("gate_proj", "up_proj", "down_proj")  # the per-expert layout's gate, up and down

    def matches(self, cfg) -> bool:
        return llama_shaped(cfg) and cfg.num_experts is not None

    def check(self, cfg) -> None:
        super().check(cfg)
        if cfg.moe_router_score_function != "softmax":
            raise ConversionError(
                f"{self.architecture} routes by softmax; --moe-router-score-function "
                f"{cfg.moe_router_score_function} cannot be expressed."
            )
        if cfg.moe_router_load_balancing_type == "sinkhorn":  # (its weights: sigmoid, or softmax over all)
            raise ConversionError(
                f"{self.architecture} routes by a softmax over the top k; --moe-router-load-balancing-type "
                "sinkhorn's weights cannot be expressed."
            )
        refuse_fields(cfg, self.architecture, ROUTER_UNSUPPORTED)
        self.check_experts(cfg)

    def check_experts(self, cfg) -> None:
        """ConversionError for the routing and layers of cfg this architecture cannot express."""

    # ---- config.json ----

    def variant_config(self, cfg) -> dict:
        return {**super().variant_config(cfg), **self.moe_config(cfg), "output_router_logits": False}

    def variant_fields(self, c: dict) -> dict:
        return {**super().variant_fields(c), **self.moe_fields(c)}

    def moe_config(self, cfg) -> dict:
        """config.json's MoE entries besides the `config_keys`."""
        return {}

    def moe_fields(self, c: dict) -> dict:
        """The GPTConfig MoE fields besides the `config_keys` ones."""
        return {}

    # ---- tensors ----

    def mlp_links(self, cfg, i: int) -> list:
        if not is_moe_layer(cfg, i + 1):
            return super().mlp_links(cfg, i)
        hf, ours = f"model.layers.{i}.{self.moe}", f"layers.{i}.mlp"
        links = [same(f"{ours}.router.weight", f"{hf}.gate.weight")]
        for e in range(cfg.num_experts):
            links += gated_mlp_links(
                f"{ours}.experts.local_experts.{e}",
                f"{hf}.experts.{e}",
                cfg.moe_ffn_hidden_size,
                names=self.projections,
            )
        return links + self.shared_expert_links(cfg, i)

    def shared_expert_links(self, cfg, i: int) -> list:
        return []

    def file_name(self, name: str) -> str:
        """The per-expert layout's name of a transformers 5 name that is no fused expert tensor."""
        return name

    def canonical(self, tensors: dict, cfg) -> dict:
        """The tensors in the per-expert layout: fused 3-D expert tensors checked and split."""
        out, origin = {}, {}
        for name, t in tensors.items():
            for part, tensor in self._per_expert(name, t, cfg).items():
                if part in out:
                    raise ConversionError(
                        f"the Hugging Face weights hold {part} twice (as {origin[part]} and {name}): one model "
                        f"in two expert layouts? Keep one."
                    )
                out[part], origin[part] = tensor, name
        self._check_expert_count(out, cfg)
        return out

    def _per_expert(self, name: str, t, cfg) -> dict:
        """{per-expert name: tensor} of one HF tensor: a fused one split, another under its file name."""
        match = _FUSED.match(name)
        if match is None:
            return {self.file_name(name): t}
        i, kind = int(match.group(1)), match.group(2)
        e, f, h = cfg.num_experts, cfg.moe_ffn_hidden_size, cfg.hidden_size
        if not (i < cfg.num_layers and is_moe_layer(cfg, i + 1)):
            raise ConversionError(
                f"the Hugging Face weights hold {name}, but config.json makes layer {i} no mixture-of-experts layer."
            )
        want = [e, 2 * f, h] if kind == "gate_up_proj" else [e, h, f]
        if list(t.shape) != want or not t.is_floating_point():
            raise ConversionError(
                f"{name} is {t.dtype} of shape {list(t.shape)} but config.json needs floating point of shape {want}."
            )
        gate, up, down = (f"model.layers.{i}.{self.moe}.experts.{{}}.{p}.weight" for p in self.projections)
        if kind == "down_proj":
            return {down.format(x): t[x] for x in range(e)}
        return {k: v for x in range(e) for k, v in ((gate.format(x), t[x, :f]), (up.format(x), t[x, f:]))}

    def _check_expert_count(self, tensors: dict, cfg) -> None:
        """Each MoE layer among the weights' holds E experts, before a model of E experts is built (a
        config of 10^9 experts builds nothing); which tensors each lacks or has too many check_tensors says."""
        expert = re.compile(rf"^model\.layers\.(\d+)\.{re.escape(self.moe)}\.experts\.(\d+)\.")
        found, layers = {}, set()
        for name in tensors:
            layer, match = _LAYER.match(name), expert.match(name)
            if layer:
                layers.add(int(layer.group(1)))
            if match:
                found.setdefault(int(match.group(1)), set()).add(int(match.group(2)))
        for i in sorted(layers):
            if i >= cfg.num_layers or not is_moe_layer(cfg, i + 1):
                continue  # (check_tensors names what a dense or missing layer holds)
            held = found.get(i, set())
            if len(held) != cfg.num_experts or max(held) >= cfg.num_experts:
                span = f" (experts {min(held)}..{max(held)})" if held else ""
                raise ConversionError(
                    f"config.json has {cfg.num_experts} experts ({self.experts_key}) but layer {i}'s weights "
                    f"hold {len(held)}{span}."
                )


def dense_layers(cfg) -> list:
    """The 0-based layers of cfg without experts (Qwen's mlp_only_layers)."""
    return [i for i in range(cfg.num_layers) if not is_moe_layer(cfg, i + 1)]


def moe_layer_freq(c: dict, name: str):
    """--moe-layer-freq of Qwen's decoder_sparse_step and mlp_only_layers: 1, or a pattern."""
    n, step, dense = c.get("num_hidden_layers"), c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []
    if not (_is_int(n, 1) and _is_int(step, 1) and isinstance(dense, list) and all(_is_int(i, 0) for i in dense)):
        raise ConversionError(
            f"{name} num_hidden_layers and decoder_sparse_step must be positive integers and mlp_only_layers "
            f"a list of layer indices, got {n!r}, {step!r} and {dense!r}."
        )
    if step == 1 and not dense:
        return 1
    if n > PATTERN_LIMIT:
        raise ConversionError(f"{name} num_hidden_layers {n} is more than the {PATTERN_LIMIT} layers read here.")
    return [int((i + 1) % step == 0 and i not in dense) for i in range(n)]


def _is_int(v, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least

"""GPTConfig's mixture-of-experts fields (Megatron-LM's names, defaults and meanings) and their checks.

`MoEFields` is a keyword-only dataclass GPTConfig inherits from, so the fields are GPTConfig's like any
other (flags, resume rules and docs derive from them, megatron_sp/fields.py); they live here to keep
config.py one concept. Megatron-LM's MoE reference: megatron/core/transformer/moe/ and
transformer_config.py (`num_moe_experts` is `--num-experts`, here `num_experts`).

This module imports nothing of megatron_sp above fields.py and layer_options.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_sp.fields import ALWAYS, Switch, model_field
from megatron_sp.layer_options import format_layer_freq, is_moe_layer, moe_layer_freq_type

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none", "sinkhorn")
DROP_POLICIES = ("probs", "position")
ROUTER_DTYPES = ("fp32", "fp64")
DISPATCHERS = ("allgather", "alltoall", "flex")
_MOE = "mixture of experts"
_PARALLEL = "parallelism"


@dataclass(frozen=True, kw_only=True)
class MoEFields:
    """The MoE part of GPTConfig (None experts: a dense model; every other field then unused)."""

    num_experts: Optional[int] = model_field(
        None, help="experts per MoE layer (None: dense MLPs)", flags=("--num-experts",), resume=ALWAYS, group=_MOE
    )
    moe_layer_freq: int | tuple = model_field(
        1,
        help="which layers are MoE: N makes layers 1, N+1, 2N+1 ... MoE, a pattern such as '([1]*3+[0])*2' "
        "chooses per layer (1 MoE)",
        flags=("--moe-layer-freq",),
        parse=moe_layer_freq_type,
        format=format_layer_freq,
        resume=ALWAYS,
        group=_MOE,
    )
    moe_ffn_hidden_size: Optional[int] = model_field(
        None,
        help="each expert's MLP width; default ffn_hidden_size",
        flags=("--moe-ffn-hidden-size",),
        resume=ALWAYS,
        group=_MOE,
    )
    moe_router_topk: int = model_field(
        2, help="experts each token is routed to", flags=("--moe-router-topk",), resume=ALWAYS, group=_MOE
    )
    moe_router_score_function: str = model_field(
        "softmax",
        help="router scores: softmax or sigmoid (DeepSeek-V3's, renormalised over the chosen k)",
        flags=("--moe-router-score-function",),
        choices=SCORE_FUNCTIONS,
        resume=ALWAYS,
        group=_MOE,
    )
    moe_router_pre_softmax: bool = model_field(
        False,
        help="softmax over all experts before the top-k (default: top-k logits, then softmax over k)",
        switches=(Switch("--moe-router-pre-softmax", True),),
        resume=ALWAYS,
        group=_MOE,
    )
    moe_router_topk_scaling_factor: Optional[float] = model_field(
        None,
        help="multiplies the chosen experts' probabilities",
        flags=("--moe-router-topk-scaling-factor",),
        resume=ALWAYS,
        group=_MOE,
    )
    moe_router_num_groups: Optional[int] = model_field(
        None,
        help="group-limited routing: experts in this many equal groups",
        flags=("--moe-router-num-groups",),
        resume=ALWAYS,
        group=_MOE,
    )
    moe_router_group_topk: Optional[int] = model_field(
        None,
        help="group-limited routing: groups chosen per token (by their top-(k/groups) scores' sum)",
        flags=("--moe-router-group-topk",),
        resume=ALWAYS,
        group=_MOE,
    )
    moe_router_dtype: Optional[str] = model_field(
        None,
        help="the router's logits and probabilities in fp32 or fp64 (default: the activations' dtype)",
        flags=("--moe-router-dtype",),
        choices=ROUTER_DTYPES,
        group=_MOE,
    )
    moe_input_jitter_eps: Optional[float] = model_field(
        None, help="refused: router input jitter draws rank-local noise", flags=("--moe-input-jitter-eps",), group=_MOE
    )
    moe_router_load_balancing_type: str = model_field(
        "aux_loss",
        help="aux_loss (GShard/Switch, over the micro-batch), seq_aux_loss (per sample), global_aux_loss (over "
        "the global batch), sinkhorn (balanced assignment, no loss) or none",
        flags=("--moe-router-load-balancing-type",),
        choices=LOAD_BALANCING_TYPES,
        resume=ALWAYS,
        group=_MOE,
    )
    moe_aux_loss_coeff: float = model_field(
        0.0,
        help="coefficient of the load-balancing loss",
        flags=("--moe-aux-loss-coeff",),
        group=_MOE,
        describes_model=True,  # a Hugging Face config.json's router_aux_loss_coef: the printed flags carry it
    )
    moe_z_loss_coeff: Optional[float] = model_field(
        None, help="coefficient of the router z-loss (ST-MoE)", flags=("--moe-z-loss-coeff",), group=_MOE
    )
    moe_router_enable_expert_bias: bool = model_field(
        False,
        help="aux-loss-free balancing: a per-expert bias added to the scores for the choice only, moved by "
        "--moe-router-bias-update-rate towards even loads after each step (needs sigmoid scores)",
        switches=(Switch("--moe-router-enable-expert-bias", True),),
        resume=ALWAYS,
        group=_MOE,
    )
    moe_router_bias_update_rate: float = model_field(
        1e-3, help="the expert bias's step per iteration", flags=("--moe-router-bias-update-rate",), group=_MOE
    )
    moe_grouped_gemm: bool = model_field(
        False,
        help="the experts' GEMMs as one torch._grouped_mm (the same numbers as the per-expert loop)",
        switches=(Switch("--moe-grouped-gemm", True),),
        group=_MOE,
    )
    moe_shared_expert_intermediate_size: Optional[int] = model_field(
        None,
        help="width of the shared expert every token goes through (None: no shared expert)",
        flags=("--moe-shared-expert-intermediate-size",),
        resume=ALWAYS,
        group=_MOE,
    )
    moe_shared_expert_gate: bool = model_field(
        False,
        help="scale the shared expert's output by sigmoid(x · w), w [1, h] learnt (Qwen2-MoE's shared_expert_gate)",
        switches=(Switch("--moe-shared-expert-gate", True),),
        resume=ALWAYS,
        group=_MOE,
    )
    moe_expert_capacity_factor: Optional[float] = model_field(
        None,
        help="each expert takes at most ceil(s · topk / experts · factor) tokens of each sample (None: no drops)",
        flags=("--moe-expert-capacity-factor",),
        group=_MOE,
    )
    moe_pad_expert_input_to_capacity: bool = model_field(
        False,
        help="every expert takes exactly its capacity of tokens (the unrouted ones with probability 0)",
        switches=(Switch("--moe-pad-expert-input-to-capacity", True),),
        group=_MOE,
    )
    moe_token_drop_policy: str = model_field(
        "probs",
        help="past capacity, keep an expert's highest-probability tokens (probs) or its earliest (position)",
        flags=("--moe-token-drop-policy",),
        choices=DROP_POLICIES,
        group=_MOE,
    )
    moe_token_dispatcher_type: str = model_field(
        "allgather",
        help="expert parallelism's token exchange: allgather or alltoall (flex needs DeepEP: refused)",
        flags=("--moe-token-dispatcher-type",),
        choices=DISPATCHERS,
        group=_PARALLEL,
    )
    expert_model_parallel_size: int = model_field(
        1,
        help="EP size: the experts split over this many ranks of the DP×CP×TP ranks of a stage",
        flags=("--expert-model-parallel-size",),
        group=_PARALLEL,
    )
    expert_tensor_parallel_size: Optional[int] = model_field(
        None,
        help="each expert's weights split this many ways (default the TP size)",
        flags=("--expert-tensor-parallel-size",),
        group=_PARALLEL,
    )

    def num_moe_layers(self) -> int:
        return sum(is_moe_layer(self, layer) for layer in range(1, self.num_layers + 1))


def fill_moe_defaults(cfg) -> None:
    """moe_ffn_hidden_size and expert_tensor_parallel_size's defaults (Megatron's)."""
    if cfg.num_experts is not None and cfg.moe_ffn_hidden_size is None:
        cfg._set("moe_ffn_hidden_size", cfg.ffn_hidden_size)
    if cfg.expert_tensor_parallel_size is None:
        cfg._set("expert_tensor_parallel_size", cfg.tensor_model_parallel_size)


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_moe(cfg) -> None:
    """The MoE fields' refusals, one sentence each, before any work."""
    if cfg.num_experts is None:
        _check_dense(cfg)
        return
    e, k = cfg.num_experts, cfg.moe_router_topk
    for name in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size"):
        if not _positive(getattr(cfg, name)):
            raise ValueError(f"GPTConfig.{name} must be a positive integer, got {getattr(cfg, name)!r}.")
    if k > e:
        raise ValueError(f"GPTConfig.moe_router_topk ({k}) must not exceed num_experts ({e}).")
    _check_layer_freq(cfg)
    _check_router(cfg, e, k)
    _check_capacity(cfg)
    _check_shared_expert(cfg)
    _check_expert_layout(cfg, e)


def _check_dense(cfg):
    """MoE options without experts are refused rather than ignored."""
    defaults = MoEFields.__dataclass_fields__
    for name in (
        "moe_expert_capacity_factor",
        "moe_shared_expert_intermediate_size",
        "moe_shared_expert_gate",
        "moe_router_num_groups",
    ):
        if getattr(cfg, name) != defaults[name].default:
            raise ValueError(f"GPTConfig.{name} is a mixture-of-experts option: it needs num_experts.")
    if cfg.expert_model_parallel_size != 1:
        raise ValueError("GPTConfig.expert_model_parallel_size > 1 needs num_experts (a mixture of experts).")


def _check_layer_freq(cfg):
    freq, n = cfg.moe_layer_freq, cfg.num_layers
    if isinstance(freq, int):
        if not _positive(freq):
            raise ValueError(f"GPTConfig.moe_layer_freq must be a positive integer or a pattern, got {freq!r}.")
    elif len(freq) != n or any(v not in (0, 1) for v in freq):
        raise ValueError(f"GPTConfig.moe_layer_freq must give 0 or 1 for each of the {n} layers, got {list(freq)}.")


def _check_router(cfg, e, k):
    if cfg.moe_router_load_balancing_type == "sinkhorn":
        if cfg.moe_aux_loss_coeff:
            raise ValueError(
                "GPTConfig.moe_router_load_balancing_type sinkhorn balances the load itself: moe_aux_loss_coeff "
                "must be 0 (as in Megatron-LM)."
            )
        if (
            cfg.moe_router_score_function != "softmax"
            or cfg.moe_router_pre_softmax
            or cfg.moe_router_topk_scaling_factor
            or cfg.moe_router_num_groups
        ):
            raise ValueError(
                "GPTConfig.moe_router_load_balancing_type sinkhorn chooses and weighs the experts itself (Megatron-LM "
                "ignores the others): leave moe_router_score_function, moe_router_pre_softmax, "
                "moe_router_topk_scaling_factor and moe_router_num_groups at their defaults."
            )
    if cfg.moe_input_jitter_eps is not None:
        raise ValueError(
            "GPTConfig.moe_input_jitter_eps is not implemented (its noise would differ between layouts); "
            "leave it unset."
        )
    groups, group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ValueError("GPTConfig.moe_router_num_groups and moe_router_group_topk go together: give both or neither.")
    if groups is not None:
        if not (_positive(groups) and _positive(group_topk)) or e % groups or group_topk > groups or k % group_topk:
            raise ValueError(
                f"group-limited routing needs num_experts ({e}) divisible by moe_router_num_groups ({groups}), "
                f"moe_router_group_topk ({group_topk}) at most the groups and dividing moe_router_topk ({k})."
            )
        if k // group_topk > e // groups:
            raise ValueError(
                f"group-limited routing takes moe_router_topk / moe_router_group_topk = {k // group_topk} experts "
                f"of each chosen group, more than the {e // groups} a group has."
            )
    if cfg.moe_router_enable_expert_bias and cfg.moe_router_score_function != "sigmoid":
        raise ValueError(
            "GPTConfig.moe_router_enable_expert_bias needs moe_router_score_function sigmoid (Megatron's)."
        )
    if cfg.moe_aux_loss_coeff < 0 or (cfg.moe_z_loss_coeff is not None and cfg.moe_z_loss_coeff < 0):
        raise ValueError("GPTConfig.moe_aux_loss_coeff and moe_z_loss_coeff must be >= 0.")


def _check_capacity(cfg):
    factor = cfg.moe_expert_capacity_factor
    if factor is None:
        if cfg.moe_pad_expert_input_to_capacity or cfg.moe_token_drop_policy != "probs":
            raise ValueError(
                "GPTConfig.moe_pad_expert_input_to_capacity and moe_token_drop_policy need moe_expert_capacity_factor."
            )
        return
    if not factor > 0:
        raise ValueError(f"GPTConfig.moe_expert_capacity_factor must be positive, got {factor}.")


def _check_shared_expert(cfg):
    if not cfg.moe_shared_expert_gate:
        return
    if not cfg.moe_shared_expert_intermediate_size:
        raise ValueError(
            "GPTConfig.moe_shared_expert_gate gates the shared expert: it needs moe_shared_expert_intermediate_size."
        )
    if cfg.add_bias_linear:  # the gate would not scale fc2's bias, which is added after the layer
        raise ValueError(
            "GPTConfig.moe_shared_expert_gate needs a shared expert without biases (Megatron's); "
            "use --disable-bias-linear."
        )


def _check_expert_layout(cfg, e):
    ep, etp, tp = cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size, cfg.tensor_model_parallel_size
    if not (_positive(ep) and _positive(etp)):
        raise ValueError("GPTConfig.expert_model_parallel_size and expert_tensor_parallel_size must be positive.")
    if e % ep:
        raise ValueError(f"GPTConfig.num_experts ({e}) must be divisible by expert_model_parallel_size ({ep}).")
    f = cfg.moe_ffn_hidden_size
    if f % etp or (cfg.moe_shared_expert_intermediate_size or tp) % tp:
        raise ValueError(
            f"GPTConfig.moe_ffn_hidden_size ({f}) must be divisible by expert_tensor_parallel_size ({etp}), and "
            f"the shared expert's size by tensor_model_parallel_size ({tp})."
        )
    if etp > 1 and cfg.add_bias_linear:
        raise ValueError(
            "expert biases need expert_tensor_parallel_size 1 (fc2's bias would be added on every expert-TP "
            "rank); use --disable-bias-linear or expert-TP 1."
        )
    if tp > 1 and not cfg.sequence_parallel:
        raise ValueError("mixture of experts with tensor_model_parallel_size > 1 needs sequence_parallel (Megatron's).")
    if cfg.moe_token_dispatcher_type == "flex":
        raise ValueError(
            "GPTConfig.moe_token_dispatcher_type flex needs DeepEP (CUDA only), which megatron_sp does not use; "
            "use alltoall or allgather."
        )

"""A Megatron-LM GPT model <-> ours: its config from the checkpoint's `args`, its tensors to
ReferenceGPT's keys and back (docs/checkpoints.md has the table).

    config_fields(args, path)          GPTConfig fields of a checkpoint's args (a refusal names the option)
    merge_tp(name, shards, qkv_groups) a legacy tensor's TP shards -> the whole tensor (mcore layout)
    split_tp(name, tensor, tp)         the whole tensor -> the TP shards of the legacy format
    to_ours(mcore, cfg, path)          {mcore name: whole tensor} -> ReferenceGPT state; every tensor used
    from_ours(state, cfg, padded)      ReferenceGPT state -> {mcore name: whole tensor}

Layouts undone (mcore's on the left):
    linear_qkv   per query group g: [q heads of g; k_g; v_g]  ->  ours [all q; all k; all v]
    linear_fc1   SwiGLU [gate; up] whole, but [gate_r; up_r] on each TP rank of the legacy format
    vocab        embedding / output rows padded to args.padded_vocab_size -> cfg.vocab_size rows
    tied output  no output_layer (or its copy on the last pipeline stage, which must equal the embedding)
"""

from __future__ import annotations

import re

import torch

from megatron_sp.checkpointing.paths import CheckpointError

# mcore layer module -> ours (the local spec's names; torch_dist's TE norm names are renamed on reading)
_LAYER = {
    "input_layernorm": "ln1",
    "self_attention.linear_qkv": "attn.qkv",
    "self_attention.linear_proj": "attn.proj",
    "self_attention.q_layernorm": "attn.q_norm",
    "self_attention.k_layernorm": "attn.k_norm",
    "pre_mlp_layernorm": "ln2",
    "mlp.linear_fc1": "mlp.fc1",
    "mlp.linear_fc2": "mlp.fc2",
    "self_attention.core_attention": "attn",  # softmax_offset: --softmax-type learnable's per-head logits
    "mlp.router": "mlp.router",  # weight [E, h]; the expert_bias buffer [E]
    "mlp.shared_experts": "mlp.shared_experts",  # gate_weight [1, h]
    "mlp.shared_experts.linear_fc1": "mlp.shared_experts.fc1",
    "mlp.shared_experts.linear_fc2": "mlp.shared_experts.fc2",
}
# an expert's MLP: mcore's local_experts.{e}.linear_fc1/2, numbered globally here (the readers renumber
# each EP rank's local experts and unstack torch_dist's [L, E, ...] entries)
_OUR_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.fc([12])$")
_TOP = {
    "embedding.word_embeddings": "embedding.word_embeddings",
    "embedding.position_embeddings": "embedding.position_embeddings",
    "decoder.final_layernorm": "final_ln",
    "output_layer": "output_layer",
}
_COLUMN = ("linear_qkv.", "linear_fc1.", "word_embeddings.weight", "output_layer.weight", "softmax_offset")  # on rows
_ROW = ("linear_proj.weight", "linear_fc2.weight")  # split on columns

# args Megatron-LM sets for options we do not have: refused when truthy (one sentence naming the flag)
_UNSUPPORTED = (
    "multi_latent_attention",
    "moe_apply_probs_on_input",
    "moe_latent_size",
    "moe_router_force_load_balancing",
    "moe_use_legacy_grouped_gemm",
    "mtp_num_layers",
    "rotary_interleaved",
    "qk_l2_norm",
    "attention_output_gate",
    "hybrid_override_pattern",
    "heterogeneous_layers_config_path",
    "quick_geglu",
    "no_rope_freq",
    "apply_residual_connection_post_layernorm",
    "yarn_original_max_position_embeddings",
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_args(get, path: str) -> None:
    """Options megatron_sp does not support, and the sizes a GPT checkpoint's args must hold."""
    for name in _UNSUPPORTED:
        if get(name):
            raise CheckpointError(f"{path} was trained with {_flag(name)}, which megatron_sp does not support.")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "padded_vocab_size"):
        if not isinstance(get(name), int):
            raise CheckpointError(f"{path} has no {name} in its args: not a GPT checkpoint of Megatron-LM.")


def _block_fields(get, path: str) -> dict:
    """The block's options from the args: positions, norms, activation, biases, dropout."""
    return dict(
        position_embedding_type=_positions(get, path),
        rotary_base=float(get("rotary_base", 10000)),
        rotary_percent=float(get("rotary_percent", 1.0)),
        rotary_seq_len_interpolation_factor=get("rotary_seq_len_interpolation_factor"),
        rope_scaling=bool(get("use_rope_scaling")),
        rope_scaling_factor=float(get("rope_scaling_factor", 8.0)),
        normalization=get("normalization") or "LayerNorm",
        layernorm_epsilon=float(_either(get, "layernorm_epsilon", "norm_epsilon", 1e-5)),
        layernorm_zero_centered_gamma=bool(_either(get, "layernorm_zero_centered_gamma", "apply_layernorm_1p", False)),
        activation=_activation(get),
        qk_layernorm=bool(get("qk_layernorm")),
        untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights")),
        add_bias_linear=bool(get("add_bias_linear", True)),
        add_qkv_bias=bool(get("add_qkv_bias") or get("add_bias_linear", True)),
        hidden_dropout=float(get("hidden_dropout", 0.1)),
        attention_dropout=float(get("attention_dropout", 0.1)),
    )


def config_fields(args, path: str, vocab_size=None) -> dict:
    """The GPTConfig fields of a Megatron-LM checkpoint's args (older and newer names both read)."""
    if args is None:
        raise CheckpointError(f"{path} holds no args: it was not written by Megatron-LM's save_checkpoint.")
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    _check_args(get, path)
    heads = get("num_attention_heads")
    fields = dict(
        num_layers=get("num_layers"),
        hidden_size=get("hidden_size"),
        num_attention_heads=heads,
        vocab_size=vocab_size or get("padded_vocab_size"),
        seq_length=get("seq_length") or get("max_position_embeddings"),
        max_position_embeddings=get("max_position_embeddings") or get("seq_length"),
        ffn_hidden_size=get("ffn_hidden_size"),
        kv_channels=get("kv_channels") or get("hidden_size") // heads,
        num_query_groups=get("num_query_groups") if get("group_query_attention") else heads,
        **_block_fields(get, path),
        init_method_std=float(get("init_method_std", 0.02)),
        seed=int(get("seed", 1234)),
        make_vocab_size_divisible_by=int(get("make_vocab_size_divisible_by", 128)),
    )
    if get("window_size"):
        skip = get("window_attn_skip_freq")
        fields.update(window_size=tuple(get("window_size")), window_attn_skip_freq=_freq(skip))
    if get("softmax_type") not in (None, "vanilla"):
        fields["softmax_type"] = get("softmax_type")
    if get("num_experts"):
        fields.update(_moe_fields(get, path))
    fields["model"] = _family(fields)
    return fields


# Megatron-LM's MoE args read as GPTConfig's fields of the same names (moe_config.py; defaults Megatron's)
_MOE_ARGS = (
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_dtype",
    "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate",
    "moe_z_loss_coeff",
    "moe_grouped_gemm",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity",
    "moe_token_drop_policy",
)


def _moe_fields(get, path: str) -> dict:
    """The MoE fields of a Megatron-LM run's args (--num-experts and the --moe-* flags)."""
    if get("add_bias_linear", True):
        raise CheckpointError(
            f"{path} is a mixture of experts with biases (no --disable-bias-linear): megatron-core's router then "
            f"has a bias, which megatron_sp's router does not have."
        )
    out = {name: get(name) for name in _MOE_ARGS if get(name) is not None}
    out.update(num_experts=get("num_experts"), moe_layer_freq=_freq(get("moe_layer_freq", 1)))
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):  # a str / float, or one per layer type
        value = get(name)
        if isinstance(value, (list, tuple)):
            if len(value) != 1:
                raise CheckpointError(f"{path} was trained with several {_flag(name)} at once: not supported.")
            value = value[0]
        if value is not None:
            out[name] = value
    return out


def _freq(value):
    """--moe-layer-freq / --window-attn-skip-freq: an int, or Megatron-LM's list -> GPTConfig's tuple."""
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _either(get, new: str, old: str, default):
    value = get(new)
    return value if value is not None else (get(old) if get(old) is not None else default)


def _positions(get, path: str) -> str:
    kind = get("position_embedding_type") or ("rope" if get("use_rotary_position_embeddings") else "learned_absolute")
    if get("add_position_embedding") is False and kind == "learned_absolute":
        kind = "none"
    if kind not in ("learned_absolute", "rope", "none"):
        raise CheckpointError(f"{path} was trained with --position-embedding-type {kind}: not supported.")
    return kind


def _activation(get) -> str:
    if get("swiglu"):
        return "swiglu"
    if get("squared_relu"):
        return "squared_relu"
    return "openai_gelu" if get("openai_gelu") else "gelu"


def _family(fields: dict) -> str:
    """The family whose defaults describe the model best (all fields are set explicitly anyway)."""
    llama = (fields["normalization"], fields["activation"], fields["position_embedding_type"])
    return "llama" if llama == ("RMSNorm", "swiglu", "rope") else "gpt2"


# ---- TP shards of the legacy format ---------------------------------------------------------------


def _split_dim(name: str):
    if name.endswith(_ROW):
        return 1
    if any(part in name for part in _COLUMN):
        return 0
    return None


def _swiglu(name: str, cfg) -> bool:
    return "linear_fc1." in name and cfg.activation == "swiglu"


def merge_tp(name: str, shards: list, cfg, path: str) -> torch.Tensor:
    """A legacy tensor's TP shards -> the whole tensor in torch_dist's (mcore's) layout."""
    dim = _split_dim(name)
    if dim is None:
        if any(not torch.equal(s, shards[0]) for s in shards[1:]):
            raise CheckpointError(f"{path} holds {name} differently on its tensor-parallel ranks.")
        return shards[0]
    if _swiglu(name, cfg):  # each rank [gate_r; up_r] -> [gate; up]
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=dim)


def split_tp(name: str, tensor: torch.Tensor, tp: int, cfg) -> list:
    """The whole tensor -> the TP shards of the legacy format (merge_tp's inverse)."""
    dim = _split_dim(name)
    if dim is None:
        return [tensor] * tp
    if _swiglu(name, cfg):
        gate, up = tensor.chunk(2, dim=0)
        return [torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp))]
    return list(tensor.chunk(tp, dim=dim))


# ---- the tensors ---------------------------------------------------------------------------------


def _qkv_shape(cfg) -> tuple:
    """(groups, query heads per group, head dim)."""
    groups = cfg.num_query_groups
    return groups, cfg.num_attention_heads // groups, cfg.kv_channels


def deinterleave_qkv(t: torch.Tensor, cfg) -> torch.Tensor:
    """mcore's [g: q_g; k_g; v_g] rows -> ours [q; k; v]."""
    g, per, d = _qkv_shape(cfg)
    grouped = t.reshape(g, per + 2, d, *t.shape[1:])  # [g, per + 2, d, (h)]
    q = grouped[:, :per].reshape(g * per * d, *t.shape[1:])
    return torch.cat(
        [q, grouped[:, per].reshape(g * d, *t.shape[1:]), grouped[:, per + 1].reshape(g * d, *t.shape[1:])]
    )


def interleave_qkv(t: torch.Tensor, cfg) -> torch.Tensor:
    """ours [q; k; v] -> mcore's [g: q_g; k_g; v_g]."""
    g, per, d = _qkv_shape(cfg)
    rest = t.shape[1:]
    q, k, v = t.split([g * per * d, g * d, g * d])
    grouped = torch.cat([q.reshape(g, per, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1)
    return grouped.reshape(t.shape)


def _mcore_names(cfg) -> dict:
    """{our name: mcore name} of every tensor of a ReferenceGPT of cfg (the expert biases' buffers too)."""
    inverse = {v: k for k, v in _LAYER.items()}
    top = {v: k for k, v in _TOP.items()}
    out = {}
    for name in _shapes(cfg):
        module, _, kind = name.rpartition(".")
        if name.startswith("layers."):
            _, index, local = module.split(".", 2)
            expert = _OUR_EXPERT.match(local)
            mcore = f"mlp.experts.local_experts.{expert[1]}.linear_fc{expert[2]}" if expert else inverse[local]
            out[name] = f"decoder.layers.{index}.{mcore}.{kind}"
        else:
            out[name] = f"{top[module]}.{kind}"
    return out


_EXTRA_STATE_OF = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")


def check_objects(names, path: str) -> None:
    """The non-tensor entries: each an `_extra_state` of a linear layer (Transformer Engine's FP8
    scaling state, None for the local spec), which a model in megatron_sp's precisions does not use."""
    for name in sorted(names):
        module = name.rpartition("._extra_state")[0].rpartition(".")[2]
        if not name.endswith("._extra_state") or module not in _EXTRA_STATE_OF:
            raise CheckpointError(f"{path} holds the object {name}, which a model of its args has no place for.")


def to_ours(mcore: dict, cfg, padded_vocab: int, path: str, parameters_only: bool = False) -> dict:
    """{mcore name: whole tensor} -> ReferenceGPT state of cfg; every tensor used, every one present.
    parameters_only: the parameters' tensors, without the buffers (an optimizer's state)."""
    wanted = _mcore_names(cfg)
    if parameters_only:
        wanted = {ours: name for ours, name in wanted.items() if not ours.endswith(".expert_bias")}
    tied_copy = mcore.get("output_layer.weight") if not cfg.untie_embeddings_and_output_weights else None
    if tied_copy is not None and not torch.equal(tied_copy, mcore.get("embedding.word_embeddings.weight", tied_copy)):
        raise CheckpointError(
            f"{path} ties the output layer to the embedding but holds a different output_layer.weight."
        )
    used = set(wanted.values()) | ({"output_layer.weight"} if tied_copy is not None else set())
    extra = sorted(set(mcore) - used)
    if extra:
        raise CheckpointError(f"{path} holds {extra[0]}, which a model of its args has no place for.")
    shapes = _shapes(cfg)
    state = {}
    for ours, name in sorted(wanted.items()):
        if name not in mcore:
            raise CheckpointError(f"{path} lacks {name}, which its args' model needs.")
        state[ours] = _tensor_to_ours(name, mcore[name], cfg, padded_vocab, path)
        if tuple(state[ours].shape) != shapes[ours]:
            raise CheckpointError(
                f"{path} holds {name} of shape {list(mcore[name].shape)}, which does not match its args "
                f"(a model of them needs {list(shapes[ours])} in megatron_sp's layout)."
            )
    return state


def _shapes(cfg) -> dict:
    from megatron_sp.checkpointing.full_state import _meta_model
    from megatron_sp.checkpointing.states import kept_buffers

    model = _meta_model(cfg)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return shapes | {name: tuple(b.shape) for name, b in kept_buffers(model)}


def _tensor_to_ours(name: str, t: torch.Tensor, cfg, padded_vocab: int, path: str) -> torch.Tensor:
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if t.shape[0] != padded_vocab or padded_vocab < cfg.vocab_size:
            raise CheckpointError(
                f"{path} holds {name} of {t.shape[0]} rows but its args pad the vocab to {padded_vocab}."
            )
        t = t[: cfg.vocab_size]
    elif ".linear_qkv." in name:
        t = deinterleave_qkv(t, cfg) if t.shape[0] == _qkv_rows(cfg) else t  # a wrong size: the shape check names it
    return t.float() if t.dtype != torch.float32 else t


def _qkv_rows(cfg) -> int:
    return (cfg.num_attention_heads + 2 * cfg.num_query_groups) * cfg.kv_channels


def from_ours(state: dict, cfg, padded_vocab: int) -> dict:
    """ReferenceGPT state -> {mcore name: whole tensor} (vocab rows padded with zeros)."""
    out = {}
    for ours, name in _mcore_names(cfg).items():
        t = state[ours]
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
        elif ".linear_qkv." in name:
            t = interleave_qkv(t, cfg)
        out[name] = t.contiguous()
    return out

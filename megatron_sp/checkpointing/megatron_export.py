"""A whole model of ours -> a checkpoint directory Megatron-LM loads (--ckpt-format torch or
torch_dist, at a chosen TP/PP), model only (Megatron-LM then needs --no-load-optim --no-load-rng).

    write_megatron(state, cfg, save, fmt, tp, pp, iteration=0, consumed=0, ep=1)

torch_dist is written with plain torch.distributed.checkpoint under megatron-core's names and
layouts (layers stacked on a leading axis, experts on a second one, an entry only some layers have
(MoE and dense layers mixed) as one DCP chunk per layer, Transformer Engine's fused norm names, one
`_extra_state` object per layer and linear layer), plus common.pt (args, iteration,
checkpoint_version) and metadata.json, as megatron-core 0.16 writes them; torch writes
mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt, each EP rank its experts numbered from 0.
An MoE layer's pre-MLP norm goes under both the local spec's name (mlp.linear_fc1.layer_norm_*) and
the Transformer Engine spec's (pre_mlp_layernorm.*), so either spec loads it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import warnings

import torch

from megatron_sp.checkpointing import files
from megatron_sp.checkpointing.megatron_files import RANK_FILE, TRACKER
from megatron_sp.checkpointing.megatron_model import from_ours, split_tp
from megatron_sp.checkpointing.paths import CheckpointError

CHECKPOINT_VERSION = 3.0
_DIST_CONFIG = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
_MOE_LINEARS = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_TE_NORM = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}


def padded_vocab(cfg, tp: int) -> int:
    """Megatron-LM's padded_vocab_size at TP size tp."""
    multiple = cfg.make_vocab_size_divisible_by * tp
    return -(-cfg.vocab_size // multiple) * multiple


def megatron_args(cfg, fmt: str, tp: int, pp: int, iteration: int, consumed: int, ep: int = 1) -> argparse.Namespace:
    """The args Megatron-LM reads back from a checkpoint (both the older and newer norm names)."""
    args = argparse.Namespace(
        **_shape_args(cfg, tp),
        **_block_args(cfg),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        params_dtype=torch.float32,
        ckpt_format=fmt,
        iteration=iteration,
        consumed_train_samples=consumed,
        seed=cfg.seed,
        init_method_std=cfg.init_method_std,
        num_experts=cfg.num_experts,
    )
    if cfg.num_experts:
        vars(args).update(_moe_args(cfg, tp))
    return args


def _shape_args(cfg, tp: int) -> dict:
    """Sizes: layers, widths, heads, positions, vocabulary (padded as Megatron-LM pads it at TP tp)."""
    return dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        kv_channels=cfg.kv_channels,
        group_query_attention=cfg.num_query_groups != cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        max_position_embeddings=cfg.max_position_embeddings,
        seq_length=cfg.seq_length,
        vocab_size=cfg.vocab_size,
        padded_vocab_size=padded_vocab(cfg, tp),
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
    )


def _block_args(cfg) -> dict:
    """The block's options: positions, norms, activation, biases, dropout, attention windows."""
    return dict(
        position_embedding_type=cfg.position_embedding_type,
        add_position_embedding=cfg.position_embedding_type == "learned_absolute",
        rotary_base=int(cfg.rotary_base) if float(cfg.rotary_base).is_integer() else cfg.rotary_base,
        rotary_percent=cfg.rotary_percent,
        rotary_seq_len_interpolation_factor=cfg.rotary_seq_len_interpolation_factor,
        use_rope_scaling=cfg.rope_scaling,
        rope_scaling_factor=cfg.rope_scaling_factor,
        normalization=cfg.normalization,
        layernorm_epsilon=cfg.layernorm_epsilon,
        norm_epsilon=cfg.layernorm_epsilon,
        layernorm_zero_centered_gamma=cfg.layernorm_zero_centered_gamma,
        apply_layernorm_1p=cfg.layernorm_zero_centered_gamma,
        swiglu=cfg.activation == "swiglu",
        squared_relu=cfg.activation == "squared_relu",
        openai_gelu=cfg.activation == "openai_gelu",
        qk_layernorm=bool(cfg.qk_layernorm),
        untie_embeddings_and_output_weights=bool(cfg.untie_embeddings_and_output_weights),
        add_bias_linear=bool(cfg.add_bias_linear),
        add_qkv_bias=bool(cfg.add_qkv_bias),
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        window_size=cfg.window_size,
        window_attn_skip_freq=cfg.window_attn_skip_freq,
        softmax_type=cfg.softmax_type,
    )


def _moe_args(cfg, tp: int) -> dict:
    from megatron_sp.checkpointing.megatron_model import _MOE_ARGS

    moe = {name: getattr(cfg, name) for name in _MOE_ARGS}
    freq = cfg.moe_layer_freq
    moe.update(moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq, expert_tensor_parallel_size=tp)
    moe.update(moe_router_load_balancing_type=cfg.moe_router_load_balancing_type)
    moe.update(moe_aux_loss_coeff=cfg.moe_aux_loss_coeff)
    return moe


def _check(cfg, tp: int, pp: int, ep: int) -> None:
    if cfg.num_layers % pp:
        raise CheckpointError(
            f"--pipeline-model-parallel-size {pp} does not divide the model's {cfg.num_layers} layers."
        )
    for what, n in (("query groups", cfg.num_query_groups), ("FFN width", cfg.ffn_hidden_size)):
        if n % tp:
            raise CheckpointError(f"--tensor-model-parallel-size {tp} does not divide the model's {n} {what}.")
    if ep != 1 and (not cfg.num_experts or cfg.num_experts % ep):
        raise CheckpointError(
            f"--expert-model-parallel-size {ep} needs a mixture of experts whose number of experts it divides "
            f"(the model has {cfg.num_experts})."
        )
    if cfg.num_experts and cfg.add_bias_linear:
        raise CheckpointError(
            "a mixture of experts with biases cannot be exported: megatron-core's router then has a bias, "
            "which megatron_sp's router does not have (train with --disable-bias-linear)."
        )
    if cfg.num_experts and cfg.moe_shared_expert_intermediate_size and cfg.moe_shared_expert_intermediate_size % tp:
        raise CheckpointError(f"--tensor-model-parallel-size {tp} does not divide the model's shared expert.")


def write_megatron(
    state: dict, cfg, save: str, fmt: str, tp: int, pp: int, iteration: int = 0, consumed: int = 0, ep: int = 1
):
    """Writes iter_NNNNNNN of `save` (a new directory) and its tracker; returns the iteration dir."""
    _check(cfg, tp, pp, ep)
    if os.path.lexists(os.path.join(save, TRACKER)):
        raise CheckpointError(f"--save {save} already holds a Megatron-LM checkpoint ({TRACKER}); choose a new one.")
    mcore = from_ours(state, cfg, padded_vocab(cfg, tp))
    args = megatron_args(cfg, fmt, tp, pp, iteration, consumed, ep)
    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    path = os.path.join(save, f"iter_{iteration:07d}")
    os.makedirs(path, exist_ok=False)
    if fmt == "torch_dist":
        _write_dist(mcore, cfg, common, path)
    else:
        _write_legacy(mcore, cfg, common, path, tp, pp, ep)
    files.write_atomic(os.path.join(save, TRACKER), str(iteration).encode())
    return path


def _write_dist(mcore: dict, cfg, common: dict, path: str) -> None:
    layers, per_layer = cfg.num_layers, _non_homogeneous(cfg)
    grouped, entries = {}, {}
    for name, t in mcore.items():
        if not name.startswith("decoder.layers."):
            entries[name] = t
            continue
        index, _, rest = name[len("decoder.layers.") :].partition(".")
        i, expert = int(index), _EXPERT.match(rest)
        names = [f"mlp.experts.experts.{expert[2]}" if expert else _TE_NORM.get(rest, rest)]
        if rest.startswith("pre_mlp_layernorm.") and _is_moe(cfg, i):  # the TE spec's name too
            names.append(rest)
        for local in names:
            key = f"decoder.layers.{i}.{local}" if per_layer else f"decoder.layers.{local}"
            grouped.setdefault(key, {})[(i, int(expert[1])) if expert else (i,)] = t
    for key, parts in grouped.items():
        entries[key] = _stack(parts, per_layer)
    e = cfg.num_experts or 1
    for i in range(layers):
        moe = _is_moe(cfg, i)
        prefix = f"decoder.layers.{i}." if per_layer else "decoder.layers."
        for module in _LINEARS[:2] + (_MOE_LINEARS if moe else _LINEARS[2:]):
            # DCP's planner torch.saves an object entry: the bytes of megatron-core's [data] list
            shard = "0_1" if per_layer else f"{i}_{layers}"
            entries[f"{prefix}{module}._extra_state/shard_{shard}"] = [None]
        for module in ("linear_fc1", "linear_fc2") if moe else ():
            for j in range(e):
                shard = f"{j}_{e}" if per_layer else f"{i}.{j}_{layers}.{e}"
                entries[f"{prefix}mlp.experts.experts.{module}._extra_state/shard_{shard}"] = [None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torch.distributed.checkpoint as dcp

        dcp.save(entries, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    torch.save(common, os.path.join(path, "common.pt"))
    files.write_atomic(os.path.join(path, "metadata.json"), json.dumps(_DIST_CONFIG).encode())


def _non_homogeneous(cfg) -> bool:
    """megatron-core's TransformerBlock keys each layer on its own (decoder.layers.{i}.*) rather than
    stacked on a leading [L] axis when --moe-layer-freq mixes dense and MoE layers (a pattern, or > 1)."""
    freq = cfg.moe_layer_freq
    return bool(cfg.num_experts) and (isinstance(freq, tuple) or freq > 1)


def _is_moe(cfg, index: int) -> bool:
    from megatron_sp.layer_options import is_moe_layer

    return bool(cfg.num_experts) and is_moe_layer(cfg, index + 1)


def _stack(parts: dict, per_layer: bool) -> torch.Tensor:
    """{(layer[, expert]): tensor} -> [(L,) (E,) ...]: experts stacked, and layers unless per_layer."""
    by_layer = {}
    for where, t in sorted(parts.items()):
        by_layer.setdefault(where[0], []).append(t)
    slabs = [torch.stack(ts) if len(next(iter(parts))) == 2 else ts[0] for _, ts in sorted(by_layer.items())]
    return slabs[0] if per_layer else torch.stack(slabs)


def _write_legacy(mcore: dict, cfg, common: dict, path: str, tp: int, pp: int, ep: int) -> None:
    per_stage = cfg.num_layers // pp
    local = (cfg.num_experts or ep) // ep
    for p in range(pp):
        stage = _stage(mcore, cfg, p, pp, per_stage)
        for e in range(ep):
            ranks = _expert_rank(stage, e, local)
            for t in range(tp):
                model = {}
                for name, tensor in ranks.items():
                    model[name] = None if tensor is None else split_tp(name, tensor, tp, cfg)[t].clone()
                name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                os.makedirs(os.path.join(path, name))
                torch.save(dict(common, model=model), os.path.join(path, name, RANK_FILE))


def _expert_rank(stage: dict, e: int, local: int) -> dict:
    """EP rank e's entries: the dense ones, and its experts numbered from 0."""
    out = {}
    for name, t in stage.items():
        head, sep, tail = name.partition(".mlp.experts.local_experts.")
        if not sep:
            out[name] = t
            continue
        index, _, rest = tail.partition(".")
        if e * local <= int(index) < (e + 1) * local:
            out[f"{head}{sep}{int(index) - e * local}.{rest}"] = t
    return out


def _stage(mcore: dict, cfg, p: int, pp: int, per_stage: int) -> dict:
    """Pipeline stage p's entries under its own layer numbers (None: an `_extra_state`)."""
    first, last = p == 0, p == pp - 1
    out = {}
    for name, t in mcore.items():
        if name.startswith("decoder.layers."):
            index, _, rest = name[len("decoder.layers.") :].partition(".")
            if p * per_stage <= int(index) < (p + 1) * per_stage:
                local = int(index) - p * per_stage
                out[f"decoder.layers.{local}.{rest}"] = t
                module = rest.rpartition(".")[0]
                if module in _LINEARS + _MOE_LINEARS or _EXPERT.match(module):
                    out[f"decoder.layers.{local}.{module}._extra_state"] = None
        elif name.startswith("embedding.") and first:
            out[name] = t
        elif not name.startswith("embedding.") and last:
            out[name] = t
    if last:
        out["output_layer._extra_state"] = None
        if pp > 1 and not cfg.untie_embeddings_and_output_weights:  # the tied weight's copy on the last stage
            out["output_layer.weight"] = mcore["embedding.word_embeddings.weight"]
    return out

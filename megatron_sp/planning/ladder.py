"""Llama 3's sizes as a ladder, for tools/plan.py: the model fields of each size, the largest that fits a
cluster, and the longest sequence one trains at there (each with the fastest runnable layout)."""

from __future__ import annotations

from megatron_sp.planning import layouts as lay

# name: (hidden, layers, heads, key/value heads, ffn) -- Llama 3.2 1B/3B, 3.1 8B, Llama 2 13B,
# Code Llama 34B, Llama 3.1 70B and 405B; vocabulary 128256 for all
LLAMA_LADDER = {
    "1B": (2048, 16, 32, 8, 8192),
    "3B": (3072, 28, 24, 8, 8192),
    "8B": (4096, 32, 32, 8, 14336),
    "13B": (5120, 40, 40, 8, 13824),
    "34B": (8192, 48, 64, 8, 22016),
    "70B": (8192, 80, 64, 8, 28672),
    "405B": (16384, 126, 128, 8, 53248),
}


def llama_fields(base: dict, size: str) -> dict:
    h, layers, heads, groups, ffn = LLAMA_LADDER[size]
    return dict(
        base,
        model="llama",
        hidden_size=h,
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=ffn,
        vocab_size=128256,
        kv_channels=None,
        activation=None,
        normalization=None,
        position_embedding_type=None,
        untie_embeddings_and_output_weights=None,
        add_bias_linear=None,
        add_qkv_bias=None,
    )


# Mixture-of-experts rungs (tools/plan.py --largest-moe): Mixtral 8x7B and 8x22B (Mistral's configs), and
# DeepSeek-V2 and V3 sizes with their multi-head latent attention approximated by standard attention
# (128 heads of 128 channels, 8 key/value groups: 237.5 B / 23.1 B active for V2's 236 B / 21 B,
# 674.8 B / 41.4 B for V3's 671 B / 37 B; no multi-token prediction module); vocabularies as released
_MIXTRAL = dict(num_query_groups=8, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_layer_freq=1)
_DEEPSEEK = dict(
    num_attention_heads=128,
    kv_channels=128,
    num_query_groups=8,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-4,
)
MOE_LADDER = {
    "Mixtral-8x7B": dict(
        _MIXTRAL, hidden_size=4096, num_layers=32, num_attention_heads=32, ffn_hidden_size=14336, num_experts=8,
        vocab_size=32000,
    ),
    "Mixtral-8x22B": dict(
        _MIXTRAL, hidden_size=6144, num_layers=56, num_attention_heads=48, ffn_hidden_size=16384, num_experts=8,
        vocab_size=32768,
    ),
    "DeepSeek-V2-236B": dict(
        _DEEPSEEK, hidden_size=5120, num_layers=60, ffn_hidden_size=12288, num_experts=160, moe_router_topk=6,
        moe_ffn_hidden_size=1536, moe_shared_expert_intermediate_size=3072, vocab_size=102400,
        moe_layer_freq=(0,) + (1,) * 59,
    ),
    "DeepSeek-V3-671B": dict(
        _DEEPSEEK, hidden_size=7168, num_layers=61, ffn_hidden_size=18432, num_experts=256, moe_router_topk=8,
        moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048, vocab_size=129280,
        moe_layer_freq=(0,) * 3 + (1,) * 58,
    ),
}  # fmt: skip


def moe_fields(base: dict, name: str) -> dict:
    """The MoE rung `name` (Llama-style blocks: RMSNorm, SwiGLU, RoPE, an untied output layer), the
    all-to-all dispatcher, the rest of `base`."""
    fields = dict(llama_fields(base, "8B"), moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None)
    fields.update(moe_token_dispatcher_type="alltoall", moe_router_topk_scaling_factor=None)
    fields.update(moe_router_num_groups=None, moe_router_group_topk=None, moe_expert_capacity_factor=None)
    fields.update(moe_pad_expert_input_to_capacity=False, moe_z_loss_coeff=None)
    fields.update(expert_model_parallel_size=1, expert_tensor_parallel_size=None)
    fields.update(
        moe_router_score_function="softmax", moe_router_enable_expert_bias=False, moe_router_pre_softmax=False
    )
    fields.update(moe_router_load_balancing_type="aux_loss")
    return dict(fields, **MOE_LADDER[name])


def active_parameters(cfg) -> int:
    """Parameters one token goes through: every expert but its top-k left out."""
    if cfg.num_experts is None:
        return cfg.num_parameters()
    weights, biases = cfg._mlp_params(cfg.moe_ffn_hidden_size)
    return cfg.num_parameters() - cfg.num_moe_layers() * (cfg.num_experts - cfg.moe_router_topk) * (weights + biases)


def fastest(fields, prec, cluster, batch, fixed, moe_refused=frozenset()):
    """The fastest runnable plan of the model `fields` on the cluster (any layout `fixed` allows), or None."""
    fits = lay.plans(fields, prec, cluster, batch, fixed, True, moe_refused).fits
    runnable = [p for p in fits if p.runnable]
    return runnable[0] if runnable else None


LONGEST_SEQUENCE = 2**24  # the search stops doubling here (a huge cluster fits any length)


def longest_sequence(fields, prec, cluster, batch, fixed, step: int = 8192):
    """(s, plan): the longest sequence, a multiple of `step` found by doubling then bisection, whose
    fastest layout fits, and that plan; (0, None) when not even `step` tokens fit; LONGEST_SEQUENCE
    when that fits (the answer is then "at least")."""
    fields = dict(fields, max_position_embeddings=None)
    lo, hi, best = 0, step, None
    while (found := fastest(dict(fields, seq_length=hi), prec, cluster, batch, fixed)) is not None:
        lo, hi, best = hi, 2 * hi, found
        if lo >= LONGEST_SEQUENCE:
            return lo, best
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        found = fastest(dict(fields, seq_length=mid), prec, cluster, batch, fixed)
        lo, hi, best = (mid, hi, found) if found is not None else (lo, mid, best)
    return lo, best

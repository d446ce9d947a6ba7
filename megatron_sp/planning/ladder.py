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


def fastest(fields, prec, cluster, batch, fixed):
    """The fastest runnable plan of the model `fields` on the cluster (any layout `fixed` allows), or None."""
    fits = lay.plans(fields, prec, cluster, batch, fixed, True).fits
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

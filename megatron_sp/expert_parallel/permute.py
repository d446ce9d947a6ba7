"""Tokens sorted by expert and back (Megatron's permute / unpermute), and the dispatch without expert
parallelism (every expert on this rank: the serial model's).

    permute    tokens [n, h], probs [n, E], map [n, E] -> rows [N, h] grouped by expert (tokens in order
               within an expert), their probs [N], their source tokens [N], counts [E]
    unpermute  rows [N, h] -> [n, h]: each token the sum of its rows
"""

from __future__ import annotations


def permute(tokens, probs, routing_map):
    """(rows [N, h], row probs [N], source token of each row [N], rows per expert [E])."""
    by_expert = routing_map.t()  # [E, n]
    expert, token = by_expert.nonzero(as_tuple=True)  # expert-major, tokens in order
    return tokens[token], probs.t()[expert, token], token, by_expert.sum(1)


def unpermute(rows, token, n: int):
    """[n, h]: the sum of each token's rows."""
    return rows.new_zeros((n, rows.shape[-1])).index_add(0, token, rows)


class LocalDispatcher:
    """No expert parallelism: the rank's tokens to its (all) experts and back."""

    def __call__(self, tokens, probs, routing_map, experts):
        rows, row_probs, token, counts = permute(tokens, probs, routing_map)
        out = experts(rows, counts.tolist(), row_probs)
        return unpermute(out, token, tokens.shape[0])

"""Which tokens a context-parallel rank holds, and documents as ids rather than s×s masks.

a2a (Ulysses)  rank r of p holds the contiguous slice [r s/p, (r+1) s/p): after the all-to-all
               each rank attends over the whole sequence for some heads, which balances itself
p2p (ring)     the sequence is cut into 2p chunks; rank r holds chunks r and 2p-1-r ("zigzag"),
               so under the causal mask every rank does the same work at every ring step
"""

from __future__ import annotations

import torch


def check_sequence(s: int, cp_size: int, comm_type: str) -> None:
    parts = 2 * cp_size if comm_type == "p2p" else cp_size
    if s % parts != 0:
        raise ValueError(
            f"sequence length {s} must be divisible by {parts} "
            f"({'2 × ' if comm_type == 'p2p' else ''}context_parallel_size {cp_size}"
            f"{', ring attention: zigzag chunks' if comm_type == 'p2p' else ''})."
        )


def cp_positions(s: int, cp_size: int, cp_rank: int, comm_type: str, device=None) -> torch.Tensor:
    """Global positions [s/p] of the tokens CP rank `cp_rank` holds, in the order it holds them."""
    check_sequence(s, cp_size, comm_type)
    if comm_type == "a2a":
        local = s // cp_size
        return torch.arange(cp_rank * local, (cp_rank + 1) * local, device=device)
    chunk = s // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = 2 * cp_size - 1 - cp_rank
    return torch.cat([first, torch.arange(last * chunk, (last + 1) * chunk, device=device)])


def document_ids(attention_mask: torch.Tensor):
    """[b, s] id of each token's document (the position where it starts) from Megatron's mask
    [b, 1, s, s] (True = masked), or None when the mask is not block-diagonal by documents."""
    b, _, s, _ = attention_mask.shape
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = ~attention_mask[:, 0].bool() & causal  # [b, s, s]
    starts = allowed.int().argmax(dim=-1)  # first visible key per query
    same = starts.unsqueeze(-1) == starts.unsqueeze(-2)
    if not torch.equal(allowed, same & causal):
        return None
    return starts

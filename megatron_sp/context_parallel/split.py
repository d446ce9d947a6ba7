"""How a context-parallel group splits one sequence: which tokens each rank holds, and documents as
ids rather than s×s masks.

a2a (Ulysses)  rank r of p holds the contiguous slice [r s/p, (r+1) s/p): after the all-to-all
               each rank attends over the whole sequence for some heads, which balances itself
p2p (ring)     the sequence is cut into 2p chunks; rank r holds chunks r and 2p-1-r ("zigzag"),
               so under the causal mask every rank does the same work at every ring step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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


def document_ids_from_mask(attention_mask: torch.Tensor):
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


@dataclass
class CPSplit:
    """One micro-batch's sequence over the CP group: each rank's positions and documents (ring
    attention asks for those of the rank whose key/value block it holds)."""

    seq_length: int
    size: int
    rank: int
    comm_type: str
    whole_document_ids: Optional[torch.Tensor]  # [b, s] or None

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """[s/p] global positions of CP rank `rank`'s tokens."""
        return cp_positions(self.seq_length, self.size, rank, self.comm_type, device=device)

    def document_ids(self, rank: int) -> Optional[torch.Tensor]:
        """[b, s/p] document ids of CP rank `rank`'s tokens, or None without documents."""
        if self.whole_document_ids is None:
            return None
        return self.whole_document_ids[:, self.positions(rank, self.whole_document_ids.device)]

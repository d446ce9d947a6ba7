"""How a context-parallel group splits one sequence: which tokens each rank holds, and documents as
ids rather than s×s masks.

contiguous  rank r of p holds [r s/p, (r+1) s/p): when every layer is a2a (Ulysses), whose
            all-to-all gives each rank the whole sequence for some heads, which balances itself
zigzag      the sequence is cut into 2p chunks; rank r holds chunks r and 2p-1-r, so under the causal
            mask every rank does the same work (ring steps, all-gathered keys); the split of every
            other case, a2a layers included (all layers share one split)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_sp.ops.attention_runs import Keys, Run, runs_of


def check_sequence(s: int, cp_size: int, zigzag: bool) -> None:
    parts = 2 * cp_size if zigzag else cp_size
    if s % parts != 0:
        raise ValueError(
            f"sequence length {s} must be divisible by {parts} "
            f"({'2 × ' if zigzag else ''}context_parallel_size {cp_size}{': zigzag chunks' if zigzag else ''})."
        )


def zigzag_chunks(cp_size: int, cp_rank: int) -> tuple:
    """The two chunk indices (of 2p) that rank cp_rank holds, in order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_runs(s: int, cp_size: int, cp_rank: int, zigzag: bool) -> tuple:
    """The runs (ops/attention_runs.py) of the tokens CP rank `cp_rank` holds, in the order it holds them."""
    check_sequence(s, cp_size, zigzag)
    if not zigzag:
        return (Run(0, cp_rank * (s // cp_size), s // cp_size),)
    chunk = s // (2 * cp_size)
    return runs_of([c * chunk for c in zigzag_chunks(cp_size, cp_rank)], chunk)


def cp_positions(s: int, cp_size: int, cp_rank: int, zigzag: bool, device=None) -> torch.Tensor:
    """Global positions [s/p] of the tokens CP rank `cp_rank` holds, in the order it holds them."""
    runs = cp_runs(s, cp_size, cp_rank, zigzag)
    return torch.cat([torch.arange(r.start, r.start + r.length, device=device) for r in runs])


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
    zigzag: bool
    whole_document_ids: Optional[torch.Tensor]  # [b, s] or None

    def runs(self, rank: int) -> tuple:
        """The runs of CP rank `rank`'s tokens (ops/attention_runs.py)."""
        return cp_runs(self.seq_length, self.size, rank, self.zigzag)

    def positions(self, rank: int, device=None) -> torch.Tensor:
        """[s/p] global positions of CP rank `rank`'s tokens."""
        return cp_positions(self.seq_length, self.size, rank, self.zigzag, device=device)

    def document_ids(self, rank: int) -> Optional[torch.Tensor]:
        """[b, s/p] document ids of CP rank `rank`'s tokens, or None without documents."""
        if self.whole_document_ids is None:
            return None
        return self.whole_document_ids[:, self.positions(rank, self.whole_document_ids.device)]

    def keys(self, rank: int, device=None):
        """(positions, document ids) of CP rank `rank`'s tokens, as ops/attention_runs.Keys."""
        return Keys(self.positions(rank, device), self.document_ids(rank))

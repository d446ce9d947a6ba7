"""DeepSpeed-Ulysses: an all-to-all over the CP group turns sequence-sharded q, k, v into
head-sharded ones over the whole sequence, attention runs as without CP, and a second all-to-all
turns the output back (Jacobs et al. 2023).

    q_seq   [s/p, b, n, d]   --ulysses_pack--> [p, s/p, b, n/p, d] --all_to_all--> view [s, b, n/p, d]
    out     [s, b, n/p, d]   --view--> [p, s/p, b, n/p, d] --all_to_all--> --ulysses_unpack--> [s/p, b, n, d]

n is the heads this TP rank holds; n/p of them per CP rank, so n must be divisible by p. Key/value
heads fewer than p (GQA) are repeated to the query heads before the exchange. When another layer's
type needs the zigzag split (split.py), the gathered sequence is put back in position order for the
core and out of it after; the core's sliding window and its sink (the heads' slice) are its own. The pack/unpack copies
are the fused layout ops (megatron_sp._C) when built.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megatron_sp import ops
from megatron_sp.ops.layout import ulysses_heads_to_send, ulysses_recv_to_heads


def _exchange(send: torch.Tensor, group) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


def _seq_to_heads(x, p, group, fused):
    return ulysses_recv_to_heads(_exchange(ops.ulysses_pack(x, p, fused=fused), group), p)


def _heads_to_seq(x, p, group, fused):
    return ops.ulysses_unpack(_exchange(ulysses_heads_to_send(x, p), group), p, fused=fused)


def _move(x, to_heads: bool, p, group, fused):
    return _seq_to_heads(x, p, group, fused) if to_heads else _heads_to_seq(x, p, group, fused)


class _Exchange(torch.autograd.Function):
    """forward: [s/p, b, n, d] -> [s, b, n/p, d] (to_heads) or back; backward: the other direction."""

    @staticmethod
    def forward(ctx, x, to_heads, p, group, fused):
        ctx.args = (not to_heads, p, group, fused)
        return _move(x, to_heads, p, group, fused)

    @staticmethod
    def backward(ctx, grad):
        return _move(grad.contiguous(), *ctx.args), None, None, None, None


def gather_heads(t, p, group, fused, zigzag: bool):
    """[b, n, s/p, d] this rank's tokens -> [b, n/p, s', d]: the p ranks' tokens for n/p heads, in
    position order (zigzag: the ranks' chunks put back in order, ops/layout.py)."""
    x = _Exchange.apply(t.permute(2, 0, 1, 3), True, p, group, fused)  # [s', b, n/p, d], ranks' tokens in turn
    if zigzag:
        x = ops.zigzag_reorder(x, p, dim=0, inverse=True, fused=fused)
    return x.permute(1, 2, 0, 3)


def scatter_heads(out, p, group, fused, zigzag: bool):
    """gather_heads' inverse: [b, n/p, s', d] -> [b, n, s/p, d]."""
    x = out.permute(2, 0, 1, 3).contiguous()
    if zigzag:
        x = ops.zigzag_reorder(x, p, dim=0, fused=fused)
    return _Exchange.apply(x, False, p, group, fused).permute(1, 2, 0, 3)


def check_heads(nq: int, p: int, what: str) -> None:
    if nq % p != 0:
        raise ValueError(
            f"Ulysses needs the query heads per TP rank ({nq}) divisible by {what} ({p}); "
            f"use --cp-comm-type p2p or allgather."
        )


def repeat_kv(k, v, nq: int, p: int):
    """Key/value heads too few to split over p: repeated to the query heads."""
    if k.shape[1] % p == 0:
        return k, v
    return (t.repeat_interleave(nq // k.shape[1], dim=1) for t in (k, v))


def head_slice(sink, rank: int, heads: int):
    """The sink logits of the `heads` heads CP rank `rank` attends with (a view: gradients flow back)."""
    return {} if sink is None else {"sink": sink[rank * heads : (rank + 1) * heads]}


class UlyssesAttention(nn.Module):
    """Wraps a whole-sequence attention core (models/attention.py: CausalAttention) for CP ranks."""

    def __init__(self, core, ps, fused: bool):
        super().__init__()
        self.core, self.group, self.p, self.cp_rank, self.fused = core, ps.cp_group, ps.cp_size, ps.cp_rank, fused

    def forward(self, q, k, v, seq, head_offset: int, sink=None):
        """q [b, n_q, s/p, d], k/v [b, n_kv, s/p, d] (this rank's tokens) -> [b, n_q, s/p, d];
        sink [n_q] or None."""
        p, nq, zigzag = self.p, q.shape[1], seq.cp_split.zigzag
        check_heads(nq, p, "context_parallel_size")
        k, v = repeat_kv(k, v, nq, p)
        q, k, v = (gather_heads(t, p, self.group, self.fused, zigzag) for t in (q, k, v))
        heads = nq // p
        out = self.core(q, k, v, seq.whole, head_offset + self.cp_rank * heads, **head_slice(sink, self.cp_rank, heads))
        return scatter_heads(out, p, self.group, self.fused, zigzag)  # [b, n_q, s/p, d]

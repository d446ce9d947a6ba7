"""The all-to-all token dispatcher (--moe-token-dispatcher-type alltoall; Megatron's
MoEAlltoAllTokenDispatcher) on torch.distributed's uneven all_to_all_single (its backward the reverse exchange).

On a rank of an EP group of size P (E experts, E_l = E / P each) and an expert-TP group of size T:

    permute        rows [N, h] of this rank's tokens, grouped by expert (all E)
    a2a (EP)       the rows of rank p's experts to rank p: [N_in, h], by (source, local expert)
    all-gather     (T > 1) the rows of the expert-TP peers too: by (peer, source, local expert)
    sort           by local expert, then peer and source: E_l groups for the experts
    experts        each on its rows (this rank's expert-TP shard: partial sums when T > 1)
    unsort, reduce-scatter (T > 1: each peer's rows summed over the shards), a2a back, unpermute

The counts travel first (an all-to-all of [P, E_l] integers), so every split is known before the rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sp.expert_parallel.permute import permute, unpermute


def _a2a_once(x, out_splits, in_splits, group):
    """One uneven all-to-all of rows: in_splits[r] of x's rows to rank r, out_splits[r] from it."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """forward: the exchange; backward: the reverse exchange of the gradients."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits = (out_splits, in_splits, group)
        return _a2a_once(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group = ctx.splits
        return _a2a_once(grad, in_splits, out_splits, group), None, None, None


def _a2a(x, out_splits, in_splits, group):
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _counts_a2a(send, group):
    """[P, E_l] rows per (destination, expert) -> [P, E_l] rows per (source, expert)."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.view(-1), send.contiguous().view(-1), group=group)
    return recv


def _all_gather_uneven(x, sizes, rank, group):
    """Every peer's rows (sizes[r] rows of peer r), concatenated by peer; backward: each peer's share summed."""
    peers = len(sizes)
    return _a2a(torch.cat([x] * peers), sizes, [sizes[rank]] * peers, group)


def _reduce_scatter_uneven(x, sizes, rank, group):
    """Rows by peer (sizes[r] of peer r) -> my rows summed over the peers."""
    peers = len(sizes)
    mine = _a2a(x, [sizes[rank]] * peers, sizes, group)
    return mine.view(peers, sizes[rank], *x.shape[1:]).sum(0)


def _by_expert(chunks):
    """Row order putting chunks [S, E_l] (sources × local experts, source-major) expert-major."""
    s, e = chunks.shape
    starts = torch.cat([chunks.new_zeros(1), chunks.flatten().cumsum(0)[:-1]]).view(s, e)
    pieces = [torch.arange(int(starts[i, j]), int(starts[i, j] + chunks[i, j])) for j in range(e) for i in range(s)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


class AllToAllDispatcher:
    """Tokens to their experts' EP ranks and back (see the module docstring)."""

    def __init__(self, num_experts: int, ps):
        self.ps, self.local = ps, num_experts // ps.ep_size

    def __call__(self, tokens, probs, routing_map, experts):
        ps = self.ps
        rows, row_probs, token, counts = permute(tokens, probs, routing_map)
        send = counts.view(ps.ep_size, self.local)  # [P, E_l] rows to each EP rank's experts
        recv = _counts_a2a(send, ps.ep_group) if ps.ep_size > 1 else send
        in_splits, out_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        x, p = rows, row_probs
        if ps.ep_size > 1:
            x, p = _a2a(rows, out_splits, in_splits, ps.ep_group), _a2a(row_probs, out_splits, in_splits, ps.ep_group)
        chunks, sizes = recv, None
        if ps.etp_size > 1:
            gathered = [torch.empty_like(recv) for _ in range(ps.etp_size)]
            dist.all_gather(gathered, recv.contiguous(), group=ps.etp_group)
            sizes = [int(c.sum()) for c in gathered]
            x = _all_gather_uneven(x, sizes, ps.etp_rank, ps.etp_group)
            p = _all_gather_uneven(p, sizes, ps.etp_rank, ps.etp_group)
            chunks = torch.cat(gathered)  # [T·P, E_l]
        order = _by_expert(chunks).to(x.device)
        y = experts(x[order], chunks.sum(0).tolist(), p[order])
        y = y.new_zeros(y.shape).index_copy(0, order, y)  # back to (peer, source, expert) order
        if sizes is not None:
            y = _reduce_scatter_uneven(y, sizes, ps.etp_rank, ps.etp_group)
        if ps.ep_size > 1:
            y = _a2a(y, in_splits, out_splits, ps.ep_group)
        return unpermute(y, token, tokens.shape[0])

"""Layout changes around the collectives, as one copy each.

Ulysses (sequence <-> head sharding over a context-parallel group of p ranks):

    seq -> head:  x_seq [s/p, b, n, d] --ulysses_pack--> send [p, s/p, b, n/p, d]
                  --all_to_all_single(dim 0)--> recv [p, s/p, b, n/p, d]
                  --ulysses_recv_to_heads (a view)--> x_head [s, b, n/p, d]
    head -> seq:  x_head [s, b, n/p, d] --ulysses_heads_to_send (a view)--> send [p, s/p, b, n/p, d]
                  --all_to_all_single(dim 0)--> recv [p, s/p, b, n/p, d]
                  --ulysses_unpack--> x_seq [s/p, b, n, d]

Chunk j of the pack's send buffer is this rank's sequence shard restricted to rank j's heads
(n/p consecutive heads), so after the exchange chunk i of the receive buffer is sequence shard i:
stacking the chunks is the full sequence and needs no copy. The one real permutation of each
direction is the pack (before) and the unpack (after); they are each other's inverse and backward.

TP gather of non-SP outputs: a dim-0 all-gather of t outputs [s, ..., l] gives [t*s, ..., l];
gather_to_last_dim turns it into the concatenation [s, ..., t*l] (last_dim_to_gather undoes it).

Zigzag (ring attention causal load balance): the sequence axis is cut into 2p chunks and rank r
holds chunks r and 2p-1-r; zigzag_reorder lays the sequence out so that rank r's shard is the
r-th of p equal slices; inverse=True restores the natural order.
"""

from __future__ import annotations

import torch

from megatron_sp.ops._extension import extension_available, use_fused


def _check_divisible(size: int, k: int, what: str) -> None:
    if k < 1 or size % k != 0:
        raise ValueError(f"{what} ({size}) must be divisible by {k}.")


def _zigzag_source(slot: int, p: int, inverse: bool) -> int:
    if not inverse:
        return slot // 2 if slot % 2 == 0 else 2 * p - 1 - slot // 2
    return 2 * slot if slot < p else 2 * (2 * p - 1 - slot) + 1


# ---- references -------------------------------------------------------------------------------


def ulysses_pack_reference(x: torch.Tensor, p: int) -> torch.Tensor:
    """[s/p, b, n, d] -> [p, s/p, b, n/p, d]: chunk j holds heads j*n/p .. (j+1)*n/p - 1."""
    s_shard, b, n, d = x.shape
    return x.reshape(s_shard, b, p, n // p, d).permute(2, 0, 1, 3, 4).contiguous()


def ulysses_unpack_reference(x: torch.Tensor, p: int) -> torch.Tensor:
    """[p, s/p, b, n/p, d] -> [s/p, b, n, d]: chunk i holds heads i*n/p ..; inverse of the pack."""
    _, s_shard, b, n_shard, d = x.shape
    return x.permute(1, 2, 0, 3, 4).reshape(s_shard, b, p * n_shard, d).contiguous()


def gather_to_last_dim_reference(x: torch.Tensor, t: int) -> torch.Tensor:
    """[t*s, ..., l] -> [s, ..., t*l]: rank r's slice of the gather becomes columns r*l .. (r+1)*l."""
    return torch.cat(torch.chunk(x, t, dim=0), dim=-1)


def last_dim_to_gather_reference(x: torch.Tensor, t: int) -> torch.Tensor:
    """[s, ..., t*l] -> [t*s, ..., l]: inverse of gather_to_last_dim."""
    return torch.cat(torch.chunk(x, t, dim=-1), dim=0)


def zigzag_reorder_reference(x: torch.Tensor, p: int, dim: int = 0, inverse: bool = False) -> torch.Tensor:
    """Reorders the 2p chunks of `dim` so that slice r of p holds chunks r and 2p-1-r."""
    chunks = torch.chunk(x, 2 * p, dim=dim)
    return torch.cat([chunks[_zigzag_source(i, p, inverse)] for i in range(2 * p)], dim=dim)


# ---- views around the all-to-all (no copy) ------------------------------------------------------


def ulysses_recv_to_heads(recv: torch.Tensor, p: int) -> torch.Tensor:
    """Receive buffer [p, s/p, b, n/p, d] of the seq->head exchange as [s, b, n/p, d] (a view)."""
    _, s_shard, b, n_shard, d = recv.shape
    return recv.view(p * s_shard, b, n_shard, d)


def ulysses_heads_to_send(x_head: torch.Tensor, p: int) -> torch.Tensor:
    """Head-sharded [s, b, n/p, d] as the head->seq send buffer [p, s/p, b, n/p, d] (a view)."""
    s, b, n_shard, d = x_head.shape
    _check_divisible(s, p, "ulysses_heads_to_send: sequence length")
    return x_head.contiguous().view(p, s // p, b, n_shard, d)


# ---- public ops -------------------------------------------------------------------------------


def ulysses_pack(x: torch.Tensor, p: int, fused: bool = True) -> torch.Tensor:
    """seq->head send buffer: [s/p, b, n, d] -> [p, s/p, b, n/p, d]."""
    if x.dim() != 4:
        raise ValueError(f"ulysses_pack expects [s/p, b, n, d], got shape {tuple(x.shape)}.")
    _check_divisible(x.shape[2], p, "ulysses_pack: number of heads")
    if use_fused(fused, x):
        return torch.ops.megatron_sp.ulysses_pack(x, p)
    return ulysses_pack_reference(x, p)


def ulysses_unpack(x: torch.Tensor, p: int, fused: bool = True) -> torch.Tensor:
    """head->seq receive buffer to sequence shard: [p, s/p, b, n/p, d] -> [s/p, b, n, d]."""
    if x.dim() != 5 or x.shape[0] != p:
        raise ValueError(f"ulysses_unpack expects [p={p}, s/p, b, n/p, d], got {tuple(x.shape)}.")
    if use_fused(fused, x):
        return torch.ops.megatron_sp.ulysses_unpack(x, p)
    return ulysses_unpack_reference(x, p)


def gather_to_last_dim(x: torch.Tensor, t: int, fused: bool = True) -> torch.Tensor:
    """Dim-0 all-gather output [t*s, ..., l] -> last-dim concatenation [s, ..., t*l]."""
    if x.dim() < 2:
        raise ValueError(f"gather_to_last_dim expects at least 2 dims, got {tuple(x.shape)}.")
    _check_divisible(x.shape[0], t, "gather_to_last_dim: dim 0")
    if use_fused(fused, x):
        return torch.ops.megatron_sp.gather_to_last_dim(x, t)
    return gather_to_last_dim_reference(x, t)


def last_dim_to_gather(x: torch.Tensor, t: int, fused: bool = True) -> torch.Tensor:
    """[s, ..., t*l] -> [t*s, ..., l] (inverse of gather_to_last_dim)."""
    if x.dim() < 2:
        raise ValueError(f"last_dim_to_gather expects at least 2 dims, got {tuple(x.shape)}.")
    _check_divisible(x.shape[-1], t, "last_dim_to_gather: last dim")
    if use_fused(fused, x):
        return torch.ops.megatron_sp.last_dim_to_gather(x, t)
    return last_dim_to_gather_reference(x, t)


def zigzag_reorder(x: torch.Tensor, p: int, dim: int = 0, inverse: bool = False, fused: bool = True) -> torch.Tensor:
    """Zigzag order of `dim` for p ranks (rank r: chunks r and 2p-1-r), or back with inverse."""
    if x.dim() == 0:
        raise ValueError("zigzag_reorder needs a tensor with at least one dimension.")
    _check_divisible(x.shape[dim], 2 * p, f"zigzag_reorder: size of dim {dim}")
    if use_fused(fused, x):
        return torch.ops.megatron_sp.zigzag_reorder(x, p, dim, inverse)
    return zigzag_reorder_reference(x, p, dim, inverse)


# ---- fake and autograd registrations -----------------------------------------------------------


def _register_permutation(name, out_shape, backward):
    torch.library.register_fake(f"megatron_sp::{name}")(lambda x, *args: x.new_empty(out_shape(x, *args)))

    def setup_context(ctx, inputs, output):
        ctx.args = inputs[1:]

    def backward_fn(ctx, grad):  # a permutation's gradient is the inverse permutation
        return (backward(grad, *ctx.args),) + (None,) * len(ctx.args)

    torch.library.register_autograd(f"megatron_sp::{name}", backward_fn, setup_context=setup_context)


def _pack_shape(x, p):
    s_shard, b, n, d = x.shape
    return (p, s_shard, b, n // p, d)


def _unpack_shape(x, p):
    _, s_shard, b, n_shard, d = x.shape
    return (s_shard, b, p * n_shard, d)


def _gather_shape(x, t):
    return (x.shape[0] // t,) + tuple(x.shape[1:-1]) + (x.shape[-1] * t,)


def _split_shape(x, t):
    return (x.shape[0] * t,) + tuple(x.shape[1:-1]) + (x.shape[-1] // t,)


if extension_available():
    ops = torch.ops.megatron_sp
    _register_permutation("ulysses_pack", _pack_shape, lambda g, p: ops.ulysses_unpack(g, p))
    _register_permutation("ulysses_unpack", _unpack_shape, lambda g, p: ops.ulysses_pack(g, p))
    _register_permutation("gather_to_last_dim", _gather_shape, lambda g, t: ops.last_dim_to_gather(g, t))
    _register_permutation("last_dim_to_gather", _split_shape, lambda g, t: ops.gather_to_last_dim(g, t))
    _register_permutation(
        "zigzag_reorder",
        lambda x, p, dim, inverse: x.shape,
        lambda g, p, dim, inverse: ops.zigzag_reorder(g, p, dim, not inverse),
    )

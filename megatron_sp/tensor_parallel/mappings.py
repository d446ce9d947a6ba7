"""Autograd collectives between the four regions of a layer (Megatron's names and semantics).

Activations are [s, b, h]. Each public function's docstring is its contract; `group` is the tensor
parallel group (None or size 1 short-circuits to the identity). Paper names (Korthikanti et al.):
f = copy_to_tensor_parallel_region, f̄ = reduce_from_tensor_parallel_region,
g = gather_from_sequence_parallel_region, ḡ = reduce_scatter_to_sequence_parallel_region.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# torch 2.13 names the tensor collectives *_single (the functional ones too) and deprecates the old names
# with a warning per call; 2.11 (the GPU machines) has only the old ones. The four functions below call
# whichever this torch has, looked up at each call (bench/comm_volume.py's counter wraps them by name).
_C10D_SINGLE = hasattr(dist, "all_gather_single")
_FUNCOL_SINGLE = hasattr(funcol, "all_gather_single")


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


# ---- raw collectives (no autograd) -------------------------------------------------------------
# Functional collectives: they return a new tensor (no in-place write into an input or a torch.empty
# buffer), which is what torch.compile traces faithfully; waited for at once, as the c10d calls were.


def all_gather_into(out, x, group, async_op=False):
    """c10d all-gather of x along dim 0 into out (t times x's rows)."""
    fn = dist.all_gather_single if _C10D_SINGLE else dist.all_gather_into_tensor
    return fn(out, x, group=group, async_op=async_op)


def reduce_scatter_into(out, x, group):
    """c10d reduce-scatter (sum) of x along dim 0 into out (x's rows / t)."""
    fn = dist.reduce_scatter_single if _C10D_SINGLE else dist.reduce_scatter_tensor
    return fn(out, x, group=group)


def all_gather_start(x, group):
    """Functional all-gather along dim 0, started and not waited for (funcol.wait_tensor, or first use)."""
    fn = funcol.all_gather_single if _FUNCOL_SINGLE else funcol.all_gather_tensor
    return fn(x.contiguous(), 0, group)


def reduce_scatter_start(x, group):
    """Functional reduce-scatter (sum) along dim 0, started and not waited for."""
    fn = funcol.reduce_scatter_single if _FUNCOL_SINGLE else funcol.reduce_scatter_tensor
    return fn(x.contiguous(), "sum", 0, group)


def _all_reduce(x, group):
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


def _all_gather_dim0(x, group):
    return funcol.wait_tensor(all_gather_start(x, group))


def _reduce_scatter_dim0(x, group):
    t = _size(group)
    if x.shape[0] % t != 0:
        raise ValueError(f"reduce-scatter along dim 0 needs its size ({x.shape[0]}) divisible by {t}.")
    return funcol.wait_tensor(reduce_scatter_start(x, group))


def _split_dim(x, dim, group):
    t = _size(group)
    if x.shape[dim] % t != 0:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} into {t} equal parts.")
    return x.chunk(t, dim=dim)[_rank(group)].contiguous()


def _all_gather_last(x, group):
    # Gather along dim 0 (one contiguous collective), then move the rank axis next to the last dim.
    stacked = _all_gather_dim0(x.unsqueeze(0), group)  # [t, ..., h/t]
    return torch.cat(stacked.unbind(0), dim=-1)  # [..., h]


def _reduce_scatter_last(x, group):
    t = _size(group)
    parts = x.chunk(t, dim=-1)  # t × [..., h/t]
    stacked = torch.stack(parts, dim=0)  # [t, ..., h/t]
    return _reduce_scatter_dim0(stacked, group).squeeze(0)


def _all_to_all(x, group, scatter_dim, gather_dim):
    """Splits x along scatter_dim across ranks and concatenates the received pieces along gather_dim."""
    t = _size(group)
    send = torch.stack(x.chunk(t, dim=scatter_dim), dim=0).contiguous()  # [t, ...piece]
    recv = funcol.wait_tensor(funcol.all_to_all_single(send, None, None, group))
    return torch.cat(recv.unbind(0), dim=gather_dim)


# ---- autograd functions ----------------------------------------------------------------------


_OPS = {
    "identity": lambda x, g: x,
    "all_reduce": _all_reduce,
    "all_gather_dim0": _all_gather_dim0,
    "reduce_scatter_dim0": _reduce_scatter_dim0,
    "split_dim0": lambda x, g: _split_dim(x, 0, g),
    "split_last": lambda x, g: _split_dim(x, -1, g),
    "all_gather_last": _all_gather_last,
    "reduce_scatter_last": _reduce_scatter_last,
}


class _Collective(torch.autograd.Function):
    """One autograd Function for every mapping: forward op and backward op chosen by name."""

    @staticmethod
    def forward(ctx, x, group, forward_op, backward_op):
        ctx.group, ctx.backward_op = group, backward_op
        return _OPS[forward_op](x, group)

    @staticmethod
    def backward(ctx, grad):
        return _OPS[ctx.backward_op](grad, ctx.group), None, None, None


def _apply(x, group, forward_op, backward_op):
    if _size(group) == 1:
        return x
    return _Collective.apply(x, group, forward_op, backward_op)


def copy_to_tensor_parallel_region(x, group):
    """f — forward: identity, backward: all-reduce."""
    return _apply(x, group, "identity", "all_reduce")


def reduce_from_tensor_parallel_region(x, group):
    """f̄ — forward: all-reduce, backward: identity."""
    return _apply(x, group, "all_reduce", "identity")


def scatter_to_tensor_parallel_region(x, group):
    """forward: split last dim (keep my part), backward: all-gather last dim."""
    return _apply(x, group, "split_last", "all_gather_last")


def gather_from_tensor_parallel_region(x, group):
    """forward: all-gather last dim, backward: split last dim."""
    return _apply(x, group, "all_gather_last", "split_last")


def scatter_to_sequence_parallel_region(x, group):
    """forward: split dim 0 (keep my part), backward: all-gather dim 0."""
    return _apply(x, group, "split_dim0", "all_gather_dim0")


def gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad: bool = True):
    """g — forward: all-gather dim 0, backward: reduce-scatter dim 0.

    With tensor_parallel_output_grad=False the consumer is replicated (not TP-sharded), so each
    rank's gradient is already complete and the backward only splits dim 0.
    """
    backward = "reduce_scatter_dim0" if tensor_parallel_output_grad else "split_dim0"
    return _apply(x, group, "all_gather_dim0", backward)


def reduce_scatter_to_sequence_parallel_region(x, group):
    """ḡ — forward: reduce-scatter dim 0, backward: all-gather dim 0."""
    return _apply(x, group, "reduce_scatter_dim0", "all_gather_dim0")


def all_gather_last_dim_from_tensor_parallel_region(x, group):
    """forward: all-gather last dim, backward: reduce-scatter last dim."""
    return _apply(x, group, "all_gather_last", "reduce_scatter_last")


def reduce_scatter_last_dim_to_tensor_parallel_region(x, group):
    """forward: reduce-scatter last dim, backward: all-gather last dim."""
    return _apply(x, group, "reduce_scatter_last", "all_gather_last")


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x, group, scatter_dim: int, gather_dim: int):
    """Ulysses — forward: all-to-all (split scatter_dim, concat gather_dim), backward: the inverse."""
    if _size(group) == 1:
        return x
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)

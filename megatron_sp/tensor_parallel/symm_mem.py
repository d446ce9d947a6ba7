"""The CUDA side of --tp-comm-overlap: torch's symmetric-memory fused ops (torchtitan's async TP).

    torch.ops.symm_mem.fused_all_gather_matmul(A_shard, [B], gather_dim, group_name)   all-gather -> GEMM
    torch.ops.symm_mem.fused_matmul_reduce_scatter(A, B, "sum", scatter_dim, group)    GEMM -> reduce-scatter

Used for CUDA tensors on an NCCL group when this torch has both ops; anything else takes the ring in
overlap.py (on GPUs its sends and receives run on NCCL's streams). The four functions have the ring's
signatures and shapes (see overlap.py). The fused ops multiply like `mm.out`, so A and B are cast to
one dtype first: the GEMM dtype (autocast's when on) in the forward, the gradient's in the backward,
and the forward's all-gather moves that dtype.

Not exercised on the CPU test machines: GPU correctness is checked where a GPU is lent
(tests/test_tp_comm_overlap.py's CUDA test, bench/RESULTS.md).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist

from megatron_sp.tensor_parallel import mappings


@functools.cache
def _have_fused_ops() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (registers torch.ops.symm_mem)
    except ImportError:
        return False
    ops = torch.ops.symm_mem
    return hasattr(ops, "fused_all_gather_matmul") and hasattr(ops, "fused_matmul_reduce_scatter")


def usable(x: torch.Tensor, group) -> bool:
    """Whether the fused ops can run this layer: a CUDA tensor, an NCCL group, a torch that has them."""
    return x.is_cuda and dist.get_backend(group) == "nccl" and _have_fused_ops()


def _group_name(group) -> str:
    """The group's name for the ops; older torch versions must register it for symmetric memory first."""
    from torch.distributed import _symmetric_memory

    enable = getattr(_symmetric_memory, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():  # deprecated (and unneeded) on recent versions
            warnings.simplefilter("ignore", FutureWarning)
            enable(group.group_name)
    return group.group_name


def _gemm_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def all_gather_matmul(x_shard, weight, group):
    """gather(x_shard) @ weight.T: [s/t, b, k] -> [s, b, n]."""
    dtype = _gemm_dtype(x_shard)
    _, (out,) = torch.ops.symm_mem.fused_all_gather_matmul(
        x_shard.to(dtype).contiguous(), [weight.to(dtype).t()], 0, _group_name(group), return_A=False
    )
    return out


def matmul_reduce_scatter(x, weight, group):
    """reduce_scatter(x @ weight.T): [s, b, k/t] -> [s/t, b, n]."""
    dtype = _gemm_dtype(x)
    return torch.ops.symm_mem.fused_matmul_reduce_scatter(
        x.to(dtype).contiguous(), weight.to(dtype).t(), "sum", 0, _group_name(group)
    )


def column_backward(grad_out, x_shard, weight, group):
    """x's re-gather runs on NCCL's stream while the fused dgrad GEMM -> reduce-scatter runs; then wgrad."""
    grad_out = grad_out.contiguous()
    shard = x_shard.to(grad_out.dtype).contiguous()
    total = shard.new_empty((dist.get_world_size(group) * shard.shape[0],) + tuple(shard.shape[1:]))
    gather = mappings.all_gather_into(total, shard, group, async_op=True)
    grad_x = torch.ops.symm_mem.fused_matmul_reduce_scatter(
        grad_out, weight.to(grad_out.dtype), "sum", 0, _group_name(group)
    )
    gather.wait()
    return grad_x, _flat(grad_out).t() @ _flat(total)


def row_backward(grad_shard, x, weight, group):
    """The fused all-gather -> dgrad GEMM returns the gathered gradient too, for the wgrad GEMM."""
    grad_total, (grad_x,) = torch.ops.symm_mem.fused_all_gather_matmul(
        grad_shard.contiguous(), [weight.to(grad_shard.dtype)], 0, _group_name(group), return_A=True
    )
    return grad_x, _flat(grad_total).t() @ _flat(x.to(grad_shard.dtype))

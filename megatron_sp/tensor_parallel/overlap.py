"""--tp-comm-overlap: sequence parallelism's all-gather and reduce-scatter cut into t ring steps, so that
each step's GEMM runs while the next chunk travels (Megatron-LM's `--tp-comm-overlap`, torchtitan's
async TP, Wang et al. 2023's decomposition).

Chunk c is rank c's sequence shard: rows [c·n, (c+1)·n) of dim 0, n = s/t. On rank r of a TP group
of size t the ring sends to r+1 and receives from r-1:

    all-gather -> GEMM   step k multiplies the chunk of rank (r-k) mod t it holds, while that chunk
                         goes on to r+1 and the next one arrives from r-1 (t-1 shifts)
    GEMM -> reduce-scatter
                         step k computes its partial product of chunk (r-k-1) mod t, adds the sum
                         that arrived from r-1 (the GEMM ran while it travelled) and sends it on;
                         the last step's chunk is r's own, now summed over all t ranks

    layer                 forward                     backward
    ColumnParallelLinear  all-gather x -> GEMM        dgrad GEMM -> reduce-scatter, x's shards re-gathered
                          [s/t,b,k] -> [s,b,n/t]      in the same steps; the wgrad GEMM on the gathered x
                                                      while the last partial sum travels
    RowParallelLinear     GEMM -> reduce-scatter      all-gather grad -> the dgrad GEMM of each chunk;
                          [s,b,k/t] -> [s/t,b,n]      then the wgrad GEMM on the gathered gradient

Megatron's ordering: the weight-gradient GEMM after the dgrad, under the reduce-scatter in the column
layer. It stays one GEMM per layer, as without the flag (a chunked wgrad sums in another order, and
AdamW turns that rounding into ±lr steps where a gradient is near zero), and the chunks of the other
GEMMs are row blocks of the plain GEMMs: only the order of the t-term partial sums differs from the
plain layers (two terms have one order: bit-identical at t = 2 on CPU). Every rank sends what the
collectives would send: (t-1)/t of the gathered or reduced tensor. The ring is torch.distributed's
isend/irecv: gloo on CPU, NCCL's own streams on GPUs (work.wait() makes the compute stream wait, not
the host). On CUDA with NCCL, torch's symmetric-memory fused ops are used instead where this torch
has them (symm_mem.py).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from megatron_sp.tensor_parallel import symm_mem

_TAG_CHUNK, _TAG_SUM = 0, 1  # gloo matches point-to-point messages by tag: gathered chunks vs partial sums


class _InFlight:
    """A posted send/receive pair; wait() returns the received tensor."""

    def __init__(self, works, received):
        self.works, self.received = works, received

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


class Ring:
    """The TP group as a ring: this rank sends to the next and receives from the previous one."""

    def __init__(self, group):
        ranks = dist.get_process_group_ranks(group)
        self.group, self.size, self.rank = group, len(ranks), dist.get_rank(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def shift(self, tensor: torch.Tensor, tag: int, into=None) -> _InFlight:
        """Posts sending `tensor` to the next rank and receiving the previous rank's (into `into`, or a
        new tensor)."""
        received = torch.empty_like(tensor) if into is None else into
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, received, self.prev, self.group, tag),
        ]
        return _InFlight(dist.batch_isend_irecv(ops), received)

    def gathered(self, shard: torch.Tensor, tag: int = _TAG_CHUNK, out=None):
        """Yields (c, chunk of rank c) for every rank, this rank's first; while the caller works on one
        chunk, it is already on its way to the next rank and the next chunk is arriving. out: a
        [t·n, ...] tensor to gather into (the chunks are its row blocks), or None."""
        n, held = shard.shape[0], shard.contiguous()
        if out is not None:
            held = _rows(out, self.rank, n).copy_(held)
        for k in range(self.size):
            c = (self.rank - k) % self.size
            flight = None
            if k + 1 < self.size:
                flight = self.shift(held, tag, None if out is None else _rows(out, (c - 1) % self.size, n))
            yield c, held
            if flight is not None:
                held = flight.wait()

    def reduce_scattered(self, partial, tag: int = _TAG_SUM, meanwhile=None) -> torch.Tensor:
        """Σ over ranks of partial(r) for this rank's chunk r; partial(c) computes this rank's term of
        chunk c (a GEMM), which runs while the sum of the previous step travels. meanwhile(): more
        work, run while the last sum is in flight."""
        flight, total = None, None
        for k in range(self.size):
            total = partial((self.rank - k - 1) % self.size)
            if k + 1 == self.size and meanwhile is not None:
                meanwhile()
            if flight is not None:
                total = total + flight.wait()
            if k + 1 < self.size:
                flight = self.shift(total, tag)
        return total


def _rows(x: torch.Tensor, c: int, n: int) -> torch.Tensor:
    """Chunk c of dim 0 (n rows): a contiguous view of a contiguous x."""
    return x.narrow(0, c * n, n)


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # [s·b, features]


def _gemm_dtype(x: torch.Tensor) -> torch.dtype:
    """The forward GEMMs' dtype: autocast's where it is on (a GEMM into `out=` bypasses autocast), else x's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def chunk_rows(x: torch.Tensor, t: int, layer: str) -> int:
    """Rows of dim 0 per ring chunk; refuses a dim 0 that t chunks cannot split."""
    if x.shape[0] % t != 0:
        raise ValueError(
            f"{layer} with tp_comm_overlap cannot cut the sequence dimension ({x.shape[0]}) into "
            f"{t} equal chunks; make the sequence length divisible by the TP size {t}."
        )
    return x.shape[0] // t


# ---- the ring versions (symm_mem.py has the same four functions on CUDA) ----------------------


def all_gather_matmul(x_shard, weight, group):
    """gather(x_shard) @ weight.T: [s/t, b, k] -> [s, b, n], n = weight rows."""
    ring, n = Ring(group), x_shard.shape[0]
    dtype = _gemm_dtype(x_shard)
    w_t = weight.to(dtype).t()
    out = torch.empty(
        (ring.size * n,) + tuple(x_shard.shape[1:-1]) + (w_t.shape[1],), dtype=dtype, device=x_shard.device
    )
    for c, chunk in ring.gathered(x_shard):
        torch.matmul(chunk.to(dtype), w_t, out=_rows(out, c, n))
    return out


def matmul_reduce_scatter(x, weight, group):
    """reduce_scatter(x @ weight.T): [s, b, k/t] -> [s/t, b, n], summed over the TP group."""
    ring = Ring(group)
    n = chunk_rows(x, ring.size, "RowParallelLinear")
    w_t = weight.t()
    return ring.reduce_scattered(lambda c: torch.matmul(_rows(x, c, n), w_t))  # autocast applies


def column_backward(grad_out, x_shard, weight, group):
    """(grad x_shard, grad weight) of all_gather_matmul, grad_out [s, b, n]: the dgrad GEMM -> reduce-
    scatter ring, whose steps also gather x's shards; the wgrad GEMM on the gathered x runs while the
    last partial sum travels (Megatron's order: wgrad under the dgrad reduce-scatter)."""
    ring, n = Ring(group), x_shard.shape[0]
    grad_out = grad_out.contiguous()
    weight = weight.to(grad_out.dtype)
    total = x_shard.new_empty((ring.size * n,) + tuple(x_shard.shape[1:]))  # x, gathered
    x_chunks = ring.gathered(x_shard, out=total)
    grad_w = grad_out.new_empty(weight.shape)

    def dgrad(c):
        next(x_chunks)  # x's next shard travels beside the partial sum
        return torch.matmul(_rows(grad_out, c, n), weight)  # [s/t, b, k]

    def wgrad():
        torch.matmul(_flat(grad_out).t(), _flat(total.to(grad_out.dtype)), out=grad_w)

    return ring.reduce_scattered(dgrad, meanwhile=wgrad), grad_w


def row_backward(grad_shard, x, weight, group):
    """(grad x, grad weight) of matmul_reduce_scatter, grad_shard [s/t, b, n]: gathered chunk by chunk,
    each chunk's dgrad GEMM running while the next one arrives; then the wgrad GEMM on the gathered
    gradient (Megatron's order)."""
    ring, n = Ring(group), grad_shard.shape[0]
    weight = weight.to(grad_shard.dtype)
    grad_total = grad_shard.new_empty((ring.size * n,) + tuple(grad_shard.shape[1:]))
    grad_x = grad_shard.new_empty(x.shape)
    for c, g in ring.gathered(grad_shard, out=grad_total):
        torch.matmul(g, weight, out=_rows(grad_x, c, n))
    return grad_x, _flat(grad_total).t() @ _flat(x.to(grad_shard.dtype))


# ---- autograd ---------------------------------------------------------------------------------------


class Ops(NamedTuple):
    """One implementation of the four overlapped GEMMs."""

    all_gather_matmul: Callable
    matmul_reduce_scatter: Callable
    column_backward: Callable
    row_backward: Callable


RING = Ops(all_gather_matmul, matmul_reduce_scatter, column_backward, row_backward)
SYMM_MEM = Ops(
    symm_mem.all_gather_matmul, symm_mem.matmul_reduce_scatter, symm_mem.column_backward, symm_mem.row_backward
)


def _ops(x, group) -> Ops:
    """torch's symmetric-memory fused ops where they run (CUDA tensors, an NCCL group), else the ring."""
    return SYMM_MEM if symm_mem.usable(x, group) else RING


class _OverlappedColumn(torch.autograd.Function):
    """y = gather(x_shard) @ w.T (+ b), the gather overlapped with the GEMM (see the module docstring).
    Saves only the shard; the backward re-gathers it (as the plain SP layer does)."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x_shard, weight)
        out = _ops(x_shard, group).all_gather_matmul(x_shard, weight, group)
        return out + bias.to(out.dtype) if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):
        x_shard, weight = ctx.saved_tensors
        grad_x, grad_w = _ops(x_shard, ctx.group).column_backward(grad_out, x_shard, weight, ctx.group)
        grad_b = _flat(grad_out).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class _OverlappedRow(torch.autograd.Function):
    """y_shard = reduce_scatter(x @ w.T), the reduction of each chunk overlapped with the next GEMM."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        return _ops(x, group).matmul_reduce_scatter(x, weight, group)

    @staticmethod
    def backward(ctx, grad_shard):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = _ops(x, ctx.group).row_backward(grad_shard.contiguous(), x, weight, ctx.group)
        return grad_x, grad_w, None


def column_linear(x_shard, weight, bias, group):
    """g then the column GEMM, overlapped — forward: all-gather dim 0 -> GEMM, backward: GEMM ->
    reduce-scatter dim 0 (x_shard [s/t, b, k], weight [n/t, k] -> [s, b, n/t])."""
    return _OverlappedColumn.apply(x_shard, weight, bias, group)


def row_linear(x, weight, group):
    """The row GEMM then ḡ, overlapped — forward: GEMM -> reduce-scatter dim 0, backward: all-gather
    dim 0 -> GEMMs (x [s, b, k/t], weight [n, k/t] -> [s/t, b, n]; the bias is the caller's)."""
    return _OverlappedRow.apply(x, weight, group)

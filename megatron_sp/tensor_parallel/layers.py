"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

Shard shapes on a rank of a TP group of size t (s = sequence, b = batch):

    layer                   weight        input                          output
    ColumnParallelLinear    [out/t, in]   [s/t, b, in] (SP) or [s, b, in]  [s, b, out/t]
    RowParallelLinear       [out, in/t]   [s, b, in/t]                    [s/t, b, out] (SP) or [s, b, out]
    VocabParallelEmbedding  [V/t, h]      ids [b, s]                      [s/t, b, h] (SP) or [s, b, h]

With tp_comm_overlap (SP only) the column layer's all-gather and the row layer's reduce-scatter are
cut into t ring steps overlapped with the GEMMs (tensor_parallel/overlap.py); shapes are unchanged.

Every parameter carries where it sits in the serial model (see `ShardSpec`), which is all
`GPTModel.load_full_state_dict` / `full_state_dict` need. Parameters that live in the SP region
(replicated, but each rank sees only its sequence shard) are marked `sequence_parallel=True`: their
gradients are partial sums that must be summed over the TP group (tensor_parallel/partial_grads.py).
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from megatron_sp.tensor_parallel import mappings, overlap
from megatron_sp.tensor_parallel.sharding import ShardSpec, local_dim_size

INIT_TAGS = ("normal", "scaled_normal", "embedding", "ones", "zeros")


def mark(
    param: nn.Parameter, spec: ShardSpec = ShardSpec(), sequence_parallel: bool = False, *, init: str
) -> nn.Parameter:
    """Tags a parameter with where it sits in the serial model (spec), whether it lives in the SP
    region (its gradient is a partial sum over the TP group) and how it is initialised
    (models/init.py: "normal" std, "scaled_normal" std/sqrt(2L), "ones", "zeros")."""
    if init not in INIT_TAGS:
        raise ValueError(f"unknown init tag {init!r}; use one of {INIT_TAGS}.")
    param.shard_spec = spec
    param.sequence_parallel = sequence_parallel
    param.init_tag = init
    return param


class InputCollective(enum.Enum):
    """The collective on the input side of a column GEMM (forward / backward). Row-parallel layers
    have none: their collective comes after the GEMM."""

    COPY = "copy"  # f: forward identity, backward all-reduce of the input gradient
    GATHER = "gather"  # g: forward all-gather dim 0, backward reduce-scatter dim 0
    GATHER_OVERLAP = "gather_overlap"  # g in t ring steps under the GEMM (tensor_parallel/overlap.py)


class _ParallelLinear(torch.autograd.Function):
    """y = collective(x) @ w.T (+ b) for collective COPY or GATHER (see InputCollective).

    GATHER saves only the local shard of x; backward gathers it again for the weight gradient
    (Megatron). In backward the re-gather overlaps the input-gradient GEMM, and the input-gradient
    collective overlaps the weight-gradient GEMM. fp8: the layer's Fp8Gemms (tensor_parallel/fp8.py),
    which runs the three GEMMs in FP8, or None; group None: no collective (FP8 at TP1, row layers).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, collective, fp8=None):
        ctx.group, ctx.gather, ctx.has_bias = group, collective is InputCollective.GATHER, bias is not None
        ctx.fp8, ctx.fp8_saved = fp8, None
        if fp8 is not None:  # it gathers x itself (in FP8 under tensor scales, keeping those bytes)
            gather = (lambda t: mappings._all_gather_dim0(t, group)) if ctx.gather else None
            out, ctx.fp8_saved = fp8.fprop(x, weight, gather)
            ctx.save_for_backward(ctx.fp8_saved.pop("x8", x), weight)
        else:
            ctx.save_for_backward(x, weight)
            total = mappings._all_gather_dim0(x, group) if ctx.gather else x
            out = torch.matmul(total, weight.t())  # autocast (bf16/fp16) applies here
        return out + bias.to(out.dtype) if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group, gather = ctx.group, ctx.gather
        # Functional collectives start at once and are waited for at first use (eagerly, and as
        # torch.compile traces them: the async c10d calls would break the graph).
        total = mappings.all_gather_start(x, group) if gather else x  # re-gather
        # Under autocast the GEMMs ran in grad_out's dtype; autograd casts our grads back to the
        # dtypes of x and weight (fp32 master weights).
        fp8 = ctx.fp8
        if fp8 is not None:
            grad_in = fp8.dgrad(grad_out, weight, ctx.fp8_saved)  # overlaps the re-gather
        else:
            grad_in = torch.matmul(grad_out, weight.to(grad_out.dtype))  # overlaps the re-gather
        total = total if x.dtype == torch.uint8 else total.to(grad_out.dtype)  # (uint8: FP8 bytes kept)
        if gather:
            grad_in = mappings.reduce_scatter_start(grad_in, group)
        elif group is not None:
            grad_in = funcol.all_reduce(grad_in, "sum", group)
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        if fp8 is not None:
            grad_w = fp8.wgrad(grad_out, total, ctx.fp8_saved)  # overlaps grad_in's collective
        else:
            grad_w = torch.matmul(g2.t(), total.reshape(-1, total.shape[-1]))  # overlaps grad_in's collective
        grad_b = g2.sum(0) if ctx.has_bias else None
        grad_in = funcol.wait_tensor(grad_in) if group is not None else grad_in
        return grad_in, grad_w, grad_b, None, None, None


def input_collective(sequence_parallel: bool, tp_comm_overlap: bool = False) -> InputCollective:
    """The input-side collective of a column GEMM: GATHER_OVERLAP, GATHER (SP) or COPY."""
    if tp_comm_overlap and not sequence_parallel:
        raise ValueError(
            "tp_comm_overlap needs sequence_parallel: it overlaps the sequence all-gather and reduce-scatter."
        )
    if tp_comm_overlap:
        return InputCollective.GATHER_OVERLAP
    return InputCollective.GATHER if sequence_parallel else InputCollective.COPY


def parallel_linear(x, weight, bias, group, collective: InputCollective, fp8=None):
    """Functional form of the column/row GEMM with its input-side collective (_ParallelLinear, or
    overlap.column_linear for GATHER_OVERLAP); a group of one runs a plain linear. fp8: an Fp8Gemms."""
    if group is None or dist.get_world_size(group) == 1:
        if fp8 is not None:
            return _ParallelLinear.apply(x, weight, bias, None, InputCollective.COPY, fp8)
        return nn.functional.linear(x, weight, bias)
    if fp8 is not None and collective is InputCollective.GATHER_OVERLAP:
        raise ValueError("FP8 GEMMs do not run under tp_comm_overlap; turn one of them off.")
    if fp8 is not None:
        return _ParallelLinear.apply(x, weight, bias, group, collective, fp8)
    if collective is InputCollective.GATHER_OVERLAP:
        return overlap.column_linear(x, weight, bias, group)
    return _ParallelLinear.apply(x, weight, bias, group, collective)


def _tp_info(group):
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class ColumnParallelLinear(nn.Module):
    """Y = X A with A split by columns (output features). Under SP the input is seq-sharded and
    all-gathered (g; with tp_comm_overlap in ring steps under the GEMM); otherwise it is copied (f).
    The output stays TP-sharded: [s, b, out_local].

    segments/units: a fused layer's output parts (sizes summing to out_features) and the heads each
    is made of (see tensor_parallel/sharding.py); each part is split on its own, so the local output
    is [part0_r | part1_r | ...]. init: the weight's init tag; the bias starts at zero.
    fp8: an Fp8Gemms (tensor_parallel/fp8.py) that runs the GEMMs in FP8, or None.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        init: str,
        group=None,
        sequence_parallel=False,
        tp_comm_overlap=False,
        bias=True,
        segments: tuple = (),
        units: tuple = (),
        dtype=torch.float32,
        device=None,
        fp8=None,
    ):
        super().__init__()
        t, _ = _tp_info(group)
        self.collective, self.fp8 = input_collective(sequence_parallel, tp_comm_overlap), fp8
        if segments and sum(segments) != out_features:
            raise ValueError(f"ColumnParallelLinear: segments {segments} do not add up to {out_features}.")
        spec = ShardSpec(0, tuple(segments), tuple(units))
        if not segments and out_features % t != 0:
            raise ValueError(f"ColumnParallelLinear: out_features {out_features} not divisible by {t}.")
        local = local_dim_size(spec, out_features, t)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = mark(nn.Parameter(torch.empty(local, in_features, dtype=dtype, device=device)), spec, init=init)
        self.bias = None
        if bias:
            self.bias = mark(nn.Parameter(torch.zeros(local, dtype=dtype, device=device)), spec, init="zeros")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return parallel_linear(x, self.weight, self.bias, self.group, self.collective, self.fp8)


class RowParallelLinear(nn.Module):
    """Y = X A with A split by rows (input features); X arrives TP-sharded [s, b, in/t].
    The partial products are reduce-scattered along the sequence (ḡ, SP; with tp_comm_overlap chunk by
    chunk under the GEMMs) or all-reduced (f̄). The bias is added after the collective, so under SP it
    lives in the SP region. fp8: as ColumnParallelLinear's."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        init: str,
        group=None,
        sequence_parallel=False,
        tp_comm_overlap=False,
        bias=True,
        dtype=torch.float32,
        device=None,
        fp8=None,
    ):
        super().__init__()
        t, _ = _tp_info(group)
        self.fp8 = fp8
        if in_features % t != 0:
            raise ValueError(f"RowParallelLinear: in_features {in_features} not divisible by {t}.")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.overlap = input_collective(sequence_parallel, tp_comm_overlap) is InputCollective.GATHER_OVERLAP and t > 1
        self.weight = mark(
            nn.Parameter(torch.empty(out_features, in_features // t, dtype=dtype, device=device)),
            ShardSpec(1),
            init=init,
        )
        self.bias = None
        if bias:
            self.bias = mark(
                nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)),
                sequence_parallel=sequence_parallel,
                init="zeros",
            )

    def forward(self, x: torch.Tensor, *, add_bias: bool = True) -> torch.Tensor:
        """add_bias=False leaves the bias to a fused bias-dropout-add that follows."""
        out = self._summed_product(x)
        return out + self.bias if (add_bias and self.bias is not None) else out

    def _summed_product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T summed over the TP group: [s, b, in/t] -> [s/t, b, out] (SP) or [s, b, out]."""
        if self.overlap:
            return overlap.row_linear(x, self.weight, self.group)
        if self.fp8 is not None:  # (no input collective: the GEMM alone)
            partial = _ParallelLinear.apply(x, self.weight, None, None, InputCollective.COPY, self.fp8)
        else:
            partial = torch.matmul(x, self.weight.t())  # [s, b, out] partial sum over ranks
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.group)
        return mappings.reduce_from_tensor_parallel_region(partial, self.group)


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocabulary split across TP ranks.

    Each rank looks up the ids in its vocab range and zeros the rest; the partial embeddings are
    summed with a reduce-scatter along the sequence under SP (the output enters the SP region),
    or an all-reduce otherwise.
    """

    def __init__(
        self,
        vocab_size: int,
        padded_vocab_size: int,
        hidden_size: int,
        *,
        init: str = "normal",
        group=None,
        sequence_parallel=False,
        dtype=torch.float32,
        device=None,
    ):
        super().__init__()
        t, rank = _tp_info(group)
        if padded_vocab_size % t != 0 or padded_vocab_size < vocab_size:
            raise ValueError(f"padded vocab {padded_vocab_size} must be >= {vocab_size} and divisible by {t}.")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size
        local = padded_vocab_size // t
        self.vocab_start, self.vocab_end = rank * local, (rank + 1) * local
        self.weight = mark(
            nn.Parameter(torch.empty(local, hidden_size, dtype=dtype, device=device)),
            ShardSpec(0, full=vocab_size),
            init=init,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, s] -> [s/t, b, h] (SP) or [s, b, h]."""
        ids = ids.t()  # [s, b]
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = nn.functional.embedding(local_ids, self.weight)
        partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)  # [s, b, h]
        if self.sequence_parallel:
            return mappings.reduce_scatter_to_sequence_parallel_region(partial, self.group)
        return mappings.reduce_from_tensor_parallel_region(partial, self.group)

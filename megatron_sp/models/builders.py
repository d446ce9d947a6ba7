"""Builders: the only place where the serial oracle and the tensor (+sequence) parallel model differ.

A model spec's blocks (models/blocks.py) create their layers through a builder:

    method                    SerialBuilder (oracle)           ParallelBuilder (TP, SP)
    column(in, out, ...)      nn.Linear  [out, in]             ColumnParallelLinear [out/t, in], gathers x under SP
    row(in, out, ...)         nn.Linear  [out, in]             RowParallelLinear [out, in/t], reduce(-scatter)s
    word_embedding(cfg)       [V, h] lookup                    VocabParallelEmbedding [V_pad/t, h]
    output_layer(cfg)         [V, h]                           [V_pad/t, h]
    lm_head(cfg)              logits, F.cross_entropy          vocab-parallel logits and cross entropy
    core_attention(cfg, l)    CausalAttention                  CausalAttention (context parallel: later)
    context(tokens, ...)      whole sequence                   this rank's rows of the SP region

`SequenceContext` is what every layer needs to know about the micro-batch (dropout indices of the
tokens a rank holds, positions for RoPE, the document mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_sp import ops
from megatron_sp.context_parallel.layout import cp_positions, document_ids
from megatron_sp.context_parallel.ring import RingAttention
from megatron_sp.context_parallel.ulysses import UlyssesAttention
from megatron_sp.models.attention import CausalAttention
from megatron_sp.ops.philox import DropoutIndex
from megatron_sp.tensor_parallel import mappings
from megatron_sp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_sp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    mark,
    parallel_linear,
)
from megatron_sp.tensor_parallel.sharding import ShardSpec


@dataclass
class SequenceContext:
    """The current micro-batch as one rank sees it (s_tp: this rank's tokens in the TP region, s_sp:
    in the SP region; with context parallelism s_tp = s / cp, in the CP layout's order).

    tokens, labels, loss_mask  [b, s_tp] this rank's tokens (labels/loss_mask may be None)
    full_index       DropoutIndex of the s_tp tokens (global positions; attention-probability dropout)
    shard_index      DropoutIndex of the s_sp tokens (hidden dropout, bias-dropout-add)
    position_ids     [b, s_tp] position of each token (RoPE; reset at document starts when asked)
    sp_position_ids  [s_sp, b] the same for the SP-region tokens (learned position embeddings)
    attention_mask   [b, 1, s, s] bool, True = masked out, or None (always None under CP)
    segments         [b, s_tp] document id of each token when the mask is block-diagonal, else None
    cp               CPLayout under context parallelism, else None
    """

    tokens: torch.Tensor
    labels: Optional[torch.Tensor]
    loss_mask: Optional[torch.Tensor]
    full_index: DropoutIndex
    shard_index: DropoutIndex
    position_ids: torch.Tensor
    sp_position_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    segments: Optional[torch.Tensor]
    training: bool
    cp: Optional["CPLayout"] = None


@dataclass
class CPLayout:
    """The whole sequence of a CP group: which positions each rank holds, and the documents."""

    seq_length: int
    size: int
    rank: int
    comm_type: str
    whole_segments: Optional[torch.Tensor]  # [b, s] or None
    whole: SequenceContext  # the whole sequence (what Ulysses' core attends over)

    def positions(self, rank: int, device=None) -> torch.Tensor:
        return cp_positions(self.seq_length, self.size, rank, self.comm_type, device=device)

    def segments(self, rank: int):
        if self.whole_segments is None:
            return None
        return self.whole_segments[:, self.positions(rank, self.whole_segments.device)]


def masked_mean(loss_bs: torch.Tensor, loss_mask) -> torch.Tensor:
    """Mean per-token loss [b, s] over the tokens whose loss_mask is 1 (all when None)."""
    if loss_mask is None:
        return loss_bs.mean()
    loss_mask = loss_mask.to(loss_bs.dtype)
    return (loss_bs * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


def _check_length(cfg, s):
    if s > cfg.max_position_embeddings:
        raise ValueError(f"sequence of {s} tokens exceeds max_position_embeddings ({cfg.max_position_embeddings}).")


def sequence_context(
    cfg, tokens, labels, loss_mask, position_ids, attention_mask, sample_ids, training, rows: slice, cp=None
):
    """rows: this rank's SP-region rows of its s_tp tokens; cp: (size, rank, comm_type) or None."""
    b, s = tokens.shape
    _check_length(cfg, s)
    device = tokens.device
    if sample_ids is None:
        sample_ids = torch.arange(b, device=device)
    if position_ids is None:
        position_ids = torch.arange(s, device=device).expand(b, s)
    segments = document_ids(attention_mask) if attention_mask is not None else None
    positions = torch.arange(s, device=device)
    whole = SequenceContext(
        tokens,
        labels,
        loss_mask,
        DropoutIndex(positions, sample_ids),
        DropoutIndex(positions[rows], sample_ids),
        position_ids,
        position_ids.t()[rows],
        attention_mask,
        segments,
        training,
    )
    if cp is None:
        return whole
    size, rank, comm_type = cp
    if attention_mask is not None and segments is None:
        raise ValueError(
            "with context parallelism the attention mask must be a document mask (block-diagonal, "
            "as --reset-attention-mask makes); other masks need context_parallel_size 1."
        )
    whole.attention_mask = None
    layout = CPLayout(s, size, rank, comm_type, segments, whole)
    local = layout.positions(rank, device)
    pick = lambda t: None if t is None else t[:, local]
    local_positions = position_ids[:, local]
    return SequenceContext(
        tokens[:, local],
        pick(labels),
        pick(loss_mask),
        DropoutIndex(local, sample_ids),
        DropoutIndex(local[rows], sample_ids),
        local_positions,
        local_positions.t()[rows],
        None,
        pick(segments),
        training,
        layout,
    )


# ---- serial -----------------------------------------------------------------------------------


class Linear(nn.Linear):
    """nn.Linear whose parameters carry init tags (and the parallel layer's ShardSpec, so checkpoint
    conversion sees one layout); forward(x, add_bias=False) leaves the bias to the caller."""

    def __init__(self, in_features, out_features, *, init, bias, spec=ShardSpec()):
        super().__init__(in_features, out_features, bias=bias)
        mark(self.weight, spec, init=init)
        if bias:
            mark(self.bias, spec if spec.dim == 0 else ShardSpec(), init="zeros")

    def forward(self, x, *, add_bias: bool = True):
        return F.linear(x, self.weight, self.bias if add_bias else None)


class WordEmbedding(nn.Module):
    def __init__(self, vocab_size, hidden_size, init="normal"):
        super().__init__()
        self.weight = mark(nn.Parameter(torch.empty(vocab_size, hidden_size)), ShardSpec(0, full=vocab_size), init=init)

    def forward(self, ids):
        return F.embedding(ids.t(), self.weight)  # [s, b, h]


class OutputLayer(nn.Module):
    """The untied output projection's weight [V(/t), h] (the head applies it)."""

    def __init__(self, rows, hidden_size, vocab_size):
        super().__init__()
        self.weight = mark(nn.Parameter(torch.empty(rows, hidden_size)), ShardSpec(0, full=vocab_size), init="normal")


class SerialLMHead(nn.Module):
    def forward(self, hidden, weight, ctx):
        logits = torch.matmul(hidden, weight.t())  # [s, b, V]
        if ctx.labels is None:
            return logits.transpose(0, 1)
        b, s = ctx.labels.shape
        loss = F.cross_entropy(logits.float().flatten(0, 1), ctx.labels.t().flatten(), reduction="none")
        return masked_mean(loss.view(s, b).t(), ctx.loss_mask)


class SerialBuilder:
    """Plain torch.nn layers on whole tensors: the oracle that defines the function."""

    tp_size, tp_rank, sequence_parallel = 1, 0, False

    def column(self, in_features, out_features, *, init, bias, segments=(), units=()):
        return Linear(in_features, out_features, init=init, bias=bias, spec=ShardSpec(0, segments, units))

    def row(self, in_features, out_features, *, init, bias):
        return Linear(in_features, out_features, init=init, bias=bias, spec=ShardSpec(1))

    def word_embedding(self, cfg):
        return WordEmbedding(cfg.vocab_size, cfg.hidden_size)

    def output_layer(self, cfg):
        return OutputLayer(cfg.vocab_size, cfg.hidden_size, cfg.vocab_size)

    def lm_head(self, cfg):
        return SerialLMHead()

    def core_attention(self, cfg, layer):
        return CausalAttention(cfg, layer)

    def context(self, cfg, tokens, *, labels, loss_mask, position_ids, attention_mask, sample_ids, training):
        return sequence_context(
            cfg,
            tokens,
            labels,
            loss_mask,
            position_ids,
            attention_mask,
            sample_ids,
            training,
            slice(0, tokens.shape[1]),
        )


# ---- tensor (+ sequence) parallel ---------------------------------------------------------------


class ParallelLMHead(nn.Module):
    """hidden [s_sp, b, h] -> logits [s_tp, b, V_pad/t] (g under SP) -> vocab-parallel cross entropy;
    under CP the mean runs over the whole sequence (sums and counts all-reduced over the CP group)."""

    def __init__(self, cfg, ps):
        super().__init__()
        self.vocab_size, self.group, self.sp = cfg.vocab_size, ps.tp_group, cfg.sequence_parallel
        self.vocab_start = ps.tp_rank * (cfg.padded_vocab_size // ps.tp_size)
        self.cp_group, self.cp_size, self.fused = ps.cp_group, ps.cp_size, cfg.use_fused_kernels

    def forward(self, hidden, weight, ctx):
        logits = parallel_linear(hidden, weight, None, self.group, "sp" if self.sp else "tp")
        if ctx.labels is None:
            return self._logits(logits, ctx)
        loss = vocab_parallel_cross_entropy(
            logits, ctx.labels.t(), group=self.group, vocab_size=self.vocab_size, vocab_start=self.vocab_start
        ).t()  # [b, s_tp]
        if self.cp_size == 1:
            return masked_mean(loss, ctx.loss_mask)
        mask = ctx.loss_mask.to(loss.dtype) if ctx.loss_mask is not None else torch.ones_like(loss)
        total = mappings.reduce_from_tensor_parallel_region((loss * mask).sum(), self.cp_group)
        count = mask.sum().detach()
        dist.all_reduce(count, group=self.cp_group)
        return total / count.clamp(min=1.0)

    def _logits(self, logits, ctx):
        full = mappings.gather_from_tensor_parallel_region(logits, self.group)[..., : self.vocab_size]
        if self.cp_size > 1:  # whole sequence, natural order
            full = mappings.gather_from_sequence_parallel_region(full, self.cp_group, tensor_parallel_output_grad=False)
            if ctx.cp.comm_type == "p2p":  # the ranks' zigzag chunks, undone
                full = ops.zigzag_reorder(full.contiguous(), self.cp_size, dim=0, inverse=True, fused=self.fused)
        return full.transpose(0, 1)


class ParallelBuilder:
    """Megatron's layers on this rank's shards; `ps` gives the TP group and coordinates."""

    def __init__(self, cfg, ps):
        self.ps, self.group = ps, ps.tp_group
        self.tp_size, self.tp_rank, self.sequence_parallel = ps.tp_size, ps.tp_rank, cfg.sequence_parallel

    def column(self, in_features, out_features, *, init, bias, segments=(), units=()):
        return ColumnParallelLinear(
            in_features,
            out_features,
            init=init,
            group=self.group,
            sequence_parallel=self.sequence_parallel,
            bias=bias,
            segments=segments,
            units=units,
        )

    def row(self, in_features, out_features, *, init, bias):
        return RowParallelLinear(
            in_features, out_features, init=init, group=self.group, sequence_parallel=self.sequence_parallel, bias=bias
        )

    def word_embedding(self, cfg):
        return VocabParallelEmbedding(
            cfg.vocab_size,
            cfg.padded_vocab_size,
            cfg.hidden_size,
            group=self.group,
            sequence_parallel=self.sequence_parallel,
        )

    def output_layer(self, cfg):
        return OutputLayer(cfg.padded_vocab_size // self.tp_size, cfg.hidden_size, cfg.vocab_size)

    def lm_head(self, cfg):
        return ParallelLMHead(cfg, self.ps)

    def core_attention(self, cfg, layer):
        core = CausalAttention(cfg, layer)
        if self.ps.cp_size == 1:
            return core
        if cfg.cp_comm_type == "a2a":
            return UlyssesAttention(core, self.ps, cfg.use_fused_kernels)
        return RingAttention(cfg, layer, self.ps)

    def context(self, cfg, tokens, *, labels, loss_mask, position_ids, attention_mask, sample_ids, training):
        cp = (self.ps.cp_size, self.ps.cp_rank, cfg.cp_comm_type) if self.ps.cp_size > 1 else None
        s = tokens.shape[1] // self.ps.cp_size  # this rank's tokens
        rows = slice(0, s)
        if self.sequence_parallel:
            if s % self.tp_size != 0:
                raise ValueError(
                    f"sequence length {tokens.shape[1]} is not divisible by TP size {self.tp_size} "
                    f"× CP size {self.ps.cp_size} under sequence parallelism."
                )
            local = s // self.tp_size
            rows = slice(self.tp_rank * local, (self.tp_rank + 1) * local)
        return sequence_context(
            cfg, tokens, labels, loss_mask, position_ids, attention_mask, sample_ids, training, rows, cp
        )

"""The micro-batch as one rank sees it: what every layer needs to know besides its activations.

The builder makes one `SequenceContext` per forward (SerialBuilder: the whole sequence;
ParallelBuilder: this rank's tokens under CP and its SP-region rows) and every layer reads it as
`seq` (the dropout indices of the tokens the rank holds, positions for RoPE, the document mask).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from megatron_sp.context_parallel.split import CPSplit, document_ids_from_mask
from megatron_sp.layer_options import zigzag_split
from megatron_sp.ops.philox import DropoutIndex


class AuxShares(MutableMapping):
    """{(layer, name): tensor}: the MoE auxiliary-loss shares of one forward (models/moe/losses.py).
    A mapping that is no dict: FSDP2 rebuilds a module's dict and dataclass arguments holding tensors
    that require gradients (torch.distributed.fsdp's replace_grad_tensors), which would leave the shares
    a layer records in a copy that the loss never sees; it does not look inside this."""

    def __init__(self):
        self._shares = {}

    def __getitem__(self, key):
        return self._shares[key]

    def __setitem__(self, key, value):
        self._shares[key] = value

    def __delitem__(self, key):
        del self._shares[key]

    def __iter__(self):
        return iter(self._shares)

    def __len__(self):
        return len(self._shares)


@dataclass
class SequenceContext:
    """s_tp: this rank's tokens in the TP region, s_sp: in the SP region (s_tp / t under SP); with
    context parallelism s_tp = s / cp, in the CP split's order.

    tokens, labels, loss_mask  [b, s_tp] this rank's tokens (labels/loss_mask may be None)
    tp_index         DropoutIndex of the s_tp tokens (global positions; attention-probability dropout)
    sp_index         DropoutIndex of the s_sp tokens (hidden dropout, bias-dropout-add)
    position_ids     [b, s_tp] position of each token (RoPE; reset at document starts when asked)
    sp_position_ids  [s_sp, b] the same for the SP-region tokens (learned position embeddings)
    attention_mask   [b, 1, s, s] bool, True = masked out, or None (always None under CP)
    document_ids     [b, s_tp] document of each token when the mask is block-diagonal, else None
    training         dropout on
    cp_split         CPSplit under context parallelism, else None
    whole            under context parallelism, the whole sequence's context (what Ulysses' core
                     attends over), else None
    moe_losses       {(layer, name): this rank's share of an MoE auxiliary loss} (models/moe/losses.py)
    """

    tokens: torch.Tensor
    labels: Optional[torch.Tensor]
    loss_mask: Optional[torch.Tensor]
    tp_index: DropoutIndex
    sp_index: DropoutIndex
    position_ids: torch.Tensor
    sp_position_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    document_ids: Optional[torch.Tensor]
    training: bool
    cp_split: Optional[CPSplit] = None
    whole: Optional["SequenceContext"] = None
    moe_losses: AuxShares = field(default_factory=AuxShares)


def _check_length(cfg, s):
    if s > cfg.max_position_embeddings:
        raise ValueError(f"sequence of {s} tokens exceeds max_position_embeddings ({cfg.max_position_embeddings}).")


def sequence_context(
    cfg,
    tokens,
    *,
    labels,
    loss_mask,
    position_ids,
    attention_mask,
    sample_ids,
    training,
    sp_rows: slice,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> SequenceContext:
    """tokens [b, s] (the whole sequence); sp_rows: this rank's SP-region rows of its s_tp tokens."""
    _check_length(cfg, tokens.shape[1])
    whole = _whole_sequence(tokens, labels, loss_mask, position_ids, attention_mask, sample_ids, training, sp_rows)
    if cp_size == 1:
        return whole
    if attention_mask is not None and whole.document_ids is None:
        raise ValueError(
            "with context parallelism the attention mask must be a document mask (block-diagonal, "
            "as --reset-attention-mask makes); other masks need context_parallel_size 1."
        )
    split = CPSplit(tokens.shape[1], cp_size, cp_rank, zigzag_split(cfg), whole.document_ids)
    return _cp_rank_context(replace(whole, attention_mask=None), split, sp_rows)


def _whole_sequence(tokens, labels, loss_mask, position_ids, attention_mask, sample_ids, training, sp_rows):
    """The context of the whole sequence, with the default positions and sample ids filled in."""
    batch, s = tokens.shape
    device = tokens.device
    if sample_ids is None:
        sample_ids = torch.arange(batch, device=device)
    if position_ids is None:
        position_ids = torch.arange(s, device=device).expand(batch, s)
    positions = torch.arange(s, device=device)
    return SequenceContext(
        tokens=tokens,
        labels=labels,
        loss_mask=loss_mask,
        tp_index=DropoutIndex(positions, sample_ids),
        sp_index=DropoutIndex(positions[sp_rows], sample_ids),
        position_ids=position_ids,
        sp_position_ids=position_ids.t()[sp_rows],
        attention_mask=attention_mask,
        document_ids=document_ids_from_mask(attention_mask) if attention_mask is not None else None,
        training=training,
    )


def _cp_rank_context(whole: SequenceContext, split: CPSplit, sp_rows: slice) -> SequenceContext:
    """The tokens CP rank `split.rank` holds, out of the whole sequence's context."""
    local = split.positions(split.rank, whole.tokens.device)  # [s/cp] global positions
    sample_ids = whole.tp_index.sample_ids

    def pick(t):  # [b, s] -> [b, s/cp]
        return None if t is None else t[:, local]

    local_position_ids = pick(whole.position_ids)
    return SequenceContext(
        tokens=pick(whole.tokens),
        labels=pick(whole.labels),
        loss_mask=pick(whole.loss_mask),
        tp_index=DropoutIndex(local, sample_ids),
        sp_index=DropoutIndex(local[sp_rows], sample_ids),
        position_ids=local_position_ids,
        sp_position_ids=local_position_ids.t()[sp_rows],
        attention_mask=None,
        document_ids=pick(whole.document_ids),
        training=whole.training,
        cp_split=split,
        whole=whole,
    )

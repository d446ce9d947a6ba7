"""The language-model head: logits from the final hidden states, and the mean cross entropy.

    SerialLMHead    hidden [s, b, h] -> logits [s, b, V] -> F.cross_entropy
    ParallelLMHead  hidden [s_sp, b, h] -> logits [s_tp, b, V_pad/t] (g under SP) -> vocab-parallel
                    cross entropy; under CP the mean runs over the whole sequence (sums and token
                    counts all-reduced over the CP group)

Both take the output weight from the model (the word embedding's when tied, OutputLayer's when
not) and return the mean loss, or the logits [b, s, V] when the micro-batch has no labels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_sp import ops
from megatron_sp.tensor_parallel import mappings
from megatron_sp.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_sp.tensor_parallel.layers import input_collective, mark, parallel_linear
from megatron_sp.tensor_parallel.sharding import ShardSpec


def masked_mean(loss_bs: torch.Tensor, loss_mask) -> torch.Tensor:
    """Mean per-token loss [b, s] over the tokens whose loss_mask is 1 (all when None)."""
    if loss_mask is None:
        return loss_bs.mean()
    loss_mask = loss_mask.to(loss_bs.dtype)
    return (loss_bs * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


class OutputLayer(nn.Module):
    """The untied output projection's weight [V, h] (serial) or [V_pad/t, h] (a TP rank's rows)."""

    def __init__(self, rows, hidden_size, vocab_size):
        super().__init__()
        self.weight = mark(nn.Parameter(torch.empty(rows, hidden_size)), ShardSpec(0, full=vocab_size), init="normal")


class SerialLMHead(nn.Module):
    def forward(self, hidden, weight, seq):
        logits = torch.matmul(hidden, weight.t())  # [s, b, V]
        if seq.labels is None:
            return logits.transpose(0, 1)
        batch, s = seq.labels.shape
        loss = F.cross_entropy(logits.float().flatten(0, 1), seq.labels.t().flatten(), reduction="none")
        return masked_mean(loss.view(s, batch).t(), seq.loss_mask)


class ParallelLMHead(nn.Module):
    """The head on a rank's vocabulary shard (see the module docstring)."""

    def __init__(self, cfg, ps):
        super().__init__()
        self.vocab_size, self.group = cfg.vocab_size, ps.tp_group
        self.collective = input_collective(cfg.sequence_parallel, cfg.tp_comm_overlap)  # the logits GEMM's gather
        self.vocab_start = ps.tp_rank * (cfg.padded_vocab_size // ps.tp_size)
        self.cp_group, self.cp_size, self.fused = ps.cp_group, ps.cp_size, cfg.use_fused_kernels

    def forward(self, hidden, weight, seq):
        logits_shard = parallel_linear(hidden, weight, None, self.group, self.collective)
        if seq.labels is None:
            return self._gathered_logits(logits_shard, seq)
        loss = vocab_parallel_cross_entropy(
            logits_shard, seq.labels.t(), group=self.group, vocab_size=self.vocab_size, vocab_start=self.vocab_start
        ).t()  # [b, s_tp]
        if self.cp_size == 1:
            return masked_mean(loss, seq.loss_mask)
        return self._cp_mean(loss, seq.loss_mask)

    def _cp_mean(self, loss, loss_mask):
        """The mean over the whole sequence of the CP group: sum and count all-reduced."""
        mask = loss_mask.to(loss.dtype) if loss_mask is not None else torch.ones_like(loss)
        total = mappings.reduce_from_tensor_parallel_region((loss * mask).sum(), self.cp_group)
        count = mask.sum().detach()
        dist.all_reduce(count, group=self.cp_group)
        return total / count.clamp(min=1.0)

    def _gathered_logits(self, logits_shard, seq):
        """[s_tp, b, V_pad/t] -> [b, s, V]: the vocabulary (and under CP the sequence) gathered."""
        logits = mappings.gather_from_tensor_parallel_region(logits_shard, self.group)[..., : self.vocab_size]
        if self.cp_size > 1:  # whole sequence, natural order
            logits = mappings.gather_from_sequence_parallel_region(
                logits, self.cp_group, tensor_parallel_output_grad=False
            )
            if seq.cp_split.zigzag:  # the ranks' zigzag chunks, undone
                logits = ops.zigzag_reorder(logits.contiguous(), self.cp_size, dim=0, inverse=True, fused=self.fused)
        return logits.transpose(0, 1)

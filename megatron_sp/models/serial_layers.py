"""The serial oracle's layers (SerialBuilder): plain torch.nn on whole tensors, whose parameters
carry the init tag and the ShardSpec of their parallel twin (so checkpoint conversion sees one
set of shapes and split dimensions for both models)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_sp.tensor_parallel.layers import mark
from megatron_sp.tensor_parallel.sharding import ShardSpec


class Linear(nn.Linear):
    """nn.Linear [out, in] with init tags; forward(x, add_bias=False) leaves the bias to the caller."""

    def __init__(self, in_features, out_features, *, init, bias, shard_spec=ShardSpec()):
        super().__init__(in_features, out_features, bias=bias)
        mark(self.weight, shard_spec, init=init)
        if bias:
            mark(self.bias, shard_spec if shard_spec.dim == 0 else ShardSpec(), init="zeros")

    def forward(self, x, *, add_bias: bool = True):
        return F.linear(x, self.weight, self.bias if add_bias else None)


class WordEmbedding(nn.Module):
    """ids [b, s] -> [s, b, h] from the whole [V, h] table."""

    def __init__(self, vocab_size, hidden_size, init="normal"):
        super().__init__()
        self.weight = mark(nn.Parameter(torch.empty(vocab_size, hidden_size)), ShardSpec(0, full=vocab_size), init=init)

    def forward(self, ids):
        return F.embedding(ids.t(), self.weight)  # [s, b, h]

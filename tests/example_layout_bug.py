"""A block with a planted layout bug, for tools/check_parity.py's test: an MLP with a learned output
gain that lives in the sequence-parallel region (each rank scales only its own tokens) but is
tagged without `sequence_parallel=builder.sequence_parallel`, so under TP+SP its gradient stays
each rank's partial sum. The serial model, TP without SP, CP, PP and DP are all right; TP+SP
is not, and the check must name `layers.N.mlp.gain`."""

import torch
from torch import nn

from megatron_sp.models.blocks import MLP
from megatron_sp.models.spec import BlockSpec, ModelSpec
from megatron_sp.tensor_parallel.layers import mark


class GainMLP(MLP):
    def __init__(self, cfg, *, layer, builder, block_spec):
        super().__init__(cfg, layer=layer, builder=builder, block_spec=block_spec)
        self.gain = mark(nn.Parameter(torch.ones(cfg.hidden_size)), init="ones")  # the bug: no sequence_parallel

    def forward(self, x, seq=None):  # (the mlp slot's forward: models/blocks.py)
        return super().forward(x, seq) * self.gain  # [s_sp, b, h]: this rank's tokens under SP


SPEC = ModelSpec(
    name="layout-bug",
    block=BlockSpec(mlp=GainMLP),
    defaults=dict(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope"),
)

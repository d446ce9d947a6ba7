"""A model spec: the serial-first definition of a model family, from which models/language_model.py
builds both the serial oracle (ReferenceGPT) and the tensor + sequence parallel model (GPTModel).

    ModelSpec(name, block=BlockSpec(norm, attention, mlp, bias_dropout_add, layout),
              embedding, final_norm, defaults)

Every class is called with the config and a builder (models/builders.py); the contracts are in
models/blocks.py. `defaults` fills the GPTConfig fields a user left at None (the family's
normalisation, activation, positions, ...). A new block variant is one file with its classes and a
`SPEC = ModelSpec(...)`, plus one line in megatron_sp/families.py (README: "Write your own model").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sp.models.attention import SelfAttention
from megatron_sp.models.blocks import MLP, BiasDropoutAdd, Embedding, Norm, PreNormBlock


@dataclass(frozen=True)
class BlockSpec:
    """The submodules of one transformer layer and how they are wired (`layout`)."""

    norm: type = Norm
    attention: type = SelfAttention
    mlp: type = MLP
    bias_dropout_add: type = BiasDropoutAdd
    layout: type = PreNormBlock

    def build(self, cfg, layer: int, builder):
        return self.layout(cfg, layer, builder, self)


@dataclass(frozen=True)
class ModelSpec:
    """A model family: its layer, embedding, final norm and GPTConfig defaults."""

    name: str
    block: BlockSpec = BlockSpec()
    embedding: type = Embedding
    final_norm: type = Norm
    defaults: dict = field(default_factory=dict)
    description: str = ""

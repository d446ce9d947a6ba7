"""A model spec: the serial-first definition of a model family, from which models/language_model.py
builds both the serial oracle (ReferenceGPT) and the tensor + sequence parallel model (GPTModel).

    ModelSpec(name, block=BlockSpec(norm, attention, core_attention, mlp, bias_dropout_add, wiring),
              embedding, final_norm, defaults)

Every slot is a class called as `Slot(cfg, layer=..., builder=..., block_spec=...)` (the builder
is models/builders.py's; the contracts are in models/blocks.py). `defaults` fills the GPTConfig
fields a user left at None (normalisation, activation, positions, ...) for a spec outside the
registry (`--model package.module:SPEC`); a registered family's defaults are data in
megatron_sp/families.py, so a config is built without importing this module. A new block variant
is one file with its classes and a `SPEC = ModelSpec(...)`, plus one line in megatron_sp/families.py
(docs/models.md: "Write your own model", "Add a family").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_sp.layer_options import is_moe_layer
from megatron_sp.models.attention import CausalAttention, SelfAttention
from megatron_sp.models.blocks import MLP, BiasDropoutAdd, Embedding, Norm, PreNormBlock
from megatron_sp.models.moe.moe_layer import MoELayer


@dataclass(frozen=True)
class BlockSpec:
    """The submodules of one transformer layer, and the `wiring` that creates and connects them."""

    norm: type = Norm
    attention: type = SelfAttention
    core_attention: type = CausalAttention
    mlp: type = MLP
    bias_dropout_add: type = BiasDropoutAdd
    wiring: type = PreNormBlock
    moe: type = MoELayer  # the mlp of the layers --moe-layer-freq makes mixture-of-experts

    def mlp_class(self, cfg, layer: int) -> type:
        """The MLP slot of layer `layer` (1-based): `moe` where cfg makes it an MoE layer."""
        return self.moe if is_moe_layer(cfg, layer) else self.mlp

    def build(self, cfg, *, layer: int, builder):
        return self.wiring(cfg, layer=layer, builder=builder, block_spec=self)


@dataclass(frozen=True)
class ModelSpec:
    """A model family: its layer, embedding, final norm and GPTConfig defaults."""

    name: str
    block: BlockSpec = BlockSpec()
    embedding: type = Embedding
    final_norm: type = Norm
    defaults: dict = field(default_factory=dict)
    description: str = ""

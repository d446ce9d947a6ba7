"""A new block variant in one file: the parallel residual layer of GPT-J / GPT-NeoX / PaLM,

    x + attn(ln1(x)) + mlp(ln1(x))        (one norm, attention and MLP side by side)

built from the library's attention, MLP, norm and bias-dropout-add. Registering it is one line,
`register_model("parallel-residual", "example_parallel_residual:SPEC")` (or that line in
megatron_sp/families.py's FAMILIES), or pass `--model example_parallel_residual:SPEC`.
The serial oracle and the TP+SP model both come from this definition, so the parity harness
checks it with no extra code (tests/test_parity.py::test_user_block_gets_parity_for_free).
"""

from torch import nn

from megatron_sp.models.spec import BlockSpec, ModelSpec
from megatron_sp.ops import philox


class ParallelResidualBlock(nn.Module):
    def __init__(self, cfg, *, layer, builder, block_spec):  # every slot is called this way
        super().__init__()
        slot = dict(layer=layer, builder=builder, block_spec=block_spec)
        self.ln1 = block_spec.norm(cfg, **slot)
        self.attn = block_spec.attention(cfg, **slot)
        self.mlp = block_spec.mlp(cfg, **slot)
        self.bda = block_spec.bias_dropout_add(cfg, **slot)

    def forward(self, x, seq):
        h = self.ln1(x)  # [s_sp, b, h]
        x = self.bda(self.attn(h, seq), self.attn.output_bias, x, philox.SITE_ATTENTION_OUT, seq)
        return self.bda(self.mlp(h), self.mlp.output_bias, x, philox.SITE_MLP_OUT, seq)


SPEC = ModelSpec(
    name="parallel-residual",
    block=BlockSpec(wiring=ParallelResidualBlock),
    defaults=dict(normalization="LayerNorm", activation="openai_gelu", position_embedding_type="rope"),
)

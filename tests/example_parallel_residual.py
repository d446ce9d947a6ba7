"""A new block variant in one file: the parallel residual layer of GPT-J / GPT-NeoX / PaLM,

    x + attn(ln1(x)) + mlp(ln1(x))        (one norm, attention and MLP side by side)

built from the library's attention, MLP, norm and bias-dropout-add. Registering it is one line,
`register_model("parallel-residual", "example_parallel_residual:SPEC")` (or that line in
megatron_sp/families.py's MODELS), or pass `--model example_parallel_residual:SPEC`.
The serial oracle and the TP+SP model both come from this definition, so the parity harness
checks it with no extra code (tests/test_parity.py::test_user_block_gets_parity_for_free).
"""

from torch import nn

from megatron_sp.models.spec import BlockSpec, ModelSpec
from megatron_sp.tensor_parallel import random as tp_random


class ParallelResidualBlock(nn.Module):
    def __init__(self, cfg, layer, b, spec):
        super().__init__()
        self.ln1 = spec.norm(cfg, b)
        self.attn = spec.attention(cfg, layer, b)
        self.mlp = spec.mlp(cfg, layer, b)
        self.bda = spec.bias_dropout_add(cfg, layer)

    def forward(self, x, ctx):
        h = self.ln1(x)  # [s_sp, b, h]
        x = self.bda(self.attn(h, ctx), self.attn.output_bias, x, tp_random.SITE_ATTENTION_OUT, ctx)
        return self.bda(self.mlp(h), self.mlp.output_bias, x, tp_random.SITE_MLP_OUT, ctx)


SPEC = ModelSpec(
    name="parallel-residual",
    block=BlockSpec(layout=ParallelResidualBlock),
    defaults=dict(normalization="LayerNorm", activation="openai_gelu", position_embedding_type="rope"),
)

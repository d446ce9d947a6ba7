"""GPT-2: learned positions, pre-LayerNorm blocks, GELU MLP, biases, tied input/output embeddings.
(--openai-gelu selects GPT-2's tanh GELU; the default is the exact erf GELU, as in Megatron-LM.)"""

from megatron_sp.models.spec import ModelSpec

SPEC = ModelSpec(
    name="gpt2",
    defaults=dict(
        normalization="LayerNorm",
        activation="gelu",
        position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=False,
        add_bias_linear=True,
    ),
    description="GPT-2 (Radford et al. 2019) / Megatron-LM's default GPT",
)

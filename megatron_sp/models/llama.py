"""Llama: RMSNorm, SwiGLU MLP (fused gate/up), rotary positions, grouped-query attention when
num_query_groups < num_attention_heads, no biases, untied output layer (Llama 2/3 layout)."""

from megatron_sp.models.spec import ModelSpec

SPEC = ModelSpec(
    name="llama",
    defaults=dict(
        normalization="RMSNorm",
        activation="swiglu",
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        add_bias_linear=False,
    ),
    description="Llama 2/3 (Touvron et al. 2023; Grattafiori et al. 2024)",
)

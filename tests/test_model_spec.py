"""Model specs and the registry: families fill GPTConfig's defaults, untagged parameters are refused,
the attention core is a slot of the spec, documents packed with reset positions compute what each
document computes alone (learned positions and RoPE), and the config refuses bad architecture fields
naming them."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_sp import families
from megatron_sp.config import GPTConfig
from megatron_sp.models import registry
from megatron_sp.models.attention import CausalAttention
from megatron_sp.models.builders import ParallelBuilder
from megatron_sp.models.reference import ReferenceGPT
from megatron_sp.models.spec import BlockSpec, ModelSpec

BASE = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=97,
    seq_length=32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    use_fused_kernels=False,
)


def test_families_set_defaults_and_flags_override():
    gpt2, llama = GPTConfig(**BASE), GPTConfig(**BASE, model="llama")
    assert (gpt2.normalization, gpt2.activation, gpt2.position_embedding_type) == (
        "LayerNorm",
        "gelu",
        "learned_absolute",
    )
    assert (llama.normalization, llama.activation, llama.position_embedding_type) == ("RMSNorm", "swiglu", "rope")
    assert llama.untie_embeddings_and_output_weights and not llama.add_bias_linear and not llama.add_qkv_bias
    assert llama.ffn_hidden_size == 128 and llama.num_query_groups == 4  # Megatron's 8h/3 rule, MHA
    tied = GPTConfig(**BASE, model="llama", untie_embeddings_and_output_weights=False, add_bias_linear=True)
    assert not tied.untie_embeddings_and_output_weights and tied.add_qkv_bias
    for cfg in (gpt2, llama, tied):  # the formula counts the model
        assert cfg.num_parameters() == sum(p.numel() for p in ReferenceGPT(cfg).parameters())


def test_registry_names_paths_and_errors():
    assert registry.get_spec("llama").name == "llama"
    assert registry.get_spec("example_parallel_residual:SPEC").name == "parallel-residual"
    families.register_model("parallel-residual", "example_parallel_residual:SPEC")
    try:
        assert GPTConfig(**BASE, model="parallel-residual").activation == "openai_gelu"
    finally:
        del families.FAMILIES["parallel-residual"]
    with pytest.raises(ValueError, match="GPTConfig.model: unknown model 'nope'; registered: gpt2, gpt_oss, llama"):
        GPTConfig(**BASE, model="nope")
    with pytest.raises(ValueError, match="cannot load"):
        GPTConfig(**BASE, model="no_such_module:SPEC")
    with pytest.raises(ValueError, match="not a ModelSpec"):
        GPTConfig(**BASE, model="megatron_sp.families:FAMILIES")


class _UntaggedMLP(nn.Module):
    def __init__(self, cfg, *, layer, builder, block_spec):
        super().__init__()
        self.fc1 = builder.column(cfg.hidden_size, cfg.ffn_hidden_size, init="normal", bias=True)
        self.scale = nn.Parameter(torch.ones(cfg.ffn_hidden_size))  # no init tag
        self.fc2 = builder.row(cfg.ffn_hidden_size, cfg.hidden_size, init="scaled_normal", bias=True)
        self.output_bias = self.fc2.bias

    def forward(self, x):
        return self.fc2(self.fc1(x) * self.scale, add_bias=False)


def test_untagged_parameter_is_an_error():
    spec = ModelSpec(name="untagged", block=BlockSpec(mlp=_UntaggedMLP))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.scale has no init tag.*1 more untagged"):
        ReferenceGPT(GPTConfig(**BASE), spec)


class _CountingCore(CausalAttention):
    calls = 0

    def forward(self, q, k, v, seq, head_offset):
        _CountingCore.calls += 1
        return super().forward(q, k, v, seq, head_offset)


def test_core_attention_is_a_spec_slot():
    """The spec's core runs in every layer (same function as the default one); ring attention, which
    computes causal attention itself, refuses a core it would not run."""
    cfg = GPTConfig(**BASE)
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    default = ReferenceGPT(cfg)
    custom = ReferenceGPT(cfg, ModelSpec(name="counting", block=BlockSpec(core_attention=_CountingCore)))
    torch.testing.assert_close(custom(tokens, tokens), default(tokens, tokens), rtol=0, atol=0)
    assert _CountingCore.calls == cfg.num_layers
    ps = SimpleNamespace(tp_group=None, tp_size=1, tp_rank=0, cp_size=2, cp_rank=0)
    core = _CountingCore(cfg, layer=1, builder=None, block_spec=None)
    with pytest.raises(ValueError, match="cannot run the spec's core_attention _CountingCore; use cp_comm_type a2a"):
        ParallelBuilder(cfg, ps).wrap_core_attention(core, cfg, layer=1)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_packed_documents_equal_documents_alone(family):
    """With reset position ids and the document mask, the logits of the second document of a packed
    sequence are the logits of that document run alone (so positions do reach the model)."""
    model = ReferenceGPT(GPTConfig(**BASE, model=family)).eval()
    tokens = torch.randint(0, 97, (1, 32), generator=torch.Generator().manual_seed(5))
    split = 13
    doc = (torch.arange(32) >= split).long()
    positions = torch.where(doc.bool(), torch.arange(32) - split, torch.arange(32)).view(1, 32)
    mask = (doc.view(-1, 1) != doc.view(1, -1)).view(1, 1, 32, 32)
    with torch.no_grad():
        packed = model(tokens, position_ids=positions, attention_mask=mask)
        alone = model(tokens[:, split:])
        shifted = model(tokens, attention_mask=mask)  # mask without position reset
        scrambled = model(tokens, position_ids=positions.flip(-1), attention_mask=mask)
    torch.testing.assert_close(packed[:, split:], alone, rtol=1e-5, atol=1e-5)
    assert (scrambled[:, split:] - alone).abs().max() > 1e-3  # positions reach the model
    if family == "llama":  # RoPE is relative: a constant shift of the positions changes nothing
        torch.testing.assert_close(shifted[:, split:], alone, rtol=1e-5, atol=1e-5)
    else:  # learned absolute positions: it does
        assert (shifted[:, split:] - alone).abs().max() > 1e-3


@pytest.mark.parametrize(
    "override,field",
    [
        (dict(model="llama", num_query_groups=3), "num_query_groups"),
        (
            dict(
                model="llama", num_query_groups=3, num_attention_heads=6, tensor_model_parallel_size=2, hidden_size=96
            ),
            "num_query_groups",
        ),
        (dict(normalization="BatchNorm"), "normalization"),
        (dict(activation="relu"), "activation"),
        (dict(position_embedding_type="alibi"), "position_embedding_type"),
        (dict(model="llama", rotary_percent=0.0), "rotary_percent"),
        (dict(model="llama", kv_channels=15), "rotary_percent"),
        (dict(rope_scaling=True), "rope_scaling"),
        (dict(model="llama", rope_scaling=True, rope_scaling_low_freq_factor=4.0), "rope_scaling_low_freq_factor"),
        (dict(model="llama", rope_scaling=True, rope_scaling_factor=0.0), "rope_scaling_factor"),
        (dict(model="llama", rotary_seq_len_interpolation_factor=-2.0), "rotary_seq_len_interpolation_factor"),
        (dict(hidden_size=66), "hidden_size"),
        (dict(attention_backend="cudnn"), "attention_backend"),
    ],
)
def test_architecture_fields_are_checked(override, field):
    with pytest.raises(ValueError, match=f"GPTConfig.{field}"):
        GPTConfig(**{**BASE, **override})


def test_gqa_shapes_and_kv_channels():
    cfg = GPTConfig(**{**BASE, "hidden_size": 48}, model="llama", num_query_groups=1, kv_channels=16)
    sd = ReferenceGPT(cfg).state_dict()
    assert sd["layers.0.attn.qkv.weight"].shape == (16 * (4 + 2), 48)  # MQA, d independent of h/n
    assert sd["layers.0.attn.proj.weight"].shape == (48, 64)
    assert sd["layers.0.mlp.fc1.weight"].shape == (2 * cfg.ffn_hidden_size, 48)  # fused gate and up


def _saved_bytes(cfg):
    from activation_memory import SavedTensorCounter

    model = ReferenceGPT(cfg).train()
    tokens = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(0))
    with SavedTensorCounter(model) as counter:
        loss = model(tokens, tokens)
    del loss
    return counter.total()


def test_recompute_saves_fewer_activations():
    dropout = dict(hidden_dropout=0.1, attention_dropout=0.1, attention_backend="unfused")
    plain = _saved_bytes(GPTConfig(**{**BASE, **dropout}))
    selective = _saved_bytes(GPTConfig(**{**BASE, **dropout}, recompute_granularity="selective"))
    full = _saved_bytes(GPTConfig(**{**BASE, **dropout}, recompute_granularity="full"))
    assert full < selective < plain  # selective drops the s×s softmax of the unfused core
    assert plain - selective >= 2 * 4 * 4 * 32 * 32 * 2  # at least softmax + dropped probs, fp32, 2 layers


@pytest.mark.parametrize(
    "override,field",
    [
        (dict(recompute_granularity="some"), "recompute_granularity"),
        (dict(recompute_method="block"), "recompute_method"),
        (dict(recompute_granularity="full", recompute_num_layers=3), "recompute_num_layers"),
        (dict(context_parallel_size=2, seq_length=30), "seq_length"),
        (
            dict(context_parallel_size=4, cp_comm_type="a2a", num_attention_heads=2, hidden_size=64),
            "num_attention_heads",
        ),
        (dict(context_parallel_size=2, cp_comm_type="ring"), "cp_comm_type"),
    ],
)
def test_recompute_and_context_parallel_fields_are_checked(override, field):
    with pytest.raises(ValueError, match=f"GPTConfig.{field}"):
        GPTConfig(**{**BASE, **override})

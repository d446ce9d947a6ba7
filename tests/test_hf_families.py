"""The families users start from, against transformers' own classes (fp32, randomly initialised tiny
models): Qwen2 (q/k/v biases only, RoPE theta from the config; tied, as Qwen2.5's small models),
Qwen3 (per-head q/k RMSNorm, head_dim != hidden / heads) and Mistral (a sliding window shorter than
the documents). tools/convert_hf.py imports each (the
printed flags name the family) and exports it back (transformers loads the class, the same logits),
to_hf / from_hf round-trip bit for bit, and what the class cannot say is refused. At TP1, TP2+SP,
CP2 and PP2 the parallel model of the imported weights computes transformers' logits, loss and
every gradient within 1e-5, on packed documents (reset positions, block-causal mask; transformers
runs each document alone), through the parity harness (megatron_sp/testing/parity.py).

The mixture-of-experts families, Mixtral (a window too), Qwen3-MoE (a dense layer among the MoE ones,
norm_topk_prob), Qwen2-MoE (the gated shared expert, the k probabilities as they are) and gpt-oss
(sinks, windows on alternate layers, YaRN, biases on the router and the experts, gate/up interleaved,
the clamped quick-GeGLU), go the same way through files (the per-expert layout transformers'
save_pretrained writes, gpt-oss's fused one; the export writes the same file bit for bit), from
transformers 5's fused 3-D expert tensors (the same state), and compute
transformers' logits, loss and every gradient within 1e-5 serially (EP1), at EP2 and at EP2 × TP2+SP
(expert-TP 1: the 2 ranks). Every expert tensor is accounted for: missing, surplus, doubled or
misshapen ones are refused naming the key."""

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_sp.layer_options import is_moe_layer, layer_window
from megatron_sp.models.hf import ConversionError, from_hf, to_hf
from megatron_sp.testing import LocalWorld
from megatron_sp.testing.layouts import parse_layout
from megatron_sp.testing.parity import make_batches, rel, run_layout, run_serial
from megatron_sp.testing.tiny import reference_from_checkpoint
from tools import convert_hf

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 97, 16, 2
SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB)
CONFIGS = {
    "qwen2": lambda: transformers.Qwen2Config(
        **SMALL, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, rope_theta=1e6
    ),
    "qwen3": lambda: transformers.Qwen3Config(
        **SMALL, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5
    ),
    # a window shorter than the documents (5, 5 and 6 tokens): sliding_window 4 = --window-size 3,0
    "mistral": lambda: transformers.MistralConfig(
        **SMALL, num_key_value_heads=2, max_position_embeddings=64, sliding_window=4
    ),
    # YaRN (Qwen2.5's long-context recipe) over an original context shorter than the sequence, so that
    # the frequencies and the attention scaling differ from plain RoPE's
    "qwen2-yarn": lambda: transformers.Qwen2Config(
        **SMALL,
        num_key_value_heads=2,
        max_position_embeddings=32,  # factor x original (else transformers warns)
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8},
    ),
}
# the MoE families: 4 experts of width 16, top 2; no load-balancing loss (transformers adds its own,
# pooled over the layers, only with output_router_logits: models/hf/moe.py)
MOE = dict(SMALL, num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2, router_aux_loss_coef=0.0)
CONFIGS.update(
    {
        "mixtral": lambda: transformers.MixtralConfig(
            **{**MOE, "intermediate_size": 16}, num_local_experts=4, sliding_window=4
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **MOE, head_dim=16, num_experts=4, moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[1]
        ),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **MOE, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24
        ),
        # its YaRN (GptOssConfig's: factor 32 over 4096 positions), a window of 4 on alternate layers, the
        # clamp at 0.5 so that it bites at these sizes (gpt-oss's is 7)
        "gpt_oss": lambda: transformers.GptOssConfig(
            **{**MOE, "intermediate_size": 16, "max_position_embeddings": 32 * 4096},
            head_dim=8,
            num_local_experts=4,
            sliding_window=4,
            swiglu_limit=0.5,
        ),
    }
)
MOE_CASES = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
# GPTConfig fields of our MoE models
EXPERTS = dict(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2)
SHARED = dict(moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True)
# gpt-oss's layer (its experts with EXPERTS): --glu-linear-offset 1, a clamp, sinks, a window
GPT_OSS = dict(
    model="gpt_oss",
    **EXPERTS,
    glu_linear_offset=1.0,
    activation_func_clamp_value=7.0,
    softmax_type="learnable",
    window_size=(7, 0),
)
MOE_FIELDS = (
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_router_pre_softmax",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "add_qkv_bias",
    "qk_layernorm",
    "add_bias_linear",
    "activation",
    "activation_func_clamp_value",
    "softmax_type",
    "window_size",
)
CLASSES = {
    **MOE_CASES,
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2-yarn": "Qwen2ForCausalLM",
}  # case: class; the family is the case's name up to "-"


def _hf_model(case):
    torch.manual_seed(0)
    model = getattr(transformers, CLASSES[case])(CONFIGS[case]())
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # non-trivial norms and biases (HF initialises them to 1 and 0)
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("_bias"):  # (gpt-oss's expert biases are [E, n])
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif case == "gpt_oss" and ".experts." in name:  # as large as the rest (HF draws them at 0.02)
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _logits(model, tokens):
    with torch.no_grad():
        return model.eval()(tokens).logits


@pytest.mark.parametrize("case", sorted(CLASSES))
def test_import_and_export_through_transformers(case, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf, family = _hf_model(case), case.partition("-")[0]
    hf.save_pretrained(tmp_path / "hf")
    assert convert_hf.main(["import", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    assert f"--model {family}" in capsys.readouterr().out
    ours, tokens = reference_from_checkpoint(tmp_path / "ckpt"), make_batches(VOCAB, SEQ, BATCH, 1)[0].tokens
    want = _logits(hf, tokens)
    assert ours.cfg.model == family and (ours(tokens) - want).abs().max().item() < 1e-5
    assert convert_hf.main(["export", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert type(back).__name__ == CLASSES[case]
    assert torch.equal(_logits(back, tokens), want)
    original, again = hf.state_dict(), back.state_dict()  # the round trip, bit for bit
    assert again.keys() == original.keys() and all(torch.equal(again[k], original[k]) for k in original)
    saved, written = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "out"))
    assert written.keys() == saved.keys() and all(torch.equal(written[k], saved[k]) for k in saved)
    if case in MOE_CASES:  # transformers 5's fused expert tensors are the same model
        config = json.loads((tmp_path / "hf" / "config.json").read_text())
        fused, per_expert = from_hf(dict(original), config)[0], from_hf(saved, config)[0]
        assert any(k.endswith(".experts.gate_up_proj") for k in original) and not any(
            ".experts.0." in k for k in original
        )
        assert fused.keys() == per_expert.keys() and all(torch.equal(fused[k], per_expert[k]) for k in fused)


@pytest.mark.parametrize(
    "fields,architecture",
    [
        (dict(model="qwen2"), "Qwen2ForCausalLM"),
        (dict(model="qwen3", kv_channels=16), "Qwen3ForCausalLM"),
        (dict(model="llama", add_qkv_bias=True), "Qwen2ForCausalLM"),  # what LlamaForCausalLM cannot say
        (dict(model="llama", qk_layernorm=True), "Qwen3ForCausalLM"),
        (dict(model="mistral", window_size=(7, 0)), "MistralForCausalLM"),
        (dict(model="llama", window_size=(7, 0)), "MistralForCausalLM"),  # what LlamaForCausalLM cannot say
        (dict(model="mixtral", **EXPERTS, window_size=(7, 0)), "MixtralForCausalLM"),
        (dict(model="llama", **EXPERTS), "MixtralForCausalLM"),
        (dict(model="qwen3_moe", **EXPERTS, num_layers=3, moe_layer_freq=(0, 1, 1)), "Qwen3MoeForCausalLM"),
        (dict(model="qwen3", **EXPERTS, moe_router_pre_softmax=True), "Qwen3MoeForCausalLM"),
        (dict(model="qwen2_moe", **EXPERTS, **SHARED, moe_router_pre_softmax=True), "Qwen2MoeForCausalLM"),
        (dict(model="llama", **EXPERTS, **SHARED, moe_layer_freq=2, num_layers=2), "Qwen2MoeForCausalLM"),
        (dict(GPT_OSS, num_layers=2, window_attn_skip_freq=2), "GptOssForCausalLM"),
        (dict(GPT_OSS, num_layers=3, window_attn_skip_freq=(1, 0, 1), kv_channels=16), "GptOssForCausalLM"),
        (dict(GPT_OSS, num_layers=2, window_size=None, position_embedding_type="rope"), "GptOssForCausalLM"),
    ],
)
def test_round_trip_is_exact_and_picks_the_architecture(fields, architecture):
    from megatron_sp.config import GPTConfig
    from megatron_sp.models.reference import ReferenceGPT

    shape = dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=16)
    cfg = GPTConfig(**{**shape, **fields})
    state = ReferenceGPT(cfg).state_dict()
    tensors, config = to_hf(state, cfg)
    assert config["architectures"] == [architecture]
    back, read = from_hf(tensors, json.loads(json.dumps(config)))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert read["kv_channels"] == cfg.kv_channels and read["model"] == config["model_type"]
    assert read.get("window_size") == cfg.window_size  # (Mistral's sliding_window 8 = --window-size 7,0)
    again = GPTConfig(**read, seq_length=16)
    assert all(getattr(again, name) == getattr(cfg, name) for name in MOE_FIELDS), config
    layers = range(1, cfg.num_layers + 1)
    assert [is_moe_layer(again, i) for i in layers] == [is_moe_layer(cfg, i) for i in layers]
    assert [layer_window(again, i) for i in layers] == [layer_window(cfg, i) for i in layers]


@pytest.mark.parametrize(
    "family,change,needle",
    [
        ("qwen3", {"attention_bias": True}, "attention_bias"),
        ("qwen3", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("mistral", {"sliding_window": 0}, "sliding_window must be a positive integer"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen3_moe", {"num_experts": 8}, "num_local_experts 4; keep one"),  # (transformers 5 writes the latter)
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be"),
        ("gpt_oss", {"swiglu_alpha": 1.5}, "swiglu_alpha 1.5 is not supported"),
        ("gpt_oss", {"attention_bias": False}, "attention_bias false"),
        ("gpt_oss", {"layer_types": ["full_attention"]}, "layer_types must list"),
        ("gpt_oss", {"sliding_window": None}, "sliding_window is null"),
    ],
)
def test_what_the_families_cannot_express_is_refused(family, change, needle):
    hf = _hf_model(family)
    config = {**json.loads(hf.config.to_json_string()), **change}
    with pytest.raises(ConversionError, match=needle):
        from_hf({k: v.detach() for k, v in hf.state_dict().items()}, config)


@pytest.mark.parametrize(
    "fields,needle",
    [
        (dict(model="qwen3", add_bias_linear=True), "no biases in its MLP"),
        (dict(model="mistral", window_size=(7, 0), add_bias_linear=True), "MistralForCausalLM has no biases"),
        (dict(model="mistral", window_size=(7, 0), window_attn_skip_freq=2), "--window-attn-skip-freq"),
        (dict(model="mixtral", **EXPERTS, moe_router_score_function="sigmoid"), "routes by softmax"),
        (dict(model="mixtral", **EXPERTS, moe_router_load_balancing_type="sinkhorn"), "sinkhorn's weights"),
        (dict(GPT_OSS, moe_router_load_balancing_type="sinkhorn"), "sinkhorn's weights"),
        (dict(model="mixtral", **EXPERTS, moe_layer_freq=2), "experts on every layer"),
        (dict(model="mixtral", **EXPERTS, moe_router_pre_softmax=True), "--moe-router-pre-softmax"),
        (dict(model="mixtral", **EXPERTS, moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor"),
        (dict(model="mixtral", **EXPERTS, moe_router_topk_scaling_factor=2.0), "--moe-router-topk-scaling"),
        (dict(model="mixtral", **EXPERTS, moe_shared_expert_intermediate_size=24), "a shared expert"),
        (dict(model="qwen2_moe", **EXPERTS, moe_shared_expert_intermediate_size=24), "--moe-shared-expert-gate"),
        (dict(model="gpt2", **EXPERTS), r"positions \+ mixture of experts"),
        (dict(GPT_OSS, add_bias_linear=False), "--disable-bias-linear"),
        (dict(GPT_OSS, activation_func_clamp_value=None), "no --activation-func-clamp-value"),
        (dict(GPT_OSS, softmax_type="off-by-one"), "--softmax-type off-by-one"),
        (dict(GPT_OSS, glu_linear_offset=0.0), "--glu-linear-offset 0.0"),
        (dict(GPT_OSS, moe_router_pre_softmax=True), "--moe-router-pre-softmax"),
        (dict(GPT_OSS, moe_layer_freq=2), "experts on every layer"),
    ],
)
def test_export_refuses_what_the_class_has_no_place_for(fields, needle):
    from megatron_sp.config import GPTConfig
    from megatron_sp.models.reference import ReferenceGPT

    shape = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=16)
    cfg = GPTConfig(**shape, **fields)
    with pytest.raises(ConversionError, match=needle):
        to_hf(ReferenceGPT(cfg).state_dict(), cfg)


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory):
    """{case: (transformers' fused state dict, its saved per-expert tensors, config.json)}."""
    out = {}
    for case in ("mixtral", "qwen3_moe", "gpt_oss"):
        hf, where = _hf_model(case), tmp_path_factory.mktemp(case)
        hf.save_pretrained(where)
        config = json.loads((where / "config.json").read_text())
        out[case] = (dict(hf.state_dict()), load_file(where / "model.safetensors"), config)
    return out


_MIX = "model.layers.0.block_sparse_moe.experts"


def _drop(t, c, fused):
    del t["model.layers.1.block_sparse_moe.experts.3.w2.weight"]


def _surplus_expert(t, c, fused):
    t.update({k.replace(".experts.0.", ".experts.4."): v for k, v in t.items() if k.startswith(f"{_MIX}.0.")})


def _unused(t, c, fused):
    t[f"{_MIX}.0.w1.bias"] = torch.zeros(16)


def _both_layouts(t, c, fused):
    t["model.layers.0.mlp.experts.gate_up_proj"] = fused["model.layers.0.mlp.experts.gate_up_proj"]


def _misshapen(t, c, fused):
    for k in [k for k in t if k.startswith(f"{_MIX}.")]:
        del t[k]
    t.update({k: v[:3] for k, v in fused.items() if k.startswith("model.layers.0.mlp.experts.")})


def _fused_on_a_dense_layer(t, c, fused):
    t["model.layers.1.mlp.experts.down_proj"] = fused["model.layers.0.mlp.experts.down_proj"]


def _hostile(t, c, fused):
    c["num_local_experts"] = 10**9


_OSS = "model.layers.1.mlp.experts"


def _oss_drop(t, c, fused):
    del t[f"{_OSS}.down_proj_bias"]


def _oss_no_experts(t, c, fused):
    for k in [k for k in t if k.startswith(f"{_OSS}.")]:
        del t[k]


def _oss_fewer(t, c, fused):
    t[f"{_OSS}.gate_up_proj_bias"] = t[f"{_OSS}.gate_up_proj_bias"][:3]


def _oss_narrow(t, c, fused):
    t[f"{_OSS}.gate_up_proj"] = t[f"{_OSS}.gate_up_proj"][..., :-2]


def _oss_per_expert(t, c, fused):
    t[f"{_OSS}.0.down_proj.weight"] = t[f"{_OSS}.down_proj"][0].t()


def _oss_mxfp4(t, c, fused):
    t[f"{_OSS}.down_proj_blocks"] = t.pop(f"{_OSS}.down_proj").to(torch.uint8)


@pytest.mark.parametrize(
    "case,edit,needle",
    [
        ("mixtral", _drop, "lack model.layers.1.block_sparse_moe.experts.3.w2.weight"),
        ("mixtral", _surplus_expert, r"has 4 experts \(num_local_experts\) but layer 0's weights hold 5"),
        ("mixtral", _unused, f"hold {_MIX}.0.w1.bias, which this config has no place for"),
        ("mixtral", _both_layouts, f"hold {_MIX}.0.w1.weight twice"),
        ("mixtral", _misshapen, r"gate_up_proj is torch.float32 of shape \[3, 32, 32\] but config.json needs"),
        ("qwen3_moe", _fused_on_a_dense_layer, "makes layer 1 no mixture-of-experts layer"),
        ("mixtral", _hostile, "has 1000000000 experts"),
        ("gpt_oss", _oss_drop, f"lack {_OSS}.down_proj_bias"),
        ("gpt_oss", _oss_no_experts, f"lack {_OSS}.gate_up_proj"),
        ("gpt_oss", _oss_fewer, rf"has 4 experts \(num_local_experts\) but {_OSS}.gate_up_proj_bias holds \[3\]"),
        ("gpt_oss", _oss_narrow, rf"{_OSS}.gate_up_proj has shape \[4, 32, 30\] but config.json needs"),
        ("gpt_oss", _oss_per_expert, f"hold {_OSS}.0.down_proj.weight, which this config has no place for"),
        ("gpt_oss", _oss_mxfp4, "MXFP4-quantised"),
        ("gpt_oss", _hostile, "has 1000000000 experts"),
    ],
)
def test_every_expert_tensor_is_accounted_for(moe_files, case, edit, needle):
    """A missing, surplus, unused, doubled or misshapen expert tensor is refused naming it (a config
    of 10^9 experts builds nothing); the files as they are import."""
    fused, saved, config = moe_files[case]
    from_hf(dict(saved), config)
    tensors, config = dict(saved), dict(config)
    edit(tensors, config, fused)
    with pytest.raises(ConversionError, match=needle):
        from_hf(tensors, config)


@pytest.mark.parametrize(
    "parameters",
    [
        dict(factor=32.0, original_max_position_embeddings=4096, truncate=False),  # gpt-oss's
        dict(factor=4.0, original_max_position_embeddings=8),  # truncated (HF's default)
        dict(
            factor=8.0,
            original_max_position_embeddings=64,
            beta_fast=16.0,
            beta_slow=2.0,
            mscale=0.7,
            mscale_all_dim=0.3,
        ),
    ],
)
def test_yarn_is_transformers_yarn(parameters):
    """--position-embedding-type yarn's frequencies and attention scaling, from a config.json's
    rope_parameters, are bit for bit transformers' own (its `yarn` RoPE initialiser)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_sp.config import GPTConfig
    from megatron_sp.models.hf.rope import rope_config, rope_fields
    from megatron_sp.models.rope import inverse_frequencies, yarn_attention_scale

    rope = dict(rope_type="yarn", rope_theta=150000.0, **parameters)
    hf = transformers.Qwen2Config(**SMALL, max_position_embeddings=64, rope_parameters=dict(rope))
    fields = rope_fields(json.loads(hf.to_json_string()), "Qwen2")
    cfg = GPTConfig(
        model="qwen2", num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=16, **fields
    )
    want, scale = ROPE_INIT_FUNCTIONS["yarn"](hf)
    assert torch.equal(inverse_frequencies(cfg), want) and yarn_attention_scale(cfg) == scale
    exported, expected = rope_config(cfg)["rope_parameters"], {"truncate": True, **rope}  # (and back)
    assert {k: exported.get(k) for k in expected} == expected


# ---- at every layout, against transformers (one 2-rank world) ----------------------------------


@pytest.fixture(scope="module")
def world():
    w = LocalWorld(2)
    yield w
    w.close()


def _per_document(hf, batch):
    """transformers' logits of each document run alone (its positions from 0), side by side [B, s, V]."""
    starts = [0, *(torch.nonzero(batch.position_ids[0] == 0).flatten().tolist()[1:]), SEQ]
    return torch.cat([hf(batch.tokens[:, a:b]).logits for a, b in zip(starts, starts[1:])], dim=1)


def _transformers_run(hf, batch, ours):
    """(logits, loss, gradients under our names: `ours(HF gradients)`) of transformers' model on the
    packed documents."""
    hf.train()  # no dropout in these configs: the same function, with gradients
    logits = _per_document(hf, batch)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch.labels.reshape(-1))
    loss.backward()
    return logits.detach(), loss.item(), ours({n: p.grad for n, p in hf.named_parameters()})


# {name: (layout, fields)}: serial = TP1 with both ranks replicas; None: the serial model in this process
DENSE_LAYOUTS = {"serial": ("dp1", {}), "tp2+sp": ("tp2+sp", {}), "cp2": ("cp2", {}), "pp2": ("pp2", {})}
EP2 = dict(expert_model_parallel_size=2, expert_tensor_parallel_size=1)
MOE_LAYOUTS = {"ep1": None, "ep2": ("dp1", EP2), "tp2+sp/ep2": ("tp2+sp", EP2)}


@pytest.mark.parametrize("case", sorted(CLASSES))
def test_every_layout_computes_what_transformers_computes(world, case):
    hf = _hf_model(case)
    config = json.loads(hf.config.to_json_string())
    state, fields = from_hf({k: v.detach() for k, v in hf.state_dict().items()}, config)  # (MoE: fused)
    fields.update(seq_length=SEQ)
    batch = make_batches(VOCAB, SEQ, BATCH, 1, documents=True)[0]
    grads = lambda hf_grads: from_hf(hf_grads, config)[0]  # noqa: E731  (the same Links as the weights)
    layouts = MOE_LAYOUTS if case in MOE_CASES else DENSE_LAYOUTS
    _check_layouts(world, fields, state, batch, _transformers_run(hf, batch, grads), layouts)


def _check_layouts(world, fields, state, batch, reference, layouts=DENSE_LAYOUTS):
    """The model of `state` at each of `layouts` computes transformers' logits, loss and gradients
    (`reference`) within 1e-5; {layout name: (logits, worst gradient)} relative errors."""
    worst = {}
    for name, at in layouts.items():
        if at is None:
            run = run_serial(fields, [batch], state=state, logits=True)
        else:
            layout, extra = parse_layout(at[0]), {**fields, **at[1]}
            run = next(r for r in world.run(run_layout, extra, layout, [batch], state=state, logits=True) if r)
        worst[name] = _check_run(name, run, *reference)
    return worst


def _check_run(name, run, logits, loss, grads):
    assert abs(run.losses[0] - loss) <= 1e-5 * loss, (name, run.losses[0], loss)
    logits_error = None
    if run.logits is not None:  # (the pipeline's last stage returns losses only)
        logits_error = rel(run.logits, logits)
        assert logits_error < 1e-5, (name, logits_error)
    assert run.grads0.keys() == grads.keys(), name
    worst = max((rel(run.grads0[k], g), k) for k, g in grads.items())
    assert worst[0] < 1e-5, (name, worst)
    return logits_error, worst


# ---- gpt-oss's dense parts, against transformers' GptOssForCausalLM with one expert ------------
# With one expert and top-1 routing its router's softmax is 1 for every token (and its gradient 0),
# so the model is dense: biases everywhere, attention sinks (--softmax-type learnable), a sliding
# window on alternate layers (--window-size W-1,0 --window-attn-skip-freq 2), YaRN (its config's),
# and the clamped quick-GeGLU MLP (--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value).
# The clamp is 0.1 here, not gpt-oss's 7, so that it bites at these sizes. Its dense parts at CP2 and
# PP2 (where the MoE cases do not go); the whole model through the adapter: the MoE cases above.

GPT_OSS_LIMIT, GPT_OSS_WINDOW = 0.1, 4


def _gpt_oss_one_expert():
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        **SMALL,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=1,
        num_experts_per_tok=1,
        sliding_window=GPT_OSS_WINDOW,
        max_position_embeddings=32 * 4096,  # YaRN's factor times its original context (GptOssConfig's)
        swiglu_limit=GPT_OSS_LIMIT,
    )
    model = transformers.GptOssForCausalLM(config)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # non-trivial norms, biases and sinks; the experts' weights as large as the rest
        for name, p in model.named_parameters():
            if p.dim() == 1 or "bias" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
            elif "experts" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _gpt_oss_as_ours(t: dict, layers: int) -> dict:
    """Our tensors of a one-expert GptOssForCausalLM's (its router dropped; the experts' interleaved
    gate/up columns as our fc1's [gate; up] rows)."""
    out = {
        "embedding.word_embeddings.weight": t["model.embed_tokens.weight"],
        "final_ln.weight": t["model.norm.weight"],
        "output_layer.weight": t["lm_head.weight"],
    }
    for i in range(layers):
        hf, ours, attn, experts = (
            f"model.layers.{i}",
            f"layers.{i}",
            f"model.layers.{i}.self_attn",
            f"model.layers.{i}.mlp.experts",
        )
        out[f"{ours}.ln1.weight"] = t[f"{hf}.input_layernorm.weight"]
        out[f"{ours}.ln2.weight"] = t[f"{hf}.post_attention_layernorm.weight"]
        for kind in ("weight", "bias"):
            out[f"{ours}.attn.qkv.{kind}"] = torch.cat([t[f"{attn}.{x}_proj.{kind}"] for x in "qkv"])
            out[f"{ours}.attn.proj.{kind}"] = t[f"{attn}.o_proj.{kind}"]
        out[f"{ours}.attn.softmax_offset"] = t[f"{attn}.sinks"]
        gate_up, gate_up_bias = t[f"{experts}.gate_up_proj"][0], t[f"{experts}.gate_up_proj_bias"][0]  # [h, 2f], [2f]
        out[f"{ours}.mlp.fc1.weight"] = torch.cat([gate_up[:, 0::2].t(), gate_up[:, 1::2].t()])
        out[f"{ours}.mlp.fc1.bias"] = torch.cat([gate_up_bias[0::2], gate_up_bias[1::2]])
        out[f"{ours}.mlp.fc2.weight"] = t[f"{experts}.down_proj"][0].t()
        out[f"{ours}.mlp.fc2.bias"] = t[f"{experts}.down_proj_bias"][0]
    return {k: v.contiguous() for k, v in out.items()}


def test_gpt_oss_dense_parts_compute_what_transformers_computes(world):
    from megatron_sp.models.hf.rope import rope_fields

    hf = _gpt_oss_one_expert()
    config = json.loads(hf.config.to_json_string())
    fields = dict(
        model="llama",
        num_layers=SMALL["num_hidden_layers"],
        hidden_size=SMALL["hidden_size"],
        num_attention_heads=SMALL["num_attention_heads"],
        num_query_groups=2,
        kv_channels=8,
        ffn_hidden_size=SMALL["intermediate_size"],
        vocab_size=VOCAB,
        seq_length=SEQ,
        layernorm_epsilon=config["rms_norm_eps"],
        add_bias_linear=True,
        activation="quick_geglu",
        glu_linear_offset=1.0,
        activation_func_clamp_value=GPT_OSS_LIMIT,
        softmax_type="learnable",
        window_size=(GPT_OSS_WINDOW - 1, 0),
        window_attn_skip_freq=2,  # layer 1 windowed, layer 2 full: gpt-oss's layer_types
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **rope_fields(config, "gpt-oss"),  # its YaRN: factor 32 over 4096 positions, not truncated
    )
    assert fields["position_embedding_type"] == "yarn" and not fields["yarn_correction_range_round_to_int"]
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    state = _gpt_oss_as_ours({k: v.detach() for k, v in hf.state_dict().items()}, fields["num_layers"])
    batch = make_batches(VOCAB, SEQ, BATCH, 1, documents=True)[0]
    logits, loss, grads = _transformers_run(hf, batch, lambda g: g)
    routers = [g for n, g in grads.items() if ".router." in n]
    assert routers and all(not g.any() for g in routers)  # one expert: the router does nothing
    _check_layouts(world, fields, state, batch, (logits, loss, _gpt_oss_as_ours(grads, fields["num_layers"])))

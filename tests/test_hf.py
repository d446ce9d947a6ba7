"""Hugging Face import/export (tools/convert_hf.py): logits of GPT2LMHeadModel / LlamaForCausalLM
(transformers, randomly initialised from configs, fp32) equal ReferenceGPT's within 1e-4 after import,
and transformers loads our exports offline with the same logits; what cannot be expressed is refused."""
import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import convert_hf  # noqa: E402

from megatron_sp.models.hf import ConversionError, from_hf, to_hf  # noqa: E402
from megatron_sp.models.reference import ReferenceGPT  # noqa: E402
from megatron_sp.training.full_state import (checkpoint_path, config_from_dict, read_full_state,  # noqa: E402
                                             write_full_checkpoint)

VOCAB, SEQ = 97, 24

HF_MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0)),
    "gpt2-erf-untied": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_inner=96, vocab_size=VOCAB, n_positions=32, activation_function="gelu",
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)),
    "llama-gqa": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, rope_theta=500000.0, rms_norm_eps=1e-5,
        bos_token_id=0, eos_token_id=0)),
    "llama-tied-bias-headdim": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=True, attention_bias=True,
        mlp_bias=True, bos_token_id=0, eos_token_id=0)),
}


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model.eval()(tokens).logits


def _our_model(save):
    state, meta = read_full_state(checkpoint_path(save))
    model = ReferenceGPT(config_from_dict(meta["config"], hidden_dropout=0.0, attention_dropout=0.0,
                                          use_fused_kernels=False), initialise=False)
    model.load_state_dict(state)
    return model.eval()


def _randomise(model):
    """Non-trivial norms and biases (HF initialises them to 1 and 0)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("name", sorted(HF_MODELS))
def test_import_matches_transformers_logits(name, tmp_path, capsys):
    torch.manual_seed(0)
    hf = HF_MODELS[name]()
    _randomise(hf)
    hf.save_pretrained(tmp_path / "hf")
    assert convert_hf.main(["import", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    assert "--model" in capsys.readouterr().out                       # the flags to train it
    tokens = _tokens()
    ours = _our_model(tmp_path / "ckpt")(tokens)
    want = _hf_logits(hf, tokens)
    assert (ours - want).abs().max().item() < 1e-4, (ours - want).abs().max().item()


@pytest.mark.parametrize("fields", [
    dict(model="gpt2", activation="openai_gelu"),
    dict(model="gpt2", untie_embeddings_and_output_weights=True),
    dict(model="llama", num_query_groups=2),
    dict(model="llama", num_query_groups=4, untie_embeddings_and_output_weights=False, rotary_base=1e6),
], ids=["gpt2", "gpt2-untied", "llama-gqa", "llama-tied"])
def test_export_loads_in_transformers_offline(fields, tmp_path, monkeypatch):
    from megatron_sp.config import GPTConfig
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB, seq_length=32,
                    hidden_dropout=0.0, attention_dropout=0.0, use_fused_kernels=False, **fields)
    ref = ReferenceGPT(cfg).eval()
    _randomise(ref)
    config = {k: getattr(cfg, k) for k in GPTConfig.__dataclass_fields__}
    write_full_checkpoint(ref.state_dict(), config, str(tmp_path / "ckpt"), "test")
    assert convert_hf.main(["export", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    tokens = _tokens()
    with torch.no_grad():
        ours = ref(tokens)
    diff = (_hf_logits(hf, tokens) - ours).abs().max().item()
    assert diff < 1e-4, diff


def test_round_trip_is_exact():
    from megatron_sp.config import GPTConfig
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=16,
                    model="llama", num_query_groups=2)
    state = ReferenceGPT(cfg).state_dict()
    tensors, config = to_hf(state, cfg)
    back, fields = from_hf(tensors, json.loads(json.dumps(config)))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert (fields["num_query_groups"], fields["kv_channels"], fields["model"]) == (2, 8, "llama")


@pytest.mark.parametrize("fields,needle", [
    (dict(normalization="RMSNorm"), "no Hugging Face architecture"),
    (dict(num_query_groups=2), "grouped-query"),
    (dict(model="llama", add_qkv_bias=True), "attention_bias"),
    (dict(model="llama", position_embedding_type="rope", rotary_percent=0.5), "rotary-percent"),
])
def test_export_refuses_what_hf_cannot_express(fields, needle):
    from megatron_sp.config import GPTConfig
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=16, **fields)
    with pytest.raises(ConversionError, match=needle):
        to_hf(ReferenceGPT(cfg).state_dict(), cfg)


def test_import_refuses_rope_scaling_and_unknown_models(tmp_path, capsys):
    hf = HF_MODELS["llama-gqa"]()
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()                                          # transformers' own progress output
    assert convert_hf.main(["import", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "rope_type 'llama3'" in err and len(err.strip().splitlines()) == 1
    config["model_type"] = "mistral"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert convert_hf.main(["import", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "c")]) == 2
    assert "model_type 'mistral'" in capsys.readouterr().err
    assert convert_hf.main(["import", "--input", str(tmp_path / "nope"), "--save", str(tmp_path / "c")]) == 2
    assert "not a Hugging Face model directory" in capsys.readouterr().err

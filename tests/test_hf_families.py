"""The families users start from, against transformers' own classes (fp32, randomly initialised tiny
models): Qwen2 (q/k/v biases only, RoPE theta from the config; tied, as Qwen2.5's small models),
Qwen3 (per-head q/k RMSNorm, head_dim != hidden / heads) and Mistral (a sliding window shorter than
the documents). tools/convert_hf.py imports each (the
printed flags name the family) and exports it back (transformers loads the class, the same logits),
to_hf / from_hf round-trip bit for bit, and what the class cannot say is refused. At TP1, TP2+SP,
CP2 and PP2 the parallel model of the imported weights computes transformers' logits, loss and
every gradient within 1e-5, on packed documents (reset positions, block-causal mask; transformers
runs each document alone), through the parity harness (megatron_sp/testing/parity.py)."""

import json

import pytest
import torch

from megatron_sp.models.hf import ConversionError, from_hf, to_hf
from megatron_sp.testing import LocalWorld
from megatron_sp.testing.layouts import parse_layout
from megatron_sp.testing.parity import make_batches, rel, run_layout
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
}
CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}


def _hf_model(family):
    torch.manual_seed(0)
    model = getattr(transformers, CLASSES[family])(CONFIGS[family]())
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # non-trivial norms and biases (HF initialises them to 1 and 0)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _logits(model, tokens):
    with torch.no_grad():
        return model.eval()(tokens).logits


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_import_and_export_through_transformers(family, tmp_path, capsys, monkeypatch):
    from test_hf import _our_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path / "hf")
    assert convert_hf.main(["import", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    assert f"--model {family}" in capsys.readouterr().out
    ours, tokens = _our_model(tmp_path / "ckpt"), make_batches(VOCAB, SEQ, BATCH, 1)[0].tokens
    want = _logits(hf, tokens)
    assert ours.cfg.model == family and (ours(tokens) - want).abs().max().item() < 1e-5
    assert convert_hf.main(["export", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert type(back).__name__ == CLASSES[family]
    assert torch.equal(_logits(back, tokens), want)


@pytest.mark.parametrize(
    "fields,architecture",
    [
        (dict(model="qwen2"), "Qwen2ForCausalLM"),
        (dict(model="qwen3", kv_channels=16), "Qwen3ForCausalLM"),
        (dict(model="llama", add_qkv_bias=True), "Qwen2ForCausalLM"),  # what LlamaForCausalLM cannot say
        (dict(model="llama", qk_layernorm=True), "Qwen3ForCausalLM"),
        (dict(model="mistral", window_size=(7, 0)), "MistralForCausalLM"),
        (dict(model="llama", window_size=(7, 0)), "MistralForCausalLM"),  # what LlamaForCausalLM cannot say
    ],
)
def test_round_trip_is_exact_and_picks_the_architecture(fields, architecture):
    from megatron_sp.config import GPTConfig
    from megatron_sp.models.reference import ReferenceGPT

    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=16, **fields)
    state = ReferenceGPT(cfg).state_dict()
    tensors, config = to_hf(state, cfg)
    assert config["architectures"] == [architecture]
    back, read = from_hf(tensors, json.loads(json.dumps(config)))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert read["kv_channels"] == cfg.kv_channels and read["model"] == config["model_type"]
    assert read.get("window_size") == cfg.window_size  # (Mistral's sliding_window 8 = --window-size 7,0)


@pytest.mark.parametrize(
    "family,change,needle",
    [
        ("qwen3", {"attention_bias": True}, "attention_bias"),
        ("qwen3", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
        ("mistral", {"sliding_window": 0}, "sliding_window must be a positive integer"),
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
    ],
)
def test_export_refuses_what_the_class_has_no_place_for(fields, needle):
    from megatron_sp.config import GPTConfig
    from megatron_sp.models.reference import ReferenceGPT

    shape = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=16)
    cfg = GPTConfig(**shape, **fields)
    with pytest.raises(ConversionError, match=needle):
        to_hf(ReferenceGPT(cfg).state_dict(), cfg)


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


def _transformers_run(hf, batch, config):
    """(logits, loss, gradients under our names) of transformers' model on the packed documents."""
    hf.train()  # no dropout in these configs: the same function, with gradients
    logits = _per_document(hf, batch)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch.labels.reshape(-1))
    loss.backward()
    grads, _ = from_hf({n: p.grad for n, p in hf.named_parameters()}, config)  # the same Links as the weights
    return logits.detach(), loss.item(), grads


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_every_layout_computes_what_transformers_computes(world, family):
    hf = _hf_model(family)
    config = json.loads(hf.config.to_json_string())
    state, fields = from_hf({k: v.detach() for k, v in hf.state_dict().items()}, config)
    fields.update(seq_length=SEQ)
    batch = make_batches(VOCAB, SEQ, BATCH, 1, documents=True)[0]
    logits, loss, grads = _transformers_run(hf, batch, config)
    for name in ("serial", "tp2+sp", "cp2", "pp2"):
        layout = parse_layout("dp1" if name == "serial" else name)  # serial: TP1, both ranks replicas
        run = next(r for r in world.run(run_layout, fields, layout, [batch], state=state, logits=True) if r)
        assert abs(run.losses[0] - loss) <= 1e-5 * loss, (name, run.losses[0], loss)
        if run.logits is not None:  # (the pipeline's last stage returns losses only)
            assert rel(run.logits, logits) < 1e-5, (name, rel(run.logits, logits))
        assert run.grads0.keys() == grads.keys(), name
        worst = max((rel(run.grads0[k], g), k) for k, g in grads.items())
        assert worst[0] < 1e-5, (name, worst)

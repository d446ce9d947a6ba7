"""Hugging Face import/export (tools/convert_hf.py): logits of GPT2LMHeadModel / LlamaForCausalLM
(transformers, randomly initialised from configs, fp32) equal ReferenceGPT's within 1e-4 after import,
and transformers loads our exports offline with the same logits (RoPE scaling: Llama 3.1's and linear
included); what cannot be expressed is refused; imported models train with the printed flags.
The Qwen families, and every family at TP/CP/PP against transformers: tests/test_hf_families.py."""

import json

import pytest
import torch

from megatron_sp.checkpointing.full_state import write_full_checkpoint
from megatron_sp.models.hf import ConversionError, from_hf, to_hf
from megatron_sp.models.reference import ReferenceGPT
from megatron_sp.testing.tiny import reference_from_checkpoint
from tools import convert_hf

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 97, 24

HF_MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0
        )
    ),
    "gpt2-erf-untied": lambda: transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            n_inner=96,
            vocab_size=VOCAB,
            n_positions=32,
            activation_function="gelu",
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
        )
    ),
    "llama-gqa": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            bos_token_id=0,
            eos_token_id=0,
        )
    ),
    "llama-tied-bias-headdim": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            bos_token_id=0,
            eos_token_id=0,
        )
    ),
    # Llama 3.1's RoPE scaling; a short original context so that SEQ tokens reach all three bands
    # (head dim 16, theta 1e4: wavelength 6.3 < 32/4 kept, 19.9 smoothed, the rest divided by 8)
    "llama3-rope-scaling": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=256,
            bos_token_id=0,
            eos_token_id=0,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    ),
    "llama-linear-rope": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=VOCAB,
            max_position_embeddings=128,
            bos_token_id=0,
            eos_token_id=0,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        )
    ),
}
SCALED = {"llama3-rope-scaling": "rope_scaling", "llama-linear-rope": "rotary_seq_len_interpolation_factor"}


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model.eval()(tokens).logits


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
    assert "--model" in capsys.readouterr().out  # the flags to train it
    tokens = _tokens()
    ours = reference_from_checkpoint(tmp_path / "ckpt")(tokens)
    want = _hf_logits(hf, tokens)
    assert (ours - want).abs().max().item() < 1e-4, (ours - want).abs().max().item()
    if name in SCALED:  # the scaling is what makes them equal
        unscaled = reference_from_checkpoint(
            tmp_path / "ckpt", **{SCALED[name]: None if "factor" in SCALED[name] else False}
        )
        assert (unscaled(tokens) - want).abs().max().item() > 1e-3  # 10× the tolerance


@pytest.mark.parametrize(
    "fields",
    [
        dict(model="gpt2", activation="openai_gelu"),
        dict(model="gpt2", untie_embeddings_and_output_weights=True),
        dict(model="llama", num_query_groups=2),
        dict(model="llama", num_query_groups=4, untie_embeddings_and_output_weights=False, rotary_base=1e6),
        dict(
            model="llama",
            num_query_groups=2,
            rope_scaling=True,
            rope_scaling_factor=4.0,
            rope_scaling_high_freq_factor=2.0,
            rope_scaling_original_max_position_embeddings=24,
        ),
        dict(model="llama", num_query_groups=2, rotary_seq_len_interpolation_factor=2.0),
    ],
    ids=["gpt2", "gpt2-untied", "llama-gqa", "llama-tied", "llama3-rope-scaling", "llama-linear-rope"],
)
def test_export_loads_in_transformers_offline(fields, tmp_path, monkeypatch):
    from megatron_sp.config import GPTConfig

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = GPTConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=VOCAB,
        seq_length=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_fused_kernels=False,
        **fields,
    )
    ref = ReferenceGPT(cfg).eval()
    _randomise(ref)
    write_full_checkpoint(ref.state_dict(), cfg, str(tmp_path / "ckpt"), "test")
    assert convert_hf.main(["export", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    tokens = _tokens()
    with torch.no_grad():
        ours = ref(tokens)
    diff = (_hf_logits(hf, tokens) - ours).abs().max().item()
    assert diff < 1e-4, diff


def test_round_trip_is_exact():
    from megatron_sp.config import GPTConfig

    cfg = GPTConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=VOCAB,
        seq_length=16,
        model="llama",
        num_query_groups=2,
    )
    state = ReferenceGPT(cfg).state_dict()
    tensors, config = to_hf(state, cfg)
    back, fields = from_hf(tensors, json.loads(json.dumps(config)))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert (fields["num_query_groups"], fields["kv_channels"], fields["model"]) == (2, 8, "llama")


@pytest.mark.parametrize(
    "fields,needle",
    [
        (dict(normalization="RMSNorm"), "no Hugging Face architecture"),
        (dict(num_query_groups=2), "grouped-query"),
        (dict(model="llama", add_bias_linear=True, add_qkv_bias=False), "attention_bias"),
        (dict(model="llama", position_embedding_type="rope", rotary_percent=0.5), "rotary-percent"),
        (dict(model="llama", rope_scaling=True, rotary_seq_len_interpolation_factor=2.0), "scaled one way"),
        # Llama's reason first; Mistral's class windows every layer alike
        (dict(model="llama", window_size=(8, 0), window_attn_skip_freq=2), "--window-size"),
        (dict(softmax_type="learnable"), "--softmax-type"),
    ],
)
def test_export_refuses_what_hf_cannot_express(fields, needle):
    from megatron_sp.config import GPTConfig

    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=16, **fields)
    with pytest.raises(ConversionError, match=needle):
        to_hf(ReferenceGPT(cfg).state_dict(), cfg)


def test_import_refuses_other_rope_scalings_and_unknown_models(tmp_path, capsys):
    hf = HF_MODELS["llama-gqa"]()
    hf.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    capsys.readouterr()  # transformers' own progress output
    for rope, needle in [
        ({"rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0}, "rope_type 'dynamic'"),
        ({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}, "low_freq_factor"),
    ]:
        config["rope_parameters"] = rope
        (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
        assert convert_hf.main(["import", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "c")]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
    config["model_type"] = "falcon"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert convert_hf.main(["import", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "c")]) == 2
    assert "model_type 'falcon'" in capsys.readouterr().err
    assert convert_hf.main(["import", "--input", str(tmp_path / "nope"), "--save", str(tmp_path / "c")]) == 2
    assert "not a Hugging Face model directory" in capsys.readouterr().err


def test_imported_scaled_llama_trains_with_the_printed_flags(tmp_path, capsys):
    """The flags convert_hf prints carry the RoPE scaling; a run without them is refused at start-up
    (the checkpoint's weights were trained for the scaled positions)."""
    import shlex

    from launch_helpers import TINY, records

    from megatron_sp.training import pretrain

    HF_MODELS["llama3-rope-scaling"]().save_pretrained(tmp_path / "hf")
    assert convert_hf.main(["import", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    printed = shlex.split(next(line for line in capsys.readouterr().out.splitlines() if "--finetune" in line))
    assert "--use-rope-scaling" in printed
    i = printed.index("--rope-scaling-original-max-position-embeddings")
    assert printed[i + 1] == "32"
    run = TINY + [
        "--train-iters",
        "1",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        str(VOCAB),
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
    ]
    log = tmp_path / "log.jsonl"
    assert pretrain.main(run + printed + ["--log-jsonl", str(log)]) == 0
    assert len([r for r in records(log) if "lm_loss" in r]) == 1
    capsys.readouterr()
    assert pretrain.main(run + [f for f in printed if f != "--use-rope-scaling"]) == 2
    err = capsys.readouterr().err.strip()
    assert "rope_scaling=True" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("name", ["gpt2", "llama3-rope-scaling"])
def test_greedy_generation_matches_transformers(name, tmp_path, capsys):
    """tools/generate.py on an imported model: greedy decoding picks transformers' tokens (its
    generate(), no sampling); top-k 1 and a tiny top-p sample the same tokens; it stops at eod."""
    from tools import generate as gen

    torch.manual_seed(0)
    hf = HF_MODELS[name]()
    _randomise(hf)
    hf.save_pretrained(tmp_path / "hf")
    assert convert_hf.main(["import", "--input", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 0
    model, _ = gen.load_model(str(tmp_path / "ckpt"))
    prompt = _tokens()[:, :5]
    want = hf.eval().generate(
        prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=12
    )
    ours = gen.generate(model, prompt, 12)
    assert torch.equal(ours, want), (ours, want)
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        sampled = gen.generate(model, prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(0), **kw)
        assert torch.equal(sampled, want), kw
    eod = int(want[0, 8])  # a token the first row produces
    stopped = gen.generate(model, prompt[:1], 12, eod=eod)
    assert stopped.shape[1] <= 9 and stopped[0, -1].item() == eod
    capsys.readouterr()
    assert (
        gen.main(
            [
                "--load",
                str(tmp_path / "ckpt"),
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                str(VOCAB),
                "--prompt",
                " ".join(map(str, prompt[0].tolist())),
                "--max-new-tokens",
                "12",
                "--ignore-eod",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.split() == [str(t) for t in want[0].tolist()]
    assert gen.main(["--load", str(tmp_path / "ckpt"), "--tokenizer-type", "NullTokenizer", "--vocab-size", "500"]) == 2
    assert "the tokenizer has 500 ids" in capsys.readouterr().err

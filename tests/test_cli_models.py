"""The model and schedule flags of Megatron-LM's Llama-3 and GPT-3 example scripts: accepted, mapped
onto the model they describe, trained (in-process, TP=1); sample-based LR schedules; GPT2BPETokenizer;
what cannot run (a pipeline without its ranks, ...) refused in one sentence."""

import math

import pytest
from launch_helpers import TINY, records

from megatron_sp.training import pretrain

LLAMA3 = [
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--rotary-base",
    "500000",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--kv-channels",
    "16",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--attention-backend",
    "fused",
    "--norm-epsilon",
    "1e-5",
    "--ffn-hidden-size",
    "96",
    "--attention-dropout",
    "0.0",
    "--hidden-dropout",
    "0.0",
]
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]


def test_megatron_llama3_flags_build_a_llama(tmp_path):
    setup = pretrain.check_inputs(TINY + ["--train-iters", "2"] + LLAMA3 + MOCK)
    cfg = setup.cfg
    assert (cfg.model, cfg.normalization, cfg.activation, cfg.position_embedding_type) == (
        "gpt2",
        "RMSNorm",
        "swiglu",
        "rope",
    )
    assert (cfg.num_query_groups, cfg.kv_channels, cfg.rotary_base, cfg.ffn_hidden_size) == (2, 16, 500000.0, 96)
    assert cfg.untie_embeddings_and_output_weights and not cfg.add_bias_linear and not cfg.add_qkv_bias
    same = pretrain.check_inputs(
        TINY
        + [
            "--train-iters",
            "2",
            "--model",
            "llama",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--rotary-base",
            "500000",
            "--ffn-hidden-size",
            "96",
        ]
        + MOCK
    ).cfg
    for field in (
        "normalization",
        "activation",
        "position_embedding_type",
        "num_query_groups",
        "untie_embeddings_and_output_weights",
        "add_bias_linear",
        "rotary_base",
    ):
        assert getattr(same, field) == getattr(cfg, field), field  # --model llama: the same defaults
    assert (
        pretrain.check_inputs(TINY + ["--train-iters", "2", "--group-query-attention"] + MOCK).cfg.num_query_groups == 1
    )  # Megatron: MQA by default
    llama31 = pretrain.check_inputs(
        TINY
        + ["--train-iters", "2"]
        + LLAMA3
        + MOCK
        + ["--use-rope-scaling", "--rope-scaling-factor", "32", "--rotary-seq-len-interpolation-factor", "2"]
    ).cfg
    assert (
        llama31.rope_scaling,
        llama31.rope_scaling_factor,
        llama31.rope_scaling_low_freq_factor,
        llama31.rope_scaling_high_freq_factor,
        llama31.rope_scaling_original_max_position_embeddings,
        llama31.rotary_seq_len_interpolation_factor,
    ) == (True, 32.0, 1.0, 4.0, 8192, 2.0)
    log = tmp_path / "log.jsonl"
    assert pretrain.main(TINY + ["--train-iters", "2", "--log-jsonl", str(log)] + LLAMA3 + MOCK) == 0
    assert len([r for r in records(log) if "lm_loss" in r]) == 2


def _bpe_files(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        ["def add(x, y):\n    return x + y\n" * 30, "the quick brown fox " * 40],
        vocab_size=320,
        special_tokens=["<|endoftext|>"],
    )
    return tok.save_model(str(tmp_path))  # vocab.json, merges.txt


def test_gpt2_bpe_tokenizer_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from megatron_sp.data import build_tokenizer

    vocab, merges = _bpe_files(tmp_path)
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    theirs = transformers.GPT2Tokenizer(vocab, merges)  # the pure-Python implementation
    text = "def quick(fox):\n    return fox + 'brown' ✓ unseen"
    assert ours.tokenize(text) == theirs(text)["input_ids"]
    assert ours.detokenize(ours.tokenize(text)) == text
    assert ours.eod == theirs.convert_tokens_to_ids("<|endoftext|>") and ours.vocab_size == len(theirs)


def test_gpt3_example_flags_with_a_sample_based_schedule(tmp_path):
    vocab, merges = _bpe_files(tmp_path)
    log = tmp_path / "log.jsonl"
    flags = [
        "--train-samples",
        "48",
        "--lr-decay-samples",
        "40",
        "--lr-warmup-fraction",
        "0.2",
        "--openai-gelu",
        "--attention-backend",
        "auto",
        "--pipeline-model-parallel-size",
        "1",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
        "--mock-data",
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-4",
        "--lr-decay-style",
        "cosine",
        "--log-jsonl",
        str(log),
    ]
    i = TINY.index("--lr-warmup-iters")
    argv = TINY[:i] + TINY[i + 2 :] + flags  # warmup from the fraction instead
    assert pretrain.main(argv) == 0
    lrs = [r["lr"] for r in records(log) if "lm_loss" in r]
    assert len(lrs) == 48 // 8  # iterations = samples / global batch
    warmup, decay = int(0.2 * 40), 40
    for it, lr in enumerate(lrs, start=1):
        seen = it * 8  # LR is a function of samples seen
        if seen <= warmup:
            want = 1e-3 * seen / warmup
        else:
            progress = min(1.0, (seen - warmup) / (decay - warmup))
            want = 1e-4 + 0.5 * (math.cos(math.pi * progress) + 1) * (1e-3 - 1e-4)
        assert abs(lr - want) < 1e-12, (it, lr, want)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--pipeline-model-parallel-size", "2"], "world size 1 is not divisible by"),  # PP needs its ranks
        (["--train-samples", "64"], "--train-iters or --train-samples, not both"),
        (["--lr-decay-samples", "64"], "--lr-decay-samples needs --train-samples"),
        (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "not both"),
        (["--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file"),
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json", "--merge-file", "m.txt"], "v.json"),
        (["--model", "llama", "--group-query-attention", "--num-query-groups", "3"], "--num-query-groups"),
        (["--model", "nope"], "unknown model 'nope'"),
        (["--use-rope-scaling"], "need --position-embedding-type rope"),
    ],
)
def test_unsupported_model_flags_are_one_sentence(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = pretrain.main(TINY + ["--train-iters", "2"] + argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err

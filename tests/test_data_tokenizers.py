"""Tokenizers: round trips, Megatron's NullTokenizer semantics, errors, train_tokenizer output."""

import json

import pytest

from megatron_sp.data import DataError, as_megatron_tokenizer, build_tokenizer

TEXT = "Hello, wörld! ∑ x² — 日本語\nnew line\ttab <|endoftext|> done"


def test_byte_level_round_trip_and_ids():
    tok = build_tokenizer()
    assert (tok.vocab_size, tok.eod) == (257, 256)
    ids = tok.tokenize(TEXT)
    assert max(ids) < 256 and ids == list(TEXT.encode("utf-8"))
    assert tok.detokenize(ids) == TEXT
    assert tok.detokenize(ids + [tok.eod]) == TEXT  # EOD has no text


def test_null_tokenizer_follows_megatron_lm():
    """Megatron-LM since 2026-04: --vocab-size N is N ids with EOD N - 1 (--null-tokenizer-eod-id
    another). megatron-core 0.16.1 (installed) has N + 1 ids with EOD N: --vocab-size N + 1 reads
    its data with the same EOD."""
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.tokenize("3 1 4 1 5") == [3, 1, 4, 1, 5]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    assert (tok.vocab_size, tok.eod) == (100, 99)
    assert build_tokenizer("NullTokenizer", vocab_size=100, null_eod_id=0).eod == 0
    mc = pytest.importorskip("megatron.core.tokenizers.text.libraries.null_tokenizer")
    reference, old_data = mc.NullTokenizer(100), build_tokenizer("NullTokenizer", vocab_size=101)
    assert (old_data.vocab_size, old_data.eod) == (reference.vocab_size, reference.eod) == (101, 100)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(tokenizer_type="GPT2BPETokenizer"), "GPT2BPETokenizer"),
        (dict(tokenizer_type="NullTokenizer"), "--vocab-size"),
        (dict(tokenizer_type="HuggingFaceTokenizer"), "--tokenizer-model"),
        (dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/nope/tokenizer.json"), "/nope/tokenizer.json"),
    ],
)
def test_tokenizer_errors_are_one_clear_sentence(kwargs, needle):
    with pytest.raises(DataError, match=needle.replace("-", r"\-")):
        build_tokenizer(**kwargs)


def test_null_tokenizer_rejects_out_of_range_and_text():
    tok = build_tokenizer("NullTokenizer", vocab_size=10)
    assert tok.tokenize("8 9") == [8, 9]  # 9 is the EOD id, allowed in data
    with pytest.raises(DataError, match="10"):
        tok.tokenize("1 10")
    with pytest.raises(DataError, match="integer ids"):
        tok.tokenize("hello world")


def _write_corpus(tmp_path):
    lines = [{"text": f"The quick brown fox {i} jumps over the lazy dog. " * 3} for i in range(50)]
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    txt = tmp_path / "extra.txt"
    txt.write_text("Plain text file with unicode: naïve café. " * 20)
    return [str(jsonl), str(txt)]


def test_train_tokenizer_output_loads_as_hf_tokenizer(tmp_path):
    from tools import train_tokenizer

    out = str(tmp_path / "tok" / "tokenizer.json")
    assert train_tokenizer.main(["--input", *_write_corpus(tmp_path), "--output", out, "--vocab-size", "300"]) == out
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tok"))
    assert tok.vocab_size <= 300 and tok.eod == tok._tok.token_to_id("<|endoftext|>")
    for text in (TEXT, "The quick brown fox 7 jumps"):
        assert tok.detokenize(tok.tokenize(text)) == text
    # A literal "<|endoftext|>" in the text is the special token (as in Megatron-LM); else absent.
    assert tok.eod in tok.tokenize(TEXT) and tok.eod not in tok.tokenize("naïve café")
    assert len(tok.tokenize("The quick brown fox")) < len("The quick brown fox")  # merges learnt
    # Identity is the file content: same file -> same cache key, different tokenizer -> different.
    again = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=out)
    assert again.fingerprint() == tok.fingerprint() != build_tokenizer().fingerprint()


def test_train_tokenizer_rejects_bad_json_line(tmp_path):
    from tools import train_tokenizer

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text key"}\n')
    with pytest.raises(DataError, match="line 2"):
        train_tokenizer.main(["--input", str(bad), "--output", str(tmp_path / "t.json")])


def test_hf_tokenizer_without_eod_is_rejected(tmp_path):
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(path))
    with pytest.raises(DataError, match="end-of-document"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
    path.write_text("{not json")
    with pytest.raises(DataError, match="not a valid"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))


def test_megatron_view_hides_pad_equal_to_eod():
    view = as_megatron_tokenizer(build_tokenizer())
    assert (view.vocab_size, view.eod) == (257, 256)
    assert view.unique_identifiers["cls"] == "ByteLevelTokenizer"
    with pytest.raises(AttributeError):
        view.pad

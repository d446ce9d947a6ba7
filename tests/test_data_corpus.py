"""The embedded default corpus: deterministic, cached, large enough, usable by build_gpt_datasets."""

import os
import time

import numpy as np
import pytest

from megatron_sp.data import (
    DataError,
    build_gpt_datasets,
    build_tokenizer,
    default_corpus_prefix,
    validate_indexed_prefix,
)
from megatron_sp.data.corpus import corpus_texts

pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("corpus_cache"))


@pytest.fixture(scope="module")
def corpus(cache_dir):
    start = time.perf_counter()
    prefix = default_corpus_prefix(cache_dir, build_tokenizer())
    return prefix, time.perf_counter() - start


def test_corpus_is_built_once_and_cached(corpus, cache_dir):
    prefix, first_seconds = corpus
    assert first_seconds < 20
    start = time.perf_counter()
    assert default_corpus_prefix(cache_dir, build_tokenizer()) == prefix
    assert time.perf_counter() - start < 1.0
    leftovers = [f for f in os.listdir(cache_dir) if f.startswith(".building_")]
    assert leftovers == []


def test_corpus_size_and_documents(corpus):
    prefix, _ = corpus
    texts = corpus_texts()
    assert texts == corpus_texts()  # fixed order
    info = validate_indexed_prefix(prefix, vocab_size=257)
    assert info.num_tokens > 1_000_000 and info.num_documents == len(texts)
    tokens = np.memmap(prefix + ".bin", dtype=info.dtype, mode="r")
    ends = np.cumsum(info.sequence_lengths) - 1
    assert (tokens[ends] == 256).all() and int((tokens == 256).sum()) == len(texts)  # EOD each


def test_corpus_needs_a_text_tokenizer(cache_dir):
    with pytest.raises(DataError, match="NullTokenizer"):
        default_corpus_prefix(cache_dir, build_tokenizer("NullTokenizer", vocab_size=10))


def test_gpt_datasets_default_to_the_corpus(corpus, cache_dir):
    train, valid, _ = build_gpt_datasets(None, "95,5,0", 64, 1234, build_tokenizer(), 500, 50, 0, cache_dir=cache_dir)
    assert len(train) >= 500 and len(valid) >= 50
    text = build_tokenizer().detokenize(train[0]["tokens"])
    assert len(text) > 10

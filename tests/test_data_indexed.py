"""Indexed datasets: byte compatibility with megatron-core in both directions, and validation."""

import struct

import numpy as np
import pytest

from megatron_sp.data import DataError, read_documents, validate_indexed_prefix, write_documents

pytest.importorskip("megatron.core")


def _docs(seed=0, n=12, high=250):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, size=int(rng.integers(0, 40))).tolist() for _ in range(n)]


def _mcore_indexed():
    from megatron_sp.data._mcore import mcore

    return mcore("datasets.indexed_dataset")


def test_megatron_core_written_data_reads_back_through_ours(tmp_path):
    indexed = _mcore_indexed()
    prefix = str(tmp_path / "mc")
    builder = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    docs = _docs()
    for doc in docs:  # one document as two sequences, as sentence-split data would be
        cut = len(doc) // 2
        builder.add_document(doc, [n for n in (cut, len(doc) - cut) if n])
    builder.finalize(prefix + ".idx")
    info = validate_indexed_prefix(prefix, vocab_size=257)
    assert (info.num_documents, info.num_tokens) == (len(docs), sum(map(len, docs)))
    assert info.dtype == np.uint16 and info.max_token_id == max(max(d) for d in docs if d)
    assert [d.tolist() for d in read_documents(prefix)] == docs


@pytest.mark.parametrize("vocab_size, dtype", [(257, np.uint16), (70000, np.int32)])
def test_our_data_reads_back_through_megatron_core(tmp_path, vocab_size, dtype):
    indexed = _mcore_indexed()
    prefix = str(tmp_path / "ours")
    docs = _docs(seed=1, high=vocab_size)
    write_documents(prefix, docs, vocab_size)
    dataset = indexed.IndexedDataset(prefix)
    assert dataset.index.dtype == dtype
    bounds = dataset.document_indices
    got = [
        np.concatenate([dataset[int(i)] for i in range(a, b)] or [np.zeros(0, dtype)]).tolist()
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    assert got == docs
    # And the bytes are what megatron-core's own builder writes for the same documents.
    ref = str(tmp_path / "ref")
    builder = indexed.IndexedDatasetBuilder(ref + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_document(doc, [len(doc)] if doc else [])
    builder.finalize(ref + ".idx")
    for ext in (".bin", ".idx"):
        assert open(prefix + ext, "rb").read() == open(ref + ext, "rb").read()


@pytest.fixture
def good_prefix(tmp_path):
    prefix = str(tmp_path / "good")
    write_documents(prefix, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], vocab_size=257)
    return prefix


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


BAD_INPUTS = {
    "missing bin": (lambda p: __import__("os").remove(p + ".bin"), ".bin", "does not exist"),
    "missing idx": (lambda p: __import__("os").remove(p + ".idx"), ".idx", "does not exist"),
    "wrong magic": (lambda p: _patch(p + ".idx", 0, b"NOTMEGA"), ".idx", "not a Megatron index"),
    "bad version": (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), ".idx", "version 2"),
    "float dtype": (lambda p: _patch(p + ".idx", 17, struct.pack("<B", 6)), ".idx", "dtype code"),
    "idx header cut": (lambda p: _truncate(p + ".idx", 20), ".idx", "truncated"),
    "idx arrays cut": (lambda p: _truncate(p + ".idx", 50), ".idx", "truncated"),
    "bin cut": (lambda p: _truncate(p + ".bin", 10), ".bin", "truncated"),
    "bin too long": (lambda p: open(p + ".bin", "ab").write(b"\0\0"), ".bin", "different runs"),
    "corrupt lengths": (lambda p: _patch(p + ".idx", 34, struct.pack("<i", 2)), ".idx", "inconsistent"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_raise_data_error_naming_the_file(good_prefix, case):
    damage, ext, needle = BAD_INPUTS[case]
    damage(good_prefix)
    with pytest.raises(DataError) as err:
        validate_indexed_prefix(good_prefix)
    message = str(err.value)
    assert good_prefix + ext in message and needle in message
    assert "\n" not in message


def test_token_ids_beyond_the_vocabulary_are_caught(good_prefix):
    assert validate_indexed_prefix(good_prefix, vocab_size=10).max_token_id == 9
    with pytest.raises(DataError, match=r"good\.bin holds token id 9.*\[0, 9\)"):
        validate_indexed_prefix(good_prefix, vocab_size=9)

"""Megatron indexed datasets (`{prefix}.bin` + `{prefix}.idx`): check, write, read back.

Reading and writing go through megatron-core's IndexedDataset / IndexedDatasetBuilder, so files
are byte-compatible with Megatron-LM. `validate_indexed_prefix` re-reads the .idx layout itself
(it is small and fixed) because megatron-core only asserts, deep inside dataset building, with
messages that do not say how to fix anything.

.idx layout (little endian), version 1:
    b"MMIDIDX\\x00\\x00" | u64 version | u8 dtype code | u64 S (sequences) | u64 D (document
    boundaries, = documents + 1) | i32 lengths[S] | i64 byte pointers[S] | i64 doc_indices[D]
"""

import os
import struct
from dataclasses import dataclass, field

import numpy as np

from megatron_sp.data._mcore import mcore
from megatron_sp.data.errors import DataError

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, doc-index count
# Integer token dtypes by megatron-core's DType code (6 and 7 are floats: never token ids).
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
_FIX = "re-create it with tools/preprocess_data.py"


@dataclass(frozen=True)
class IndexedInfo:
    """What validation learned about a dataset; cheap to compute, handy for logging."""

    prefix: str
    dtype: np.dtype
    num_sequences: int
    num_documents: int
    num_tokens: int
    max_token_id: int | None  # None when no vocab check was asked for or the data is empty
    sequence_lengths: np.ndarray = field(repr=False)  # tokens per sequence, from the .idx


def validate_indexed_prefix(prefix: str, vocab_size: int | None = None) -> IndexedInfo:
    """Check `{prefix}.bin/.idx` before any heavy work; raise DataError naming the file and the fix.

    Checks: both files exist; the .idx magic and version are Megatron's; its arrays are as long as
    its header says and self-consistent; the .bin is exactly as long as the index implies; and,
    when `vocab_size` is given, every token id is in [0, vocab_size). The id check reads the whole
    .bin once through np.memmap (about a second per GB): fine for the corpora this project trains
    on; pass vocab_size=None to skip it for huge data.
    """
    idx_path, bin_path = _require_files(prefix)
    dtype, lengths, doc_indices = _read_index(idx_path)
    num_tokens = int(lengths.sum())
    _check_bin_size(bin_path, idx_path, num_tokens * np.dtype(dtype).itemsize)
    max_id = None
    if vocab_size is not None and num_tokens > 0:
        max_id = _check_token_ids(bin_path, dtype, vocab_size)
    return IndexedInfo(prefix, np.dtype(dtype), len(lengths), len(doc_indices) - 1, num_tokens, max_id, lengths)


def _require_files(prefix: str) -> tuple[str, str]:
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (bin_path, idx_path):
        if not os.path.isfile(path):
            raise DataError(
                f"Indexed dataset file {path} does not exist; check --data-path (a prefix without .bin/.idx) or {_FIX}."
            )
    return idx_path, bin_path


def _read_index(idx_path: str) -> tuple[type, np.ndarray, np.ndarray]:
    """Parse and check the .idx; returns (token dtype, sequence lengths, document indices)."""
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER.size)
    if head[: len(_MAGIC)] != _MAGIC:
        raise DataError(f"{idx_path} is not a Megatron index (magic {head[:9]!r}, expected {_MAGIC!r}); {_FIX}.")
    if len(head) < _HEADER.size:
        raise DataError(f"{idx_path} is truncated inside its header; {_FIX}.")
    _, version, code, n_seq, n_doc = _HEADER.unpack(head)
    if version != 1:
        raise DataError(f"{idx_path} has index version {version}, only version 1 is supported; {_FIX}.")
    if code not in _DTYPES:
        raise DataError(f"{idx_path} has dtype code {code}, not an integer token dtype; {_FIX}.")
    expected = _HEADER.size + n_seq * (4 + 8) + n_doc * 8
    if size < expected:
        raise DataError(
            f"{idx_path} is truncated: {size} bytes but its header ({n_seq} "
            f"sequences, {n_doc} document indices) needs {expected}; {_FIX}."
        )
    return _DTYPES[code], *_read_index_arrays(idx_path, code, n_seq, n_doc)


def _read_index_arrays(idx_path: str, code: int, n_seq: int, n_doc: int):
    """Read lengths/pointers/doc indices and check they describe one contiguous token stream."""
    offset = _HEADER.size
    lengths = np.fromfile(idx_path, np.int32, n_seq, offset=offset)
    pointers = np.fromfile(idx_path, np.int64, n_seq, offset=offset + 4 * n_seq)
    doc_indices = np.fromfile(idx_path, np.int64, n_doc, offset=offset + 12 * n_seq)
    itemsize = np.dtype(_DTYPES[code]).itemsize
    expected_pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * itemsize
    ok = (
        n_doc >= 1
        and doc_indices[0] == 0
        and doc_indices[-1] == n_seq
        and np.all(np.diff(doc_indices) >= 0)
        and np.all(lengths >= 0)
        and np.array_equal(pointers, expected_pointers[:n_seq])
    )
    if not ok:
        raise DataError(f"{idx_path} is corrupt: its lengths, pointers and document indices are inconsistent; {_FIX}.")
    return lengths, doc_indices


def _check_bin_size(bin_path: str, idx_path: str, expected: int) -> None:
    size = os.path.getsize(bin_path)
    if size < expected:
        raise DataError(f"{bin_path} is truncated: {size} bytes but {idx_path} implies {expected}; {_FIX}.")
    if size > expected:
        raise DataError(
            f"{bin_path} has {size} bytes but {idx_path} implies {expected}: the two "
            f"files come from different runs; {_FIX}."
        )


def _check_token_ids(bin_path: str, dtype, vocab_size: int) -> int:
    tokens = np.memmap(bin_path, dtype=dtype, mode="r")
    low, high = int(tokens.min()), int(tokens.max())
    del tokens
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise DataError(
            f"{bin_path} holds token id {bad}, outside the model's vocabulary "
            f"[0, {vocab_size}); preprocess it with the tokenizer you train with "
            f"(same --tokenizer-type/--tokenizer-model/--vocab-size)"
            + (
                f"; NullTokenizer data of megatron-core <= 0.16 uses EOD = --vocab-size: pass --vocab-size {bad + 1}."
                if bad == vocab_size
                else "."
            )
        )
    return high


def token_dtype(vocab_size: int) -> type:
    """The .bin token dtype Megatron's preprocess picks: uint16 below 65500 ids, else int32."""
    return mcore("datasets.indexed_dataset").DType.optimal_dtype(vocab_size)


def write_documents(prefix: str, documents, vocab_size: int) -> None:
    """Write `documents` (iterable of int sequences), one sequence per document, to prefix.bin/.idx.

    Uses megatron-core's IndexedDatasetBuilder with Megatron's dtype choice, so the output is what
    Megatron-LM's preprocess_data.py would write for the same token ids.
    """
    indexed = mcore("datasets.indexed_dataset")
    builder = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=token_dtype(vocab_size))
    for doc in documents:
        doc = np.asarray(doc)
        builder.add_document(doc, [doc.size] if doc.size else [])
    builder.finalize(prefix + ".idx")


def read_documents(prefix: str) -> list[np.ndarray]:
    """All documents of `prefix`, read through megatron-core's IndexedDataset, as int64 arrays.

    A document is the concatenation of its sequences (one per document unless the data was
    sentence-split). Meant for tests and inspection: it loads everything into memory.
    """
    validate_indexed_prefix(prefix)
    indexed = mcore("datasets.indexed_dataset")
    dataset = indexed.IndexedDataset(prefix)
    bounds = dataset.document_indices
    docs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        parts = [np.asarray(dataset[int(i)], dtype=np.int64) for i in range(start, end)]
        docs.append(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))
    del dataset
    return docs

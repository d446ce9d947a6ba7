"""Tokenizers: a file-free byte-level default, any Hugging Face `tokenizer.json`, Megatron's null.

Every tokenizer exposes the small surface the pipeline needs: `vocab_size`, `eod` (the
end-of-document id appended after each document), `pad`, `tokenize(text) -> list[int]`,
`detokenize(ids) -> str`, and `unique_identifiers` (what megatron-core hashes into its index-cache
keys, so a cache built with one tokenizer is never reused with another).

megatron-core's GPTDatasetConfig wants a MegatronTokenizer-like object; `as_megatron_tokenizer`
gives the thin view it needs (see its docstring for the one behavioural difference: `pad`).
"""

import hashlib
import json
import os
from collections import OrderedDict

from megatron_sp.data.errors import DataError

TOKENIZER_TYPES = ("ByteLevelTokenizer", "HuggingFaceTokenizer", "GPT2BPETokenizer", "NullTokenizer")

# End-of-document spellings used by common tokenizer.json files, in order of preference.
_EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
_PAD_TOKENS = ("<pad>", "<|pad|>", "[PAD]", "<|padding|>")


class _Tokenizer:
    """Shared plumbing; subclasses set vocab_size/eod/pad and implement tokenize/detokenize."""

    vocab_size: int
    eod: int
    pad: int

    def _identity(self) -> dict:
        """Fields beyond the class name that make two tokenizers produce different ids."""
        return {}

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Cache key material for megatron-core (it json-dumps this into the index-cache hash)."""
        ids = OrderedDict(cls=type(self).__name__, vocab_size=self.vocab_size, eod=self.eod)
        ids.update(self._identity())
        return ids

    def fingerprint(self) -> str:
        """Short stable hash of `unique_identifiers`, for naming files built with this tokenizer."""
        blob = json.dumps(self.unique_identifiers, sort_keys=True).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class ByteLevelTokenizer(_Tokenizer):
    """UTF-8 bytes as ids 0..255 plus EOD = 256 (257 ids). Needs no files, never fails to encode.

    `pad` equals `eod`: GPT-style pretraining packs documents and never pads inside the dataset.
    """

    vocab_size = 257
    eod = 256
    pad = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        # Special ids (EOD) have no bytes; a window may cut a multi-byte character, hence replace.
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HuggingFaceTokenizer(_Tokenizer):
    """Any Hugging Face `tokenizer.json` through the `tokenizers` library (no `transformers`).

    `tokenizer_model` is the json file or a directory holding `tokenizer.json`. EOD is the first of
    <|endoftext|>, </s>, <eos>, <|end_of_text|> found in the vocabulary. Text is encoded without
    the tokenizer's template specials (BOS etc.): the pipeline appends EOD itself.
    """

    def __init__(self, tokenizer_model: str | None):
        import tokenizers

        path = _resolve_tokenizer_file(tokenizer_model)
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as err:  # the library raises a bare Exception on malformed json
            raise DataError(
                f"{path} is not a valid Hugging Face tokenizer.json ({err}); "
                "re-create it with tools/train_tokenizer.py."
            ) from None
        self.path = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = _first_token_id(self._tok, _EOD_TOKENS)
        if self.eod is None:
            raise DataError(
                f"{path} has none of the end-of-document tokens {list(_EOD_TOKENS)}; "
                "add one as a special token (tools/train_tokenizer.py adds "
                "<|endoftext|>)."
            )
        pad = _first_token_id(self._tok, _PAD_TOKENS)
        self.pad = self.eod if pad is None else pad
        with open(path, "rb") as f:
            self._sha = hashlib.sha256(f.read()).hexdigest()

    def _identity(self) -> dict:
        # Content hash, not path: a copied tokenizer.json reuses caches, an edited one does not.
        return {"sha256": self._sha}

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts at once (the Rust library parallelises across them)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class GPT2BPETokenizer(HuggingFaceTokenizer):
    """Megatron's GPT2BPETokenizer: GPT-2's byte-level BPE from `--vocab-file vocab.json` and
    `--merge-file merges.txt` (the files OpenAI released; also what `tokenizers` saves), through the
    `tokenizers` library. EOD is <|endoftext|>, which the vocabulary must hold (GPT-2's is 50256)."""

    def __init__(self, vocab_file: str | None, merge_file: str | None):
        import tokenizers
        from tokenizers import decoders, models, pre_tokenizers

        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path or not os.path.isfile(path):
                raise DataError(
                    f"GPT2BPETokenizer needs {flag} PATH to an existing file, got {path!r} "
                    f"(GPT-2's vocab.json and merges.txt)."
                )
        try:
            self._tok = tokenizers.Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        except Exception as err:  # the library raises a bare Exception on malformed files
            raise DataError(
                f"{vocab_file} / {merge_file} are not a GPT-2 BPE vocabulary and merges file ({err})."
            ) from None
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self.path = vocab_file
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = self._tok.token_to_id("<|endoftext|>")
        if self.eod is None:
            raise DataError(f"{vocab_file} has no <|endoftext|> token (GPT2BPETokenizer's end of document).")
        self.pad = self.eod
        digest = hashlib.sha256()
        for path in (vocab_file, merge_file):
            with open(path, "rb") as f:
                digest.update(f.read())
        self._sha = digest.hexdigest()


class NullTokenizer(_Tokenizer):
    """Megatron-LM's NullTokenizer: the "text" already is space-separated token ids.

    As Megatron-LM since 2026-04: with `--vocab-size N` the vocabulary is N ids and `eod = N - 1`
    (`--null-tokenizer-eod-id` sets another). megatron-core 0.16.1 and earlier used eod = N and
    N + 1 ids: data written that way has ids up to N, which `--vocab-size N + 1` reads with the
    same EOD (the data check says so). `pad` equals `eod` (Megatron's pad id -1 is no id).
    """

    def __init__(self, vocab_size: int | None, eod_id: int | None = None):
        if vocab_size is None or int(vocab_size) <= 0:
            raise DataError("NullTokenizer needs a positive --vocab-size (data ids must be below it; EOD is N - 1).")
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1 if eod_id is None else int(eod_id)
        if not 0 <= self.eod < self.vocab_size:
            raise DataError(f"--null-tokenizer-eod-id {self.eod} is outside the vocabulary [0, {self.vocab_size}).")
        self.pad = self.eod

    def tokenize(self, text) -> list[int]:
        """Parse "3 1 4" (or take an int sequence); ids must lie in [0, vocab_size)."""
        try:
            ids = [int(x) for x in (text.split() if isinstance(text, str) else text)]
        except ValueError:
            raise DataError(
                f"NullTokenizer expects space-separated integer ids, got "
                f"{str(text)[:40]!r}; use a text tokenizer for text."
            ) from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise DataError(
                f"NullTokenizer got id {bad[0]} outside [0, {self.vocab_size}); raise --vocab-size or fix the data."
            )
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(
    tokenizer_type: str = "ByteLevelTokenizer",
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    null_eod_id: int | None = None,
):
    """Build a tokenizer by Megatron-style name.

    `vocab_size` is used by NullTokenizer only (as in Megatron); the other types know their size.
    `vocab_file`/`merge_file`: GPT2BPETokenizer's files.
    Raises DataError for an unknown type or a missing/invalid tokenizer file.
    """
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size, null_eod_id)
    raise DataError(f"Unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}.")


def _resolve_tokenizer_file(tokenizer_model: str | None) -> str:
    """Path of the tokenizer.json named by `tokenizer_model` (a file or a directory)."""
    if not tokenizer_model:
        raise DataError(
            "HuggingFaceTokenizer needs --tokenizer-model PATH to a tokenizer.json "
            "(train one with tools/train_tokenizer.py)."
        )
    path = tokenizer_model
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise DataError(
            f"Tokenizer file {path} does not exist; pass --tokenizer-model PATH to a "
            "tokenizer.json (train one with tools/train_tokenizer.py)."
        )
    return path


def _first_token_id(tok, candidates) -> int | None:
    """Id of the first candidate token present in `tok`'s vocabulary, else None."""
    for token in candidates:
        token_id = tok.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


class _MegatronTokenizerView:
    """What megatron-core's GPTDataset reads from `config.tokenizer`, and nothing else."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.eod = tokenizer.eod
        self.unique_identifiers = tokenizer.unique_identifiers
        self.tokenize = tokenizer.tokenize
        self.detokenize = tokenizer.detokenize

    @property
    def pad(self) -> int:
        # GPTDataset masks the loss wherever label == pad. With pad == eod that would silently
        # turn on eod_mask_loss (megatron-core warns and falls back to -1); we go straight to the
        # fallback by not having a pad when it is the EOD.
        if self._tokenizer.pad == self._tokenizer.eod:
            raise AttributeError("pad is the EOD token")
        return self._tokenizer.pad


def as_megatron_tokenizer(tokenizer):
    """A view of our tokenizer usable as megatron-core's `GPTDatasetConfig.tokenizer`.

    Difference from the tokenizer itself: when `pad == eod` the view has no `pad`, so megatron-core
    uses its private pad id -1 (never present in data) instead of masking every EOD label.
    """
    return _MegatronTokenizerView(tokenizer)

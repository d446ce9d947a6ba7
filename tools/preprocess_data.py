"""Tokenize a JSON-lines corpus into Megatron's indexed format ({prefix}_{key}_document.bin/.idx).

Same flags and output as Megatron-LM's tools/preprocess_data.py (the subset without sentence
splitting), written by megatron-core's IndexedDatasetBuilder, so the files are byte-identical to
what Megatron-LM writes for the same token ids and interchangeable with it.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json \\
        --append-eod --workers 2
    # -> data/my_text_document.bin, data/my_text_document.idx

Each line is a JSON object; each --json-keys field is one document (a string, or a list of
strings stored as one sequence each, as Megatron does). Output is identical for any --workers.
"""

import argparse
import json
import multiprocessing
import os
import sys

from megatron_sp.data.errors import DataError
from megatron_sp.data.indexed import token_dtype
from megatron_sp.data.tokenizers import TOKENIZER_TYPES, build_tokenizer

_worker = {}  # per-process state: the tokenizer and options (set by _init_worker)


class _NotText(Exception):
    """A document field that is neither a string nor a list of strings (the type name)."""


def get_args(argv=None) -> argparse.Namespace:
    """Megatron-LM's flag names; --workers defaults to 1 here (required there)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="JSON-lines file")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="fields to extract, one output dataset each")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", default="ByteLevelTokenizer", choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", default=None, help="tokenizer.json (HuggingFace)")
    group.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocab size")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer merges.txt")
    group.add_argument("--append-eod", action="store_true", help="append EOD to each document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="prefix of the .bin/.idx files")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    return parser.parse_args(argv)


def _init_worker(args: argparse.Namespace) -> None:
    _worker["tokenizer"] = build_tokenizer(
        args.tokenizer_type, args.tokenizer_model, args.vocab_size, args.vocab_file, args.merge_file
    )
    _worker["args"] = args


def encode_line(numbered_line: tuple[int, bytes]):
    """(line number, raw line) -> ({key: (ids, sequence lengths)}, bytes read), as Megatron."""
    lineno, line = numbered_line
    args, tokenizer = _worker["args"], _worker["tokenizer"]
    if not line.strip():
        return None, len(line)
    try:
        record = json.loads(line)
    except ValueError:
        raise DataError(
            f"{args.input} line {lineno} is not valid JSON; the input must be JSON lines (one object per line)."
        ) from None
    encoded = {}
    for key in args.json_keys:
        if not isinstance(record, dict) or key not in record:
            raise DataError(f"{args.input} line {lineno} has no {key!r} field; pass the right --json-keys.")
        try:
            encoded[key] = _encode_document(record[key], tokenizer, args.append_eod)
        except _NotText as err:
            raise DataError(
                f"{args.input} line {lineno}: field {key!r} is of type {err}, not text (a string or "
                "a list of strings); fix that line or pass the right --json-keys."
            ) from None
    return encoded, len(line)


def _encode_document(text, tokenizer, append_eod: bool):
    """Token ids of one document and the lengths of its sequences (Megatron's Encoder.encode)."""
    ids, lengths = [], []
    for sentence in text if isinstance(text, list) else [text]:
        if not isinstance(sentence, str):
            raise _NotText(type(sentence).__name__)
        sentence_ids = tokenizer.tokenize(sentence)
        if sentence_ids:
            ids.extend(sentence_ids)
            lengths.append(len(sentence_ids))
    if ids and append_eod:
        ids.append(tokenizer.eod)
        lengths[-1] += 1
    return ids, lengths


def _numbered_lines(path: str):
    with open(path, "rb") as f:
        yield from enumerate(f, start=1)


def _encoded_stream(args):
    """Encoded lines in input order, from a Pool when workers > 1 (imap keeps the order)."""
    if args.workers <= 1:
        _init_worker(args)
        yield from map(encode_line, _numbered_lines(args.input))
        return
    with multiprocessing.Pool(args.workers, initializer=_init_worker, initargs=(args,)) as pool:
        yield from pool.imap(encode_line, _numbered_lines(args.input), 32)


def main(argv=None) -> list[str]:
    """Run the tool; returns the written prefixes ({output_prefix}_{key}_document)."""
    from tqdm import tqdm

    from megatron_sp.data._mcore import mcore

    args = get_args(argv)
    if not os.path.isfile(args.input):
        raise DataError(f"Input file {args.input} does not exist; pass --input PATH to a JSON-lines file.")
    tokenizer = build_tokenizer(
        args.tokenizer_type, args.tokenizer_model, args.vocab_size, args.vocab_file, args.merge_file
    )
    indexed = mcore("datasets.indexed_dataset")
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    builders = {
        key: indexed.IndexedDatasetBuilder(prefix + ".bin.tmp", dtype=token_dtype(tokenizer.vocab_size))
        for key, prefix in prefixes.items()
    }
    try:
        with tqdm(
            total=os.path.getsize(args.input), unit="B", unit_scale=True, desc=os.path.basename(args.input)
        ) as progress:
            for encoded, nbytes in _encoded_stream(args):
                progress.update(nbytes)
                for key, (ids, lengths) in (encoded or {}).items():
                    builders[key].add_document(ids, lengths)
    except DataError:
        for prefix in prefixes.values():  # no half-written .bin.tmp left behind
            if os.path.exists(prefix + ".bin.tmp"):
                os.remove(prefix + ".bin.tmp")
        raise
    for key, prefix in prefixes.items():
        # Write under temporary names and rename .bin then .idx: a crash never leaves a pair
        # that looks complete.
        builders[key].finalize(prefix + ".idx.tmp")
        os.replace(prefix + ".bin.tmp", prefix + ".bin")
        os.replace(prefix + ".idx.tmp", prefix + ".idx")
    return list(prefixes.values())


if __name__ == "__main__":
    try:
        for written in main():
            print(f"wrote {written}.bin and {written}.idx")
    except DataError as error:  # bad input: one sentence, exit 2 (as pretrain_gpt_sp.py)
        print(f"preprocess_data.py: error: {error}", file=sys.stderr)
        sys.exit(2)

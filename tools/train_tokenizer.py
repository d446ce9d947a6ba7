"""Train a byte-level BPE tokenizer.json (GPT-2 style) with the Hugging Face `tokenizers` library.

    python tools/train_tokenizer.py --input corpus.jsonl notes.txt --output tokenizer.json \\
        --vocab-size 8192

Inputs ending in .json/.jsonl are JSON lines (the --json-key field of each object is one text);
any other file is plain text, one text per file. The result always contains <|endoftext|> (the
EOD of HuggingFaceTokenizer) and can encode any byte string (the 256 byte symbols are seeded).
"""

import argparse
import json
import os
import sys

from megatron_sp.data.errors import DataError

EOD_TOKEN = "<|endoftext|>"


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", nargs="+", required=True, help="text or JSON-lines files")
    parser.add_argument("--output", required=True, help="path of the tokenizer.json to write")
    parser.add_argument("--vocab-size", type=int, default=8192, help="final vocabulary size, special tokens included")
    parser.add_argument("--min-frequency", type=int, default=2, help="merge pairs seen fewer times are not learnt")
    parser.add_argument("--json-key", default="text", help="field holding the text in JSON lines")
    return parser.parse_args(argv)


def iter_texts(paths: list[str], json_key: str = "text"):
    """Yield the training texts of `paths` (JSON lines: one per object; else one per file)."""
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"Input file {path} does not exist; pass existing --input files.")
        if path.endswith((".json", ".jsonl")):
            yield from _json_texts(path, json_key)
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()


def _json_texts(path: str, json_key: str):
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)[json_key]
            except (ValueError, KeyError, TypeError):
                raise DataError(
                    f"{path} line {lineno} is not a JSON object with a {json_key!r} "
                    "field; fix the line or pass --json-key."
                ) from None


def train_tokenizer(texts, vocab_size: int, min_frequency: int = 2):
    """A trained byte-level BPE `tokenizers.Tokenizer` with <|endoftext|> as a special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size <= 257:
        raise DataError(
            f"--vocab-size {vocab_size} is too small: byte-level BPE needs 256 byte "
            "symbols plus <|endoftext|>, so use at least 258."
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def main(argv=None) -> str:
    """Train and save; returns the output path."""
    args = get_args(argv)
    tokenizer = train_tokenizer(iter_texts(args.input, args.json_key), args.vocab_size, args.min_frequency)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    tokenizer.save(args.output)
    return args.output


if __name__ == "__main__":
    try:
        out = main()
        print(f"wrote {out}")
    except DataError as error:
        sys.exit(f"error: {error}")

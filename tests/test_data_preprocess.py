"""tools/preprocess_data.py: Megatron's output format, read back by megatron-core, any --workers."""

import json
import os
import runpy
import sys

import numpy as np
import pytest

from megatron_sp.data import DataError, build_tokenizer

pytest.importorskip("megatron.core")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = [
    {"text": "First document. Ünïcode ✓", "meta": "a"},
    {"text": "", "meta": "empty documents stay (as zero-length documents)"},
    {"text": ["Pre-split sentence one.", " And two."], "meta": "c"},
    *({"text": f"Document number {i}: " + "lorem ipsum " * (i % 7), "meta": str(i)} for i in range(40)),
]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")  # trailing blank line
    return str(path)


def _expected_documents(tokenizer, key="text"):
    """Megatron-LM's Encoder.encode, written out independently: ids of each part, then EOD."""
    docs = []
    for record in RECORDS:
        parts = record[key] if isinstance(record[key], list) else [record[key]]
        ids = [i for part in parts for i in tokenizer.tokenize(part)]
        docs.append(ids + [tokenizer.eod] if ids else [])
    return docs


def _read_with_megatron_core(prefix):
    from megatron_sp.data._mcore import mcore

    dataset = mcore("datasets.indexed_dataset").IndexedDataset(prefix)
    bounds = dataset.document_indices
    return [[int(t) for i in range(a, b) for t in dataset[int(i)]] for a, b in zip(bounds[:-1], bounds[1:])]


def test_preprocess_writes_megatron_format_identically_for_any_workers(tmp_path, jsonl):
    from tools import preprocess_data

    outputs = {}
    for workers in (1, 2):
        prefix = str(tmp_path / f"w{workers}" / "corpus")
        written = preprocess_data.main(
            ["--input", jsonl, "--output-prefix", prefix, "--append-eod", "--workers", str(workers)]
        )
        assert written == [prefix + "_text_document"]
        outputs[workers] = written[0]
    for ext in (".bin", ".idx"):
        one, two = (open(outputs[w] + ext, "rb").read() for w in (1, 2))
        assert one == two
    assert _read_with_megatron_core(outputs[1]) == _expected_documents(build_tokenizer())
    # Pre-split text keeps one sequence per part, as Megatron-LM stores it.
    from megatron_sp.data._mcore import mcore

    dataset = mcore("datasets.indexed_dataset").IndexedDataset(outputs[1])
    assert list(np.diff(dataset.document_indices[:4])) == [1, 0, 2]


def test_preprocess_script_with_null_tokenizer_and_two_keys(tmp_path, monkeypatch, capsys):
    path = tmp_path / "ids.jsonl"
    rows = [{"text": "1 2 3", "other": "7 8"}, {"text": "4 5", "other": "9"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prefix = str(tmp_path / "ids")
    # Script mode (`python tools/preprocess_data.py ...`), run in-process to skip a new
    # interpreter's seconds of torch + megatron-core imports.
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "preprocess_data.py",
            "--input",
            str(path),
            "--output-prefix",
            prefix,
            "--json-keys",
            "text",
            "other",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "11",  # ids 0..10, EOD 10 (Megatron-LM's N - 1)
            "--append-eod",
        ],
    )
    runpy.run_path(os.path.join(ROOT, "tools", "preprocess_data.py"), run_name="__main__")
    assert f"wrote {prefix}_other_document.bin" in capsys.readouterr().out
    assert _read_with_megatron_core(prefix + "_text_document") == [[1, 2, 3, 10], [4, 5, 10]]
    assert _read_with_megatron_core(prefix + "_other_document") == [[7, 8, 10], [9, 10]]
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


@pytest.mark.parametrize(
    "line, needle", [("{not json", "line 2 is not valid JSON"), ('{"body": "x"}', "line 2 has no 'text' field")]
)
def test_preprocess_bad_lines_name_file_and_line(tmp_path, line, needle):
    from tools import preprocess_data

    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n' + line + "\n")
    with pytest.raises(DataError, match=needle) as err:
        preprocess_data.main(["--input", str(path), "--output-prefix", str(tmp_path / "o")])
    assert str(path) in str(err.value)
    with pytest.raises(DataError, match="does not exist"):
        preprocess_data.main(["--input", str(tmp_path / "nope"), "--output-prefix", "x"])


def test_preprocess_with_a_trained_hf_tokenizer(tmp_path, jsonl):
    from tools import preprocess_data, train_tokenizer

    model = str(tmp_path / "tokenizer.json")
    train_tokenizer.main(["--input", jsonl, "--output", model, "--vocab-size", "320"])
    prefix = str(tmp_path / "hf")
    written = preprocess_data.main(
        [
            "--input",
            jsonl,
            "--output-prefix",
            prefix,
            "--append-eod",
            "--tokenizer-type",
            "HuggingFaceTokenizer",
            "--tokenizer-model",
            model,
            "--workers",
            "2",
        ]
    )
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=model)
    assert _read_with_megatron_core(written[0]) == _expected_documents(tokenizer)

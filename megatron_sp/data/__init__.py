"""Data pipeline: tokenizers, Megatron indexed datasets (.bin/.idx), GPT samples, samplers.

megatron-core's dataset code is imported lazily (inside the functions that need it), and so are
this package's own modules (below), so importing this package is cheap.
"""

import importlib

# name -> submodule. Imported on first use (PEP 562), so that a run on --mock-data, or a tool that
# needs only the tokenizers, does not import numpy or megatron-core.
_EXPORTS = {
    "build_data_iterator": "batch",
    "collate": "batch",
    "default_corpus_prefix": "corpus",
    "DataError": "errors",
    "build_gpt_datasets": "gpt",
    "parse_data_path": "blend",
    "parse_split": "blend",
    "check_train_share": "blend",
    "check_train_split": "gpt",
    "IndexedInfo": "indexed",
    "read_documents": "indexed",
    "validate_indexed_prefix": "indexed",
    "write_documents": "indexed",
    "PretrainingSampler": "sampler",
    "ByteLevelTokenizer": "tokenizers",
    "HuggingFaceTokenizer": "tokenizers",
    "NullTokenizer": "tokenizers",
    "as_megatron_tokenizer": "tokenizers",
    "build_tokenizer": "tokenizers",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))

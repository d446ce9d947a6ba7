"""Data pipeline: tokenizers, Megatron indexed datasets (.bin/.idx), GPT samples, samplers.

megatron-core's dataset code is imported lazily (inside the functions that need it), so importing
this package is cheap.
"""
from megatron_sp.data.batch import build_data_iterator, collate
from megatron_sp.data.corpus import default_corpus_prefix
from megatron_sp.data.errors import DataError
from megatron_sp.data.gpt import build_gpt_datasets, parse_data_path, parse_split
from megatron_sp.data.indexed import (IndexedInfo, read_documents, validate_indexed_prefix,
                                      write_documents)
from megatron_sp.data.sampler import PretrainingSampler
from megatron_sp.data.tokenizers import (ByteLevelTokenizer, HuggingFaceTokenizer, NullTokenizer,
                                         as_megatron_tokenizer, build_tokenizer)

__all__ = [
    "ByteLevelTokenizer", "DataError", "HuggingFaceTokenizer", "IndexedInfo", "NullTokenizer",
    "PretrainingSampler", "as_megatron_tokenizer", "build_data_iterator", "build_gpt_datasets",
    "build_tokenizer", "collate", "default_corpus_prefix", "parse_data_path", "parse_split",
    "read_documents", "validate_indexed_prefix", "write_documents",
]

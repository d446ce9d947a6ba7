"""The embedded default corpus: text that ships with Python itself, so training needs no download.

Documents, in a fixed order: every `pydoc_data.topics` help topic (the language reference
sections `help()` shows), then the source of each .py file of a fixed list of standard-library
modules and packages (located with importlib's finders, read from disk, never imported). About
7 MB of text: enough that a tiny GPT trained for minutes does not simply memorise it. Modules a
distribution strips are skipped, and the cache key hashes the text itself, so a different Python
yields a different (still deterministic) corpus file instead of a stale one.
"""

import contextlib
import hashlib
import importlib.util
import os
import tempfile

from megatron_sp.data.errors import DataError
from megatron_sp.data.indexed import write_documents
from megatron_sp.data.tokenizers import NullTokenizer

CORPUS_VERSION = 1

# Top-level names only: find_spec on these imports nothing. Packages contribute all their .py
# files (test directories excluded). Chosen for size (~6 MB together) and prose-like docstrings.
STDLIB_SOURCES = (
    "abc",
    "argparse",
    "ast",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "cmd",
    "codecs",
    "collections",
    "concurrent",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "dis",
    "doctest",
    "email",
    "enum",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "glob",
    "gzip",
    "heapq",
    "hmac",
    "html",
    "http",
    "imaplib",
    "importlib",
    "inspect",
    "ipaddress",
    "json",
    "locale",
    "logging",
    "mailbox",
    "multiprocessing",
    "numbers",
    "operator",
    "optparse",
    "pathlib",
    "pdb",
    "pickle",
    "pickletools",
    "platform",
    "pprint",
    "pydoc",
    "queue",
    "random",
    "re",
    "selectors",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "socketserver",
    "ssl",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "trace",
    "traceback",
    "turtle",
    "typing",
    "unittest",
    "urllib",
    "uuid",
    "warnings",
    "weakref",
    "xml",
    "xmlrpc",
    "zipfile",
    "_pydecimal",
    "_pyio",
)
_SKIP_DIRS = {"test", "tests", "__pycache__", "idle_test"}


def corpus_texts() -> list[str]:
    """The corpus documents, in their fixed order (help topics, then module sources)."""
    from pydoc_data.topics import topics

    docs = [f"{name}\n\n{topics[name]}" for name in sorted(topics)]
    for name in STDLIB_SOURCES:
        docs.extend(_module_sources(name))
    return docs


def _module_sources(name: str) -> list[str]:
    """Source text of module `name`, or of every .py file of package `name` in sorted order."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return []  # stripped by this distribution, or a builtin / C extension
    if not spec.submodule_search_locations:
        return [_read(spec.origin)]
    texts = []
    for root in spec.submodule_search_locations:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
            texts.extend(_read(os.path.join(dirpath, f)) for f in sorted(filenames) if f.endswith(".py"))
    return texts


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def default_corpus_prefix(cache_dir: str, tokenizer) -> str:
    """Prefix of the default corpus tokenized with `tokenizer`, building it once under cache_dir.

    The file name hashes the corpus text, CORPUS_VERSION and the tokenizer identity, so a cache
    entry is never reused with another tokenizer or Python. Building writes into a temporary
    directory and renames into place (.bin first, .idx last, and a reader needs both), under an
    exclusive file lock: concurrent callers (e.g. all ranks of a job) build it once and the others
    wait, and an interrupted build never leaves a half-written dataset behind. EOD follows each
    document. Not a collective: safe to call on any subset of ranks.
    """
    if not hasattr(tokenizer, "fingerprint"):
        raise DataError("default_corpus_prefix needs a tokenizer from build_tokenizer().")
    os.makedirs(cache_dir, exist_ok=True)
    texts = corpus_texts()
    key = hashlib.sha256(f"v{CORPUS_VERSION}|{tokenizer.fingerprint()}".encode())
    for text in texts:
        key.update(text.encode("utf-8", errors="replace"))
    prefix = os.path.join(cache_dir, f"default_corpus_{key.hexdigest()[:16]}_text_document")
    if _exists(prefix):
        return prefix
    with _file_lock(prefix + ".lock"):
        if not _exists(prefix):  # another process may have built it while we waited
            _build(prefix, texts, tokenizer)
    return prefix


def _exists(prefix: str) -> bool:
    return os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")


def _build(prefix: str, texts: list[str], tokenizer) -> None:
    """Tokenize `texts` (EOD after each) into prefix.bin/.idx atomically."""
    if isinstance(tokenizer, NullTokenizer):
        raise DataError(
            "The default corpus is text; NullTokenizer cannot encode it. Pass "
            "--data-path or choose ByteLevelTokenizer/HuggingFaceTokenizer."
        )
    batch = getattr(tokenizer, "tokenize_batch", None)
    token_lists = batch(texts) if batch else [tokenizer.tokenize(t) for t in texts]
    docs = [ids + [tokenizer.eod] for ids in token_lists]
    directory = os.path.dirname(prefix)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".building_") as tmp:
        tmp_prefix = os.path.join(tmp, "corpus")
        write_documents(tmp_prefix, docs, tokenizer.vocab_size)
        os.replace(tmp_prefix + ".bin", prefix + ".bin")
        os.replace(tmp_prefix + ".idx", prefix + ".idx")


@contextlib.contextmanager
def _file_lock(path: str):
    """Exclusive advisory lock on `path` (no-op where fcntl does not exist)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: fall back to atomic renames alone
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

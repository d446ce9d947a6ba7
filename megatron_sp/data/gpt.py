"""GPT train/valid/test datasets: megatron-core's GPTDataset + BlendedMegatronDatasetBuilder.

megatron-core owns the sample index: documents of each split are shuffled per epoch (seeded),
concatenated with their EOD tokens and cut into windows of seq_length + 1 tokens (tokens =
window[:-1], labels = window[1:]); blends draw from each source in proportion to its weight. We add
what it lacks: input checks that fail early with a DataError instead of an assert (or, for a
split with no tokens, an endless loop), and running without torch.distributed.

Each dataset item is a dict of tensors (megatron-core's format): tokens/labels LongTensor [s],
loss_mask FloatTensor [s], position_ids LongTensor [s], attention_mask BoolTensor [1, s, s]
(True = masked out) only when reset_attention_mask is on, and dataset_id when blending.
Megatron semantics to know: eod_mask_loss zeroes the loss where the *input* token is EOD (the
unpredictable first token of the next document), and reset_* restart positions / block attention
after each EOD input token.
"""

import contextlib
import hashlib
import os
import warnings

from megatron_sp.data._mcore import mcore
from megatron_sp.data.blend import parse_data_path, parse_split  # noqa: F401 - part of this API
from megatron_sp.data.corpus import default_corpus_prefix
from megatron_sp.data.errors import DataError
from megatron_sp.data.indexed import validate_indexed_prefix
from megatron_sp.data.tokenizers import as_megatron_tokenizer

_SPLIT_NAMES = ("train", "valid", "test")


def build_gpt_datasets(
    data_path: list[str] | None,
    split: str,
    seq_length: int,
    seed: int,
    tokenizer,
    train_samples: int,
    valid_samples: int,
    test_samples: int,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    cache_dir: str = "data_cache",
):
    """Build (train, valid, test) GPT datasets; a split with weight 0 in `split` is None.

    A valid/test split that gets no documents of some source (tiny data) is None too, with a
    warning (megatron-core would loop forever on it); an empty train split is a DataError.

    data_path: Megatron's --data-path: ["prefix"], ["p1", "p2"] (blend by token count) or
        ["0.3", "p1", "0.7", "p2"] (blend by weight); None means the embedded default corpus.
    split: Megatron's --split, e.g. "969,30,1": each prefix's documents are cut into contiguous
        train/valid/test ranges in these proportions.
    *_samples: at least this many samples per split; a dataset repeats (reshuffled) epochs to
        reach it, so len(dataset) >= the request.
    cache_dir: holds the default corpus and megatron-core's index cache
        (<cache_dir>/indices/<data identity>), reused across runs with identical settings.

    Collective when torch.distributed is initialised (call it on every rank): global rank 0
    builds the index cache first, the others wait at a barrier and then load it.
    """
    _check_sizes(seq_length, train_samples, valid_samples, test_samples)
    if not data_path:
        data_path = [default_corpus_prefix(os.path.join(cache_dir, "corpus"), tokenizer)]
    prefixes, weights = parse_data_path(data_path)
    parse_split(split)  # a clear error here instead of megatron-core's assert
    infos = [validate_indexed_prefix(prefix, tokenizer.vocab_size) for prefix in prefixes]
    if weights is None and len(prefixes) > 1:
        # megatron-core blends unweighted sources by size but caps the blend at one epoch of
        # each; explicit size weights keep the "at least *_samples" promise (more epochs).
        weights = [float(info.num_tokens) for info in infos]
    gpt = mcore("datasets.gpt_dataset")
    builder_mod = mcore("datasets.blended_megatron_dataset_builder")
    config = gpt.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=split,
        path_to_cache=_index_cache_dir(cache_dir, infos),
        tokenizer=as_megatron_tokenizer(tokenizer),
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=reset_attention_mask,
    )
    empty = {i for info in infos for i in _empty_splits(info, config.split_matrix, split)}
    _drop_splits(config, empty, split)
    # Every rank reads its own samples (the model wants full tokens on every rank), so every
    # rank builds the datasets; megatron-core orders rank 0 first when distributed.
    builder = builder_mod.BlendedMegatronDatasetBuilder(
        gpt.GPTDataset, [train_samples, valid_samples, test_samples], lambda: True, config
    )
    with _rank_zero_when_not_distributed(), _index_cache_without_pickle(config.path_to_cache):
        train, valid, test = builder.build()
    return train, valid, test


def _index_cache_dir(cache_dir: str, infos) -> str:
    """<cache_dir>/indices/<hash of the data files' identity>.

    megatron-core keys its index cache by prefix *name* (plus seed, lengths, split, tokenizer);
    re-preprocessing data in place would silently reuse indices of the old files. Keying the
    directory by each file's size and mtime as well makes a changed dataset get fresh indices.
    """
    identity = hashlib.sha256()
    for info in infos:
        for path in (info.prefix + ".idx", info.prefix + ".bin"):
            stat = os.stat(path)
            identity.update(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|".encode())
    return os.path.join(cache_dir, "indices", identity.hexdigest()[:16])


def check_train_split(info, split: str) -> None:
    """DataError when the train split of `split` gets no tokens of this source (`info` from
    validate_indexed_prefix); cheap, so the program runs it before building anything."""
    _empty_splits(info, [(0.0, parse_split(split)[0])], split)


def _empty_splits(info, split_matrix, split: str) -> list[int]:
    """Splits present in `split_matrix` that get no token of this prefix (train: DataError).

    Same document ranges as megatron-core's builder (round(bound * number of sequences)); it
    would loop forever building epochs of an empty range.
    """
    n, empty = info.num_sequences, []
    for index, bounds in enumerate(split_matrix):
        if bounds is None:
            continue
        lo, hi = int(round(bounds[0] * n)), int(round(bounds[1] * n))
        if int(info.sequence_lengths[lo:hi].sum()) == 0:
            empty.append(index)
    if 0 in empty:
        raise DataError(
            f"{info.prefix}: the train split of --split {split} gets no tokens from "
            f"its {n} documents; use more data or give train a larger share."
        )
    return empty


def _drop_splits(config, empty: set[int], split: str) -> None:
    """Turn valid/test splits without data into None splits (as a weight of 0 would), warning."""
    for index in sorted(empty):
        warnings.warn(
            f"The {_SPLIT_NAMES[index]} split of --split {split} gets no documents of "
            "some --data-path source; that dataset is None (use more data or a larger "
            "share for it).",
            stacklevel=3,
        )
        config.split_matrix[index] = None


def _check_sizes(seq_length: int, *samples: int) -> None:
    if seq_length <= 0:
        raise DataError(f"seq_length must be positive, got {seq_length}.")
    if any(s is None or s < 0 for s in samples):
        raise DataError(f"train/valid/test sample counts must be >= 0, got {list(samples)}.")


@contextlib.contextmanager
def _rank_zero_when_not_distributed():
    """Let megatron-core 0.16.1's BlendedDataset cache code run without a process group.

    BlendedDataset._build_indices calls torch.distributed.get_rank() on a cache miss without
    checking is_initialized() (GPTDataset does check), which raises in a single process. While
    no process group exists we are rank 0 by definition, so get_rank answers 0 for the duration
    of the build; with a process group nothing is touched.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    original = dist.get_rank
    dist.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        dist.get_rank = original


@contextlib.contextmanager
def _index_cache_without_pickle(cache_dir: str):
    """Load megatron-core's cached sample indices with allow_pickle=False.

    megatron-core 0.16.1 reads its index cache (`*-document_index.npy`, `*-sample_index.npy`, ...)
    with numpy.load(..., allow_pickle=True): a file there that holds a pickle instead of an .npy
    array would run code. It only ever writes plain integer arrays, so while the datasets are built
    numpy.load refuses pickles, and a file it cannot read becomes a DataError naming the cache.
    """
    import numpy

    original = numpy.load

    def load(file, *args, **kwargs):
        kwargs["allow_pickle"] = False
        try:
            return original(file, *args, **kwargs)
        except (ValueError, OSError, EOFError) as err:
            raise DataError(
                f"{file} in the dataset index cache is not a plain numpy array "
                f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); delete "
                f"{cache_dir} to rebuild the indices."
            ) from None

    numpy.load = load
    try:
        yield
    finally:
        numpy.load = original

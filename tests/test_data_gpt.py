"""build_gpt_datasets: packing with EOD, Megatron's reset/eod masks, blending, seeds, errors."""

import os
import warnings

import numpy as np
import pytest
import torch

from megatron_sp.data import DataError, build_data_iterator, build_gpt_datasets, build_tokenizer, write_documents

pytest.importorskip("megatron.core")

VOCAB = 100  # data ids < 100, EOD = 100: megatron-core 0.16's NullTokenizer(100), read as ours with 101 ids
EOD = VOCAB
SEQ = 8


def _tok():
    return build_tokenizer("NullTokenizer", vocab_size=VOCAB + 1)


def _doc(d, length):
    """Document d: ids d*10 + position, so each id tells its document and position."""
    return [d * 10 + p for p in range(length)] + [EOD]


@pytest.fixture
def tiny(tmp_path):
    lengths = [3, 9, 1, 6, 8, 2, 5, 7]
    prefix = str(tmp_path / "tiny")
    write_documents(prefix, [_doc(d, n) for d, n in enumerate(lengths)], VOCAB + 1)
    return prefix, lengths


def _build(prefix, tmp_path, samples, **flags):
    train, valid, test = build_gpt_datasets(
        [prefix], "1,0,0", SEQ, 1234, _tok(), samples, 0, 0, cache_dir=str(tmp_path / "cache"), **flags
    )
    assert valid is None and test is None
    return train


def _check_packed(window, lengths):
    """Consecutive ids continue a document, or end it with EOD, after which a new one starts."""
    for a, b in zip(window, window[1:]):
        if a == EOD:
            assert b != EOD and b % 10 == 0, window
        elif b == EOD:
            assert a % 10 == lengths[a // 10] - 1, window
        else:
            assert b == a + 1, window


def test_windows_pack_documents_with_eod_separators(tiny, tmp_path):
    prefix, lengths = tiny
    total = sum(lengths) + len(lengths)
    train = _build(prefix, tmp_path, samples=(total - 1) // SEQ)  # exactly one epoch
    assert len(train) == (total - 1) // SEQ
    inputs = []
    for i in range(len(train)):
        item = train[i]
        assert item["tokens"].shape == item["labels"].shape == (SEQ,)
        assert torch.equal(item["tokens"][1:], item["labels"][:-1])
        _check_packed(item["tokens"].tolist() + [int(item["labels"][-1])], lengths)
        assert torch.equal(item["position_ids"], torch.arange(SEQ))
        assert bool(item["loss_mask"].eq(1).all()) and "attention_mask" not in item
        inputs += item["tokens"].tolist()
    words = [t for t in inputs if t != EOD]
    assert len(words) == len(set(words))  # one epoch: every position of the stream at most once


def _expected_positions(tokens):
    positions, p = [], 0
    for t in tokens:
        positions.append(p)
        p = 0 if t == EOD else p + 1
    return positions


def _expected_masked(tokens):
    """True where query i may not see key j: the future, or anything before an EOD at k < i."""
    n = len(tokens)
    masked = np.ones((n, n), dtype=bool)
    for i in range(n):
        for j in range(i + 1):
            masked[i, j] = any(tokens[k] == EOD for k in range(j, i))
    return masked


def test_reset_flags_and_eod_mask_follow_megatron(tiny, tmp_path):
    prefix, lengths = tiny
    train = _build(prefix, tmp_path, samples=6, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    batch = next(build_data_iterator(train, 0, micro_batch_size=6, dp_rank=0, dp_size=1))
    assert batch["attention_mask"].shape == (6, 1, SEQ, SEQ)
    assert bool((batch["tokens"] == EOD).any())  # the check below is not vacuous
    for b in range(6):
        tokens = batch["tokens"][b].tolist()
        assert batch["position_ids"][b].tolist() == _expected_positions(tokens)
        assert np.array_equal(batch["attention_mask"][b, 0].numpy(), _expected_masked(tokens))
        # Megatron's eod_mask_loss: no loss where the *input* is EOD (the next document's
        # unpredictable first token); the EOD itself is still a target.
        assert batch["loss_mask"][b].tolist() == [float(t != EOD) for t in tokens]


def _two_sources(tmp_path):
    rng = np.random.default_rng(0)
    prefixes = []
    for name, low in (("a", 0), ("b", 50)):
        docs = [rng.integers(low, low + 50, size=int(rng.integers(5, 30))).tolist() + [EOD] for _ in range(150)]
        prefixes.append(str(tmp_path / name))
        write_documents(prefixes[-1], docs, VOCAB + 1)
    return prefixes


def _first_tokens(datasets, n=40):
    return torch.stack([datasets[0][i]["tokens"] for i in range(n)])


def test_blending_respects_weights_and_sources(tmp_path):
    a, b = _two_sources(tmp_path)
    train, valid, _ = build_gpt_datasets(
        ["0.3", a, "0.7", b], "90,10,0", SEQ, 7, _tok(), 1000, 100, 0, cache_dir=str(tmp_path / "cache")
    )
    assert len(train) == 1000 and len(valid) == 100
    ids = np.array([int(train[i]["dataset_id"]) for i in range(1000)])
    assert abs((ids == 0).mean() - 0.3) < 0.02
    for i in range(0, 1000, 37):  # each sample's words come from its own source
        words = [t for t in train[i]["tokens"].tolist() if t != EOD]
        assert all((t >= 50) == bool(ids[i]) for t in words)


def test_unweighted_blend_still_gives_the_requested_samples(tmp_path):
    # megatron-core alone caps an unweighted blend at one epoch of each source (~470 here).
    train, _, _ = build_gpt_datasets(
        _two_sources(tmp_path), "1,0,0", SEQ, 7, _tok(), 2000, 0, 0, cache_dir=str(tmp_path / "cache")
    )
    assert len(train) >= 2000


def test_same_seed_same_samples_other_seed_other_order(tmp_path):
    a, b = _two_sources(tmp_path)

    def build(seed, cache):
        return build_gpt_datasets([a, b], "1,0,0", SEQ, seed, _tok(), 200, 0, 0, cache_dir=str(tmp_path / cache))

    first = _first_tokens(build(1, "c1"))
    assert torch.equal(first, _first_tokens(build(1, "c2")))  # rebuilt from scratch
    assert torch.equal(first, _first_tokens(build(1, "c1")))  # loaded from the index cache
    assert not torch.equal(first, _first_tokens(build(2, "c1")))


def test_empty_valid_test_splits_become_none_and_empty_train_fails(tiny, tmp_path):
    prefix, _ = tiny
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train, valid, test = build_gpt_datasets(
            [prefix], "969,30,1", SEQ, 1, _tok(), 10, 5, 5, cache_dir=str(tmp_path / "c")
        )
    assert len(train) >= 10 and valid is None and test is None
    assert sum("split" in str(w.message) for w in caught) == 2
    with pytest.raises(DataError, match="train split"):
        build_gpt_datasets([prefix], "1,100,0", SEQ, 1, _tok(), 10, 5, 0, cache_dir=str(tmp_path / "c"))


@pytest.mark.parametrize(
    "data_path, split, needle",
    [
        (["0.3", "{p}", "{p}"], "1,0,0", "mixes weights"),
        (["0", "{p}"], "1,0,0", "positive"),
        (["{p}_missing"], "1,0,0", "tiny_missing.bin does not exist"),
        (["{p}"], "a,b", "--split"),
        (["{p}"], "1,1,1,1", "--split"),
    ],
)
def test_bad_arguments_raise_data_error(tiny, tmp_path, data_path, split, needle):
    prefix, _ = tiny
    with pytest.raises(DataError, match=needle.replace("-", r"\-")):
        build_gpt_datasets(
            [p.format(p=prefix) for p in data_path], split, SEQ, 1, _tok(), 10, 0, 0, cache_dir=str(tmp_path / "c")
        )


def test_tokens_beyond_the_tokenizer_vocabulary_fail_early(tiny, tmp_path):
    prefix, _ = tiny
    with pytest.raises(DataError, match=r"tiny\.bin holds token id 100"):
        build_gpt_datasets(
            [prefix],
            "1,0,0",
            SEQ,
            1,
            build_tokenizer("NullTokenizer", vocab_size=50),
            10,
            0,
            0,
            cache_dir=str(tmp_path / "c"),
        )


def _distributed_build(rank, world, init_file, prefixes, cache_dir, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        datasets = build_gpt_datasets(
            ["0.5", prefixes[0], "0.5", prefixes[1]], "1,0,0", SEQ, 3, _tok(), 100, 0, 0, cache_dir=cache_dir
        )
        torch.save(_first_tokens(datasets, 20), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_distributed_build_matches_single_process(tmp_path):
    prefixes = _two_sources(tmp_path)
    torch.multiprocessing.spawn(
        _distributed_build, nprocs=2, args=(2, str(tmp_path / "init"), prefixes, str(tmp_path / "dist"), str(tmp_path))
    )
    single = _first_tokens(
        build_gpt_datasets(
            ["0.5", prefixes[0], "0.5", prefixes[1]],
            "1,0,0",
            SEQ,
            3,
            _tok(),
            100,
            0,
            0,
            cache_dir=str(tmp_path / "single"),
        ),
        20,
    )
    for rank in range(2):
        assert torch.equal(torch.load(str(tmp_path / f"{rank}.pt")), single)

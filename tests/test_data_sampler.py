"""PretrainingSampler and build_data_iterator: DP slicing, global-step invariance, resume."""

import warnings

import pytest
import torch

from megatron_sp.data import PretrainingSampler, build_data_iterator, collate

TOTAL, MICRO = 96, 2


def _rank_batches(dp, consumed=0, total=TOTAL, micro=MICRO, drop_last=True):
    """Per DP rank, the list of micro-batches it is given."""
    return [list(PretrainingSampler(total, consumed, micro, r, dp, drop_last)) for r in range(dp)]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_epoch_covers_every_index_exactly_once(dp):
    seen = [i for batches in _rank_batches(dp) for batch in batches for i in batch]
    assert sorted(seen) == list(range(TOTAL))
    assert all(len(b) == MICRO for batches in _rank_batches(dp) for b in batches)


def _global_steps(dp, global_batch=16, consumed=0):
    """Sets of sample positions consumed by the whole job per optimizer step."""
    per_rank = _rank_batches(dp, consumed)
    micro_steps = global_batch // (MICRO * dp)
    steps = []
    for start in range(0, len(per_rank[0]), micro_steps):
        steps.append({i for batches in per_rank for b in batches[start : start + micro_steps] for i in b})
    return steps


def test_global_steps_identical_for_any_dp_size():
    reference = _global_steps(1)
    assert reference[0] == set(range(16))
    for dp in (2, 4):
        assert _global_steps(dp) == reference


def test_rank_gets_its_slice_of_each_step():
    # Megatron's MegatronPretrainingSampler: chunk of micro*dp consecutive, rank r takes slice r.
    assert list(PretrainingSampler(16, 0, 2, 1, 4))[:2] == [[2, 3], [10, 11]]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_resume_continues_the_exact_sequence(dp):
    full = _rank_batches(dp)
    steps_done = 5
    resumed = _rank_batches(dp, consumed=steps_done * MICRO * dp)
    for rank in range(dp):
        assert resumed[rank] == full[rank][steps_done:]


def test_drop_last_and_length():
    kept = _rank_batches(2, total=11, micro=2, drop_last=False)
    assert kept == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10]]]
    assert _rank_batches(2, total=11, micro=2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert len(PretrainingSampler(11, 0, 2, 0, 2)) == 2
    assert len(PretrainingSampler(11, 0, 2, 0, 2, drop_last=False)) == 3


@pytest.mark.parametrize(
    "args, needle",
    [
        ((10, 10, 2, 0, 1), "consumed_samples"),
        ((10, 0, 0, 0, 1), "micro_batch_size"),
        ((10, 0, 2, 2, 2), "data_parallel_rank"),
    ],
)
def test_bad_sampler_arguments(args, needle):
    with pytest.raises(ValueError, match=needle):
        PretrainingSampler(*args)


class _FakeGPTDataset:
    """Items like GPTDataset's; tokens encode the dataset index so batches can be checked."""

    def __init__(self, n, s=4):
        self.n, self.s = n, s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        tokens = torch.full((self.s,), int(i))
        return {
            "tokens": tokens,
            "labels": tokens + 1,
            "loss_mask": torch.ones(self.s),
            "position_ids": torch.arange(self.s),
        }


def test_iterator_batches_sample_ids_and_resume():
    dataset = _FakeGPTDataset(64)
    it = build_data_iterator(dataset, consumed_samples=0, micro_batch_size=2, dp_rank=1, dp_size=2)
    batches = [next(it) for _ in range(5)]
    first = batches[0]
    assert first["tokens"].shape == (2, 4) and first["tokens"].dtype == torch.long
    assert first["attention_mask"] is None and first["loss_mask"].dtype == torch.float32
    assert first["sample_ids"].tolist() == [2, 3]
    assert all(torch.equal(b["tokens"][:, 0], b["sample_ids"]) for b in batches)
    resumed = build_data_iterator(dataset, consumed_samples=3 * 4, micro_batch_size=2, dp_rank=1, dp_size=2)
    assert torch.equal(next(resumed)["tokens"], batches[3]["tokens"])


def test_iterator_is_infinite_and_warns_when_wrapping():
    it = build_data_iterator(_FakeGPTDataset(6), 0, micro_batch_size=2, dp_rank=0, dp_size=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = [next(it) for _ in range(5)]
    assert batches[3]["sample_ids"].tolist() == [6, 7]  # global positions keep growing
    assert batches[3]["tokens"][:, 0].tolist() == [0, 1]  # the data replays
    assert sum("replaying" in str(w.message) for w in caught) == 1


def test_iterator_with_dataloader_workers_matches_in_process():
    dataset = _FakeGPTDataset(32)
    plain = build_data_iterator(dataset, 4, 2, 0, 2)
    workers = build_data_iterator(dataset, 4, 2, 0, 2, num_workers=1)
    for _ in range(3):
        a, b = next(plain), next(workers)
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["sample_ids"], b["sample_ids"])


def test_collate_keeps_attention_mask_and_dataset_id():
    s = 3
    sample = {
        "tokens": torch.arange(s),
        "labels": torch.arange(s),
        "loss_mask": torch.ones(s),
        "position_ids": torch.arange(s),
        "dataset_id": 1,
        "attention_mask": torch.ones(1, s, s, dtype=torch.bool),
    }
    batch = collate([sample, sample], [5, 9])
    assert batch["attention_mask"].shape == (2, 1, s, s)
    assert batch["dataset_id"].tolist() == [1, 1] and batch["sample_ids"].tolist() == [5, 9]

"""Micro-batches for the training loop: collate dataset items, and an infinite resumable iterator.

A batch is a dict of tensors (b = micro batch size, s = seq_length):
    tokens          LongTensor  [b, s]        input ids
    labels          LongTensor  [b, s]        next-token targets (tokens shifted by one)
    loss_mask       FloatTensor [b, s]        1 where the token counts in the loss
    position_ids    LongTensor  [b, s]        restart after EOD with reset_position_ids
    attention_mask  BoolTensor  [b, 1, s, s]  True = masked out (Megatron convention); None when
                                              reset_attention_mask is off (plain causal)
    sample_ids      LongTensor  [b]           global sample positions (PretrainingSampler): the
                                              same for a sample whatever the DP size; the model
                                              keys its dropout masks on them
    dataset_id      LongTensor  [b]           source index in a blend (only when blending)
"""

import warnings
from collections.abc import Iterator

import torch

from megatron_sp.data.errors import DataError
from megatron_sp.data.sampler import PretrainingSampler


def collate(samples: list[dict], sample_ids) -> dict:
    """Stack dataset items (GPTDataset dicts) into one micro-batch; see the module docstring."""
    if not samples or len(samples) != len(sample_ids):
        raise ValueError(
            f"collate needs one sample id per sample, got {len(samples)} samples and {len(sample_ids)} ids."
        )
    batch = {
        "tokens": torch.stack([s["tokens"] for s in samples]).long(),  # [b, s]
        "labels": torch.stack([s["labels"] for s in samples]).long(),  # [b, s]
        "loss_mask": torch.stack([s["loss_mask"] for s in samples]).float(),  # [b, s]
        "position_ids": torch.stack([s["position_ids"] for s in samples]).long(),  # [b, s]
        "attention_mask": None,
        "sample_ids": torch.as_tensor(list(sample_ids), dtype=torch.long),  # [b]
    }
    if samples[0].get("attention_mask") is not None:
        batch["attention_mask"] = torch.stack([s["attention_mask"] for s in samples]).bool()
    if "dataset_id" in samples[0]:
        batch["dataset_id"] = torch.tensor([int(s["dataset_id"]) for s in samples])  # [b]
    return batch


class _PositionedDataset(torch.utils.data.Dataset):
    """Maps a global sample position to (position, dataset item), wrapping past the end.

    Wrapping replays the dataset from its start; build datasets with enough train_samples to
    avoid it (a warning says when it happens).
    """

    def __init__(self, dataset):
        self.dataset = dataset
        self.size = len(dataset)
        self.warned = False

    def __getitem__(self, position: int):
        if position >= self.size and not self.warned:
            self.warned = True
            warnings.warn(
                f"Sample position {position} is past the dataset's {self.size} samples; "
                "replaying it from the start (raise --train-samples to avoid this).",
                stacklevel=2,
            )
        return position, self.dataset[position % self.size]


def _collate_positioned(items) -> dict:
    positions, samples = zip(*items)
    return collate(list(samples), positions)


def build_data_iterator(
    dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int, num_workers: int = 0
) -> Iterator[dict]:
    """Infinite iterator of this DP rank's micro-batches, starting at global consumed_samples.

    Each next() covers the next micro_batch_size * dp_size global positions (PretrainingSampler)
    and returns this rank's batch dict. To resume from a checkpoint, build a new iterator with
    the checkpoint's consumed_samples: it yields exactly what the interrupted one would have.
    num_workers > 0 reads samples in torch DataLoader worker processes (order is unchanged).
    """
    if dataset is None or len(dataset) == 0:
        raise DataError(
            "build_data_iterator got an empty dataset (is that split's weight 0 in --split, or too little data?)."
        )
    sampler = PretrainingSampler(None, consumed_samples, micro_batch_size, dp_rank, dp_size)
    positioned = _PositionedDataset(dataset)
    if num_workers > 0:
        loader = torch.utils.data.DataLoader(
            positioned, batch_sampler=sampler, collate_fn=_collate_positioned, num_workers=num_workers
        )
        return iter(loader)
    return (_collate_positioned([positioned[p] for p in positions]) for positions in sampler)

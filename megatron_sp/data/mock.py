"""Synthetic GPT samples (Megatron's --mock-data): random token ids, deterministic per (seed, index).

For speed measurements and smoke tests on machines without data or megatron-core: each item has
the GPTDataset keys (tokens, labels, loss_mask, position_ids) of one packed seq_length + 1 window.
"""

from __future__ import annotations

import torch


class MockGPTDataset(torch.utils.data.Dataset):
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length = num_samples, seq_length
        self.vocab_size, self.seed = vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        window = torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=gen)
        return {
            "tokens": window[:-1],
            "labels": window[1:],
            "loss_mask": torch.ones(self.seq_length),
            "position_ids": torch.arange(self.seq_length),
        }

"""Megatron's pretraining sampler: consecutive sample positions, sliced across data-parallel ranks.

Global sample position p (0, 1, 2, ...) is the p-th sample the whole job consumes. Every step of
the sampler takes the next micro_batch_size * data_parallel_size positions and gives rank r the
r-th slice of micro_batch_size. Hence any global batch (a multiple of micro_batch * dp positions)
is the same set of positions whatever the DP size, resuming at consumed_samples continues the
exact sequence, and a position names a sample independently of the parallel layout (the model keys
dropout on it). Shuffling is not the sampler's job: GPTDataset's index is already shuffled and
spans as many epochs as were requested.
"""

import itertools
from collections.abc import Iterator


class PretrainingSampler:
    """Yields, per micro-step, this rank's list of global sample positions (= dataset indices).

    total_samples: positions stop before this (normally len(dataset)); None = never stop.
    consumed_samples: position to start from (checkpoint resume); must be < total_samples.
    drop_last: with a finite total, drop a final step smaller than micro_batch * dp (Megatron's
        default); otherwise that step is sliced as usual and some ranks may get short lists.
    """

    def __init__(
        self,
        total_samples: int | None,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        _check(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last

    @property
    def samples_per_step(self) -> int:
        """Positions all DP ranks consume together per yielded micro-batch."""
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        """Number of micro-batches this sampler yields (finite totals only)."""
        if self.total_samples is None:
            raise TypeError("an unbounded PretrainingSampler has no length")
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self.samples_per_step)
        return full + int(rest > 0 and not self.drop_last)

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed_samples
        stop = self.total_samples
        mine = slice(
            self.data_parallel_rank * self.micro_batch_size, (self.data_parallel_rank + 1) * self.micro_batch_size
        )
        for step_start in itertools.count(start, self.samples_per_step):
            step_end = step_start + self.samples_per_step
            if stop is not None and step_end > stop:
                if step_start < stop and not self.drop_last:
                    yield list(range(step_start, stop))[mine]
                return
            yield list(range(step_start, step_end))[mine]


def _check(total, consumed, micro_batch_size, dp_rank, dp_size) -> None:
    """Reject sampler arguments that would silently skip, repeat or starve samples."""
    if micro_batch_size <= 0 or dp_size <= 0:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) and data_parallel_size ({dp_size}) must be positive.")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"data_parallel_rank {dp_rank} must be in [0, {dp_size}).")
    if consumed < 0:
        raise ValueError(f"consumed_samples must be >= 0, got {consumed}.")
    if total is not None and consumed >= total:
        raise ValueError(
            f"consumed_samples ({consumed}) must be below total_samples ({total}); "
            "the run already used every sample (raise --train-samples or use "
            "an unbounded sampler)."
        )

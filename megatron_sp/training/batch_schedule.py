"""The global batch size as a function of the samples consumed so far (Megatron-LM's micro-batch
calculators): constant, `--rampup-batch-size START INCREMENT SAMPLES` (START, then + INCREMENT
every SAMPLES / increments samples up to --global-batch-size) or `--step-batch-size-schedule
"0:16 2.4B:320 ..."` (thresholds in tokens, suffixes K M B T, as Megatron-LM reads them).

A step with batch B runs B / (micro batch × DP) micro-batches; the data order does not depend on
the schedule (samples are consumed in order), so a resumed run picks up the same batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_SUFFIX = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


@dataclass(frozen=True)
class BatchSchedule:
    steps: tuple  # ((samples consumed at least, global batch), ...), first threshold 0, increasing

    @classmethod
    def constant(cls, batch: int) -> "BatchSchedule":
        return cls(((0, batch),))

    @classmethod
    def rampup(cls, start: int, increment: int, samples: int, final: int) -> "BatchSchedule":
        """Megatron's ramp: batch start + k·increment once k·(samples / increments) samples are consumed."""
        increments = (final - start) // increment
        per = samples / increments
        return cls(tuple((math.ceil(k * per), start + k * increment) for k in range(increments + 1)))

    @classmethod
    def parse(cls, text: str, seq_length: int) -> "BatchSchedule":
        """ "THRESHOLD:BATCH ..." with thresholds in tokens; ValueError naming the bad entry."""
        steps = []
        for entry in text.replace(",", " ").split():
            threshold, sep, batch = entry.partition(":")
            if not sep:
                raise ValueError(f"--step-batch-size-schedule entry {entry!r} is not TOKENS:BATCH.")
            steps.append((_tokens(threshold, entry) // seq_length, _int(batch, entry)))
        if not steps or steps[0][0] != 0:
            raise ValueError("--step-batch-size-schedule must start at threshold 0, e.g. '0:16 2.4B:320'.")
        if any(b[0] <= a[0] for a, b in zip(steps, steps[1:])):
            raise ValueError("--step-batch-size-schedule thresholds must increase (in samples of --seq-length).")
        return cls(tuple(steps))

    @property
    def final(self) -> int:
        return self.steps[-1][1]

    def at(self, consumed: int) -> int:
        """The global batch of the step that starts after `consumed` samples."""
        batch = self.steps[0][1]
        for threshold, size in self.steps:
            if consumed >= threshold:
                batch = size
        return batch

    def iterations(self, samples: int) -> int:
        """Steps until `samples` samples are consumed (Megatron's update_train_iters)."""
        consumed = steps = 0
        while consumed < samples:
            if consumed >= self.steps[-1][0]:  # constant from here on
                return steps + math.ceil((samples - consumed) / self.final)
            consumed += self.at(consumed)
            steps += 1
        return steps

    def samples(self, iterations: int) -> int:
        """Samples consumed by the first `iterations` steps."""
        consumed = 0
        for _ in range(iterations):
            consumed += self.at(consumed)
        return consumed


def _tokens(text: str, entry: str) -> int:
    text = text.strip().upper()
    scale = _SUFFIX.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise ValueError(f"--step-batch-size-schedule entry {entry!r}: {text!r} is not a number.") from None


def _int(text: str, entry: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"--step-batch-size-schedule entry {entry!r}: the batch must be a positive integer.")
    return value

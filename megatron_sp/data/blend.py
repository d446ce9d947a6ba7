"""Megatron's --data-path blend and --split syntax, parsed and checked (plain Python, no numpy).

Kept apart from gpt.py so that the command line can be checked before anything heavy is imported
or built: a malformed blend, a NaN weight or a split that leaves training nothing is one sentence
at start-up.
"""

import math
import re

from megatron_sp.data.errors import DataError


def parse_data_path(data_path: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's --data-path list as (prefixes, weights or None); DataError when malformed."""
    items = [str(item).strip() for item in data_path]
    numeric = [_is_number(item) for item in items]
    if not any(numeric):
        return items, None
    if len(items) % 2 or not all(numeric[0::2]) or any(numeric[1::2]):
        raise DataError(
            f"--data-path {' '.join(items)} mixes weights and prefixes; give either "
            "prefixes only or alternating 'weight prefix' pairs."
        )
    weights = [float(w) for w in items[0::2]]
    if any(not math.isfinite(w) or w <= 0 for w in weights):
        raise DataError(
            f"--data-path weights {weights} must all be positive finite numbers; drop a "
            "source instead of giving it weight 0."
        )
    return items[1::2], weights


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_split(split: str) -> list[float]:
    """Normalised split fractions, e.g. "969,30,1" -> [0.969, 0.03, 0.001]; DataError if bad."""
    parts = [p.strip() for p in re.split(r"[,/]", str(split)) if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(not math.isfinite(v) or v < 0 for v in values) or sum(values) <= 0:
        raise DataError(
            f"--split {split!r} must be 1 to 3 comma-separated non-negative numbers "
            "with a positive sum, e.g. '969,30,1'."
        )
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


def check_train_share(split: str) -> None:
    """The train split must get a share: with 0 there is nothing to train on."""
    if parse_split(split)[0] == 0:
        raise DataError(
            f"--split {split} gives the train split no share; put the train weight first, e.g. --split 969,30,1."
        )

"""The schema of metadata.json: the type and range of every value the trainer and the tools read from it.

paths.read_metadata_json checks a file against it before any value is used, so a hand-edited
checkpoint whose `pipeline_model_parallel_size` is "2" or null is one sentence naming the field and
the file (was: a TypeError traceback on rank 0). The config's fields are checked against GPTConfig's
annotations (JSON has lists where GPTConfig has tuples); the field values' meaning is GPTConfig's own
check when the config is built. Keys not listed here are not read, so they are not checked.

This module imports nothing of megatron_sp but config (for the field types).
"""

from __future__ import annotations

import math
import types
import typing
from typing import Optional


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def count(value) -> bool:
    return _int(value) and value >= 0


def positive(value) -> bool:
    return _int(value) and value >= 1


def finite_positive(value) -> bool:
    return (_int(value) or isinstance(value, float)) and math.isfinite(value) and value > 0


# key: (check, what it must be, required)
TOP_LEVEL = {
    "iteration": (count, "a count (an integer >= 0)", True),
    "tensor_model_parallel_size": (positive, "a positive integer", True),
    "data_parallel_size": (positive, "a positive integer", False),
    "pipeline_model_parallel_size": (positive, "a positive integer", False),
    "sequence_parallel": (lambda v: isinstance(v, bool), "true or false", False),
    "tokens_seen": (count, "a count (an integer >= 0)", False),
    "format": (lambda v: isinstance(v, str), "a string", False),
    "converted_from": (lambda v: isinstance(v, str), "a string", False),
    "config": (lambda v: isinstance(v, dict), "a JSON object", True),
}
LOSS_SCALE = {  # distributed/loss_scale.py's state_dict (clean_steps, hysteresis_left: dynamic only)
    "scale": (finite_positive, "a finite positive number", True),
    "clean_steps": (count, "a count (an integer >= 0)", False),
    "hysteresis_left": (count, "a count (an integer >= 0)", False),
}


def _problem(table: dict, values: dict, prefix: str) -> Optional[str]:
    for key, (ok, what, required) in table.items():
        if key not in values:
            if required:
                return f"lacks {prefix}{key}"
            continue
        if not ok(values[key]):
            return f"has {prefix}{key} = {_short(values[key])}, which must be {what}"
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _matches(value, hint) -> bool:
    """Whether a JSON value can be a GPTConfig field of type `hint` (int, float, bool, str, tuple,
    Optional/Union of those)."""
    if hint is typing.Any:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return _int(value)
    if hint is float:
        return (_int(value) or isinstance(value, float)) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if hint is tuple:
        return isinstance(value, list) and all(isinstance(x, (int, float, str)) for x in value)
    return True  # a type the config does not use today: left to GPTConfig


def config_problem(config: dict) -> Optional[str]:
    from megatron_sp.config import GPTConfig

    for name, hint in typing.get_type_hints(GPTConfig).items():
        if name in config and not _matches(config[name], hint):
            return f"has config.{name} = {_short(config[name])}, which must be {_type_name(hint)}"
    return None


def _type_name(hint) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", tuple: "a list"}
    args = typing.get_args(hint) or (hint,)
    return " or ".join(names.get(a, "null" if a is type(None) else str(a)) for a in args)


def problem(meta: dict) -> Optional[str]:
    """What is wrong with a metadata.json object (past the train_state and files checks), or None."""
    found = _problem(TOP_LEVEL, meta, "")
    if found is None and meta.get("loss_scale") is not None:
        scale = meta["loss_scale"]
        found = "has loss_scale that is not a JSON object" if not isinstance(scale, dict) else None
        found = found or _problem(LOSS_SCALE, scale, "loss_scale.")
    return found or config_problem(meta["config"])

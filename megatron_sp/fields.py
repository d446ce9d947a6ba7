"""What a GPTConfig field means outside the model: its command-line flags, whether a resumed run must
match the checkpoint, and whether it is part of a model's description.

config.py declares every field with `model_field(...)`, so each fact is written once, beside the field;
the copies are derived (docs/model_fields.md):

    training/config_flags   the argparse flags, their defaults and help; build_config's fields; the
                            flags that rebuild a given config (tools/convert_hf.py prints them)
    checkpointing           the resume check: each field with a `resume` rule is compared with the
                            checkpoint's (a field a checkpoint lacks takes its default)

A field's Hugging Face config.json key is its family's adapter's (megatron_sp/models/hf/), which
may name only fields with a resume rule or `describes_model` (so the printed flags carry them).

This module imports nothing of megatron_sp: the rules below take configs as arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

SAME = object()  # FieldInfo.cli_default: the field's own default


@dataclass(frozen=True)
class Switch:
    """A flag that takes no value and stores `const` in the field (Megatron's --swiglu,
    --disable-bias-linear, ...). if_unset: only while the field still holds its default, so that
    `--group-query-attention` means one group unless --num-query-groups says otherwise."""

    flag: str
    const: object
    help: str = ""
    if_unset: bool = False


# When a resumed run must hold the checkpoint's value: (current config, saved config) -> bool.
def ALWAYS(current, saved) -> bool:
    """The weights' shapes or the function they were trained for."""
    return True


def IF_ROTARY(current, saved) -> bool:
    """Not a shape, but what rotary weights were trained for: compared for RoPE models only."""
    return current.rotary


def IF_YARN(current, saved) -> bool:
    """A YaRN parameter: unused unless one side's positions are yarn."""
    return "yarn" in (current.position_embedding_type, saved.position_embedding_type)


def IF_ROPE_SCALED(current, saved) -> bool:
    """A RoPE scaling parameter: unused unless one side scales."""
    return IF_ROTARY(current, saved) and bool(current.rope_scaling or saved.rope_scaling)


@dataclass(frozen=True)
class FieldInfo:
    """The metadata of one GPTConfig field (see the module docstring)."""

    help: str  # one line: what the field is (the --help text of its flags)
    flags: tuple = ()  # flags taking a value: the Megatron-LM name, then aliases
    switches: tuple = ()  # Switch flags writing a constant into the field
    cli_default: object = SAME  # the CLI's default where the field has none (required fields)
    choices: tuple = ()  # the allowed values (checked by GPTConfig, offered by the CLI)
    group: str = "model"  # the --help group of its flags
    resume: Optional[Callable] = None  # ALWAYS / IF_ROTARY / IF_ROPE_SCALED / IF_YARN: must match on resume
    nargs: Optional[str] = None  # argparse's nargs of its flags ("+": one or more words)
    parse: Optional[Callable] = None  # a flag's word -> the value (argparse's type); default by the field's type
    format: Optional[Callable] = None  # the value -> the flag's words (model_flags); default [str(value)]
    # part of what a model is although a resume may change it (epsilon, dropout, init std): the
    # flags that rebuild a config print it, and a Hugging Face config.json may carry it
    describes_model: bool = False


def model_field(default=dataclasses.MISSING, **info) -> dataclasses.Field:
    """A GPTConfig field with its FieldInfo (keywords as FieldInfo's)."""
    return dataclasses.field(default=default, metadata={"info": FieldInfo(**info)})


def info(f: dataclasses.Field) -> FieldInfo:
    return f.metadata["info"]


def cli_default(f: dataclasses.Field):
    """What the command line passes for a field whose flags are not given."""
    given = info(f).cli_default
    return f.default if given is SAME else given


def mismatch(fields, current, saved) -> Optional[str]:
    """The first field (of dataclasses.fields) with a resume rule on which `saved` differs, or None."""
    for f in fields:
        rule = info(f).resume
        if rule is not None and rule(current, saved) and getattr(saved, f.name) != getattr(current, f.name):
            return f.name
    return None


def describes_model(f: dataclasses.Field) -> bool:
    """A field the flags that rebuild a config carry: one with a resume rule or `describes_model`."""
    return info(f).resume is not None or info(f).describes_model

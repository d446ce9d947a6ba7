"""The command-line side of config.py's table of model fields (megatron_sp/fields.py):

add_config_flags(group, title)   the flags of every GPTConfig field in that --help group
config_kwargs(args)              the GPTConfig fields a parsed command line sets (build_config)
in_flags(message)                a GPTConfig error with the fields named by their flags
model_flags(cfg)                 the inverse: the flags that rebuild cfg's weights and function
                                 (tools/convert_hf.py prints them)
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from typing import Optional

from megatron_sp.config import GPTConfig
from megatron_sp.fields import cli_default, describes_model, info


class _StoreConstIfUnset(argparse.Action):
    """A Switch with if_unset: stores `const` only while the field still holds its default."""

    def __init__(self, option_strings, dest, const=None, default=None, help=None):
        super().__init__(option_strings, dest, nargs=0, const=const, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) == self.default:
            setattr(namespace, self.dest, self.const)


def _value_type(hint):
    """int / float for an (Optional) numeric field; None (argparse's str) otherwise."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0] if args[0] in (int, float) else None


def _add_field_flags(group, f, hint) -> None:
    """The flags of one GPTConfig field, as its FieldInfo describes them (megatron_sp/fields.py)."""
    meta, default = info(f), cli_default(f)
    if meta.flags:
        choices = list(meta.choices) or None
        kind = meta.parse if meta.parse is not None else _value_type(hint)
        group.add_argument(
            *meta.flags, dest=f.name, type=kind, nargs=meta.nargs, default=default, choices=choices, help=meta.help
        )
    for switch in meta.switches:
        action = _StoreConstIfUnset if switch.if_unset else "store_const"
        group.add_argument(
            switch.flag, dest=f.name, action=action, const=switch.const, default=default, help=switch.help or meta.help
        )


def add_config_flags(group, title: str) -> None:
    """The flags of every GPTConfig field in the --help group `title`, in the table's order."""
    hints = typing.get_type_hints(GPTConfig)
    for f in dataclasses.fields(GPTConfig):
        if info(f).group == title:
            _add_field_flags(group, f, hints[f.name])


def _has_flags(f) -> bool:
    return bool(info(f).flags or info(f).switches)


def config_kwargs(args) -> dict:
    """The GPTConfig fields a parsed command line sets: every field that has flags."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(GPTConfig) if _has_flags(f)}


def _field_flag(f) -> Optional[str]:
    meta = info(f)
    return meta.flags[0] if meta.flags else meta.switches[0].flag if meta.switches else None


def in_flags(message: str) -> str:
    """GPTConfig's sentence (config_checks.py names fields) as the command line's user reads it:
    "GPTConfig.num_query_groups (3) must divide num_attention_heads (4)" becomes
    "--num-query-groups (3) must divide --num-attention-heads (4)"."""
    flags = {f.name: _field_flag(f) for f in dataclasses.fields(GPTConfig) if _field_flag(f)}
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))

    def flag(m):  # a bare one-word name ("model") is left as a word; GPTConfig.model is the flag
        name = m.group(2)
        return flags[name] if m.group(1) or "_" in name else m.group(0)

    return re.sub(r"(GPTConfig\.)?\b(" + names + r")\b", flag, message).replace("GPTConfig.", "")


# ---- the inverse: the flags that rebuild a config (tools/convert_hf.py prints them) ---------------


def _describes_weights(f) -> bool:
    """A field that a resume compares or that describes the model, and that has flags."""
    return _has_flags(f) and describes_model(f)


def _flag_for(f, value) -> Optional[list]:
    """The flag tokens that set field f to value, or None when no flag can."""
    meta = info(f)
    if meta.flags and value is not None:
        return [meta.flags[0], *(meta.format(value) if meta.format is not None else [str(value)])]
    for switch in meta.switches:
        if not switch.if_unset and type(switch.const) is type(value) and switch.const == value:
            return [switch.flag]
    return None


def _family_flags(cfg: GPTConfig, family: str) -> Optional[list]:
    """--model family plus a flag for each field whose value that family and the other fields do not
    give by default; None when one cannot be expressed. The baseline of each field is built with the
    training choices (non-weight fields) at their CLI defaults and --seq-length 1, so that a field
    derived from the sequence length (max_position_embeddings) is always spelled out."""
    fields = [f for f in dataclasses.fields(GPTConfig) if _describes_weights(f)]
    target = {f.name: getattr(cfg, f.name) for f in fields}
    flags = ["--model", family]
    for f in fields:
        given = dict(target, model=family, seq_length=1, vocab_size=cfg.vocab_size, **{f.name: cli_default(f)})
        try:
            default = getattr(GPTConfig(**given), f.name)
        except ValueError:  # the field cannot be left out
            default = None
        if default != target[f.name]:
            tokens = _flag_for(f, target[f.name])
            if tokens is None:
                return None
            flags += tokens
    return flags


def _flags_parser() -> argparse.ArgumentParser:
    """A parser of the GPTConfig flags alone (pretrain_gpt_sp.py's model and parallelism flags)."""
    parser = argparse.ArgumentParser(add_help=False)
    for title in dict.fromkeys(info(f).group for f in dataclasses.fields(GPTConfig)):
        add_config_flags(parser, title)
    return parser


def model_flags(cfg: GPTConfig) -> list:
    """The pretrain_gpt_sp.py model flags that rebuild cfg's weights and function (every field with a
    resume rule or `describes_model`): `--model cfg.model` when its defaults can express the rest,
    else GPT-2's with the architecture spelled out. Checked by parsing them back."""
    for family in dict.fromkeys((cfg.model, "gpt2")):
        flags = _family_flags(cfg, family)
        if flags is None:
            continue
        args = _flags_parser().parse_args(flags + ["--seq-length", str(cfg.seq_length)])
        rebuilt = GPTConfig(vocab_size=cfg.vocab_size, **config_kwargs(args))
        fields = [f.name for f in dataclasses.fields(GPTConfig) if _describes_weights(f)]
        if all(getattr(rebuilt, name) == getattr(cfg, name) for name in fields):
            return flags
    raise ValueError(f"no pretrain_gpt_sp.py flags rebuild this model (family {cfg.model!r}).")

"""The ModelSpec of a model family (`--model NAME`, `GPTConfig(model=NAME)`).

The families live in megatron_sp/families.py (`FAMILIES`, `register_model`): their defaults are data
there, which config.py reads without importing this package; the spec is imported here, to build.
"""

from __future__ import annotations

from megatron_sp import families


def get_spec(name: str):
    """The ModelSpec of a registered name or of a "module:attribute" path."""
    from megatron_sp.models.spec import ModelSpec

    target = families.family(name).spec
    try:
        return families.load(target, "ModelSpec", lambda obj: isinstance(obj, ModelSpec))
    except ValueError as err:
        raise ValueError(f"model {name!r}: {err}") from None

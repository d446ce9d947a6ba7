"""The ModelSpec of a model family (`--model NAME`, `GPTConfig(model=NAME)`).

The names live in megatron_sp/families.py (`MODELS`, `register_model`), which config.py reads for a
family's defaults without importing this package.
"""

from __future__ import annotations

from megatron_sp import families


def get_spec(name: str):
    """The ModelSpec of a registered name or of a "module:attribute" path."""
    from megatron_sp.models.spec import ModelSpec

    return families.load(name, is_spec=lambda obj: isinstance(obj, ModelSpec))

"""Model families by name (`--model NAME`, `GPTConfig(model=NAME)`): where each family's ModelSpec lives.

Names and "module:attribute" strings only, imported on first use: config.py looks a family up here
for its defaults without importing megatron_sp.models (DESIGN: config imports no model code), and
models/registry.py's `get_spec` loads the ModelSpec itself. A new family is one file with its spec
plus one line here; `--model package.module:SPEC` also works for a spec that lives outside this
package (nothing to register).
"""

from __future__ import annotations

import importlib

MODELS = {
    "gpt2": "megatron_sp.models.gpt2:SPEC",
    "llama": "megatron_sp.models.llama:SPEC",
}


def register_model(name: str, target: str) -> None:
    """Adds (or replaces) a family: `target` is "module:attribute" naming a ModelSpec."""
    MODELS[name] = target


def load(name: str, is_spec=lambda obj: isinstance(getattr(obj, "defaults", None), dict)):
    """The object a registered name or a "module:attribute" path names; ValueError (one sentence)
    when there is none or `is_spec(obj)` is false."""
    target = MODELS.get(name, name if ":" in name else None)
    if target is None:
        raise ValueError(
            f"unknown model {name!r}; registered: {', '.join(sorted(MODELS))} "
            f"(or give a spec as package.module:ATTRIBUTE)."
        )
    module_name, _, attr = target.partition(":")
    try:
        spec = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"model {name!r}: cannot load {target} ({err}).") from None
    if not is_spec(spec):
        raise ValueError(f"model {name!r}: {target} is a {type(spec).__name__}, not a ModelSpec.")
    return spec


def family_defaults(name: str) -> dict:
    """The GPTConfig values the family sets for fields a user left at None (its ModelSpec.defaults)."""
    return dict(load(name).defaults)

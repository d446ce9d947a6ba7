"""Model families by name (`--model NAME`, `GPTConfig(model=NAME)`).

Each entry points at a `ModelSpec` (models/spec.py) as "module:attribute", imported on first use.
A new family is one file with its spec plus one line here; `--model package.module:SPEC` also works
for a spec that lives outside this package (nothing to register).
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


def get_spec(name: str):
    """The ModelSpec of a registered name or of a "module:attribute" path."""
    from megatron_sp.models.spec import ModelSpec

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
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"model {name!r}: {target} is a {type(spec).__name__}, not a ModelSpec.")
    return spec

"""Quiet, lazy access to megatron-core's dataset modules.

megatron-core is imported only when data is actually built, so `import megatron_sp` stays light.
Even then only the dataset modules are loaded: megatron/core/__init__.py imports its tensor-parallel
layers, Transformer Engine shims, inference contexts, wandb and torch._dynamo (3-4 s a process, paid
by every rank of every launch), none of which the dataset code needs. `megatron.core` is therefore
registered as its package without running that __init__, which runs on the first access of a name it
defines (`megatron.core.ModelParallelConfig`, ...), so other code in the process sees the whole package.
Its import-time warnings (Apex / Transformer Engine missing) are irrelevant here and silenced.
"""

import importlib
import importlib.util
import sys
import warnings
from types import ModuleType


def mcore(module: str) -> ModuleType:
    """Import `megatron.core.<module>` with the Apex/TE import-time warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _register_package_lazily()
        return importlib.import_module(f"megatron.core.{module}")


def _register_package_lazily() -> None:
    if "megatron.core" in sys.modules:
        return
    spec = importlib.util.find_spec("megatron.core")
    package = importlib.util.module_from_spec(spec)  # __path__ set: its submodules import as usual

    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        if f"megatron.core.{name}" in sys.modules:  # still being imported (parallel_state <-> utils)
            return sys.modules[f"megatron.core.{name}"]
        if importlib.util.find_spec(f"megatron.core.{name}") is not None:  # a submodule: just it
            return importlib.import_module(f"megatron.core.{name}")
        del package.__getattr__
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spec.loader.exec_module(package)  # the package's own __init__, now
        return getattr(package, name)

    package.__getattr__ = __getattr__
    sys.modules["megatron.core"] = package
    importlib.import_module("megatron")  # the parent, so that `megatron.core` resolves as an attribute
    sys.modules["megatron"].core = package
    importlib.import_module("megatron.core.parallel_state")  # before .utils: the two import each other

"""Quiet, lazy access to megatron-core's dataset modules.

megatron-core is imported only when data is actually built, so `import megatron_sp` stays light
(importing megatron.core takes seconds). Its import warns that Apex / Transformer Engine are
missing; those warnings are irrelevant to the dataset code we use, so they are silenced here.
"""

import importlib
import warnings
from types import ModuleType


def mcore(module: str) -> ModuleType:
    """Import `megatron.core.<module>` with the Apex/TE import-time warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(f"megatron.core.{module}")

"""What the tests and benchmarks share: the one local gloo world and the numerics of the op tests.

- `LocalWorld` (world.py): spawned gloo ranks kept alive across calls; `world.run(fn, *args)`.
- numerics.py: per-dtype tolerances (`assert_close_dtype`), `assert_same_error`, and random inputs
  (`randn`, `random_index`).
- extension.py: whether megatron_sp._C is there for the op tests (`extension_missing`), and
  MEGATRON_SP_REQUIRE_EXTENSION=1, which turns their skips into failures.

Nothing here imports pytest, so the benchmarks use it on a machine without the test dependencies.
"""

from megatron_sp.testing.extension import extension_missing, extension_required, required_message
from megatron_sp.testing.numerics import (
    FLOAT_DTYPES,
    TOLERANCES,
    assert_close_dtype,
    assert_same_error,
    randn,
    random_index,
)
from megatron_sp.testing.world import LocalWorld

__all__ = [
    "FLOAT_DTYPES",
    "TOLERANCES",
    "LocalWorld",
    "assert_close_dtype",
    "assert_same_error",
    "extension_missing",
    "extension_required",
    "randn",
    "random_index",
    "required_message",
]

"""Whether the op tests can run: megatron_sp._C loaded (with the op they need).

Without the extension the ops run their references, so the tests of the fused kernels skip; under
MEGATRON_SP_REQUIRE_EXTENSION=1 (scripts/test.sh sets it) they fail instead, so a broken build
cannot pass as a run with a few skips. tests/conftest.py applies this to tests marked `extension`.
"""

from __future__ import annotations

import os

import torch

REQUIRE_EXTENSION = "MEGATRON_SP_REQUIRE_EXTENSION"
REBUILD = "python -m pip install --no-build-isolation --no-deps -e ."


def extension_missing(op: str | None = None) -> str:
    """'' when megatron_sp._C loaded (and registers torch.ops.megatron_sp.`op`, if given); else why not."""
    from megatron_sp.ops import _extension

    if _extension._LOAD_ERROR:
        return f"megatron_sp._C did not load ({_extension._LOAD_ERROR})"
    if op is not None and not hasattr(torch.ops.megatron_sp, op):
        return f"megatron_sp._C has no {op} (built from older sources)"
    return ""


def extension_required() -> bool:
    return os.environ.get(REQUIRE_EXTENSION) == "1"


def required_message(missing: str) -> str:
    """The failure of a test that needs the extension under MEGATRON_SP_REQUIRE_EXTENSION=1."""
    return f"{missing}, and {REQUIRE_EXTENSION}=1 requires it: rebuild it with `{REBUILD}` to see the build's errors."

"""The one list of CUDA kernel cases, run on a GPU and on the CPU emulator.

Each case calls the CUDA binding of one op family (csrc/cuda/<op>_binding.cpp) through a `Target`:
- on a GPU, torch.ops.megatron_sp on cuda tensors (tests/test_cuda_ops.py);
- on the emulator, the same binding and kernels built for the CPU (tests/cuda_emulator/build.py) and
  registered as torch.ops.megatron_sp_emulated on CPU tensors, under ASan + UBSan (every case) and
  TSan (the cases marked `race`): tests/test_cuda_emulated.py runs tests/cuda_emulator/run_cases.py.

A case checks results against the references (megatron_sp/ops/) and, where the math allows, bit for
bit against the C++ CPU kernels: dropout masks exactly, dropout_add exactly, norms and
attention within the dtype tolerances, layouts exactly. Its SM count is the launch geometry the
emulator reports (1 SM: persistent grids are small, so every grid-stride loop iterates; 132: an
H200's grid); a GPU has its own. Cases too slow to emulate are `emulate=False` (GPU only).

Adding an op: a module here with a `cases()` function (every module of the package is collected).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
from typing import Any, Callable

import torch

DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "uint8"}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a case runs: the op namespace, the device of its tensors, the launch geometry."""

    ops: Any  # torch.ops.megatron_sp (GPU) or torch.ops.megatron_sp_emulated (emulator)
    device: str  # "cuda" or "cpu"
    set_sm_count: Callable[[int], None]  # the emulator's reported SM count; a GPU keeps its own

    def put(self, t: torch.Tensor | None, misaligned: bool = False) -> torch.Tensor | None:
        """t on the target's device; misaligned: one element past a 16-byte boundary (scalar paths)."""
        if t is None:
            return None
        if not misaligned:
            return t.to(self.device)
        flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=self.device)
        return flat[1:].view(t.shape).copy_(t)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: Callable  # fn(target, *args)
    args: tuple
    sms: int = 1
    race: bool = False  # also run under ThreadSanitizer (one case per kernel and barrier structure)
    emulate: bool = True  # False: too slow to emulate, GPU only


def gpu_target() -> Target:
    return Target(torch.ops.megatron_sp, "cuda", lambda sms: None)


def emulated_target() -> Target:
    return Target(torch.ops.megatron_sp_emulated, "cpu", torch.ops.megatron_sp_emulated.set_sm_count)


def opcheck(op, args) -> None:
    """Schema and fake-tensor checks of one call (the emulated ops have no autograd formula; the
    GPU's autograd registration is checked in tests/test_cuda_ops.py)."""
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def cpu(t):
    """t on the CPU (None stays None): results compared with the references and the CPU kernels."""
    return None if t is None else t.cpu()


def run(case: Case, target: Target) -> None:
    target.set_sm_count(case.sms)
    case.fn(target, *case.args)


def _collect() -> dict:
    cases = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        for case in importlib.import_module(f"cuda_cases.{module}").cases():
            assert case.name not in cases, f"two cases named {case.name}"
            cases[case.name] = case
    return cases


CASES = _collect()


def skip_or_fail(reason: str) -> None:
    """A missing tool (compiler, sanitizer runtime, the built extension) skips the test, unless
    MEGATRON_SP_REQUIRE_EXTENSION=1 asks for a build that works: then it fails."""
    import pytest

    if os.environ.get("MEGATRON_SP_REQUIRE_EXTENSION") == "1":
        pytest.fail(f"{reason} (MEGATRON_SP_REQUIRE_EXTENSION=1)")
    pytest.skip(reason)

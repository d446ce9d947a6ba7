"""Runs the CUDA cases (tests/cuda_cases/) on the emulated library, writing one result per case, and
the emulator's own checks of its warp-matrix model (warp_checks.py).

The library (build.py) holds the CUDA kernels and their torch bindings registered for CPU tensors as
torch.ops.megatron_sp_emulated.*; a case runs the binding exactly as on a GPU, on CPU tensors whose
allocations AddressSanitizer checks every kernel access against. Run in a process of its own, with
the sanitizer's runtime preloaded (build.sanitizer_env):

    cd tests && LD_PRELOAD="$(g++ -print-file-name=libasan.so) $(g++ -print-file-name=libstdc++.so)" \\
        python -m cuda_emulator.run_cases LIB OUT.json [NAME-SUBSTRING ...]

tests/test_cuda_emulated.py builds the library, runs this once per sanitizer and asserts per case.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import cuda_cases
import torch
from cuda_emulator import build, warp_checks

from megatron_sp import ops


def load(library: str) -> cuda_cases.Target:
    """Loads the emulated library and registers the fake (meta) function of each of its ops: the fake
    of the megatron_sp op of the same name (so opcheck compares the emulated binding with it)."""
    torch.ops.load_library(library)
    for name in build.op_names():
        twin = getattr(torch.ops.megatron_sp, name)
        torch.library.register_fake(f"{build.NAMESPACE}::{name}")(lambda *args, twin=twin: twin(*args))
    return cuda_cases.emulated_target()


def main():
    library, out_path, only = sys.argv[1], sys.argv[2], sys.argv[3:]
    assert ops.extension_available(), "the cases compare with megatron_sp._C's CPU ops: build it first"
    target = load(library)
    results = {}
    runs = {name: (lambda case=case: cuda_cases.run(case, target)) for name, case in cuda_cases.CASES.items()}
    runs = {name: fn for name, fn in runs.items() if cuda_cases.CASES[name].emulate}
    runs.update({name: (lambda check=check: check(target.ops)) for name, check in warp_checks.CHECKS.items()})
    for name, fn in runs.items():
        if only and name not in only:  # (exact names: one may be the start of another)
            continue
        t0 = time.perf_counter()
        try:
            fn()
            results[name] = {"ok": True, "detail": ""}
        except (AssertionError, RuntimeError):
            results[name] = {"ok": False, "detail": traceback.format_exc(limit=4)}
        results[name]["seconds"] = round(time.perf_counter() - t0, 3)
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'} ({results[name]['seconds']} s)", flush=True)
        with open(out_path, "w") as f:  # rewritten after each case: a crash keeps the rest
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""The CUDA kernels (csrc/cuda/*.cu, unmodified) and their torch bindings run on the CPU emulator of
tests/cuda_emulator/, so that their indexing, vector and scalar paths, grid-stride loops, warp and block
reductions, launch sizing and argument handling are checked on machines without a GPU:

- every case of the CUDA case list (tests/cuda_cases/, the list tests/test_cuda_ops.py runs on a GPU)
  under AddressSanitizer + UBSan (any out-of-bounds load or store, or undefined behaviour, in a kernel
  fails the run), through the bindings registered for CPU tensors as megatron_sp_emulated::*;
- the cases marked `race` (one per kernel path) under ThreadSanitizer (a missing __syncthreads is a
  data race between the emulated threads: the emulator's racecheck);
- the emulator's model of the warp-level matrix operations (mma.sync m16n8k16, ldmatrix) against
  plain matrix products built from the PTX ISA's fragment layouts (cuda_emulator/warp_checks.py);
- planted bugs (an out-of-bounds read, a missing barrier, a launch over the kernel's
  __launch_bounds__, swapped dropout words in the tensor-core forward) are caught, so these tests
  can fail;
- the global-memory bytes each kernel moves (build mode "traffic", bench/kernel_traffic.py): the
  forward and layout kernels read each input byte once and write each output byte once, and the
  backward kernels' fp32 partial sums stay a small fraction of their compulsory bytes.

The emulator does not model GPU timing, memory ordering between blocks (blocks run one after
another), fused multiply-adds or the CUDA caching allocator and streams; tests/test_cuda_ops.py
checks the real thing on a GPU."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from cuda_cases import CASES, skip_or_fail
from cuda_emulator import build as emulator_build
from cuda_emulator.warp_checks import CHECKS

from megatron_sp import ops

TESTS = os.path.dirname(os.path.abspath(__file__))
EMULATED = [name for name, case in CASES.items() if case.emulate] + list(CHECKS)
RACE_CASES = [name for name, case in CASES.items() if case.race]


def _require(sanitizer):
    if emulator_build.compiler() is None:
        skip_or_fail("no host C++ compiler")
    if sanitizer is not None and emulator_build.runtime_library(sanitizer) is None:
        skip_or_fail(f"the compiler has no lib{sanitizer}.so")
    if not ops.extension_available():
        skip_or_fail("megatron_sp._C is not built (the cases compare with its CPU ops)")


def _run(library, sanitizer, out_json, cases=()):
    env = emulator_build.sanitizer_env(sanitizer)
    env["OMP_NUM_THREADS"] = "1"  # torch's OpenMP threads are not ThreadSanitizer-aware
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "cuda_emulator.run_cases", library, str(out_json), *cases]
    proc = subprocess.run(command, env=env, cwd=TESTS, capture_output=True, text=True, timeout=1200)
    return proc.returncode, proc.stdout + proc.stderr


def _results(out_json):
    return json.loads(out_json.read_text()) if out_json.exists() else {}


@pytest.fixture(scope="module")
def object_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("emulator-objects"))


@pytest.fixture(scope="module")
def asan_run(tmp_path_factory, object_cache):
    _require("asan")
    out = tmp_path_factory.mktemp("emulator-asan")
    library = emulator_build.build(str(out / "build"), "asan", cache_dir=object_cache)
    rc, log = _run(library, "asan", out / "results.json")
    return rc, log, _results(out / "results.json")


@pytest.mark.parametrize("case", EMULATED)
def test_kernel_on_emulator(asan_run, case):
    rc, log, results = asan_run
    if case not in results or rc != 0:
        pytest.fail(f"the emulated run did not finish cleanly (exit {rc}):\n{log[-6000:]}")
    assert results[case]["ok"], results[case]["detail"]


def test_no_data_races(tmp_path, object_cache):
    _require("tsan")
    library = emulator_build.build(str(tmp_path / "build"), "tsan", cache_dir=object_cache)
    rc, log = _run(library, "tsan", tmp_path / "results.json", RACE_CASES)
    results = _results(tmp_path / "results.json")
    assert rc == 0 and "ThreadSanitizer" not in log, log[-6000:]
    assert set(results) == set(RACE_CASES), log[-3000:]
    assert all(r["ok"] for r in results.values()), results


def _planted(tmp_path, object_cache, sanitizer, filename, old, new, case):
    csrc = tmp_path / "csrc"
    shutil.copytree(emulator_build.CSRC, csrc)
    path = csrc / "cuda" / filename
    text = path.read_text()
    assert old in text, f"the planted bug no longer applies to {filename}: update this test"
    path.write_text(text.replace(old, new, 1))
    library = emulator_build.build(str(tmp_path / "build"), sanitizer, csrc=str(csrc), cache_dir=object_cache)
    return _run(library, sanitizer, tmp_path / "results.json", [case])


def test_planted_out_of_bounds_read_is_caught(tmp_path, object_cache):
    _require("asan")
    rc, log = _planted(
        tmp_path,
        object_cache,
        "asan",
        "layout.cu",
        "vals[u] = src[map(o) * run.d + v];",
        "vals[u] = src[map(o) * run.d + v + 1];",
        "ulysses_pack-16x2x8x64-float32",
    )
    assert rc != 0 and "heap-buffer-overflow" in log, log[-3000:]


def test_planted_missing_barrier_is_caught(tmp_path, object_cache):
    _require("tsan")
    rc, log = _planted(
        tmp_path,
        object_cache,
        "tsan",
        "column_sum.cu",
        "  __syncthreads();\n  if (threadIdx.y == 0",
        "  if (threadIdx.y == 0",
        "da-5x3x7-off3-fp32-sm1",
    )
    assert rc != 0 and "ThreadSanitizer: data race" in log, log[-3000:]


def test_planted_launch_over_launch_bounds_is_caught(tmp_path, object_cache):
    _require("asan")
    rc, log = _planted(
        tmp_path,
        object_cache,
        "asan",
        "dropout_add.cu",
        "__launch_bounds__(kThreads)\n    da_fwd_kernel",
        "__launch_bounds__(kThreads / 2)\n    da_fwd_kernel",
        "da-33x3x256-off512-fp32-sm132",
    )
    results = _results(tmp_path / "results.json")
    assert rc == 0 and not results["da-33x3x256-off512-fp32-sm132"]["ok"], log[-3000:]
    assert "too many resources requested for launch" in results["da-33x3x256-off512-fp32-sm132"]["detail"]


def test_planted_dropout_word_swap_is_caught(tmp_path, object_cache):
    """The tensor-core forward's Philox words exchanged between the two lanes of a key group with
    two words swapped: the mask case reads the mask out of the kernel and finds the differing bits."""
    _require("asan")
    rc, log = _planted(
        tmp_path,
        object_cache,
        "asan",
        "flash_attention_fwd_mma.cu",
        "w[0] = odd ? r0 : x.w[0], w[1] = odd ? r1 : x.w[1];",
        "w[0] = odd ? r1 : x.w[0], w[1] = odd ? r0 : x.w[1];",
        "flash-mask-causal-bf16",
    )
    results = _results(tmp_path / "results.json")
    assert rc == 0 and not results["flash-mask-causal-bf16"]["ok"], log[-3000:]
    assert "mask bits differ" in results["flash-mask-causal-bf16"]["detail"]


def test_kernel_traffic(tmp_path, object_cache):
    _require(None)
    import importlib.util

    import torch
    from cuda_emulator.run_cases import load

    bench = importlib.util.spec_from_file_location(
        "kernel_traffic", os.path.join(emulator_build.ROOT, "bench", "kernel_traffic.py")
    )
    kernel_traffic = importlib.util.module_from_spec(bench)
    bench.loader.exec_module(kernel_traffic)

    target = load(emulator_build.build(str(tmp_path / "build"), "traffic", cache_dir=object_cache))
    target.set_sm_count(8)
    s, b, h = 512, 2, 1024
    results = {
        op: (compulsory, counts)
        for op, compulsory, counts in kernel_traffic.run_ops(target.ops, torch.bfloat16, s, b, h, 8, 128)
    }
    full = s * b * h * 2  # bytes of one [s, b, h] bf16 activation
    once = {
        "dropout_add fwd": (("x", "residual"), ("out",)),
        "dropout_add fwd (embedding)": (("x", "position embeddings"), ("out",)),
        "dropout_add bwd": (("grad",), ("grad_x",)),
        "layer_norm fwd": (("x",), ("y",)),
        "layer_norm bwd": ((), ("grad_x",)),
        "rms_norm fwd": (("x",), ("y",)),
        "rms_norm bwd": ((), ("grad_x",)),
    }
    for op, (compulsory, counts) in results.items():
        inputs, outputs = once.get(op, (("in",), ("out",)))
        for name in inputs:  # (loaded, stored, distinct loaded, distinct stored)
            assert counts[name] == (full, 0, full, 0), (op, name, counts[name])
        for name in outputs:
            assert counts[name] == (0, full, 0, full), (op, name, counts[name])
    for op in ("dropout_add bwd", "layer_norm bwd", "rms_norm bwd"):
        compulsory, counts = results[op]
        scratch = counts["scratch (partial sums)"]
        assert scratch[2] == scratch[3] > 0  # each partial written once and read once
        assert scratch[3] <= compulsory / 16, (op, scratch, compulsory)
    for name in ("grad", "x"):  # the norm backwards read their rows twice
        assert results["layer_norm bwd"][1][name][2] == full
        assert results["rms_norm bwd"][1][name][2] == full

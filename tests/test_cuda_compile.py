"""Compiles the CUDA sources without a GPU or a CUDA build of torch, so that a CUDA syntax error
cannot land: the torch-free kernels (csrc/cuda/*.cu) with nvcc and the flags torch's build adds,
and the torch bindings (csrc/cuda/*_binding.cpp) with a syntax-only host compile against torch's
headers. Skipped where nvcc (or the CUDA headers) are absent, unless MEGATRON_SP_REQUIRE_EXTENSION=1
(then that fails). One architecture (sm_90) keeps it fast."""

import glob
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from cuda_cases import skip_or_fail

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
NVCC = shutil.which("nvcc")
# What torch.utils.cpp_extension passes to nvcc for every .cu (COMMON_NVCC_FLAGS).
TORCH_NVCC_FLAGS = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]


@pytest.fixture(autouse=True)
def _nvcc():
    if NVCC is None:
        skip_or_fail("nvcc not found")


def _cuda_include():
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
            return os.path.join(home, "include")
    return None


def _run_all(commands):
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        procs = list(pool.map(lambda c: subprocess.run(c, capture_output=True, text=True, timeout=300), commands))
    return [f"$ {' '.join(c)}\n{p.stderr}" for c, p in zip(commands, procs) if p.returncode != 0]


def test_kernels_compile_with_nvcc(tmp_path):
    sources = sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
    assert sources, "no CUDA sources found"
    commands = [
        [
            NVCC,
            "-c",
            "-std=c++17",
            "-O3",
            "-arch=sm_90",
            *TORCH_NVCC_FLAGS,
            "-I",
            CSRC,
            src,
            "-o",
            str(tmp_path / (os.path.basename(src) + ".o")),
        ]
        for src in sources
    ]
    failures = _run_all(commands)
    assert not failures, "\n".join(failures)


def test_binding_compiles_against_torch_headers(tmp_path):
    from torch.utils import cpp_extension

    cuda_include, cxx = _cuda_include(), shutil.which("g++") or shutil.which("c++")
    if cuda_include is None or cxx is None:
        skip_or_fail("CUDA headers or a host C++ compiler not found")
    # A CPU wheel of torch ships c10/cuda headers but not this generated one; an empty stand-in
    # (it only configures DLL export macros) is enough for a syntax check.
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    bindings = sorted(glob.glob(os.path.join(CSRC, "cuda", "*_binding.cpp")))
    assert bindings, "no CUDA bindings found"
    # One translation unit including every binding: torch's headers are parsed once (each binding
    # alone is compiled by the real build on a CUDA machine).
    unity = tmp_path / "bindings.cpp"
    unity.write_text("".join(f'#include "{path}"\n' for path in bindings))
    commands = [
        [cxx, "-std=c++20", "-fsyntax-only", *includes, f"-I{tmp_path / 'stub'}", f"-I{cuda_include}", str(unity)]
    ]
    failures = _run_all(commands)
    assert not failures, "\n".join(failures)

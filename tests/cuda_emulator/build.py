"""Builds csrc/cuda/ for the CPU emulator (include/msp_cuda_emulator.h) as a shared library: the
kernels (*.cu) and their torch bindings (*_binding.cpp), registered for CPU tensors as
torch.ops.megatron_sp_emulated.* (the schemas of csrc/*.cpp, renamed), with the emulator's own ops
(control.cpp: the SM count, traffic counters).

The kernel sources are used as they are; the only rewrite is the launch syntax, which no host
compiler accepts: `kernel<T, N><<<grid, block, shmem, stream>>>(args)` becomes
`::msp_emu::launch(&kernel<T, N>, [&] { kernel<T, N>(args); }, grid, block, shmem, stream)` (the address
finds the kernel's cudaFuncSetAttribute limits; `launch_bounded` when the kernel declares
`__launch_bounds__`), and the bindings register for CPU in the emulated
namespace. With sanitizer "asan" the kernels are built with AddressSanitizer and UBSan (every kernel
load and store is bounds-checked against the exact allocations of the inputs and of the outputs and
scratch the binding makes), with "tsan" with ThreadSanitizer (races between the emulated threads: a
missing barrier); the process that loads it must preload the runtime (`sanitizer_env`). With
"traffic" the kernel files call the emulator on every memory access, which counts the global-memory
bytes each kernel moves (bench/kernel_traffic.py); no runtime to preload.

    python tests/cuda_emulator/build.py OUT_DIR [--sanitizer asan|tsan|traffic|none]  # prints its path
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CSRC = os.path.join(ROOT, "csrc")


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def runtime_library(sanitizer: str) -> str | None:
    """The compiler's lib{asan,tsan}.so (to preload), or None where it has none."""
    cxx = compiler()
    if cxx is None:
        return None
    try:
        path = subprocess.run(
            [cxx, f"-print-file-name=lib{sanitizer}.so"], capture_output=True, text=True, timeout=60
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


def sanitizer_env(sanitizer: str = "asan") -> dict:
    """Environment for a Python process that loads a library built with `sanitizer`."""
    env = dict(os.environ)
    preload = [runtime_library(sanitizer)]
    if sanitizer == "asan":  # so that ASan's __cxa_throw interceptor finds the real one (C++
        preload.append(runtime_library("stdc++"))  # exceptions from the torch binding's checks)
    env["LD_PRELOAD"] = " ".join(p for p in preload if p)
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    env["TSAN_OPTIONS"] = "halt_on_error=1:report_signal_unsafe=0"
    return env


def _matching(text: str, start: int, open_c: str, close_c: str, step: int) -> int:
    """Index of the bracket matching the one at `start`, scanning by `step` (+1 or -1)."""
    depth, i = 0, start
    while True:
        if text[i] == open_c:
            depth += 1
        elif text[i] == close_c:
            depth -= 1
        if depth == 0:
            return i
        i += step


def translate_launches(src: str) -> str:
    """Rewrites every `kernel<...><<<config>>>(args)` into an emulator launch; a kernel declared
    with `__launch_bounds__(N)` gets a launch that fails (as on the GPU) with more than N threads."""
    bounds = {
        name: bound.split(",")[0].strip()  # the thread limit (a second argument is the blocks per SM hint)
        for bound, name in re.findall(r"__launch_bounds__\(([^)]*)\)\s*(\w+)\s*\(", src)
    }
    out, i = [], 0
    while (j := src.find("<<<", i)) >= 0:
        k = j
        while src[k - 1].isspace():  # clang-format may break the line before the launch
            k -= 1
        if src[k - 1] == ">":  # template arguments: walk back to their '<'
            k = _matching(src, k - 1, ">", "<", -1)
        while k > 0 and (src[k - 1].isalnum() or src[k - 1] in "_:"):
            k -= 1
        kernel = src[k:j].rstrip()
        end_config = src.index(">>>", j)
        config = src[j + 3 : end_config]
        paren = end_config + 3
        while src[paren].isspace():
            paren += 1
        if src[paren] != "(" or not kernel:
            raise ValueError(f"cannot parse the launch at offset {j}: {src[k : paren + 20]!r}")
        close = _matching(src, paren, "(", ")", 1)
        args = src[paren + 1 : close]
        out.append(src[i:k])
        bound = bounds.get(kernel.split("<")[0].split("::")[-1])
        address = f"reinterpret_cast<const void*>(&{kernel})"  # its cudaFuncSetAttribute limits
        if bound is None:
            out.append(f"::msp_emu::launch({address}, [&] {{ {kernel}({args}); }}, {config})")
        else:
            out.append(f"::msp_emu::launch_bounded({bound}, {address}, [&] {{ {kernel}({args}); }}, {config})")
        i = close + 1
    out.append(src[i:])
    return "".join(out)


NAMESPACE = "megatron_sp_emulated"
_FRAGMENT = "TORCH_LIBRARY_FRAGMENT(megatron_sp, m) {"
_CUDA_IMPL = "TORCH_LIBRARY_IMPL(megatron_sp, CUDA, m)"


def schemas(csrc: str = CSRC) -> list:
    """The op schemas of csrc/*.cpp (their TORCH_LIBRARY_FRAGMENT(megatron_sp, ...) blocks), in file order."""
    found = []
    for path in sorted(glob.glob(os.path.join(csrc, "*.cpp"))):
        with open(path) as f:
            text = f.read()
        start = 0
        while (start := text.find(_FRAGMENT, start)) >= 0:
            block = text[start : text.index("\n}\n", start)]
            found += [
                "".join(re.findall(r'"([^"]*)"', d)) for d in re.findall(r"m\.def\(((?:\s*\"[^\"]*\")+)\s*\);", block)
            ]
            start += len(_FRAGMENT)
    return found


def op_names(csrc: str = CSRC) -> list:
    return [schema.split("(", 1)[0] for schema in schemas(csrc)]


def _binding_source(csrc: str, tree: str) -> str:
    """One translation unit (written into `tree`) with the CUDA bindings (csrc/cuda/*_binding.cpp)
    registered as the CPU kernels of the op library NAMESPACE, that library's schemas (csrc/*.cpp's,
    renamed) and the emulator's own ops (control.cpp): torch's headers, the slowest part of the
    build, are parsed once. (Each binding compiling alone is checked by tests/test_cuda_compile.py
    and by the real build.)"""
    parts = []
    for path in sorted(glob.glob(os.path.join(csrc, "cuda", "*_binding.cpp"))) + [os.path.join(HERE, "control.cpp")]:
        with open(path) as f:
            text = f.read()
        if path.endswith("_binding.cpp"):
            if text.count(_CUDA_IMPL) != 1:
                raise ValueError(f"{path} must contain `{_CUDA_IMPL}` once")
            text = text.replace(_CUDA_IMPL, f"TORCH_LIBRARY_IMPL({NAMESPACE}, CPU, m)")
            text = re.sub(r'#include "([^"]+)"', lambda m: f'#include "{os.path.normpath("cuda/" + m[1])}"', text)
        parts.append(f'#line 1 "{path}"\n{text}')
    defs = "".join(f'  m.def("{schema}");\n' for schema in schemas(csrc))
    parts.append(f"TORCH_LIBRARY({NAMESPACE}, m) {{\n{defs}}}\n")
    target = os.path.join(tree, "bindings.cpp")
    with open(target, "w") as f:
        f.write("\n".join(parts))
    return target


def _torch_flags():
    import torch
    from torch.utils import cpp_extension

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    compile_flags = [f"-I{p}" for p in cpp_extension.include_paths()] + [
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    ]
    return compile_flags, [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-ltorch"]


def _sanitizer_flags(sanitizer: str | None) -> tuple:
    """(flags of the kernels and the emulator, extra flags of the kernel files alone)."""
    if sanitizer == "asan":
        return ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"], []
    if sanitizer == "tsan":
        return ["-fsanitize=thread", "-fno-omit-frame-pointer"], []
    if sanitizer == "traffic":  # every load/store of the kernel files calls the emulator
        calls = ["--param", "asan-instrumentation-with-call-threshold=0", "--param", "asan-stack=0"]
        return [], ["-fsanitize=kernel-address", *calls, "--param", "asan-globals=0"]
    if sanitizer is not None:
        raise ValueError(f"unknown sanitizer {sanitizer!r}")
    return [], []


def _kernel_sources(csrc: str, tree: str) -> list:
    """csrc/cuda/*.cu with their launches translated, as host C++ files in `tree` (and the headers)."""
    os.makedirs(os.path.join(tree, "cuda"), exist_ok=True)
    for header in glob.glob(os.path.join(csrc, "*.h")):
        shutil.copy(header, tree)
    for header in glob.glob(os.path.join(csrc, "cuda", "*.h")) + glob.glob(os.path.join(csrc, "cuda", "*.cuh")):
        shutil.copy(header, os.path.join(tree, "cuda"))
    sources = []
    for cu in sorted(glob.glob(os.path.join(csrc, "cuda", "*.cu"))):
        with open(cu) as f:
            text = translate_launches(f.read())
        sources.append(os.path.join(tree, "cuda", os.path.basename(cu) + ".cpp"))
        with open(sources[-1], "w") as f:
            f.write(f'#line 1 "{cu}"\n' + text)
    return sources


def _headers_digest(tree: str) -> bytes:
    digest = hashlib.sha256()
    for header in sorted(
        glob.glob(os.path.join(tree, "**", "*.*h"), recursive=True)
        + glob.glob(os.path.join(HERE, "include", "**", "*.h"), recursive=True)
        + glob.glob(os.path.join(HERE, "*.h"))
    ):
        with open(header, "rb") as f:
            digest.update(os.path.basename(header).encode() + f.read())
    return digest.digest()


def build(out_dir: str, sanitizer: str | None = "asan", csrc: str = CSRC, cache_dir: str | None = None) -> str:
    """Translates and compiles the kernels of `csrc`, the emulator, and the CUDA bindings registered
    for CPU tensors as torch.ops.megatron_sp_emulated.* (with the emulator's own ops, control.cpp);
    returns the .so's path, for torch.ops.load_library (include/c10/cuda/ stands in for the CUDA
    guard and stream). The kernels and the emulator are built with the sanitizer; the bindings, which
    only check arguments, allocate and launch, without (so their objects, the slowest to compile,
    are shared by every mode). With `cache_dir`, objects are reused across builds when the source,
    every header and the flags are unchanged (a build of a modified tree recompiles only what changed)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++/c++) found")
    tree = os.path.join(out_dir, "src")
    kernel_sources = _kernel_sources(csrc, tree) + [os.path.join(HERE, n) for n in ("emulator.cpp", "warp_matrix.cpp")]
    torch_sources = [_binding_source(csrc, tree)]
    torch_compile, torch_link = _torch_flags()
    # -g1: line tables only, enough for the sanitizers' file:line reports; full -g doubles compile time.
    base = ["-std=c++20", "-O1", "-g1", "-fPIC", "-pthread", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas"]
    base += ["-Werror=return-type", "-I", os.path.join(HERE, "include"), "-I", tree]
    sanitize, kernel_only = _sanitizer_flags(sanitizer)
    headers = _headers_digest(tree)

    def compile_one(src):
        flags = base + (torch_compile if src in torch_sources else sanitize)
        if src.endswith(".cu.cpp"):
            flags = flags + kernel_only
        obj = os.path.join(out_dir, os.path.basename(src) + ".o")
        if cache_dir is not None:
            with open(src, "rb") as f:  # without the #line directives (they name the source's folder)
                text = re.sub(rb"(?m)^#line .*$", b"", f.read())
            key_flags = " ".join(f for f in flags if f != tree).encode()
            key = hashlib.sha256(key_flags + headers + text).hexdigest()[:24]
            cached = os.path.join(cache_dir, f"{os.path.basename(src)}.{key}.o")
            if os.path.exists(cached):
                return cached
        proc = subprocess.run([cxx, *flags, "-c", src, "-o", obj], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {src} failed:\n{proc.stderr}")
        if cache_dir is not None:
            os.makedirs(cache_dir, exist_ok=True)
            shutil.copy(obj, cached + ".tmp")
            os.replace(cached + ".tmp", cached)
        return obj

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:  # the slowest first
        objects = list(pool.map(compile_one, torch_sources + kernel_sources))
    library = os.path.join(out_dir, "libmsp_cuda_emulated.so")
    link = [cxx, *base, *sanitize, "-shared", *objects, "-o", library, *torch_link]
    proc = subprocess.run(link, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"linking {library} failed:\n{proc.stderr}")
    return library


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--sanitizer", choices=["asan", "tsan", "traffic", "none"], default="asan")
    args = parser.parse_args()
    print(build(args.out_dir, None if args.sanitizer == "none" else args.sanitizer))


if __name__ == "__main__":
    main()

"""Builds csrc/cuda/*.cu for the CPU emulator (include/msp_cuda_emulator.h) as a shared library.

The kernel sources are used as they are; the only rewrite is the launch syntax, which no host
compiler accepts: `kernel<T, N><<<grid, block, shmem, stream>>>(args)` becomes
`::msp_emu::launch([&] { kernel<T, N>(args); }, grid, block, shmem, stream)` (`launch_bounded` when
the kernel declares `__launch_bounds__`). With sanitizer "asan" the library is built with
AddressSanitizer and UBSan (every kernel load and store is bounds-checked against the exact host
allocations the caller passes), with "tsan" with ThreadSanitizer (races between the emulated threads:
a missing barrier); the process that loads it must preload the runtime (`sanitizer_env`). With
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
    bounds = dict((name, bound) for bound, name in re.findall(r"__launch_bounds__\(([^)]*)\)\s*(\w+)\s*\(", src))
    out, i = [], 0
    while (j := src.find("<<<", i)) >= 0:
        k = j
        if src[k - 1] == ">":  # template arguments: walk back to their '<'
            k = _matching(src, k - 1, ">", "<", -1)
        while k > 0 and (src[k - 1].isalnum() or src[k - 1] in "_:"):
            k -= 1
        kernel = src[k:j]
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
        if bound is None:
            out.append(f"::msp_emu::launch([&] {{ {kernel}({args}); }}, {config})")
        else:
            out.append(f"::msp_emu::launch_bounded({bound}, [&] {{ {kernel}({args}); }}, {config})")
        i = close + 1
    out.append(src[i:])
    return "".join(out)


BINDING_NAMESPACE = "megatron_sp_emulated"


def _binding_sources(csrc: str, tree: str) -> list:
    """The torch binding of the CUDA ops (csrc/cuda/ops_cuda.cpp) registered as CPU kernels of
    the op library BINDING_NAMESPACE, and that library's schemas (csrc/ops.cpp's, renamed)."""
    with open(os.path.join(csrc, "cuda", "ops_cuda.cpp")) as f:
        binding = f.read()
    impl = "TORCH_LIBRARY_IMPL(megatron_sp, CUDA, m)"
    if binding.count(impl) != 1:
        raise ValueError(f"ops_cuda.cpp must contain `{impl}` once")
    binding = binding.replace(impl, f"TORCH_LIBRARY_IMPL({BINDING_NAMESPACE}, CPU, m)")
    with open(os.path.join(csrc, "ops.cpp")) as f:
        ops = f.read()
    start = ops.index("TORCH_LIBRARY(megatron_sp, m)")
    schemas = ops[start : ops.index("\n}\n", start) + 3].replace(
        "TORCH_LIBRARY(megatron_sp, m)", f"TORCH_LIBRARY({BINDING_NAMESPACE}, m)"
    )
    targets = [os.path.join(tree, "cuda", "ops_cuda.cpp"), os.path.join(tree, "schemas.cpp")]
    texts = [binding, "#include <torch/library.h>\n" + schemas]
    for target, text in zip(targets, texts):
        with open(target, "w") as f:
            f.write(text)
    return targets


def _torch_flags():
    import torch
    from torch.utils import cpp_extension

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    compile_flags = [f"-I{p}" for p in cpp_extension.include_paths()] + [
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    ]
    return compile_flags, [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-ltorch"]


def build(
    out_dir: str, sanitizer: str | None = "asan", csrc: str = CSRC, cache_dir: str | None = None, binding: bool = False
) -> str:
    """Translates and compiles the kernels of `csrc`, the emulator and the C API; returns the
    .so's path. With `binding`, the library also holds the torch binding of the CUDA ops,
    registered for CPU tensors as torch.ops.megatron_sp_emulated.* (load it with
    torch.ops.load_library; include/c10/cuda/ stands in for the CUDA guard and stream). With
    `cache_dir`, objects are reused across builds when the source, every header and the flags are
    unchanged (a build of a modified tree recompiles only what changed)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++/c++) found")
    tree = os.path.join(out_dir, "src")
    os.makedirs(os.path.join(tree, "cuda"), exist_ok=True)
    for header in glob.glob(os.path.join(csrc, "*.h")):
        shutil.copy(header, tree)
    for header in glob.glob(os.path.join(csrc, "cuda", "*.h")) + glob.glob(os.path.join(csrc, "cuda", "*.cuh")):
        shutil.copy(header, os.path.join(tree, "cuda"))
    sources = [os.path.join(HERE, "emulator.cpp"), os.path.join(HERE, "api.cpp")]
    for cu in sorted(glob.glob(os.path.join(csrc, "cuda", "*.cu"))):
        with open(cu) as f:
            text = translate_launches(f.read())
        target = os.path.join(tree, "cuda", os.path.basename(cu) + ".cpp")
        with open(target, "w") as f:
            f.write(f'#line 1 "{cu}"\n' + text)
        sources.append(target)
    torch_sources = _binding_sources(csrc, tree) if binding else []
    torch_compile, torch_link = _torch_flags() if binding else ([], [])
    kernel_flags = []
    flags = [
        "-std=c++20",
        "-O1",
        "-g",
        "-fPIC",
        "-pthread",
        "-ffp-contract=off",
        "-Wall",
        "-Wno-unknown-pragmas",
        "-Werror=return-type",
        "-I",
        os.path.join(HERE, "include"),
        "-I",
        tree,
    ]
    if sanitizer == "asan":
        flags += ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    elif sanitizer == "tsan":
        flags += ["-fsanitize=thread", "-fno-omit-frame-pointer"]
    elif sanitizer == "traffic":  # every load/store of the kernel files calls the emulator
        kernel_flags = [
            "-fsanitize=kernel-address",
            "--param",
            "asan-instrumentation-with-call-threshold=0",
            "--param",
            "asan-stack=0",
            "--param",
            "asan-globals=0",
        ]
    elif sanitizer is not None:
        raise ValueError(f"unknown sanitizer {sanitizer!r}")

    headers = hashlib.sha256()
    for header in sorted(
        glob.glob(os.path.join(tree, "**", "*.*h"), recursive=True)
        + glob.glob(os.path.join(HERE, "include", "**", "*.h"), recursive=True)
    ):
        with open(header, "rb") as f:
            headers.update(os.path.basename(header).encode() + f.read())
    key_flags = " ".join(f for f in flags if f != tree).encode()

    def compile_one(src):
        obj = os.path.join(out_dir, os.path.basename(src) + ".o")
        extra = torch_compile if src in torch_sources else []
        if src.endswith(".cu.cpp"):
            extra = extra + kernel_flags
        if cache_dir is not None:
            with open(src, "rb") as f:
                text = f.read().split(b"\n", 1)[-1] if src.endswith(".cu.cpp") else f.read()
            key = hashlib.sha256(key_flags + " ".join(extra).encode() + headers.digest() + text).hexdigest()[:24]
            cached = os.path.join(cache_dir, f"{os.path.basename(src)}.{key}.o")
            if os.path.exists(cached):
                return cached
        proc = subprocess.run([cxx, *flags, *extra, "-c", src, "-o", obj], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {src} failed:\n{proc.stderr}")
        if cache_dir is not None:
            os.makedirs(cache_dir, exist_ok=True)
            shutil.copy(obj, cached + ".tmp")
            os.replace(cached + ".tmp", cached)
        return obj

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        objects = list(pool.map(compile_one, torch_sources + sources))
    library = os.path.join(out_dir, "libmsp_cuda_emulated.so")
    proc = subprocess.run(
        [cxx, *flags, "-shared", *objects, "-o", library, *torch_link], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise RuntimeError(f"linking {library} failed:\n{proc.stderr}")
    return library


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--sanitizer", choices=["asan", "tsan", "traffic", "none"], default="asan")
    parser.add_argument(
        "--binding", action="store_true", help="also build the torch binding (torch.ops.megatron_sp_emulated)"
    )
    args = parser.parse_args()
    print(build(args.out_dir, None if args.sanitizer == "none" else args.sanitizer, binding=args.binding))


if __name__ == "__main__":
    main()

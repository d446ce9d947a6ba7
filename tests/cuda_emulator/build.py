"""Builds csrc/cuda/*.cu for the CPU emulator (include/msp_cuda_emulator.h) as a shared library.

The kernel sources are used as they are; the only rewrite is the launch syntax, which no host
compiler accepts: `kernel<T, N><<<grid, block, shmem, stream>>>(args)` becomes
`::msp_emu::launch([&] { kernel<T, N>(args); }, grid, block, shmem, stream)` (`launch_bounded` when
the kernel declares `__launch_bounds__`). With sanitizer "asan" the library is built with
AddressSanitizer and UBSan (every kernel load and store is bounds-checked against the exact host
allocations the caller passes), with "tsan" with ThreadSanitizer (races between the emulated threads:
a missing barrier); the process that loads it must preload the runtime (`sanitizer_env`).

    python tests/cuda_emulator/build.py OUT_DIR [--sanitizer asan|tsan|none]   # prints its path
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
        path = subprocess.run([cxx, f"-print-file-name=lib{sanitizer}.so"], capture_output=True,
                              text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


def sanitizer_env(sanitizer: str = "asan") -> dict:
    """Environment for a Python process that loads a library built with `sanitizer`."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = runtime_library(sanitizer)
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
    bounds = dict((name, bound) for bound, name in
                  re.findall(r"__launch_bounds__\(([^)]*)\)\s*(\w+)\s*\(", src))
    out, i = [], 0
    while (j := src.find("<<<", i)) >= 0:
        k = j
        if src[k - 1] == ">":  # template arguments: walk back to their '<'
            k = _matching(src, k - 1, ">", "<", -1)
        while k > 0 and (src[k - 1].isalnum() or src[k - 1] in "_:"):
            k -= 1
        kernel = src[k:j]
        end_config = src.index(">>>", j)
        config = src[j + 3:end_config]
        paren = end_config + 3
        while src[paren].isspace():
            paren += 1
        if src[paren] != "(" or not kernel:
            raise ValueError(f"cannot parse the launch at offset {j}: {src[k:paren + 20]!r}")
        close = _matching(src, paren, "(", ")", 1)
        args = src[paren + 1:close]
        out.append(src[i:k])
        bound = bounds.get(kernel.split("<")[0].split("::")[-1])
        if bound is None:
            out.append(f"::msp_emu::launch([&] {{ {kernel}({args}); }}, {config})")
        else:
            out.append(f"::msp_emu::launch_bounded({bound}, [&] {{ {kernel}({args}); }}, {config})")
        i = close + 1
    out.append(src[i:])
    return "".join(out)


def build(out_dir: str, sanitizer: str | None = "asan", csrc: str = CSRC,
          cache_dir: str | None = None) -> str:
    """Translates and compiles the kernels of `csrc`, the emulator and the C API; returns the
    .so's path. With `cache_dir`, objects are reused across builds when the source, every header
    and the flags are unchanged (a build of a modified tree recompiles only what changed)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++/c++) found")
    tree = os.path.join(out_dir, "src")
    os.makedirs(os.path.join(tree, "cuda"), exist_ok=True)
    for header in glob.glob(os.path.join(csrc, "*.h")):
        shutil.copy(header, tree)
    for header in glob.glob(os.path.join(csrc, "cuda", "*.h")) + \
            glob.glob(os.path.join(csrc, "cuda", "*.cuh")):
        shutil.copy(header, os.path.join(tree, "cuda"))
    sources = [os.path.join(HERE, "emulator.cpp"), os.path.join(HERE, "api.cpp")]
    for cu in sorted(glob.glob(os.path.join(csrc, "cuda", "*.cu"))):
        with open(cu) as f:
            text = translate_launches(f.read())
        target = os.path.join(tree, "cuda", os.path.basename(cu) + ".cpp")
        with open(target, "w") as f:
            f.write(f'#line 1 "{cu}"\n' + text)
        sources.append(target)
    flags = ["-std=c++20", "-O1", "-g", "-fPIC", "-pthread", "-ffp-contract=off", "-Wall",
             "-Wno-unknown-pragmas", "-Werror=return-type", "-I", os.path.join(HERE, "include"),
             "-I", tree]
    if sanitizer == "asan":
        flags += ["-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                  "-fno-omit-frame-pointer"]
    elif sanitizer == "tsan":
        flags += ["-fsanitize=thread", "-fno-omit-frame-pointer"]
    elif sanitizer is not None:
        raise ValueError(f"unknown sanitizer {sanitizer!r}")

    headers = hashlib.sha256()
    for header in sorted(glob.glob(os.path.join(tree, "**", "*.*h"), recursive=True) +
                         glob.glob(os.path.join(HERE, "include", "*.h"))):
        with open(header, "rb") as f:
            headers.update(os.path.basename(header).encode() + f.read())
    key_flags = " ".join(f for f in flags if f != tree).encode()

    def compile_one(src):
        obj = os.path.join(out_dir, os.path.basename(src) + ".o")
        if cache_dir is not None:
            with open(src, "rb") as f:
                text = f.read().split(b"\n", 1)[-1] if src.startswith(tree) else f.read()
            key = hashlib.sha256(key_flags + headers.digest() + text).hexdigest()[:24]
            cached = os.path.join(cache_dir, f"{os.path.basename(src)}.{key}.o")
            if os.path.exists(cached):
                return cached
        proc = subprocess.run([cxx, *flags, "-c", src, "-o", obj], capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {src} failed:\n{proc.stderr}")
        if cache_dir is not None:
            os.makedirs(cache_dir, exist_ok=True)
            shutil.copy(obj, cached + ".tmp")
            os.replace(cached + ".tmp", cached)
        return obj

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        objects = list(pool.map(compile_one, sources))
    library = os.path.join(out_dir, "libmsp_cuda_emulated.so")
    proc = subprocess.run([cxx, *flags, "-shared", *objects, "-o", library], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"linking {library} failed:\n{proc.stderr}")
    return library


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--sanitizer", choices=["asan", "tsan", "none"], default="asan")
    args = parser.parse_args()
    print(build(args.out_dir, None if args.sanitizer == "none" else args.sanitizer))


if __name__ == "__main__":
    main()

"""Builds megatron_sp and its extension megatron_sp._C.

The C++ (CPU) ops are built always; the CUDA ops are added when torch was built with CUDA and nvcc
is found (MEGATRON_SP_SKIP_CUDA_BUILD=1 skips them). Install with --no-build-isolation so the
extension compiles against the torch already in the environment.
"""

import glob
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cuda_home():
    """The CUDA toolkit, when CUDA_HOME / CUDA_PATH do not name one: torch guesses it as nvcc's
    directory's parent, which is wrong where `nvcc` on PATH is a wrapper (this project's machines have
    /usr/local/bin/nvcc exec-ing /usr/local/cuda-13.0/bin/nvcc: the guess /usr/local has no
    cuda_runtime.h and the bindings fail to compile). The first candidate with the runtime's header."""
    import shutil

    nvcc = shutil.which("nvcc")
    guesses = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    guesses += ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for home in guesses:
        if os.path.exists(os.path.join(home, "include", "cuda_runtime.h")) and os.path.exists(
            os.path.join(home, "bin", "nvcc")
        ):
            return home
    return None


def _extensions():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not sources:
        return [], {}
    home = None if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") else _cuda_home()
    if home:
        os.environ["CUDA_HOME"] = home  # (read when torch.utils.cpp_extension is imported)
    from torch.utils import cpp_extension

    # Per op (csrc/module.cpp): csrc/<op>.cpp (schema, CPU kernel), csrc/cuda/<op>.cu (torch-free kernels:
    # nvcc alone compiles them, tests/test_cuda_compile.py) and csrc/cuda/<op>_binding.cpp (its CUDA binding).
    cuda_sources = sorted(
        glob.glob(os.path.join("csrc", "cuda", "*.cu")) + glob.glob(os.path.join("csrc", "cuda", "*_binding.cpp"))
    )
    use_cuda = (
        cuda_sources
        and os.environ.get("MEGATRON_SP_SKIP_CUDA_BUILD", "0") != "1"
        and cpp_extension.CUDA_HOME is not None
        and __import__("torch").version.cuda is not None
    )
    # No -std: torch's BuildExtension adds the standard its headers need (the code is C++17-clean).
    # -ffp-contract=off: no fused multiply-add, so fp32 dropout output is bit-identical to the
    # reference (which multiplies and adds in separate roundings).
    cxx = ["-O3", "-fopenmp", "-ffp-contract=off"]
    extra = {"cxx": cxx + (["-DMEGATRON_SP_WITH_CUDA"] if use_cuda else [])}
    if use_cuda:
        extra["nvcc"] = ["-O3", "-lineinfo"]
        ext = cpp_extension.CUDAExtension(
            "megatron_sp._C",
            sources + cuda_sources,
            extra_compile_args=extra,
            extra_link_args=["-fopenmp"],
            py_limited_api=False,
        )
    else:
        ext = cpp_extension.CppExtension(
            "megatron_sp._C", sources, extra_compile_args=extra, extra_link_args=["-fopenmp"]
        )
    build = cpp_extension.BuildExtension.with_options(use_ninja=True)
    return [ext], {"build_ext": build}


ext_modules, cmdclass = _extensions()

setup(
    name="megatron_sp",
    version="0.1.0",
    description="Tensor + sequence parallel GPT pretraining that computes exactly what one device computes",
    packages=find_packages(include=["megatron_sp", "megatron_sp.*"]),
    package_data={"megatron_sp.training": ["megatron_arguments.json"]},  # Megatron-LM's options (megatron_rules.py)
    py_modules=["pretrain_gpt_sp"],
    python_requires=">=3.10",
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

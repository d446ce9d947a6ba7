"""Builds megatron_sp and its extension megatron_sp._C.

The C++ (CPU) ops are built always; the CUDA ops are added when torch was built with CUDA and nvcc
is found (MEGATRON_SP_SKIP_CUDA_BUILD=1 skips them). Install with --no-build-isolation so the
extension compiles against the torch already in the environment.
"""

import glob
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _extensions():
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not sources:
        return [], {}
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

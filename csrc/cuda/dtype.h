// What every launcher interface (csrc/cuda/<op>.h) shares: the element type of a launch.
//
// Design: the kernels (csrc/cuda/*.cu) include only CUDA headers, their own launcher interface and
// the torch-free headers of csrc/, so nvcc can compile each alone (tests/test_cuda_compile.py does,
// on machines without a GPU or a CUDA torch) and the CPU emulator can run them
// (tests/cuda_emulator/). A launcher takes raw pointers, sizes and a stream, and returns the
// launch's cudaError_t; the op's binding (<op>_binding.cpp) checks the arguments, allocates the
// outputs, calls it and turns a failure into a Python error.
#pragma once

namespace msp {
namespace cuda {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

}  // namespace cuda
}  // namespace msp

// The launchers of dropout_add's CUDA kernels (dropout_add.cu), called by its binding (dropout_add_binding.cpp).
// Torch-free (see dtype.h): the kernels include it, and so does the binding.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../philox.h"
#include "dtype.h"

namespace msp {
namespace cuda {

struct DropoutAddFwd {
  const void* x;             // [s, b, h], dtype
  const void* bias;          // [h], dtype, or nullptr
  const void* addend;        // [s, b, h], dtype, or nullptr
  const void* residual;      // [s, b, h], out_dtype, or nullptr
  void* out;                 // [s, b, h], out_dtype
  const int64_t* positions;  // [s]
  const int64_t* samples;    // [b]
  int64_t s, b, h;
  DType dtype, out_dtype;  // out_dtype: dtype or kF32
  DropoutParams drop;
};

struct DropoutAddBwd {
  const void* grad;  // [s, b, h], dtype
  void* grad_x;      // [s, b, h], grad_x_dtype
  float* grad_bias;  // [h] fp32, or nullptr when no bias gradient is wanted
  float* scratch;    // dropout_add_bwd_scratch(...) floats
  const int64_t* positions;
  const int64_t* samples;
  int64_t s, b, h;
  DType dtype, grad_x_dtype;  // dtype: grad_x_dtype or kF32
  DropoutParams drop;
};

int64_t dropout_add_bwd_scratch(int64_t s, int64_t b, int64_t h, DType dtype);
cudaError_t dropout_add_fwd(const DropoutAddFwd& args, cudaStream_t stream);
cudaError_t dropout_add_bwd(const DropoutAddBwd& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace msp

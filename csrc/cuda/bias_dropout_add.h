// The launchers of bias_dropout_add's CUDA kernels (bias_dropout_add.cu), called by its binding
// (bias_dropout_add_binding.cpp). Torch-free (see dtype.h): the kernels include it, and so does the binding.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../philox.h"
#include "dtype.h"

namespace msp {
namespace cuda {

struct BiasDropoutAddFwd {
  const void* x;             // [s, b, h], dtype
  const void* bias;          // [h], dtype, or nullptr
  const void* residual;      // [s, b, h], dtype
  void* out;                 // [s, b, h], dtype
  const int64_t* positions;  // [s]
  const int64_t* samples;    // [b]
  int64_t s, b, h;
  DType dtype;
  DropoutParams drop;
};

struct BiasDropoutAddBwd {
  const void* grad;  // [s, b, h], dtype
  void* grad_x;      // [s, b, h], dtype
  float* grad_bias;  // [h] fp32, or nullptr when no bias gradient is wanted
  float* scratch;    // bias_dropout_add_bwd_scratch(...) floats
  const int64_t* positions;
  const int64_t* samples;
  int64_t s, b, h;
  DType dtype;
  DropoutParams drop;
};

int64_t bias_dropout_add_bwd_scratch(int64_t s, int64_t b, int64_t h, DType dtype);
cudaError_t bias_dropout_add_fwd(const BiasDropoutAddFwd& args, cudaStream_t stream);
cudaError_t bias_dropout_add_bwd(const BiasDropoutAddBwd& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace msp

// The launchers of layer_norm's CUDA kernels (layer_norm.cu), called by its binding
// (layer_norm_binding.cpp). Torch-free (see dtype.h): the kernels include it, and so does the binding.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "dtype.h"

namespace msp {
namespace cuda {

struct LayerNormFwd {
  const void* x;       // [rows, h], dtype
  const void* weight;  // [h], weight_dtype
  const void* bias;    // [h], weight_dtype
  void* y;             // [rows, h], dtype
  float* mean;         // [rows]
  float* rstd;         // [rows]
  int64_t rows, h;
  float eps;
  DType dtype, weight_dtype;
};

struct LayerNormBwd {
  const void* grad;         // [rows, h], dtype
  const void* x;            // [rows, h], dtype
  const void* weight;       // [h], weight_dtype
  const float* mean;        // [rows]
  const float* rstd;        // [rows]
  void* grad_x;             // [rows, h], dtype
  float* grad_weight_bias;  // [2h] fp32: grad_weight then grad_bias
  float* scratch;           // layer_norm_bwd_scratch(...) floats
  int64_t rows, h;
  DType dtype, weight_dtype;
};

int64_t layer_norm_bwd_scratch(int64_t rows, int64_t h, DType dtype);
cudaError_t layer_norm_fwd(const LayerNormFwd& args, cudaStream_t stream);
cudaError_t layer_norm_bwd(const LayerNormBwd& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace msp

// The launchers of rms_norm's CUDA kernels (rms_norm.cu), called by its binding (rms_norm_binding.cpp).
// Torch-free (see dtype.h): the kernels include it, and so does the binding.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "dtype.h"

namespace msp {
namespace cuda {

struct RmsNormFwd {
  const void* x;       // [rows, h], dtype
  const void* weight;  // [h], weight_dtype
  void* y;             // [rows, h], dtype
  float* rstd;         // [rows]
  int64_t rows, h;     // rows < 2^31, h > 0 (else cudaErrorInvalidValue)
  float eps;
  DType dtype, weight_dtype;
};

struct RmsNormBwd {
  const void* grad;    // [rows, h], dtype
  const void* x;       // [rows, h], dtype
  const void* weight;  // [h], weight_dtype
  const float* rstd;   // [rows]
  void* grad_x;        // [rows, h], dtype
  float* grad_weight;  // [h] fp32
  float* scratch;      // rms_norm_bwd_scratch(...) floats
  int64_t rows, h;     // h > 0 (else cudaErrorInvalidValue)
  DType dtype, weight_dtype;
};

int64_t rms_norm_bwd_scratch(int64_t rows, int64_t h, DType dtype);
cudaError_t rms_norm_fwd(const RmsNormFwd& args, cudaStream_t stream);
cudaError_t rms_norm_bwd(const RmsNormBwd& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace msp

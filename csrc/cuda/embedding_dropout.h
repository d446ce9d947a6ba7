// The launchers of embedding_dropout's CUDA kernels (embedding_dropout.cu), called by its binding
// (embedding_dropout_binding.cpp). Torch-free (see dtype.h): the kernels include it, and so does the binding.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../philox.h"
#include "dtype.h"

namespace msp {
namespace cuda {

struct EmbeddingDropoutFwd {
  const void* x;             // [s, b, h], dtype
  const void* y;             // [s, b, h], dtype, or nullptr
  void* out;                 // [s, b, h], out_dtype (dtype or kF32)
  const int64_t* positions;  // [s]
  const int64_t* samples;    // [b]
  int64_t s, b, h;
  DType dtype, out_dtype;
  DropoutParams drop;
};

struct EmbeddingDropoutBwd {
  const void* grad;  // [s, b, h], dtype (grad_x_dtype or kF32)
  void* grad_x;      // [s, b, h], grad_x_dtype
  const int64_t* positions;
  const int64_t* samples;
  int64_t s, b, h;
  DType dtype, grad_x_dtype;
  DropoutParams drop;
};

cudaError_t embedding_dropout_fwd(const EmbeddingDropoutFwd& args, cudaStream_t stream);
cudaError_t embedding_dropout_bwd(const EmbeddingDropoutBwd& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace msp

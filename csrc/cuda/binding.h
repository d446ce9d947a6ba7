// Helpers of the CUDA bindings (csrc/cuda/<op>_binding.cpp): the launch dtype of a tensor, the
// current stream, and a launch failure turned into a Python error.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include "dtype.h"

namespace msp {

inline cuda::DType cuda_dtype(at::ScalarType t) {
  if (t == at::kBFloat16) return cuda::DType::kBF16;
  if (t == at::kHalf) return cuda::DType::kF16;
  TORCH_CHECK(t == at::kFloat, "megatron_sp CUDA ops support fp32/bf16/fp16, got ", t);
  return cuda::DType::kF32;
}

inline void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "megatron_sp::", op, " failed to launch: ", cudaGetErrorString(err));
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace msp

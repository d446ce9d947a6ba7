// Emulator stand-in for <c10/cuda/CUDAStream.h>: one (null) stream; launches are synchronous.
#pragma once
#include "msp_cuda_emulator.h"

namespace c10 {
namespace cuda {

struct CUDAStream {
  cudaStream_t stream() const { return nullptr; }
};

inline CUDAStream getCurrentCUDAStream(signed char = -1) { return {}; }

}  // namespace cuda
}  // namespace c10

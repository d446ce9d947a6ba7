// The launchers of the layout ops' CUDA kernels (layout.cu), called by their binding (layout_binding.cpp).
// Torch-free (see dtype.h): the kernels include it, and so does the binding.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "dtype.h"

namespace msp {
namespace cuda {

// dst run o <- src run transpose_source(o, a, b) for o < a*b: [a, b, run] -> [b, a, run].
cudaError_t block_transpose(const void* src, void* dst, int64_t a, int64_t b, int64_t run_bytes, cudaStream_t stream);
// dst [outer, 2p, run] <- src chunks in zigzag order (layout_index.h).
cudaError_t zigzag_reorder(const void* src, void* dst, int64_t outer, int64_t p, int64_t run_bytes, bool inverse,
                           cudaStream_t stream);

}  // namespace cuda
}  // namespace msp

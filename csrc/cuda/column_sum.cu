// Second stage of the parameter-gradient reductions: out[j] = sum_k partial[k][j].
//
// Design: the backward kernels leave one fp32 partial row per block (or per row slot). A block of
// 32 x 8 threads owns 32 columns: each warp reads 32 consecutive floats (one 128-byte line) of
// every 8th row, then the 8 per-thread sums are added in a fixed order through shared memory, so
// the result is deterministic (no atomics).
#include "common.cuh"

namespace msp {
namespace cuda {
namespace {

constexpr int kCols = 32, kRowGroups = 8;

__global__ void column_sum_kernel(const float* __restrict__ partial, int64_t rows, int64_t cols,
                                  float* __restrict__ out) {
  __shared__ float sums[kRowGroups][kCols];
  const int64_t j = blockIdx.x * int64_t(kCols) + threadIdx.x;
  float acc = 0.0f;
  if (j < cols) {
#pragma unroll 4
    for (int64_t k = threadIdx.y; k < rows; k += kRowGroups) acc += partial[k * cols + j];
  }
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
#pragma unroll
    for (int g = 1; g < kRowGroups; ++g) acc += sums[g][threadIdx.x];
    out[j] = acc;
  }
}

}  // namespace

cudaError_t column_sum(const float* partial, int64_t rows, int64_t cols, float* out, cudaStream_t stream) {
  if (cols == 0) return cudaSuccess;
  const int64_t blocks = (cols + kCols - 1) / kCols;
  if (blocks > int64_t(0x7FFFFFFF)) return cudaErrorInvalidValue;
  column_sum_kernel<<<static_cast<unsigned>(blocks), dim3(kCols, kRowGroups), 0, stream>>>(partial, rows, cols, out);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace msp

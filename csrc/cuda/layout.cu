// Layout kernels for the collectives on CUDA: block transpose [a, b, run] -> [b, a, run] (Ulysses
// pack/unpack, dim-0 gather <-> last-dim concatenation) and the zigzag chunk permutation.
//
// Design: both are "output run o comes from input run source(o)" copies (layout_index.h). The
// kernel walks the output as a flat array of vectors of the widest type the run length and the
// pointers allow (16 bytes normally), so every load and store is a coalesced 128-bit access and
// the traffic is the compulsory read + write. Splitting a flat index into (run, offset) uses a
// multiply-shift divider (as PyTorch's IntDivider) instead of a 32-bit integer division (a long
// instruction sequence on GPUs), and each thread issues kUnroll independent loads before its
// stores to keep enough bytes in flight for HBM.
#include "../layout_index.h"
#include "common.cuh"
#include "layout.h"

namespace msp {
namespace cuda {
namespace {

constexpr int kThreads = 256, kUnroll = 4;

// n / d for n < 2^31 by multiply-high and shift.
struct FastDiv {
  uint32_t d, magic, shift;
  explicit FastDiv(uint32_t divisor) : d(divisor), magic(0), shift(0) {
    while (shift < 32 && (uint64_t(1) << shift) < divisor) ++shift;
    magic = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - divisor)) / divisor + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, magic) + n) >> shift; }
};

struct TransposeMap {  // [a, b, run] -> [b, a, run]
  FastDiv a;
  uint32_t b;
  __device__ __forceinline__ uint32_t operator()(uint32_t o) const {
    const uint32_t j = a.div(o), i = o - j * a.d;
    return i * b + j;
  }
};

struct ZigzagMap {  // [outer, 2p, run], chunks permuted within each outer index
  FastDiv two_p;
  uint32_t p;
  bool inverse;
  __device__ __forceinline__ uint32_t operator()(uint32_t o) const {
    const uint32_t outer = two_p.div(o), slot = o - outer * two_p.d;
    return outer * two_p.d + zigzag_source<uint32_t>(slot, p, inverse);
  }
};

template <typename V, typename Map>
__global__ void __launch_bounds__(kThreads)
    permute_runs_kernel(const V* __restrict__ src, V* __restrict__ dst, uint32_t total, FastDiv run, Map map) {
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t base = blockIdx.x * blockDim.x + threadIdx.x; base < total; base += kUnroll * stride) {
    V vals[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = base + u * stride;
      if (i < total) {
        const uint32_t o = run.div(i), v = i - o * run.d;
        vals[u] = src[map(o) * run.d + v];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint32_t i = base + u * stride;
      if (i < total) dst[i] = vals[u];
    }
  }
}

template <typename V, typename Map>
cudaError_t launch_typed(const void* src, void* dst, int64_t runs, int64_t run_bytes, Map map, cudaStream_t stream) {
  const int64_t run_v = run_bytes / int64_t(sizeof(V)), total = runs * run_v;
  if (total >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
  const int64_t want = (total + int64_t(kThreads) * kUnroll - 1) / (int64_t(kThreads) * kUnroll);
  const int64_t budget = int64_t(sm_count()) * (2048 / kThreads) * 4;
  const int64_t blocks = want < budget ? want : budget;
  permute_runs_kernel<V, Map><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const V*>(src), static_cast<V*>(dst), static_cast<uint32_t>(total),
      FastDiv(static_cast<uint32_t>(run_v)), map);
  return cudaGetLastError();
}

// Widest access (16, 8, 4, 2 or 1 bytes) that divides the run and both pointers.
template <typename Map>
cudaError_t launch_runs(const void* src, void* dst, int64_t runs, int64_t run_bytes, Map map, cudaStream_t stream) {
  if (runs == 0 || run_bytes == 0) return cudaSuccess;
  const uint64_t bits = uint64_t(run_bytes) | reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
  if (bits % 16 == 0) return launch_typed<uint4>(src, dst, runs, run_bytes, map, stream);
  if (bits % 8 == 0) return launch_typed<uint2>(src, dst, runs, run_bytes, map, stream);
  if (bits % 4 == 0) return launch_typed<uint32_t>(src, dst, runs, run_bytes, map, stream);
  if (bits % 2 == 0) return launch_typed<uint16_t>(src, dst, runs, run_bytes, map, stream);
  return launch_typed<uint8_t>(src, dst, runs, run_bytes, map, stream);
}

}  // namespace

cudaError_t block_transpose(const void* src, void* dst, int64_t a, int64_t b, int64_t run_bytes, cudaStream_t stream) {
  if (a * b >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
  TransposeMap map{FastDiv(static_cast<uint32_t>(a > 0 ? a : 1)), static_cast<uint32_t>(b)};
  return launch_runs(src, dst, a * b, run_bytes, map, stream);
}

cudaError_t zigzag_reorder(const void* src, void* dst, int64_t outer, int64_t p, int64_t run_bytes, bool inverse,
                           cudaStream_t stream) {
  if (outer * 2 * p >= (int64_t(1) << 31)) return cudaErrorInvalidValue;
  ZigzagMap map{FastDiv(static_cast<uint32_t>(2 * p)), static_cast<uint32_t>(p), inverse};
  return launch_runs(src, dst, outer * 2 * p, run_bytes, map, stream);
}

}  // namespace cuda
}  // namespace msp

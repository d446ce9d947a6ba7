// Building blocks of the row-normalisation kernels (layer_norm.cu, rms_norm.cu): launch plans,
// per-thread walks over a row's 128-bit vectors, group sums, and the backward's hand-off of
// per-thread weight-gradient accumulators to one partial row per block. Torch-free (dtype.h).
//
// Design (shared by both norms): the forward runs one block of up to kMaxThreads threads per row,
// each thread keeping its vectors of the row in registers; the backward runs a persistent grid of
// blocks that each hold G groups of `group` threads, one row per group, so that narrow rows still
// fill 512-thread blocks and the number of fp32 partial rows (about two per SM) stays small.
#pragma once

#include "common.cuh"

namespace msp {
namespace cuda {
namespace {

constexpr int kMaxThreads = 512;
constexpr int kCacheFwd = 8;  // 128-bit vectors per thread kept in registers (forward; a
                              // 4-vector variant serves the common rows with fewer registers)
constexpr int kCacheBwd = 4;  // backward (it also holds dy and the accumulators)

struct RowPlan {
  int threads;     // block size, a multiple of 32
  int per_thread;  // vectors per thread
};

inline RowPlan plan_row(int64_t nvec, int target) {
  int64_t t = (nvec + target - 1) / target;
  t = t < 32 ? 32 : (t > kMaxThreads ? kMaxThreads : round_up(t, 32));
  return {static_cast<int>(t), static_cast<int>((nvec + t - 1) / t)};
}

// True when every pointer allows 128-bit access and a row is a whole number of vectors of T.
template <typename T, typename... Ptrs>
bool vector_path(int64_t h, const Ptrs*... ptrs) {
  return h % (16 / sizeof(T)) == 0 && (aligned16(ptrs) && ...);
}

// Loads vector v of a row (VEC elements) as floats.
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* row, int64_t v, float (&out)[VEC]) {
  load_f32<T, VEC>(row + v * VEC, out);
}

// f(k, v) for this thread's vectors v of a row; with CACHE > 0 the loop is unrolled so that k
// (the register-cache slot) is a compile-time index and the cache never spills to local memory.
template <int CACHE, typename F>
__device__ __forceinline__ void for_each_vec_of(int64_t nvec, int tid, int threads, F&& f) {
  if constexpr (CACHE > 0) {
#pragma unroll
    for (int k = 0; k < CACHE; ++k) {
      const int64_t v = tid + int64_t(k) * threads;
      if (v < nvec) f(k, v);
    }
  } else {
    for (int64_t v = tid; v < nvec; v += threads) f(0, v);
  }
}

// The same for a whole block working on one row.
template <int CACHE, typename F>
__device__ __forceinline__ void for_each_vec(int64_t nvec, F&& f) {
  for_each_vec_of<CACHE>(nvec, threadIdx.x, blockDim.x, static_cast<F&&>(f));
}

// Sum over each group of `group` consecutive threads (a multiple of 32 dividing blockDim.x);
// every thread gets its group's sum. Every thread of the block must call it. `shared`: 32 floats.
__device__ __forceinline__ float group_sum(float v, float* shared, int group) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = group >> 5;
  v = warp_sum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int first = warp / warps * warps;
  float sum = 0.0f;
  for (int w = 0; w < warps; ++w) sum += shared[first + w];
  __syncthreads();
  return sum;
}

// Floats of shared memory store_group_accumulators needs for NA accumulator rows: NA vectors of
// <= 8 per thread of a group of <= 256 threads (G > 1 needs group <= kMaxThreads / 2).
template <int NA>
constexpr int kStageFloats = kMaxThreads / 2 * NA * 8;

// Backward, cached path: the register accumulators acc[n][k][.] (accumulator row n, cache slot k)
// of groups 1 .. G-1 are added to group 0's one slot at a time, in a fixed order, through
// `stage`; group 0 then writes the block's partial rows part[n * h + column]. Every thread of the
// block must call it.
template <int NA, int CACHE, int VEC>
__device__ __forceinline__ void store_group_accumulators(float (&acc)[NA][CACHE][VEC], float* stage, float* part,
                                                         int64_t h, int64_t nvec, int tid, int g, int groups,
                                                         int group) {
#pragma unroll
  for (int k = 0; k < CACHE; ++k) {
    const int64_t v = tid + int64_t(k) * group;
    for (int src = 1; src < groups; ++src) {
      if (g == src && v < nvec) {
#pragma unroll
        for (int n = 0; n < NA; ++n)
#pragma unroll
          for (int i = 0; i < VEC; ++i) stage[(tid * NA + n) * VEC + i] = acc[n][k][i];
      }
      __syncthreads();
      if (g == 0 && v < nvec) {
#pragma unroll
        for (int n = 0; n < NA; ++n)
#pragma unroll
          for (int i = 0; i < VEC; ++i) acc[n][k][i] += stage[(tid * NA + n) * VEC + i];
      }
      __syncthreads();
    }
    if (g == 0 && v < nvec) {
#pragma unroll
      for (int n = 0; n < NA; ++n)
#pragma unroll
        for (int i = 0; i < VEC; ++i) part[n * h + v * VEC + i] = acc[n][k][i];
    }
  }
}

struct BwdPlan {
  RowPlan row;  // threads per row (the group) and vectors per thread
  bool vector, cached;
  int groups;      // rows in flight per block (cached path only; else 1)
  int64_t blocks;  // = partial rows
};

// 1024 threads per SM (half occupancy, as many rows in flight as the forward's) in blocks of up to
// 512 threads: about 2 blocks, hence 2 partial rows, per SM.
inline BwdPlan plan_bwd(int64_t rows, int64_t h, int vec, bool vector) {
  BwdPlan p;
  p.vector = vector;
  p.row = plan_row(vector ? h / vec : h, kCacheBwd);
  p.cached = vector && p.row.per_thread <= kCacheBwd;
  p.groups = p.cached && p.row.threads <= kMaxThreads / 2 ? kMaxThreads / p.row.threads : 1;
  const int64_t threads = int64_t(p.row.threads) * p.groups;
  const int64_t wanted = (rows + p.groups - 1) / p.groups;
  p.blocks = int64_t(sm_count()) * 1024 / threads;
  p.blocks = p.blocks < wanted ? p.blocks : wanted;
  p.blocks = p.blocks > 0 ? p.blocks : 1;
  return p;
}

// Partial rows the backward may need for any pointer alignment (the binding sizes its scratch
// before it knows which path runs): the larger of the vector and the scalar plans' block counts.
inline int64_t bwd_partial_rows(int64_t rows, int64_t h, DType dtype) {
  const int vec = dtype == DType::kF32 ? 4 : 8;
  const int64_t a = plan_bwd(rows, h, vec, true).blocks, b = plan_bwd(rows, h, 1, false).blocks;
  return a > b ? a : b;
}

}  // namespace
}  // namespace cuda
}  // namespace msp

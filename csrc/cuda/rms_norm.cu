// RMSNorm over the last dimension on CUDA: fp32 statistics, fp32/bf16/fp16 in and out, weight in
// the activation dtype or fp32. The same design as layer_norm.cu (building blocks: row_norm.cuh)
// with one statistic instead of two and no bias.
//
// Forward: one block of up to 512 threads per row; each thread loads its 128-bit vectors of the
// row once into registers (up to kCacheFwd vectors), so the sum of squares and the normalisation
// read x once; one warp-shuffle + shared-memory block reduction. Memory traffic is the compulsory
// read x, write y (+ 4 bytes of rstd per row). Rows too long for the register cache re-read x
// (L1/L2 hits); rows whose width or pointers do not allow 128-bit access run a scalar variant.
// Backward: a persistent grid of blocks walks the rows, several rows at a time per block when rows
// are narrow; per row one group sum gives
//   c = mean(dy*w*xhat),  xhat = x*rstd,  dx = rstd * (dy*w - xhat*c),
// and each thread accumulates dw += dy*xhat for its own columns in registers, written once as the
// block's partial row (about two per SM); column_sum adds the partials (this rank's partial sum;
// under sequence parallelism the model then sums it over the TP group).
#include "rms_norm.h"
#include "row_norm.cuh"

namespace msp {
namespace cuda {
namespace {

template <typename T, typename W, int VEC, int CACHE>
__global__ void __launch_bounds__(kMaxThreads)
    rms_fwd_kernel(const T* __restrict__ x, const W* __restrict__ w, T* __restrict__ y, float* __restrict__ rstd,
                   int64_t h, float eps) {
  __shared__ float shared[32];
  const int64_t nvec = h / VEC, row = blockIdx.x;
  const T* xr = x + row * h;
  T* yr = y + row * h;
  Pack<T, VEC> cache[CACHE > 0 ? CACHE : 1];  // raw: 4 registers per 128-bit vector
  auto row_vec = [&](int k, int64_t v, float(&xv)[VEC]) {
    if constexpr (CACHE > 0) {
      pack_to_f32(cache[k], xv);
    } else {
      load_vec<T, VEC>(xr, v, xv);
    }
  };
  if constexpr (CACHE > 0)  // issue every load of the row before any math
    for_each_vec<CACHE>(nvec, [&](int k, int64_t v) { cache[k] = load_pack<T, VEC>(xr + v * VEC); });
  float sq = 0.0f;
  for_each_vec<CACHE>(nvec, [&](int k, int64_t v) {
    float xv[VEC];
    row_vec(k, v, xv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) sq += xv[i] * xv[i];
  });
  const float rs = rsqrtf(block_sum(sq, shared) / static_cast<float>(h) + eps);
  for_each_vec<CACHE>(nvec, [&](int k, int64_t v) {
    float xv[VEC], wv[VEC];
    row_vec(k, v, xv);
    load_vec<W, VEC>(w, v, wv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) xv[i] = xv[i] * rs * wv[i];
    store_f32<T, VEC>(yr + v * VEC, xv);
  });
  if (threadIdx.x == 0) rstd[row] = rs;
}

// Backward. A block holds G groups of `group` threads; each group works on its own row (rows
// blockIdx.x * G + g, stepping by gridDim.x * G). A thread's dw accumulators live in registers
// (CACHE > 0; the G groups' are added in a fixed order through shared memory at the end) or, with
// G = 1, in the block's partial row pw (CACHE == 0; the same thread owns a column on every row,
// so no race).
template <typename T, typename W, int VEC, int CACHE>
__global__ void __launch_bounds__(kMaxThreads)
    rms_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ w,
                   const float* __restrict__ rstd, T* __restrict__ dx, float* __restrict__ partial, int64_t rows,
                   int64_t h, int group) {
  __shared__ float shared[32];
  __shared__ float stage[kStageFloats<1>];
  constexpr int A = CACHE > 0 ? CACHE : 1;
  const int64_t nvec = h / VEC;
  const int groups = blockDim.x / group, g = threadIdx.x / group, tid = threadIdx.x % group;
  float* pw = partial + int64_t(blockIdx.x) * h;
  float acc[1][A][VEC];  // [weight][cache slot][element]
#pragma unroll
  for (int k = 0; k < A; ++k)
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[0][k][i] = 0.0f;
  if constexpr (CACHE == 0) {  // groups == 1
    for_each_vec_of<0>(nvec, tid, group, [&](int, int64_t v) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) pw[v * VEC + i] = 0.0f;
    });
  }
  const float inv_h = 1.0f / static_cast<float>(h);
  // The loop bound is the same for the whole block (the group sum is a block barrier).
  for (int64_t base = int64_t(blockIdx.x) * groups; base < rows; base += int64_t(gridDim.x) * groups) {
    const int64_t row = base + g;
    const bool valid = row < rows;
    const T* dyr = dy + (valid ? row : 0) * h;
    const T* xr = x + (valid ? row : 0) * h;
    const float rs = valid ? rstd[row] : 0.0f;
    float s = 0.0f;
    if (valid) {
      for_each_vec_of<CACHE>(nvec, tid, group, [&](int k, int64_t v) {
        float gv[VEC], xv[VEC], wv[VEC];
        load_vec<T, VEC>(dyr, v, gv);
        load_vec<T, VEC>(xr, v, xv);
        load_vec<W, VEC>(w, v, wv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float xhat = xv[i] * rs;
          s += gv[i] * wv[i] * xhat;
          if constexpr (CACHE > 0) {
            acc[0][k][i] += gv[i] * xhat;
          } else {
            pw[v * VEC + i] += gv[i] * xhat;
          }
        }
      });
    }
    const float c = group_sum(s, shared, group) * inv_h;
    if (valid) {
      for_each_vec_of<CACHE>(nvec, tid, group, [&](int, int64_t v) {
        float gv[VEC], xv[VEC], wv[VEC];
        load_vec<T, VEC>(dyr, v, gv);  // second read of the row: L1/L2 hits
        load_vec<T, VEC>(xr, v, xv);
        load_vec<W, VEC>(w, v, wv);
#pragma unroll
        for (int i = 0; i < VEC; ++i) gv[i] = rs * (gv[i] * wv[i] - xv[i] * rs * c);
        store_f32<T, VEC>(dx + row * h + v * VEC, gv);
      });
    }
  }
  if constexpr (CACHE > 0) store_group_accumulators<1, CACHE, VEC>(acc, stage, pw, h, nvec, tid, g, groups, group);
}

template <typename T, typename W>
cudaError_t launch_fwd(const RmsNormFwd& a, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  const T* x = static_cast<const T*>(a.x);
  const W* w = static_cast<const W*>(a.weight);
  T* y = static_cast<T*>(a.y);
  const dim3 grid(static_cast<unsigned>(a.rows));
  if (vector_path<T>(a.h, x, w, y)) {
    RowPlan p = plan_row(a.h / VEC, 4);
    if (p.per_thread <= 4)
      rms_fwd_kernel<T, W, VEC, 4><<<grid, p.threads, 0, stream>>>(x, w, y, a.rstd, a.h, a.eps);
    else if (p.per_thread <= kCacheFwd)
      rms_fwd_kernel<T, W, VEC, kCacheFwd><<<grid, p.threads, 0, stream>>>(x, w, y, a.rstd, a.h, a.eps);
    else
      rms_fwd_kernel<T, W, VEC, 0><<<grid, p.threads, 0, stream>>>(x, w, y, a.rstd, a.h, a.eps);
  } else {
    RowPlan p = plan_row(a.h, 4);
    rms_fwd_kernel<T, W, 1, 0><<<grid, p.threads, 0, stream>>>(x, w, y, a.rstd, a.h, a.eps);
  }
  return cudaGetLastError();
}

template <typename T, typename W>
cudaError_t launch_bwd(const RmsNormBwd& a, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  const T* dy = static_cast<const T*>(a.grad);
  const T* x = static_cast<const T*>(a.x);
  const W* w = static_cast<const W*>(a.weight);
  T* dx = static_cast<T*>(a.grad_x);
  const BwdPlan p = plan_bwd(a.rows, a.h, VEC, vector_path<T>(a.h, dy, x, w, dx));
  const dim3 grid(static_cast<unsigned>(p.blocks));
  const int group = p.row.threads, threads = group * p.groups;
  if (p.cached)
    rms_bwd_kernel<T, W, VEC, kCacheBwd>
        <<<grid, threads, 0, stream>>>(dy, x, w, a.rstd, dx, a.scratch, a.rows, a.h, group);
  else if (p.vector)
    rms_bwd_kernel<T, W, VEC, 0><<<grid, threads, 0, stream>>>(dy, x, w, a.rstd, dx, a.scratch, a.rows, a.h, group);
  else
    rms_bwd_kernel<T, W, 1, 0><<<grid, threads, 0, stream>>>(dy, x, w, a.rstd, dx, a.scratch, a.rows, a.h, group);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return column_sum(a.scratch, p.blocks, a.h, a.grad_weight, stream);
}

}  // namespace

int64_t rms_norm_bwd_scratch(int64_t rows, int64_t h, DType dtype) { return bwd_partial_rows(rows, h, dtype) * h; }

cudaError_t rms_norm_fwd(const RmsNormFwd& a, cudaStream_t stream) {
  if (a.h <= 0 || a.rows < 0 || a.rows > int64_t(0x7FFFFFFF)) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaSuccess;
  MSP_DISPATCH_DTYPE(a.dtype, T, MSP_DISPATCH_PARAM(a.weight_dtype, T, W, return launch_fwd<T, W>(a, stream)));
  return cudaErrorInvalidValue;
}

cudaError_t rms_norm_bwd(const RmsNormBwd& a, cudaStream_t stream) {
  if (a.h <= 0 || a.rows < 0) return cudaErrorInvalidValue;
  if (a.rows == 0) return cudaMemsetAsync(a.grad_weight, 0, a.h * sizeof(float), stream);
  MSP_DISPATCH_DTYPE(a.dtype, T, MSP_DISPATCH_PARAM(a.weight_dtype, T, W, return launch_bwd<T, W>(a, stream)));
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace msp

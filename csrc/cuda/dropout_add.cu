// dropout_add on CUDA: out = [residual +] dropout(x [+ y]) with the Philox dropout of philox.h (bit-identical
// masks to megatron_sp/ops/philox.py), bit for bit the CPU op (csrc/dropout_add.cpp): the embedding's
// dropout(word + position embeddings) and the layers' residual + dropout(out + bias).
//
// Design: the [s, b, h] slab is rows x h with rows = s*b (row r is token r / b, sample r % b).
// Threads tile (column vector, row): threadIdx.x walks 128-bit column vectors, the y dimension
// grid-strides over rows, so a thread keeps its bias vector in registers and only one 32-bit
// division per row-iteration is needed. With VEC = 16 bytes / sizeof(T), a fp32 vector is exactly
// one Philox group (4 features) and a bf16/fp16 vector two. Per element, in fp32:
//     v = x;  v = round_T(v + addend);  v = v + bias;  v = (v * keep) * scale;  v = residual + v;  round_O(v)
// (each step only when its input is given). Memory traffic is the compulsory read of x and of the given
// addend and residual, and the write of out; the mask never touches memory. The backward draws the same
// words again, writes grad_x = (grad * scale) * keep (the reference's rounding order), and, for a bias
// gradient, sums grad_x over its rows into one partial row per block row (see da_bwd_kernel); column_sum
// finishes the bias gradient. The uses' inputs (an addend, or a bias and a residual) are uniform branches.
// Fallback (h or feature_offset not a multiple of the vector, unaligned pointers): VEC = 1.
// Dtypes: x, bias and addend in T; residual and out in O = T or fp32 (an fp32 residual stream); the backward
// reads grad in G and writes grad_x in D (D = G, or G = fp32 and D the activations' type).
#include "../philox.h"
#include "common.cuh"
#include "dropout_add.h"
#include "dropout_rows.cuh"

namespace msp {
namespace cuda {
namespace {

template <typename T, typename O, int VEC, bool GROUPED>
__global__ void __launch_bounds__(kThreads)
    da_fwd_kernel(const T* __restrict__ x, const T* __restrict__ bias, const T* __restrict__ addend,
                  const O* __restrict__ res, O* __restrict__ out, Rows rows_index, uint32_t rows, int64_t h,
                  DropoutParams d) {
  const int64_t j0 = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * VEC;
  if (j0 >= h) return;
  float bv[VEC] = {};
  if (bias != nullptr) load_f32(bias + j0, bv);
  for (uint32_t row = blockIdx.y * blockDim.y + threadIdx.y; row < rows; row += gridDim.y * blockDim.y) {
    int64_t position, sample;
    rows_index.at(row, position, sample);
    const int64_t off = int64_t(row) * h + j0;
    float v[VEC], keep[VEC];
    load_f32(x + off, v);
    if (addend != nullptr) {
      float av[VEC];
      load_f32(addend + off, av);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = to_f32(from_f32<T>(__fadd_rn(v[i], av[i])));
    }
    if (bias != nullptr) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = __fadd_rn(v[i], bv[i]);
    }
    draw_keep<VEC, GROUPED>(d, j0, position, sample, keep);
#pragma unroll
    for (int i = 0; i < VEC; ++i) v[i] = __fmul_rn(__fmul_rn(v[i], keep[i]), d.scale);
    if (res != nullptr) {
      float rv[VEC];
      load_f32(res + off, rv);
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[i] = __fadd_rn(rv[i], v[i]);
    }
    store_f32(out + off, v);
  }
}

// Backward: blocks of 32 column vectors x 8 row slots. Each thread walks its rows (grid-stride),
// writes grad_x and accumulates its columns in registers; the 8 row slots of a block are then added
// in a fixed order through shared memory, so the bias-gradient partials are one fp32 row per block
// row (gridDim.y rows, about one per resident block), not one per row slot.
constexpr int kBwdCols = 32, kBwdRows = kThreads / kBwdCols;

template <typename G, typename D, int VEC, bool GROUPED>
__global__ void __launch_bounds__(kThreads)
    da_bwd_kernel(const G* __restrict__ grad, D* __restrict__ grad_x, float* __restrict__ partial, Rows rows_index,
                  uint32_t rows, int64_t h, DropoutParams d) {
  __shared__ float slots[kBwdRows][kBwdCols * VEC];
  const int64_t j0 = (blockIdx.x * int64_t(kBwdCols) + threadIdx.x) * VEC;
  const bool active = j0 < h;  // no early return: every thread reaches the barrier below
  float acc[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
  if (active) {
    for (uint32_t row = blockIdx.y * kBwdRows + threadIdx.y; row < rows; row += gridDim.y * kBwdRows) {
      int64_t position, sample;
      rows_index.at(row, position, sample);
      const int64_t off = int64_t(row) * h + j0;
      float gv[VEC], keep[VEC];
      load_f32(grad + off, gv);
      draw_keep<VEC, GROUPED>(d, j0, position, sample, keep);
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        gv[i] = __fmul_rn(__fmul_rn(gv[i], d.scale), keep[i]);
        acc[i] += gv[i];
      }
      store_f32(grad_x + off, gv);
    }
  }
  if (partial == nullptr) return;  // uniform across the block
#pragma unroll
  for (int i = 0; i < VEC; ++i) slots[threadIdx.y][threadIdx.x * VEC + i] = acc[i];
  __syncthreads();
  if (threadIdx.y == 0 && active) {
#pragma unroll
    for (int y = 1; y < kBwdRows; ++y)
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += slots[y][threadIdx.x * VEC + i];
#pragma unroll
    for (int i = 0; i < VEC; ++i) partial[int64_t(blockIdx.y) * h + j0 + i] = acc[i];
  }
}

// Backward: kBwdCols x kBwdRows threads; block rows: one wave of resident blocks over the column
// blocks (each block row costs one partial row of h floats).
Launch bwd_launch(int64_t rows, int64_t h, int vec) {
  const int64_t nvec = (h + vec - 1) / vec;
  const int64_t gx = (nvec + kBwdCols - 1) / kBwdCols;
  int64_t gy = (rows + kBwdRows - 1) / kBwdRows;
  const int64_t budget = int64_t(sm_count()) * (2048 / kThreads);
  const int64_t per_column = (budget + gx - 1) / gx;
  gy = gy < per_column ? gy : per_column;
  gy = gy < 65535 ? (gy > 0 ? gy : 1) : 65535;
  return {dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), dim3(kBwdCols, kBwdRows)};
}

template <typename T, typename O>
cudaError_t launch_fwd(const DropoutAddFwd& a, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  const Rows idx{a.positions, a.samples, static_cast<uint32_t>(a.b)};
  const uint32_t rows = static_cast<uint32_t>(a.s * a.b);
  const T *x = static_cast<const T*>(a.x), *bias = static_cast<const T*>(a.bias);
  const T* addend = static_cast<const T*>(a.addend);
  const O* res = static_cast<const O*>(a.residual);
  O* out = static_cast<O*>(a.out);
  if (grouped_path<T>(a.drop, a.h, x, out, res, bias) && aligned16(addend)) {  // nullptr counts as aligned
    Launch l = row_launch(rows, a.h, VEC, 4);
    da_fwd_kernel<T, O, VEC, true><<<l.grid, l.block, 0, stream>>>(x, bias, addend, res, out, idx, rows, a.h, a.drop);
  } else {
    Launch l = row_launch(rows, a.h, 1, 4);
    da_fwd_kernel<T, O, 1, false><<<l.grid, l.block, 0, stream>>>(x, bias, addend, res, out, idx, rows, a.h, a.drop);
  }
  return cudaGetLastError();
}

template <typename G, typename D>
cudaError_t launch_bwd(const DropoutAddBwd& a, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(G);
  const Rows idx{a.positions, a.samples, static_cast<uint32_t>(a.b)};
  const uint32_t rows = static_cast<uint32_t>(a.s * a.b);
  const G* grad = static_cast<const G*>(a.grad);
  D* grad_x = static_cast<D*>(a.grad_x);
  float* partial = a.grad_bias != nullptr ? a.scratch : nullptr;
  const bool grouped = grouped_path<G>(a.drop, a.h, grad, grad_x, nullptr, nullptr);
  Launch l = bwd_launch(rows, a.h, grouped ? VEC : 1);
  if (grouped) {
    da_bwd_kernel<G, D, VEC, true><<<l.grid, l.block, 0, stream>>>(grad, grad_x, partial, idx, rows, a.h, a.drop);
  } else {
    da_bwd_kernel<G, D, 1, false><<<l.grid, l.block, 0, stream>>>(grad, grad_x, partial, idx, rows, a.h, a.drop);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || partial == nullptr) return err;
  return column_sum(partial, l.grid.y, a.h, a.grad_bias, stream);
}

}  // namespace

int64_t dropout_add_bwd_scratch(int64_t s, int64_t b, int64_t h, DType dtype) {
  const int vec = dtype == DType::kF32 ? 4 : 8;  // (grad's dtype) the vector path, or the scalar fallback
  const int64_t rows_vec = bwd_launch(s * b, h, vec).grid.y, rows_1 = bwd_launch(s * b, h, 1).grid.y;
  return (rows_vec > rows_1 ? rows_vec : rows_1) * h;
}

cudaError_t dropout_add_fwd(const DropoutAddFwd& a, cudaStream_t stream) {
  if (a.s * a.b == 0 || a.h == 0) return cudaSuccess;
  if (a.s * a.b >= (int64_t(1) << 31)) return cudaErrorInvalidValue;  // 32-bit row loop
  MSP_DISPATCH_DTYPE(a.dtype, T, MSP_DISPATCH_WIDE(a.out_dtype, T, O, return launch_fwd<T, O>(a, stream)));
  return cudaErrorInvalidValue;
}

cudaError_t dropout_add_bwd(const DropoutAddBwd& a, cudaStream_t stream) {
  if (a.h == 0) return cudaSuccess;
  if (a.s * a.b == 0) return a.grad_bias ? cudaMemsetAsync(a.grad_bias, 0, a.h * 4, stream) : cudaSuccess;
  if (a.s * a.b >= (int64_t(1) << 31)) return cudaErrorInvalidValue;  // 32-bit row loop
  MSP_DISPATCH_DTYPE(a.grad_x_dtype, D, MSP_DISPATCH_WIDE(a.dtype, D, G, return launch_bwd<G, D>(a, stream)));
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace msp

// embedding_dropout on CUDA: out = dropout(x + y) (word plus position embeddings) with the Philox dropout
// of philox.h, bit-identical to the reference (megatron_sp/ops/embedding_dropout.py) and the CPU op.
//
// Design: elementwise, as bias_dropout_add's forward (dropout_rows.cuh): threadIdx.x walks 128-bit column
// vectors of x, the y dimension grid-strides over the s*b rows; a vector of VEC = 16 / sizeof(T) features
// is VEC / 4 Philox groups. Per element the reference's two roundings:
//     sum = round_T(x + y),  out = round_O(sum * keep * scale)       (O: x's type T, or fp32)
// and the backward grad_x = round_D(round_G(grad * scale) * keep) (G: out's type, D: x's). Memory traffic
// is the compulsory read x (and y), write out; the mask never touches memory.
// Fallback (h or feature_offset not a multiple of the vector, unaligned pointers): VEC = 1.
#include "common.cuh"
#include "dropout_rows.cuh"
#include "embedding_dropout.h"

namespace msp {
namespace cuda {
namespace {

template <typename T, typename O, int VEC, bool GROUPED>
__global__ void __launch_bounds__(kThreads)
    emb_fwd_kernel(const T* __restrict__ x, const T* __restrict__ y, O* __restrict__ out, Rows rows_index,
                   uint32_t rows, int64_t h, DropoutParams d) {
  const int64_t j0 = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * VEC;
  if (j0 >= h) return;
  for (uint32_t row = blockIdx.y * blockDim.y + threadIdx.y; row < rows; row += gridDim.y * blockDim.y) {
    int64_t position, sample;
    rows_index.at(row, position, sample);
    const int64_t off = int64_t(row) * h + j0;
    float xv[VEC], keep[VEC], ov[VEC];
    load_f32(x + off, xv);
    if (y != nullptr) {
      float yv[VEC];
      load_f32(y + off, yv);
#pragma unroll
      for (int i = 0; i < VEC; ++i) xv[i] = to_f32(from_f32<T>(__fadd_rn(xv[i], yv[i])));
    }
    draw_keep<VEC, GROUPED>(d, j0, position, sample, keep);
#pragma unroll
    for (int i = 0; i < VEC; ++i) ov[i] = __fmul_rn(__fmul_rn(xv[i], keep[i]), d.scale);
    store_f32(out + off, ov);
  }
}

template <typename G, typename D, int VEC, bool GROUPED>
__global__ void __launch_bounds__(kThreads) emb_bwd_kernel(const G* __restrict__ grad, D* __restrict__ grad_x,
                                                           Rows rows_index, uint32_t rows, int64_t h, DropoutParams d) {
  const int64_t j0 = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * VEC;
  if (j0 >= h) return;
  for (uint32_t row = blockIdx.y * blockDim.y + threadIdx.y; row < rows; row += gridDim.y * blockDim.y) {
    int64_t position, sample;
    rows_index.at(row, position, sample);
    const int64_t off = int64_t(row) * h + j0;
    float gv[VEC], keep[VEC];
    load_f32(grad + off, gv);
    draw_keep<VEC, GROUPED>(d, j0, position, sample, keep);
#pragma unroll
    for (int i = 0; i < VEC; ++i) gv[i] = __fmul_rn(to_f32(from_f32<G>(__fmul_rn(gv[i], d.scale))), keep[i]);
    store_f32(grad_x + off, gv);
  }
}

template <typename T, typename O>
cudaError_t launch_fwd(const EmbeddingDropoutFwd& a, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(T);
  const Rows idx{a.positions, a.samples, static_cast<uint32_t>(a.b)};
  const uint32_t rows = static_cast<uint32_t>(a.s * a.b);
  const T* x = static_cast<const T*>(a.x);
  const T* y = static_cast<const T*>(a.y);
  O* out = static_cast<O*>(a.out);
  if (grouped_path<T>(a.drop, a.h, x, out, x, y)) {
    Launch l = row_launch(rows, a.h, VEC, 4);
    emb_fwd_kernel<T, O, VEC, true><<<l.grid, l.block, 0, stream>>>(x, y, out, idx, rows, a.h, a.drop);
  } else {
    Launch l = row_launch(rows, a.h, 1, 4);
    emb_fwd_kernel<T, O, 1, false><<<l.grid, l.block, 0, stream>>>(x, y, out, idx, rows, a.h, a.drop);
  }
  return cudaGetLastError();
}

template <typename G, typename D>
cudaError_t launch_bwd(const EmbeddingDropoutBwd& a, cudaStream_t stream) {
  constexpr int VEC = 16 / sizeof(D);
  const Rows idx{a.positions, a.samples, static_cast<uint32_t>(a.b)};
  const uint32_t rows = static_cast<uint32_t>(a.s * a.b);
  const G* grad = static_cast<const G*>(a.grad);
  D* grad_x = static_cast<D*>(a.grad_x);
  if (grouped_path<D>(a.drop, a.h, grad, grad_x, grad, nullptr)) {
    Launch l = row_launch(rows, a.h, VEC, 4);
    emb_bwd_kernel<G, D, VEC, true><<<l.grid, l.block, 0, stream>>>(grad, grad_x, idx, rows, a.h, a.drop);
  } else {
    Launch l = row_launch(rows, a.h, 1, 4);
    emb_bwd_kernel<G, D, 1, false><<<l.grid, l.block, 0, stream>>>(grad, grad_x, idx, rows, a.h, a.drop);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t embedding_dropout_fwd(const EmbeddingDropoutFwd& a, cudaStream_t stream) {
  if (a.s * a.b == 0 || a.h == 0) return cudaSuccess;
  if (a.s * a.b >= (int64_t(1) << 31)) return cudaErrorInvalidValue;  // 32-bit row loop
  MSP_DISPATCH_DTYPE(a.dtype, T, MSP_DISPATCH_WIDE(a.out_dtype, T, O, return launch_fwd<T, O>(a, stream)));
  return cudaErrorInvalidValue;
}

cudaError_t embedding_dropout_bwd(const EmbeddingDropoutBwd& a, cudaStream_t stream) {
  if (a.s * a.b == 0 || a.h == 0) return cudaSuccess;
  if (a.s * a.b >= (int64_t(1) << 31)) return cudaErrorInvalidValue;  // 32-bit row loop
  MSP_DISPATCH_DTYPE(a.grad_x_dtype, D, MSP_DISPATCH_WIDE(a.dtype, D, G, return launch_bwd<G, D>(a, stream)));
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace msp

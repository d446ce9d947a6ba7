// What the tensor-core flash_attention kernels (flash_attention_fwd_mma.cu, _bwd_mma.cu) share:
// shared-memory tiles (16-bit rows padded by 16 bytes, loaded by cp.async or element by element),
// the ldmatrix addresses of the fragments, and the dropout words of an accumulator fragment.
//
// A 64-row tile of q, k, v, dO is [64][kD + 8] elements in shared memory (kD: the head dim rounded up
// to 64 or 128, zero-filled past d and past the last row): the 16 bytes of padding put the 8 rows an
// ldmatrix reads in distinct banks. Rows move by cp.async (16 bytes) when the tensor's rows are
// 16-byte aligned with unit column stride and d % 8 == 0, else by plain loads (strided head dims,
// misaligned views).
#pragma once

#include "flash_attention.cuh"
#include "warp_mma.cuh"

namespace msp {
namespace cuda {
namespace flash {

constexpr int kMmaWarps = 4, kMmaThreads = 32 * kMmaWarps;

template <int kD>
struct Pitch {
  static constexpr int value = kD + 8;  // elements per shared row
};

// Rows row0 .. row0 + kRows - 1 of one (sample, head) slice of a [b, n, s, d] tensor (base: its row
// 0) into tile [kRows][kD + 8]; rows >= n_rows and columns >= d are zero. vec: cp.async (complete at
// the caller's cp_async_wait), else synchronous loads.
template <typename T, int kRows, int kD>
__device__ __forceinline__ void load_tile(T* tile, const T* base, int64_t row_stride, int64_t col_stride, int64_t row0,
                                          int64_t n_rows, int d, bool vec) {
  constexpr int kPitch = Pitch<kD>::value, kChunks = kD / 8;
  if (vec) {
    for (int c = threadIdx.x; c < kRows * kChunks; c += kMmaThreads) {
      const int r = c / kChunks, ch = c % kChunks;
      const bool valid = row0 + r < n_rows && ch * 8 < d;
      cp_async_16(tile + r * kPitch + ch * 8, valid ? base + (row0 + r) * row_stride + ch * 8 : base, valid);
    }
  } else {
    for (int e = threadIdx.x; e < kRows * kD; e += kMmaThreads) {
      const int r = e / kD, c = e % kD;
      const bool valid = row0 + r < n_rows && c < d;
      tile[r * kPitch + c] = valid ? base[(row0 + r) * row_stride + c * col_stride] : from_f32<T>(0.0f);
    }
  }
}

// dst[j] = src[i0 + j] for i0 + j < n, else 0 (kBytes 4 or 8 per element), by cp.async.
template <int kBytes, int kN, typename E>
__device__ __forceinline__ void load_vector(E* dst, const E* src, int64_t i0, int64_t n) {
  for (int j = threadIdx.x; j < kN; j += kMmaThreads) {
    const bool valid = i0 + j < n;
    cp_async_small<kBytes>(dst + j, valid ? src + i0 + j : src, valid);
  }
}

// The tile's rows as an [s, b, n, d] slice: the vector path's conditions.
inline bool rows_vectorizable(const void* base, const FlashStrides& st, int64_t d) {
  return aligned16(base) && st.d == 1 && d % 8 == 0 && st.s % 8 == 0 && st.n % 8 == 0 && st.b % 8 == 0;
}

// ldmatrix.x4 row address of lane `lane` for a 16 x 16 A operand at (row0, col0) of a row-major tile
// (a[0..3] = rows 0-7 / 8-15 x columns 0-7 / 8-15, the mma's A order).
template <typename T>
__device__ __forceinline__ const T* a_rows(const T* tile, int pitch, int row0, int col0, int lane) {
  return tile + (row0 + (lane % 16)) * pitch + col0 + (lane / 16) * 8;
}

// ... for the B operands of two n8 tiles from a tile stored [n][k] (K for Q K^T): r[0..1] = n-tile
// n0, r[2..3] = n-tile n0 + 8, each (k 0-7, k 8-15).
template <typename T>
__device__ __forceinline__ const T* b_rows_nk(const T* tile, int pitch, int n0, int k0, int lane) {
  return tile + (n0 + (lane / 16) * 8 + lane % 8) * pitch + k0 + ((lane / 8) % 2) * 8;
}

// ... for the B operands of two n8 tiles from a tile stored [k][n] (V for P V; ldmatrix .trans).
template <typename T>
__device__ __forceinline__ const T* b_rows_kn(const T* tile, int pitch, int k0, int n0, int lane) {
  return tile + (k0 + ((lane / 8) % 2) * 8 + lane % 8) * pitch + n0 + (lane / 16) * 8;
}

// ... for a 16 x 16 A operand (m, k) from a tile stored [k][m] (dS^T for dS K; ldmatrix .trans).
template <typename T>
__device__ __forceinline__ const T* a_rows_km(const T* tile, int pitch, int m0, int k0, int lane) {
  return tile + (k0 + (lane / 16) * 8 + lane % 8) * pitch + m0 + ((lane / 8) % 2) * 8;
}

// The four accumulator elements of one m16n8 tile as the A registers' halves: S (C layout) ->
// P (A layout) of the next product, two n8 tiles per 16-wide k step.
template <typename T>
__device__ __forceinline__ void to_a_fragment(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack2<T>(lo[0], lo[1]);
  a[1] = pack2<T>(lo[2], lo[3]);
  a[2] = pack2<T>(hi[0], hi[1]);
  a[3] = pack2<T>(hi[2], hi[3]);
}

__device__ __forceinline__ uint32_t pick(const Words4& w, int i) {
  return i == 0 ? w.w[0] : i == 1 ? w.w[1] : i == 2 ? w.w[2] : w.w[3];
}

// Dropout multiplier of one element: 1 / (1 - p) or 0.
__device__ __forceinline__ float keep_scale(const DropoutParams& d, uint32_t word) {
  return word >= d.threshold ? d.scale : 0.0f;
}

}  // namespace flash
}  // namespace cuda
}  // namespace msp

// Building blocks of the CPU blockwise attention (flash_attention.cpp): one 64 x 64 block pair
// at a time, in fp32 buffers that the caller packs from the strided inputs.
//
// Design: every block product is a small GEMM C (+)= op(A) * B with B row-major and its columns
// contiguous (a packed K^T, V, dO, Q or K block), computed as outer products over 4 x 16 register
// tiles: one broadcast of A against a 16-float vector row of B per step, the accumulators never
// leave the registers (8 ymm / 4 zmm; the compiler vectorises the fixed-size loops for each of the
// AVX-512 / AVX2 / baseline variants, cpu_simd.h). Packed blocks are zero-padded to 64 rows and to
// a multiple of 16 columns, so the tiles have no tails. exp is a Cephes-style polynomial (~1 ulp,
// exact 0 below -87, vectorisable, unlike libm's expf). These functions need no bit-exactness with
// the reference (the attention tests compare within tolerances), so this header (and the kernel
// files) let the compiler fuse multiply-adds (the rest of the extension is built with
// -ffp-contract=off) and assume no FP traps: under -ftrapping-math GCC keeps every select that
// guards an FP operation (the clamps of exp, the masks) as a branch, and the loops stay scalar.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_simd.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast", "no-trapping-math")

namespace msp {
namespace flash {

constexpr int64_t kBlock = 64;  // query and key rows per block
constexpr int64_t kTileRows = 4, kTileCols = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t padded_cols(int64_t d) { return (d + kTileCols - 1) / kTileCols * kTileCols; }
inline int64_t padded_rows(int64_t rows) { return (rows + kTileRows - 1) / kTileRows * kTileRows; }

// One 4 x 16 tile of C (+)= op(A) * B; op(A)[m][k] = A[m * lda + k], or A[k * lda + m] (TRANS_A).
template <bool TRANS_A, bool ACCUM>
MSP_CPU_INLINE void gemm_tile(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                              int64_t K) {
  float acc[kTileRows][kTileCols];
  for (int r = 0; r < kTileRows; ++r)
#pragma omp simd
    for (int c = 0; c < kTileCols; ++c) acc[r][c] = ACCUM ? C[r * ldc + c] : 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    for (int r = 0; r < kTileRows; ++r) {
      const float a = TRANS_A ? A[k * lda + r] : A[r * lda + k];
#pragma omp simd
      for (int c = 0; c < kTileCols; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < kTileRows; ++r)
#pragma omp simd
    for (int c = 0; c < kTileCols; ++c) C[r * ldc + c] = acc[r][c];
}

// C[M x N] (+)= op(A)[M x K] * B[K x N]; M a multiple of kTileRows, N of kTileCols.
template <bool TRANS_A, bool ACCUM>
MSP_CPU_INLINE void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B, int64_t ldb,
                         float* C, int64_t ldc) {
  for (int64_t i = 0; i < M; i += kTileRows) {
    const float* a = TRANS_A ? A + i : A + i * lda;
    for (int64_t j = 0; j < N; j += kTileCols) gemm_tile<TRANS_A, ACCUM>(a, lda, B + j, ldb, C + i * ldc + j, ldc, K);
  }
}

// exp(x) for x <= 0 (larger x are clamped to 88): 2^n * p(r), |r| <= ln2 / 2; exactly 0 below -87
// (and for -inf), where the true value is at most a denormal.
MSP_CPU_INLINE float exp_approx(float x) {
  const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return x < -87.0f ? 0.0f : p * two_n;
}

MSP_CPU_INLINE float row_max(const float* s, int64_t n) {
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = s[j] > m ? s[j] : m;
  return m;
}

// s[j] <- exp(s[j] - base); returns the sum.
MSP_CPU_INLINE float row_exp_sum(float* s, int64_t n, float base) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float e = exp_approx(s[j] - base);
    s[j] = e;
    sum += e;
  }
  return sum;
}

MSP_CPU_INLINE void scale_row(float* x, int64_t n, float by) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] *= by;
}

// dst[r * ld + c] = src[r * row_stride + c * col_stride] as fp32 for r < rows, c < cols; zeros in
// the padding up to rows_pad x ld.
template <typename T>
MSP_CPU_INLINE void pack_rows(const T* src, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols,
                              float* dst, int64_t ld, int64_t rows_pad) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * row_stride;
    float* d = dst + r * ld;
    if (col_stride == 1) {
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) d[c] = to_f32(s[c]);
    } else {
      for (int64_t c = 0; c < cols; ++c) d[c] = to_f32(s[c * col_stride]);
    }
    for (int64_t c = cols; c < ld; ++c) d[c] = 0.0f;
  }
  std::memset(dst + rows * ld, 0, sizeof(float) * (rows_pad - rows) * ld);
}

// dst[c * kBlock + r] = src[r * row_stride + c * col_stride] (a block transposed), zero-padded to
// kBlock rows and cols_pad columns.
template <typename T>
MSP_CPU_INLINE void pack_transposed(const T* src, int64_t row_stride, int64_t col_stride, int64_t rows, int64_t cols,
                                    float* dst, int64_t cols_pad) {
  for (int64_t c = 0; c < cols; ++c) {
    const T* s = src + c * col_stride;
    float* d = dst + c * kBlock;
    for (int64_t r = 0; r < rows; ++r) d[r] = to_f32(s[r * row_stride]);
    for (int64_t r = rows; r < kBlock; ++r) d[r] = 0.0f;
  }
  std::memset(dst + cols * kBlock, 0, sizeof(float) * (cols_pad - cols) * kBlock);
}

}  // namespace flash
}  // namespace msp

#pragma GCC pop_options

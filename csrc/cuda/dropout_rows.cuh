// The row machinery of the hidden-dropout kernels (dropout_add.cu): the keep factors of a thread's column
// vector of one [s, b, h] row (row r is token r / b, sample r % b), the row index, and the launch geometry
// of the elementwise kernels. Torch-free (see dtype.h).
#pragma once

#include "../philox.h"
#include "common.cuh"

namespace msp {
namespace cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint32_t select_word(const Words4& w, int lane) {
  return lane == 0 ? w.w[0] : lane == 1 ? w.w[1] : lane == 2 ? w.w[2] : w.w[3];
}

// keep[i] in {0, 1} for local features j0 .. j0+VEC-1 of the row (position, sample).
template <int VEC, bool GROUPED>
__device__ __forceinline__ void draw_keep(const DropoutParams& d, int64_t j0, int64_t position, int64_t sample,
                                          float (&keep)[VEC]) {
  if (d.threshold == 0) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) keep[i] = 1.0f;
    return;
  }
  if constexpr (GROUPED) {  // (feature_offset + j0) % 4 == 0 and VEC % 4 == 0
    const uint64_t group = static_cast<uint64_t>(d.feature_offset + j0) / 4;
#pragma unroll
    for (int g = 0; g < VEC / 4; ++g) {
      Words4 w = dropout_words(d, group + g, position, sample);
#pragma unroll
      for (int i = 0; i < 4; ++i) keep[4 * g + i] = keep_factor(d, w.w[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const uint64_t f = static_cast<uint64_t>(d.feature_offset + j0 + i);
      Words4 w = dropout_words(d, f / 4, position, sample);
      keep[i] = keep_factor(d, select_word(w, static_cast<int>(f & 3)));
    }
  }
}

struct Rows {
  const int64_t* positions;
  const int64_t* samples;
  uint32_t b;
  __device__ __forceinline__ void at(uint32_t row, int64_t& position, int64_t& sample) const {
    const uint32_t token = row / b;
    position = positions[token];
    sample = samples[row - token * b];
  }
};

// Elementwise kernels: threads x over column vectors, y over rows; blocks: enough to fill every SM
// `waves` times.
struct Launch {
  dim3 grid, block;
};

inline Launch row_launch(int64_t rows, int64_t h, int vec, int waves) {
  const int64_t nvec = (h + vec - 1) / vec;
  const int tx = static_cast<int>(nvec >= kThreads ? kThreads : round_up(nvec, 32));
  const int ty = kThreads / tx;
  const int64_t gx = (nvec + tx - 1) / tx;
  int64_t gy = (rows + ty - 1) / ty;
  const int64_t budget = int64_t(sm_count()) * (2048 / kThreads) * waves;
  gy = gy < (budget + gx - 1) / gx ? gy : (budget + gx - 1) / gx;
  gy = gy < 65535 ? (gy > 0 ? gy : 1) : 65535;
  return {dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)), dim3(tx, ty)};
}

// The vector path: rows of whole 16-byte vectors of T, groups of four features, aligned pointers.
template <typename T>
inline bool grouped_path(const DropoutParams& d, int64_t h, const void* a, const void* b, const void* c,
                         const void* e) {
  constexpr int VEC = 16 / sizeof(T);
  return h % VEC == 0 && d.feature_offset % 4 == 0 && aligned16(a) && aligned16(b) && aligned16(c) &&
         (e == nullptr || aligned16(e));
}

}  // namespace
}  // namespace cuda
}  // namespace msp

// Row-parallel CPU loops whose rows also add into per-column sums (bias / LayerNorm weight grads).
//
// Design: rows are cut into one chunk per thread; each chunk owns a zeroed fp32 partial row, so no
// two threads write the same memory, and the partials are summed once at the end in fixed chunk
// order (deterministic for a given thread count).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>

namespace msp {

// fn(row_begin, row_end, float* partial) for each chunk; returns the column sums, fp32 [cols].
template <typename Fn>
at::Tensor parallel_rows_with_column_sums(int64_t rows, int64_t cols, Fn fn) {
  int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  at::Tensor partial = at::zeros({chunks, cols}, at::TensorOptions().dtype(at::kFloat));
  float* part = partial.data_ptr<float>();
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t begin = rows * c / chunks, end = rows * (c + 1) / chunks;
      fn(begin, end, part + c * cols);
    }
  });
  for (int64_t c = 1; c < chunks; ++c) {
    const float* src = part + c * cols;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) part[j] += src[j];
  }
  return partial[0];
}

// Grain (rows per task) so that one task touches roughly 64 KiB of a row-major tensor.
inline int64_t row_grain(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

}  // namespace msp

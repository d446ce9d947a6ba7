// bias_dropout_add on the CPU: out = residual + dropout(x + bias), masks drawn by Philox.
//
// Design: rows are the s*b (token, sample) pairs of an [s, b, h] slab, split over threads with
// at::parallel_for. Per row, one pass draws the 32-bit words of all h features into a small
// buffer (one Philox call per four features, 8 calls side by side in AVX-512 lanes: philox_cpu.h),
// and a second vectorised pass applies out = residual + (x + bias) * keep * scale in fp32. The
// backward draws the same words again (no stored mask), writes grad_x = (grad * scale) * keep and
// sums it over rows for the bias gradient.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <vector>

#include "bias_dropout_add.h"
#include "cpu_reduce.h"
#include "cpu_simd.h"
#include "philox.h"
#include "philox_cpu.h"

namespace msp {
namespace {

struct RowIndex {
  const int64_t* positions;  // [s]
  const int64_t* samples;    // [b]
  int64_t b;
};

// Words of local features 0..h-1 of one row; buf holds h + 8 words. Returns the row's first word.
const uint32_t* draw_row_words(const DropoutParams& d, int64_t pos, int64_t sample, int64_t h, uint32_t* buf) {
  const int64_t first = d.feature_offset / 4, groups = (d.feature_offset + h + 3) / 4 - first;
  const uint64_t s = static_cast<uint64_t>(sample);
  philox_groups(d, static_cast<uint32_t>(first), groups, static_cast<uint32_t>(pos), static_cast<uint32_t>(s),
                static_cast<uint32_t>(s >> 32), buf);
  return buf + d.feature_offset % 4;
}

template <typename T>
MSP_CPU_INLINE void bda_fwd_row(const T* x, const float* bias, const T* res, T* out, const uint32_t* words,
                                const DropoutParams& d, int64_t h) {
  const float scale = d.scale;
  if (words == nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) out[j] = from_f32<T>(to_f32(res[j]) + (to_f32(x[j]) + bias[j]) * scale);
    return;
  }
  const uint32_t thr = d.threshold;
#pragma omp simd
  for (int64_t j = 0; j < h; ++j) {
    float keep = words[j] >= thr ? 1.0f : 0.0f;
    out[j] = from_f32<T>(to_f32(res[j]) + (to_f32(x[j]) + bias[j]) * keep * scale);
  }
}
MSP_SIMD_VARIANTS(bda_fwd_row)

template <typename T>
MSP_CPU_INLINE void bda_bwd_row(const T* g, T* gx, float* gbias, const uint32_t* words, const DropoutParams& d,
                                int64_t h) {
  const float scale = d.scale;
  const uint32_t thr = d.threshold;
#pragma omp simd
  for (int64_t j = 0; j < h; ++j) {
    float keep = words == nullptr ? 1.0f : (words[j] >= thr ? 1.0f : 0.0f);
    float v = (to_f32(g[j]) * scale) * keep;  // the reference's autograd order
    gx[j] = from_f32<T>(v);
    gbias[j] += v;
  }
}
MSP_SIMD_VARIANTS(bda_bwd_row)

const uint32_t* row_words(const DropoutParams& d, const RowIndex& idx, int64_t row, int64_t h, uint32_t* buf) {
  if (d.threshold == 0) return nullptr;  // p == 0: keep everything, skip Philox
  int64_t pos = idx.positions[row / idx.b], sample = idx.samples[row % idx.b];
  return draw_row_words(d, pos, sample, h, buf);
}

at::Tensor bias_row_f32(const c10::optional<at::Tensor>& bias, int64_t h) {
  if (!bias.has_value()) return at::zeros({h}, at::TensorOptions().dtype(at::kFloat));
  return bias->to(at::kFloat).contiguous();
}

at::Tensor fwd_cpu(const at::Tensor& x_in, const c10::optional<at::Tensor>& bias, const at::Tensor& res_in,
                   const at::Tensor& positions_in, const at::Tensor& samples_in, double p, int64_t seed, int64_t layer,
                   int64_t site, int64_t feature_offset) {
  check_bias_dropout_add(x_in, bias, res_in, positions_in, samples_in, p, feature_offset);
  at::Tensor x = x_in.contiguous(), res = res_in.contiguous(), out = at::empty_like(x);
  at::Tensor positions = positions_in.contiguous(), samples = samples_in.contiguous();
  at::Tensor bias_f = bias_row_f32(bias, x.size(2));
  const int64_t h = x.size(2), rows = x.size(0) * x.size(1);
  const DropoutParams d = make_dropout_params(p, seed, layer, site, feature_offset);
  const RowIndex idx{positions.data_ptr<int64_t>(), samples.data_ptr<int64_t>(), x.size(1)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "bda_fwd", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = res.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float* bp = bias_f.data_ptr<float>();
    at::parallel_for(0, rows, row_grain(h), [&](int64_t r0, int64_t r1) {
      std::vector<uint32_t> buf(h + 8);
      for (int64_t r = r0; r < r1; ++r) {
        const uint32_t* words = row_words(d, idx, r, h, buf.data());
        bda_fwd_row_simd<scalar_t>(xp + r * h, bp, rp + r * h, op + r * h, words, d, h);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> bwd_cpu(const at::Tensor& grad_in, const at::Tensor& pos_in,
                                           const at::Tensor& samples_in, double p, int64_t seed, int64_t layer,
                                           int64_t site, int64_t feature_offset, bool bias_grad) {
  check_bias_dropout_add_bwd(grad_in, pos_in, samples_in, p, feature_offset);
  at::Tensor g = grad_in.contiguous(), gx = at::empty_like(g);
  at::Tensor positions = pos_in.contiguous(), samples = samples_in.contiguous();
  const int64_t h = g.size(2), rows = g.size(0) * g.size(1);
  const DropoutParams d = make_dropout_params(p, seed, layer, site, feature_offset);
  const RowIndex idx{positions.data_ptr<int64_t>(), samples.data_ptr<int64_t>(), g.size(1)};
  at::Tensor gbias;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "bda_bwd", [&] {
    const scalar_t* gp = g.data_ptr<scalar_t>();
    scalar_t* gxp = gx.data_ptr<scalar_t>();
    gbias = parallel_rows_with_column_sums(rows, h, [&](int64_t r0, int64_t r1, float* part) {
      std::vector<uint32_t> buf(h + 8);
      for (int64_t r = r0; r < r1; ++r) {
        const uint32_t* words = row_words(d, idx, r, h, buf.data());
        bda_bwd_row_simd<scalar_t>(gp + r * h, gxp + r * h, part, words, d, h);
      }
    });
  });
  if (!bias_grad) gbias = at::empty({0}, g.options().dtype(at::kFloat));
  return {gx, gbias};
}

}  // namespace

// x, residual [s, b, h]; bias [h] or None; token positions [s]; sample ids [b] -> out [s, b, h]; the backward
// gives (grad_x [s, b, h], grad_bias [h] fp32, or [0] without bias_grad).
TORCH_LIBRARY_FRAGMENT(megatron_sp, m) {
  m.def(
      "bias_dropout_add_fwd(Tensor x, Tensor? bias, Tensor residual, Tensor token_positions, Tensor sample_ids, float "
      "p, int seed, int layer, int site, int feature_offset) -> Tensor");
  m.def(
      "bias_dropout_add_bwd(Tensor grad_out, Tensor token_positions, Tensor sample_ids, float p, int seed, int layer, "
      "int site, int feature_offset, bool bias_grad) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_sp, CPU, m) {
  m.impl("bias_dropout_add_fwd", &fwd_cpu);
  m.impl("bias_dropout_add_bwd", &bwd_cpu);
}

}  // namespace msp

// bias_dropout_add on the CPU: out = residual + dropout(x + bias), masks drawn by Philox.
//
// Design: rows are the s*b (token, sample) pairs of an [s, b, h] slab, split over threads with
// at::parallel_for. Per row, one pass draws the 32-bit words of all h features into a small
// buffer (one Philox call per four features, 8 calls side by side in AVX-512 lanes: philox_cpu.h),
// and a second vectorised pass applies out = residual + (x + bias) * keep * scale in fp32. The
// backward draws the same words again (no stored mask), writes grad_x = (grad * scale) * keep and
// sums it over rows for the bias gradient.
// Dtypes: x and bias in T, residual and out in R = T or fp32 (the fp32 residual stream of
// --fp32-residual-connection under bf16/fp16); the backward takes grad in R and writes grad_x in T.
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
#include "dropout_rows_cpu.h"

namespace msp {
namespace {

template <typename T, typename R>
MSP_CPU_INLINE void bda_fwd_row(const T* x, const float* bias, const R* res, R* out, const uint32_t* words,
                                const DropoutParams& d, int64_t h) {
  const float scale = d.scale;
  if (words == nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) out[j] = from_f32<R>(to_f32(res[j]) + (to_f32(x[j]) + bias[j]) * scale);
    return;
  }
  const uint32_t thr = d.threshold;
#pragma omp simd
  for (int64_t j = 0; j < h; ++j) {
    float keep = words[j] >= thr ? 1.0f : 0.0f;
    out[j] = from_f32<R>(to_f32(res[j]) + (to_f32(x[j]) + bias[j]) * keep * scale);
  }
}
MSP_SIMD_VARIANTS(bda_fwd_row)

template <typename G, typename D>
MSP_CPU_INLINE void bda_bwd_row(const G* g, D* gx, float* gbias, const uint32_t* words, const DropoutParams& d,
                                int64_t h) {
  const float scale = d.scale;
  const uint32_t thr = d.threshold;
#pragma omp simd
  for (int64_t j = 0; j < h; ++j) {
    float keep = words == nullptr ? 1.0f : (words[j] >= thr ? 1.0f : 0.0f);
    float v = (to_f32(g[j]) * scale) * keep;  // the reference's autograd order
    gx[j] = from_f32<D>(v);
    gbias[j] += v;
  }
}
MSP_SIMD_VARIANTS(bda_bwd_row)

// fn(T{}, R{}) for a low-precision (or fp32) type T and R = T or fp32: x's and the residual's dtypes.
template <typename Fn>
void dispatch_pair(at::ScalarType t, at::ScalarType r, Fn fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t, "bias_dropout_add", [&] {
    if (r == at::kFloat) {
      fn(scalar_t{}, float{});
    } else {
      fn(scalar_t{}, scalar_t{});
    }
  });
}

at::Tensor bias_row_f32(const c10::optional<at::Tensor>& bias, int64_t h) {
  if (!bias.has_value()) return at::zeros({h}, at::TensorOptions().dtype(at::kFloat));
  return bias->to(at::kFloat).contiguous();
}

at::Tensor fwd_cpu(const at::Tensor& x_in, const c10::optional<at::Tensor>& bias, const at::Tensor& res_in,
                   const at::Tensor& positions_in, const at::Tensor& samples_in, double p, int64_t seed, int64_t layer,
                   int64_t site, int64_t feature_offset) {
  check_bias_dropout_add(x_in, bias, res_in, positions_in, samples_in, p, feature_offset);
  at::Tensor x = x_in.contiguous(), res = res_in.contiguous(), out = at::empty_like(res);
  at::Tensor positions = positions_in.contiguous(), samples = samples_in.contiguous();
  at::Tensor bias_f = bias_row_f32(bias, x.size(2));
  const int64_t h = x.size(2), rows = x.size(0) * x.size(1);
  const DropoutParams d = make_dropout_params(p, seed, layer, site, feature_offset);
  const RowIndex idx{positions.data_ptr<int64_t>(), samples.data_ptr<int64_t>(), x.size(1)};
  dispatch_pair(x.scalar_type(), res.scalar_type(), [&](auto t_tag, auto r_tag) {
    using T = decltype(t_tag);
    using R = decltype(r_tag);
    const T* xp = x.data_ptr<T>();
    const R* rp = res.data_ptr<R>();
    R* op = out.data_ptr<R>();
    const float* bp = bias_f.data_ptr<float>();
    at::parallel_for(0, rows, row_grain(h), [&](int64_t r0, int64_t r1) {
      std::vector<uint32_t> buf(h + 8);
      for (int64_t r = r0; r < r1; ++r) {
        const uint32_t* words = row_words(d, idx, r, h, buf.data());
        bda_fwd_row_simd<T, R>(xp + r * h, bp, rp + r * h, op + r * h, words, d, h);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> bwd_cpu(const at::Tensor& grad_in, const at::Tensor& pos_in,
                                           const at::Tensor& samples_in, double p, int64_t seed, int64_t layer,
                                           int64_t site, int64_t feature_offset, bool bias_grad,
                                           c10::optional<at::ScalarType> grad_x_dtype) {
  const at::ScalarType dx_type =
      check_bias_dropout_add_bwd(grad_in, pos_in, samples_in, p, feature_offset, grad_x_dtype);
  at::Tensor g = grad_in.contiguous(), gx = at::empty_like(g, g.options().dtype(dx_type));
  at::Tensor positions = pos_in.contiguous(), samples = samples_in.contiguous();
  const int64_t h = g.size(2), rows = g.size(0) * g.size(1);
  const DropoutParams d = make_dropout_params(p, seed, layer, site, feature_offset);
  const RowIndex idx{positions.data_ptr<int64_t>(), samples.data_ptr<int64_t>(), g.size(1)};
  at::Tensor gbias;
  dispatch_pair(dx_type, g.scalar_type(), [&](auto d_tag, auto g_tag) {
    using D = decltype(d_tag);
    using G = decltype(g_tag);
    const G* gp = g.data_ptr<G>();
    D* gxp = gx.data_ptr<D>();
    gbias = parallel_rows_with_column_sums(rows, h, [&](int64_t r0, int64_t r1, float* part) {
      std::vector<uint32_t> buf(h + 8);
      for (int64_t r = r0; r < r1; ++r) {
        const uint32_t* words = row_words(d, idx, r, h, buf.data());
        bda_bwd_row_simd<G, D>(gp + r * h, gxp + r * h, part, words, d, h);
      }
    });
  });
  if (!bias_grad) gbias = at::empty({0}, g.options().dtype(at::kFloat));
  return {gx, gbias};
}

}  // namespace

// x, residual [s, b, h]; bias [h] or None; token positions [s]; sample ids [b] -> out [s, b, h] in the
// residual's dtype (x's, or fp32); the backward gives (grad_x [s, b, h] in grad_x_dtype (default grad_out's),
// grad_bias [h] fp32, or [0] without bias_grad).
TORCH_LIBRARY_FRAGMENT(megatron_sp, m) {
  m.def(
      "bias_dropout_add_fwd(Tensor x, Tensor? bias, Tensor residual, Tensor token_positions, Tensor sample_ids, float "
      "p, int seed, int layer, int site, int feature_offset) -> Tensor");
  m.def(
      "bias_dropout_add_bwd(Tensor grad_out, Tensor token_positions, Tensor sample_ids, float p, int seed, int layer, "
      "int site, int feature_offset, bool bias_grad, ScalarType? grad_x_dtype=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_sp, CPU, m) {
  m.impl("bias_dropout_add_fwd", &fwd_cpu);
  m.impl("bias_dropout_add_bwd", &bwd_cpu);
}

}  // namespace msp

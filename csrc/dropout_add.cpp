// dropout_add on the CPU: out = [residual +] dropout(x [+ y]), masks drawn by Philox; the one hidden-dropout op
// of the model (the embedding's dropout(word + position embeddings), and residual + dropout(out + bias) after
// attention and the MLP).
//
// Design: rows are the s*b (token, sample) pairs of an [s, b, h] slab, split over threads with
// at::parallel_for. Per row, one pass draws the 32-bit words of all h features into a small buffer (one
// Philox call per four features, 8 calls side by side in AVX-512 lanes: philox_cpu.h), and a second
// vectorised pass computes, in fp32,
//     v = x;  v = round_T(v + addend) (an addend [s, b, h]);  v = v + bias (a bias [h], unrounded);
//     v = v * keep * scale;  v = residual + v;  out = round_O(v)
// so the embedding's sum of two activations rounds to x's dtype T first, as the reference does, and the
// bias-dropout-add rounds once, at the end. The backward draws the same words again (no stored mask),
// writes grad_x = round_D((grad * scale) * keep), which is the gradient of x and of an addend, and sums it
// over rows for a bias gradient.
// Dtypes: x and y in T; residual and out in O = T or fp32 (the fp32 residual stream of
// --fp32-residual-connection); the backward takes grad in O and writes grad_x in T.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "cpu_reduce.h"
#include "cpu_simd.h"
#include "dropout_add.h"
#include "dropout_rows_cpu.h"

namespace msp {
namespace {

// One row's inputs: x, and each of addend, bias, residual or nullptr.
template <typename T, typename O>
struct FwdRow {
  const T* x;
  const T* addend;
  const float* bias;
  const O* res;
};

template <typename T, typename O>
MSP_CPU_INLINE void da_fwd_row(FwdRow<T, O> in, O* out, const uint32_t* words, const DropoutParams& d, int64_t h) {
  const float scale = d.scale;
  const uint32_t thr = d.threshold;
#pragma omp simd
  for (int64_t j = 0; j < h; ++j) {
    float v = to_f32(in.x[j]);
    if (in.addend != nullptr) v = to_f32(from_f32<T>(v + to_f32(in.addend[j])));
    if (in.bias != nullptr) v = v + in.bias[j];
    const float keep = words == nullptr ? 1.0f : (words[j] >= thr ? 1.0f : 0.0f);
    v = v * keep * scale;
    if (in.res != nullptr) v = to_f32(in.res[j]) + v;
    out[j] = from_f32<O>(v);
  }
}
MSP_SIMD_VARIANTS(da_fwd_row)

template <typename G, typename D>
MSP_CPU_INLINE void da_bwd_row(const G* g, D* gx, float* gbias, const uint32_t* words, const DropoutParams& d,
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
MSP_SIMD_VARIANTS(da_bwd_row)

// fn(T{}, W{}) for x's type T and W = T or fp32 (out, or the gradient of an fp32 out).
template <typename Fn>
void dispatch_pair(at::ScalarType t, at::ScalarType w, Fn fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t, "dropout_add", [&] {
    if (w == at::kFloat) {
      fn(scalar_t{}, float{});
    } else {
      fn(scalar_t{}, scalar_t{});
    }
  });
}

// fn(row_begin, row_end, word buffer) over the rows of an [s, b, h] slab, in parallel.
template <typename Fn>
void for_rows(int64_t rows, int64_t h, Fn fn) {
  at::parallel_for(0, rows, row_grain(h), [&](int64_t r0, int64_t r1) {
    std::vector<uint32_t> buf(h + 8);
    fn(r0, r1, buf.data());
  });
}

template <typename T>
const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

at::Tensor fwd_cpu(const at::Tensor& x_in, const c10::optional<at::Tensor>& y_in,
                   const c10::optional<at::Tensor>& res_in, const at::Tensor& positions_in,
                   const at::Tensor& samples_in, double p, int64_t seed, int64_t layer, int64_t site,
                   int64_t feature_offset, c10::optional<at::ScalarType> out_dtype) {
  const at::ScalarType out_type =
      check_dropout_add(x_in, y_in, res_in, positions_in, samples_in, p, feature_offset, out_dtype);
  at::Tensor x = x_in.contiguous(), positions = positions_in.contiguous(), samples = samples_in.contiguous();
  const bool is_bias = y_in.has_value() && y_in->dim() == 1;
  at::Tensor bias = is_bias ? y_in->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor addend = y_in.has_value() && !is_bias ? y_in->contiguous() : at::Tensor();
  at::Tensor res = res_in.has_value() ? res_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_type));
  const int64_t h = x.size(2), rows = x.size(0) * x.size(1);
  const DropoutParams d = make_dropout_params(p, seed, layer, site, feature_offset);
  const RowIndex idx{positions.data_ptr<int64_t>(), samples.data_ptr<int64_t>(), x.size(1)};
  dispatch_pair(x.scalar_type(), out_type, [&](auto t_tag, auto o_tag) {
    using T = decltype(t_tag);
    using O = decltype(o_tag);
    const T *xp = x.data_ptr<T>(), *ap = data_or_null<T>(addend);
    const float* bp = data_or_null<float>(bias);
    const O* rp = data_or_null<O>(res);
    O* op = out.data_ptr<O>();
    for_rows(rows, h, [&](int64_t r0, int64_t r1, uint32_t* buf) {
      for (int64_t r = r0; r < r1; ++r) {
        const FwdRow<T, O> in{xp + r * h, ap ? ap + r * h : nullptr, bp, rp ? rp + r * h : nullptr};
        da_fwd_row_simd<T, O>(in, op + r * h, row_words(d, idx, r, h, buf), d, h);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> bwd_cpu(const at::Tensor& grad_in, const at::Tensor& pos_in,
                                           const at::Tensor& samples_in, double p, int64_t seed, int64_t layer,
                                           int64_t site, int64_t feature_offset, bool bias_grad,
                                           c10::optional<at::ScalarType> grad_x_dtype) {
  const at::ScalarType dx_type = check_dropout_add_bwd(grad_in, pos_in, samples_in, p, feature_offset, grad_x_dtype);
  at::Tensor g = grad_in.contiguous(), gx = at::empty(g.sizes(), g.options().dtype(dx_type));
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
      for (int64_t r = r0; r < r1; ++r)
        da_bwd_row_simd<G, D>(gp + r * h, gxp + r * h, part, row_words(d, idx, r, h, buf.data()), d, h);
    });
  });
  if (!bias_grad) gbias = at::empty({0}, g.options().dtype(at::kFloat));
  return {gx, gbias};
}

}  // namespace

// x [s, b, h]; y a bias [h] or an addend [s, b, h] (x's dtype) or None; residual [s, b, h] or None; token
// positions [s]; sample ids [b] -> out [s, b, h] in out_dtype (default the residual's, else x's; x's or fp32).
// The backward gives (grad_x [s, b, h] in grad_x_dtype (default grad_out's), also an addend's gradient; the
// bias gradient [h] fp32, or [0] without bias_grad); a residual's gradient is grad_out.
TORCH_LIBRARY_FRAGMENT(megatron_sp, m) {
  m.def(
      "dropout_add_fwd(Tensor x, Tensor? y, Tensor? residual, Tensor token_positions, Tensor sample_ids, float p, "
      "int seed, int layer, int site, int feature_offset, ScalarType? out_dtype=None) -> Tensor");
  m.def(
      "dropout_add_bwd(Tensor grad_out, Tensor token_positions, Tensor sample_ids, float p, int seed, int layer, "
      "int site, int feature_offset, bool bias_grad, ScalarType? grad_x_dtype=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_sp, CPU, m) {
  m.impl("dropout_add_fwd", &fwd_cpu);
  m.impl("dropout_add_bwd", &bwd_cpu);
}

}  // namespace msp

// embedding_dropout on the CPU: out = dropout(x + y) for the embedding layer (x the word embeddings, y
// the position embeddings or none), masks drawn by Philox, the result in x's dtype or fp32.
//
// Design: as bias_dropout_add.cpp: rows are the s*b (token, sample) pairs, split over threads; per row
// one pass draws the words of its h features (philox_cpu.h) and a vectorised pass computes
//     sum = round_T(x + y),  out = round_O(sum * keep * scale)
// which are the reference's two roundings (x + y in x's dtype T, then the mask multiply in out's
// dtype O), so the op is bit-identical to it in every dtype. The backward draws the same words again
// (no stored mask): grad_x = round_T(round_O(grad * scale) * keep), the gradient of x and of y.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "cpu_reduce.h"
#include "cpu_simd.h"
#include "dropout_rows_cpu.h"
#include "embedding_dropout.h"

namespace msp {
namespace {

template <typename T, typename O>
MSP_CPU_INLINE void emb_fwd_row(const T* x, const T* y, O* out, const uint32_t* words, const DropoutParams& d,
                                int64_t h) {
  const float scale = d.scale;
  const uint32_t thr = d.threshold;
#pragma omp simd
  for (int64_t j = 0; j < h; ++j) {
    const float sum = y == nullptr ? to_f32(x[j]) : to_f32(from_f32<T>(to_f32(x[j]) + to_f32(y[j])));
    const float keep = words == nullptr ? 1.0f : (words[j] >= thr ? 1.0f : 0.0f);
    out[j] = from_f32<O>(sum * keep * scale);
  }
}
MSP_SIMD_VARIANTS(emb_fwd_row)

template <typename G, typename D>
MSP_CPU_INLINE void emb_bwd_row(const G* g, D* gx, const uint32_t* words, const DropoutParams& d, int64_t h) {
  const float scale = d.scale;
  const uint32_t thr = d.threshold;
#pragma omp simd
  for (int64_t j = 0; j < h; ++j) {
    const float keep = words == nullptr ? 1.0f : (words[j] >= thr ? 1.0f : 0.0f);
    gx[j] = from_f32<D>(to_f32(from_f32<G>(to_f32(g[j]) * scale)) * keep);  // the reference's autograd order
  }
}
MSP_SIMD_VARIANTS(emb_bwd_row)

// fn(T{}, W{}) for x's type T and W = T or fp32 (out, or the gradient of an fp32 out).
template <typename Fn>
void dispatch_pair(at::ScalarType t, at::ScalarType w, Fn fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t, "embedding_dropout", [&] {
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

at::Tensor fwd_cpu(const at::Tensor& x_in, const c10::optional<at::Tensor>& y_in, const at::Tensor& positions_in,
                   const at::Tensor& samples_in, double p, int64_t seed, int64_t layer, int64_t site,
                   int64_t feature_offset, c10::optional<at::ScalarType> out_dtype) {
  const at::ScalarType out_type =
      check_embedding_dropout(x_in, y_in, positions_in, samples_in, p, feature_offset, out_dtype);
  at::Tensor x = x_in.contiguous(), positions = positions_in.contiguous(), samples = samples_in.contiguous();
  at::Tensor y = y_in.has_value() ? y_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_type));
  const int64_t h = x.size(2), rows = x.size(0) * x.size(1);
  const DropoutParams d = make_dropout_params(p, seed, layer, site, feature_offset);
  const RowIndex idx{positions.data_ptr<int64_t>(), samples.data_ptr<int64_t>(), x.size(1)};
  dispatch_pair(x.scalar_type(), out_type, [&](auto t_tag, auto o_tag) {
    using T = decltype(t_tag);
    using O = decltype(o_tag);
    const T* xp = x.data_ptr<T>();
    const T* yp = y.defined() ? y.data_ptr<T>() : nullptr;
    O* op = out.data_ptr<O>();
    for_rows(rows, h, [&](int64_t r0, int64_t r1, uint32_t* buf) {
      for (int64_t r = r0; r < r1; ++r)
        emb_fwd_row_simd<T, O>(xp + r * h, yp == nullptr ? nullptr : yp + r * h, op + r * h,
                               row_words(d, idx, r, h, buf), d, h);
    });
  });
  return out;
}

at::Tensor bwd_cpu(const at::Tensor& grad_in, const at::Tensor& positions_in, const at::Tensor& samples_in, double p,
                   int64_t seed, int64_t layer, int64_t site, int64_t feature_offset, at::ScalarType grad_dtype) {
  check_embedding_dropout_bwd(grad_in, positions_in, samples_in, p, feature_offset, grad_dtype);
  at::Tensor g = grad_in.contiguous(), positions = positions_in.contiguous(), samples = samples_in.contiguous();
  at::Tensor gx = at::empty(g.sizes(), g.options().dtype(grad_dtype));
  const int64_t h = g.size(2), rows = g.size(0) * g.size(1);
  const DropoutParams d = make_dropout_params(p, seed, layer, site, feature_offset);
  const RowIndex idx{positions.data_ptr<int64_t>(), samples.data_ptr<int64_t>(), g.size(1)};
  dispatch_pair(grad_dtype, g.scalar_type(), [&](auto d_tag, auto g_tag) {
    using D = decltype(d_tag);
    using G = decltype(g_tag);
    const G* gp = g.data_ptr<G>();
    D* gxp = gx.data_ptr<D>();
    for_rows(rows, h, [&](int64_t r0, int64_t r1, uint32_t* buf) {
      for (int64_t r = r0; r < r1; ++r)
        emb_bwd_row_simd<G, D>(gp + r * h, gxp + r * h, row_words(d, idx, r, h, buf), d, h);
    });
  });
  return gx;
}

}  // namespace

// x, y [s, b, h] (y optional); token positions [s]; sample ids [b] -> out [s, b, h] in out_dtype (default x's);
// the backward gives grad_x [s, b, h] in grad_dtype (x's), which is also y's gradient.
TORCH_LIBRARY_FRAGMENT(megatron_sp, m) {
  m.def(
      "embedding_dropout_fwd(Tensor x, Tensor? y, Tensor token_positions, Tensor sample_ids, float p, int seed, "
      "int layer, int site, int feature_offset, ScalarType? out_dtype=None) -> Tensor");
  m.def(
      "embedding_dropout_bwd(Tensor grad, Tensor token_positions, Tensor sample_ids, float p, int seed, int layer, "
      "int site, int feature_offset, ScalarType grad_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(megatron_sp, CPU, m) {
  m.impl("embedding_dropout_fwd", &fwd_cpu);
  m.impl("embedding_dropout_bwd", &bwd_cpu);
}

}  // namespace msp

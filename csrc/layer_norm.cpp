// LayerNorm over the last dimension on the CPU, fp32 statistics, fp32/bf16/fp16 in and out.
//
// Design: rows are independent, so the forward is one at::parallel_for over rows; a row (h values)
// stays in L1/L2 between its three vectorised passes (mean, centred variance, normalise), so the
// exact two-pass variance costs no extra memory traffic. The backward per row needs two sums,
//   c1 = mean(dy * w * xhat),  c2 = mean(dy * w),  dx = rstd * (dy * w - xhat * c1 - c2),
// and the weight/bias grads (sum over rows of dy * xhat and dy) are accumulated into per-thread
// fp32 partial rows (cpu_reduce.h). These are this rank's partial sums; under sequence
// parallelism the model sums them over the TP group.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_reduce.h"
#include "cpu_simd.h"
#include "layer_norm.h"

namespace msp {
namespace {

struct RowStats {
  float mean, rstd;
};

template <typename T>
MSP_CPU_INLINE RowStats row_stats(const T* x, int64_t h, float eps) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < h; ++j) sum += to_f32(x[j]);
  const float mean = sum / static_cast<float>(h);
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t j = 0; j < h; ++j) {
    float c = to_f32(x[j]) - mean;
    sq += c * c;
  }
  return {mean, 1.0f / std::sqrt(sq / static_cast<float>(h) + eps)};
}

template <typename T, typename W>
MSP_CPU_INLINE void ln_fwd_rows(const T* x, const W* w, const W* b, T* y, float* mean, float* rstd, int64_t h,
                                float eps, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * h;
    T* yr = y + r * h;
    RowStats st = row_stats(xr, h, eps);
#pragma omp simd
    for (int64_t j = 0; j < h; ++j)
      yr[j] = from_f32<T>((to_f32(xr[j]) - st.mean) * st.rstd * to_f32(w[j]) + to_f32(b[j]));
    mean[r] = st.mean;
    rstd[r] = st.rstd;
  }
}
MSP_SIMD_VARIANTS(ln_fwd_rows)

// part = [grad_weight | grad_bias] partial sums, 2h floats.
template <typename T, typename W>
MSP_CPU_INLINE void ln_bwd_rows(const T* dy, const T* x, const W* w, const float* mean, const float* rstd, T* dx,
                                float* part, int64_t h, int64_t r0, int64_t r1) {
  float* gw = part;
  float* gb = part + h;
  const float inv_h = 1.0f / static_cast<float>(h);
  for (int64_t r = r0; r < r1; ++r) {
    const T* dyr = dy + r * h;
    const T* xr = x + r * h;
    const float mu = mean[r], rs = rstd[r];
    float s1 = 0.0f, s2 = 0.0f;
#pragma omp simd reduction(+ : s1, s2)
    for (int64_t j = 0; j < h; ++j) {
      float g = to_f32(dyr[j]), xhat = (to_f32(xr[j]) - mu) * rs, gwj = g * to_f32(w[j]);
      s1 += gwj * xhat;
      s2 += gwj;
      gw[j] += g * xhat;
      gb[j] += g;
    }
    const float c1 = s1 * inv_h, c2 = s2 * inv_h;
    T* dxr = dx + r * h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) {
      float xhat = (to_f32(xr[j]) - mu) * rs;
      dxr[j] = from_f32<T>(rs * (to_f32(dyr[j]) * to_f32(w[j]) - xhat * c1 - c2));
    }
  }
}
MSP_SIMD_VARIANTS(ln_bwd_rows)

// Calls fn(T{}, W{}) for the activation dtype T and the parameter dtype W (T or float).
template <typename Fn>
void dispatch_ln_types(const at::Tensor& x, const at::Tensor& w, Fn fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm", [&] {
    if (w.scalar_type() == at::kFloat) {
      fn(scalar_t{}, float{});
    } else {
      fn(scalar_t{}, scalar_t{});
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& x_in, const at::Tensor& w_in,
                                                       const at::Tensor& b_in, double eps) {
  const int64_t h = check_layer_norm(x_in, w_in, b_in);
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), b = b_in.contiguous();
  const int64_t rows = x.numel() / h;
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat)), rstd = at::empty_like(mean);
  dispatch_ln_types(x, w, [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    const T* xp = x.data_ptr<T>();
    const W* wp = w.data_ptr<W>();
    const W* bp = b.data_ptr<W>();
    T* yp = y.data_ptr<T>();
    float* mp = mean.data_ptr<float>();
    float* rp = rstd.data_ptr<float>();
    at::parallel_for(0, rows, row_grain(h), [&](int64_t r0, int64_t r1) {
      ln_fwd_rows_simd<T, W>(xp, wp, bp, yp, mp, rp, h, static_cast<float>(eps), r0, r1);
    });
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                       const at::Tensor& w_in, const at::Tensor& mean_in,
                                                       const at::Tensor& rstd_in) {
  int64_t rows = 0;
  const int64_t h = check_layer_norm_bwd(dy_in, x_in, w_in, mean_in, rstd_in, &rows);
  at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), w = w_in.contiguous();
  at::Tensor mean = mean_in.contiguous(), rstd = rstd_in.contiguous(), dx = at::empty_like(x);
  at::Tensor sums;
  dispatch_ln_types(x, w, [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    const T* dyp = dy.data_ptr<T>();
    const T* xp = x.data_ptr<T>();
    const W* wp = w.data_ptr<W>();
    T* dxp = dx.data_ptr<T>();
    const float* mp = mean.data_ptr<float>();
    const float* rp = rstd.data_ptr<float>();
    sums = parallel_rows_with_column_sums(rows, 2 * h, [&](int64_t r0, int64_t r1, float* part) {
      ln_bwd_rows_simd<T, W>(dyp, xp, wp, mp, rp, dxp, part, h, r0, r1);
    });
  });
  // Copies: the two gradients must not share one storage (optimisers update them in place).
  at::Tensor gw = sums.narrow(0, 0, h).to(w.scalar_type(), false, /*copy=*/true);
  at::Tensor gb = sums.narrow(0, h, h).to(w.scalar_type(), false, /*copy=*/true);
  return {dx, gw, gb};
}

}  // namespace

// x [..., h] -> (out [..., h], mean [rows] fp32, rstd [rows] fp32); the backward gives (dx, dweight, dbias).
TORCH_LIBRARY_FRAGMENT(megatron_sp, m) {
  m.def("layer_norm_fwd(Tensor x, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def(
      "layer_norm_bwd(Tensor grad_out, Tensor x, Tensor weight, Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_sp, CPU, m) {
  m.impl("layer_norm_fwd", &fwd_cpu);
  m.impl("layer_norm_bwd", &bwd_cpu);
}

}  // namespace msp

// RMSNorm over the last dimension on the CPU, fp32 statistics, fp32/bf16/fp16 in and out.
//
// Design (as layer_norm.cpp): rows are independent, so the forward is one at::parallel_for over
// rows; a row stays in L1/L2 between its two vectorised passes (sum of squares, normalise). The
// backward per row needs one sum,
//   c = mean(dy * w * xhat),  xhat = x * rstd,  dx = rstd * (dy * w - xhat * c),
// and the weight grad (sum over rows of dy * xhat) is accumulated into per-thread fp32 partial rows
// (cpu_reduce.h): this rank's partial sum; under sequence parallelism the model sums it over the
// TP group.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_reduce.h"
#include "cpu_simd.h"
#include "rms_norm.h"

namespace msp {
namespace {

template <typename T>
MSP_CPU_INLINE float row_rstd(const T* x, int64_t h, float eps) {
  float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
  for (int64_t j = 0; j < h; ++j) {
    float v = to_f32(x[j]);
    sq += v * v;
  }
  return 1.0f / std::sqrt(sq / static_cast<float>(h) + eps);
}

template <typename T, typename W>
MSP_CPU_INLINE void rms_fwd_rows(const T* x, const W* w, T* y, float* rstd, int64_t h, float eps, int64_t r0,
                                 int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * h;
    T* yr = y + r * h;
    const float rs = row_rstd(xr, h, eps);
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) yr[j] = from_f32<T>(to_f32(xr[j]) * rs * to_f32(w[j]));
    rstd[r] = rs;
  }
}
MSP_SIMD_VARIANTS(rms_fwd_rows)

// gw: this chunk's grad_weight partial row, h floats.
template <typename T, typename W>
MSP_CPU_INLINE void rms_bwd_rows(const T* dy, const T* x, const W* w, const float* rstd, T* dx, float* gw, int64_t h,
                                 int64_t r0, int64_t r1) {
  const float inv_h = 1.0f / static_cast<float>(h);
  for (int64_t r = r0; r < r1; ++r) {
    const T* dyr = dy + r * h;
    const T* xr = x + r * h;
    const float rs = rstd[r];
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < h; ++j) {
      float g = to_f32(dyr[j]), xhat = to_f32(xr[j]) * rs;
      s += g * to_f32(w[j]) * xhat;
      gw[j] += g * xhat;
    }
    const float c = s * inv_h;
    T* dxr = dx + r * h;
#pragma omp simd
    for (int64_t j = 0; j < h; ++j) {
      float xhat = to_f32(xr[j]) * rs;
      dxr[j] = from_f32<T>(rs * (to_f32(dyr[j]) * to_f32(w[j]) - xhat * c));
    }
  }
}
MSP_SIMD_VARIANTS(rms_bwd_rows)

// Calls fn(T{}, W{}) for the activation dtype T and the weight dtype W (T or float).
template <typename Fn>
void dispatch_rms_types(const at::Tensor& x, const at::Tensor& w, Fn fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    if (w.scalar_type() == at::kFloat) {
      fn(scalar_t{}, float{});
    } else {
      fn(scalar_t{}, scalar_t{});
    }
  });
}

std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  const int64_t h = check_rms_norm(x_in, w_in);
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t rows = x.numel() / h;
  at::Tensor y = at::empty_like(x), rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  dispatch_rms_types(x, w, [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    const T* xp = x.data_ptr<T>();
    const W* wp = w.data_ptr<W>();
    T* yp = y.data_ptr<T>();
    float* rp = rstd.data_ptr<float>();
    at::parallel_for(0, rows, row_grain(h), [&](int64_t r0, int64_t r1) {
      rms_fwd_rows_simd<T, W>(xp, wp, yp, rp, h, static_cast<float>(eps), r0, r1);
    });
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> bwd_cpu(const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& w_in,
                                           const at::Tensor& rstd_in) {
  int64_t rows = 0;
  const int64_t h = check_rms_norm_bwd(dy_in, x_in, w_in, rstd_in, &rows);
  at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), w = w_in.contiguous();
  at::Tensor rstd = rstd_in.contiguous(), dx = at::empty_like(x);
  at::Tensor sums;
  dispatch_rms_types(x, w, [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    const T* dyp = dy.data_ptr<T>();
    const T* xp = x.data_ptr<T>();
    const W* wp = w.data_ptr<W>();
    T* dxp = dx.data_ptr<T>();
    const float* rp = rstd.data_ptr<float>();
    sums = parallel_rows_with_column_sums(rows, h, [&](int64_t r0, int64_t r1, float* part) {
      rms_bwd_rows_simd<T, W>(dyp, xp, wp, rp, dxp, part, h, r0, r1);
    });
  });
  // A copy even in fp32: sums is a view of the per-thread partials buffer.
  return {dx, sums.to(w.scalar_type(), false, /*copy=*/true)};
}

}  // namespace

// x [..., h] -> (out [..., h], rstd [rows] fp32); the backward gives (dx, dweight).
TORCH_LIBRARY_FRAGMENT(megatron_sp, m) {
  m.def("rms_norm_fwd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_bwd(Tensor grad_out, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_sp, CPU, m) {
  m.impl("rms_norm_fwd", &fwd_cpu);
  m.impl("rms_norm_bwd", &bwd_cpu);
}

}  // namespace msp

// rms_norm's argument checks, shared by its CPU implementation (rms_norm.cpp) and its CUDA binding
// (cuda/rms_norm_binding.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include "op_checks.h"

namespace msp {

inline int64_t check_rms_norm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "rms_norm expects x [..., h] with h > 0");
  TORCH_CHECK(is_float_type(x.scalar_type()), "rms_norm supports fp32/bf16/fp16, got ", x.scalar_type());
  check_param(weight, x, x.size(-1), "rms_norm weight");
  return x.size(-1);
}

// rms_norm_bwd's inputs; returns h and sets rows.
inline int64_t check_rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                  const at::Tensor& rstd, int64_t* rows) {
  const int64_t h = check_rms_norm(x, w);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(),
              "rms_norm_bwd: grad_out must match x in shape and dtype");
  *rows = x.numel() / h;
  TORCH_CHECK(rstd.numel() == *rows && rstd.scalar_type() == at::kFloat,
              "rms_norm_bwd: rstd must be fp32 with one value per row");
  return h;
}

}  // namespace msp

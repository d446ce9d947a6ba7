// layer_norm's argument checks, shared by its CPU implementation (layer_norm.cpp) and its CUDA binding
// (cuda/layer_norm_binding.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include "op_checks.h"

namespace msp {

inline int64_t check_layer_norm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "layer_norm expects x [..., h] with h > 0");
  TORCH_CHECK(is_float_type(x.scalar_type()), "layer_norm supports fp32/bf16/fp16, got ", x.scalar_type());
  check_param(weight, x, x.size(-1), "layer_norm weight");
  check_param(bias, x, x.size(-1), "layer_norm bias");
  TORCH_CHECK(weight.scalar_type() == bias.scalar_type(), "layer_norm weight and bias dtypes differ");
  return x.size(-1);
}

// layer_norm_bwd's inputs; returns h and sets rows.
inline int64_t check_layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                    const at::Tensor& mean, const at::Tensor& rstd, int64_t* rows) {
  const int64_t h = check_layer_norm(x, w, w);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(),
              "layer_norm_bwd: grad_out must match x in shape and dtype");
  *rows = x.numel() / h;
  TORCH_CHECK(mean.numel() == *rows && rstd.numel() == *rows && mean.scalar_type() == at::kFloat &&
                  rstd.scalar_type() == at::kFloat,
              "layer_norm_bwd: mean and rstd must be fp32 with one value per row");
  return h;
}

}  // namespace msp

// bias_dropout_add's argument checks, shared by its CPU implementation (bias_dropout_add.cpp) and its
// CUDA binding (cuda/bias_dropout_add_binding.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include "op_checks.h"

namespace msp {

inline void check_bias_dropout_add(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                   const at::Tensor& residual, const at::Tensor& positions, const at::Tensor& samples,
                                   double p, int64_t feature_offset) {
  TORCH_CHECK(x.dim() == 3, "bias_dropout_add expects x of shape [s, b, h], got ", x.sizes());
  TORCH_CHECK(is_float_type(x.scalar_type()), "bias_dropout_add supports fp32/bf16/fp16, got ", x.scalar_type());
  TORCH_CHECK(
      residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.device() == x.device(),
      "residual must match x in shape, dtype and device");
  if (bias.has_value()) {
    check_param(*bias, x, x.size(2), "bias");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "bias must have x's dtype ", x.scalar_type(),
                " (the reference promotes mixed dtypes), got ", bias->scalar_type());
  }
  check_dropout_index(positions, samples, x.size(0), x.size(1), x);
  check_dropout_scalars(p, feature_offset);
}

// bias_dropout_add_bwd's grad_out and dropout index.
inline void check_bias_dropout_add_bwd(const at::Tensor& grad, const at::Tensor& positions, const at::Tensor& samples,
                                       double p, int64_t feature_offset) {
  TORCH_CHECK(grad.dim() == 3 && is_float_type(grad.scalar_type()),
              "bias_dropout_add_bwd expects a float grad_out [s, b, h], got ", grad.sizes());
  check_dropout_index(positions, samples, grad.size(0), grad.size(1), grad);
  check_dropout_scalars(p, feature_offset);
}

}  // namespace msp

// dropout_add's argument checks, shared by its CPU implementation (dropout_add.cpp) and its CUDA binding
// (cuda/dropout_add_binding.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include "op_checks.h"

namespace msp {

// x [s, b, h]; y a bias [h] or an addend like x (both in x's dtype) or None; residual like x in out's dtype or
// None; out's dtype (out_dtype, else the residual's, else x's) x's or fp32. Returns out's dtype.
inline at::ScalarType check_dropout_add(const at::Tensor& x, const c10::optional<at::Tensor>& y,
                                        const c10::optional<at::Tensor>& residual, const at::Tensor& positions,
                                        const at::Tensor& samples, double p, int64_t feature_offset,
                                        c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.dim() == 3, "dropout_add expects x of shape [s, b, h], got ", x.sizes());
  TORCH_CHECK(is_float_type(x.scalar_type()), "dropout_add supports fp32/bf16/fp16, got ", x.scalar_type());
  if (y.has_value()) {
    TORCH_CHECK((y->dim() == 1 && y->size(0) == x.size(2)) || y->sizes() == x.sizes(),
                "dropout_add: y must be a bias [", x.size(2), "] or have x's shape ", x.sizes(), ", got ", y->sizes());
    TORCH_CHECK(y->scalar_type() == x.scalar_type() && y->device() == x.device(), "dropout_add: y must have x's dtype ",
                x.scalar_type(), " and device (the reference promotes mixed dtypes), got ", y->scalar_type());
  }
  const at::ScalarType out = out_dtype.value_or(residual.has_value() ? residual->scalar_type() : x.scalar_type());
  TORCH_CHECK(out == x.scalar_type() || out == at::kFloat, "dropout_add: the output dtype must be x's or fp32, got ",
              out);
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->device() == x.device() && residual->scalar_type() == out,
                "dropout_add: residual must match x in shape and device and have the output dtype ", out, ", got ",
                residual->scalar_type(), " ", residual->sizes());
  }
  check_dropout_index(positions, samples, x.size(0), x.size(1), x);
  check_dropout_scalars(p, feature_offset);
  return out;
}

// dropout_add_bwd's grad_out, dropout index and grad_x dtype (grad_out's, or a low precision one for an fp32
// grad_out); returns the grad_x dtype.
inline at::ScalarType check_dropout_add_bwd(const at::Tensor& grad, const at::Tensor& positions,
                                            const at::Tensor& samples, double p, int64_t feature_offset,
                                            c10::optional<at::ScalarType> grad_x_dtype) {
  TORCH_CHECK(grad.dim() == 3 && is_float_type(grad.scalar_type()),
              "dropout_add_bwd expects a float grad_out [s, b, h], got ", grad.sizes());
  check_dropout_index(positions, samples, grad.size(0), grad.size(1), grad);
  check_dropout_scalars(p, feature_offset);
  const at::ScalarType dx = grad_x_dtype.value_or(grad.scalar_type());
  TORCH_CHECK(is_float_type(dx) && (dx == grad.scalar_type() || grad.scalar_type() == at::kFloat),
              "dropout_add_bwd: grad_x_dtype must be grad_out's dtype or, for an fp32 grad_out, bf16/fp16; got ", dx);
  return dx;
}

}  // namespace msp

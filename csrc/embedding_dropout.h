// embedding_dropout's argument checks, shared by its CPU implementation (embedding_dropout.cpp) and its CUDA
// binding (cuda/embedding_dropout_binding.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include "op_checks.h"

namespace msp {

// x [s, b, h], y (position embeddings) like x or None, out_dtype x's or fp32; returns out's dtype.
inline at::ScalarType check_embedding_dropout(const at::Tensor& x, const c10::optional<at::Tensor>& y,
                                              const at::Tensor& positions, const at::Tensor& samples, double p,
                                              int64_t feature_offset, c10::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.dim() == 3, "embedding_dropout expects x of shape [s, b, h], got ", x.sizes());
  TORCH_CHECK(is_float_type(x.scalar_type()), "embedding_dropout supports fp32/bf16/fp16, got ", x.scalar_type());
  if (y.has_value()) {
    TORCH_CHECK(y->sizes() == x.sizes() && y->scalar_type() == x.scalar_type() && y->device() == x.device(),
                "embedding_dropout: y must match x in shape, dtype and device");
  }
  const at::ScalarType out = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(out == x.scalar_type() || out == at::kFloat,
              "embedding_dropout: out_dtype must be x's dtype or fp32, got ", out);
  check_dropout_index(positions, samples, x.size(0), x.size(1), x);
  check_dropout_scalars(p, feature_offset);
  return out;
}

// The backward's grad [s, b, h] (out's dtype) and grad_dtype (x's: grad's, or bf16/fp16 for an fp32 grad).
inline void check_embedding_dropout_bwd(const at::Tensor& grad, const at::Tensor& positions, const at::Tensor& samples,
                                        double p, int64_t feature_offset, at::ScalarType grad_dtype) {
  TORCH_CHECK(grad.dim() == 3 && is_float_type(grad.scalar_type()),
              "embedding_dropout_bwd expects a float grad [s, b, h], got ", grad.sizes());
  TORCH_CHECK(is_float_type(grad_dtype) && (grad_dtype == grad.scalar_type() || grad.scalar_type() == at::kFloat),
              "embedding_dropout_bwd: grad_dtype must be grad's dtype or, for an fp32 grad, bf16/fp16; got ",
              grad_dtype);
  check_dropout_index(positions, samples, grad.size(0), grad.size(1), grad);
  check_dropout_scalars(p, feature_offset);
}

}  // namespace msp

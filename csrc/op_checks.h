// Argument-check helpers every op's checks use (csrc/<op>.h). Each op's own checks live in its header,
// shared by its CPU implementation (csrc/<op>.cpp) and its CUDA binding (csrc/cuda/<op>_binding.cpp),
// so both devices reject the same inputs with the same one-sentence messages.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace msp {

inline bool is_float_type(c10::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

// Parameters (bias, LayerNorm weight) may be in the activation dtype or in fp32.
inline void check_param(const at::Tensor& w, const at::Tensor& x, int64_t h, const char* what) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == h, what, " must have shape [", h, "], got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == x.scalar_type() || w.scalar_type() == at::kFloat, what,
              " must be fp32 or the activation dtype ", x.scalar_type(), ", got ", w.scalar_type());
  TORCH_CHECK(w.device() == x.device(), what, " must be on ", x.device());
}

inline void check_dropout_index(const at::Tensor& positions, const at::Tensor& samples, int64_t s, int64_t b,
                                const at::Tensor& like) {
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == s && positions.scalar_type() == at::kLong,
              "token_positions must be int64 [", s, "], got ", positions.scalar_type(), " ", positions.sizes());
  TORCH_CHECK(samples.dim() == 1 && samples.size(0) == b && samples.scalar_type() == at::kLong,
              "sample_ids must be int64 [", b, "], got ", samples.scalar_type(), " ", samples.sizes());
  TORCH_CHECK(positions.device() == like.device() && samples.device() == like.device(),
              "token_positions and sample_ids must be on ", like.device());
}

inline void check_dropout_scalars(double p, int64_t feature_offset) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "dropout probability must be in [0, 1), got ", p);
  TORCH_CHECK(feature_offset >= 0, "feature_offset must be >= 0, got ", feature_offset);
}

// An index tensor (positions, segments, sample ids): int64 of the given shape on like's device.
inline void check_index_tensor(const at::Tensor& t, at::IntArrayRef shape, const char* what, const at::Tensor& like) {
  TORCH_CHECK(t.sizes() == shape && t.scalar_type() == at::kLong, what, " must be int64 ", shape, ", got ",
              t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), what, " must be on ", like.device());
}

}  // namespace msp

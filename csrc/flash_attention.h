// flash_attention's argument checks, shared by its CPU implementation (flash_attention.cpp,
// flash_attention_bwd.cpp) and its CUDA binding (cuda/flash_attention_binding.cpp).
//
// q [b, n_q, s_q, d], k and v [b, n_kv, s_k, d] with any strides, one float dtype; n_q a multiple of
// n_kv (GQA); positions int64 [s_q] / [s_k]; segments both or neither, int64 [b, s_q] / [b, s_k];
// sample ids int64 [b].
#pragma once

#include <ATen/core/Tensor.h>

#include "op_checks.h"

namespace msp {

inline void check_flash_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& q_pos, const at::Tensor& k_pos,
                                  const c10::optional<at::Tensor>& q_seg, const c10::optional<at::Tensor>& k_seg,
                                  const at::Tensor& samples, double p, int64_t head_offset) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "flash_attention expects q [b, n_q, s_q, d] and k, v [b, n_kv, s_k, d], got ", q.sizes(), ", ", k.sizes(),
              ", ", v.sizes());
  TORCH_CHECK(is_float_type(q.scalar_type()), "flash_attention supports fp32/bf16/fp16, got ", q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "flash_attention: q, k and v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(),
              "flash_attention: q, k and v must be on one device");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3),
              "flash_attention: k and v must be [b, n_kv, s_k, d] with q's b and d, got q ", q.sizes(), ", k ",
              k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(q.size(3) > 0 && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "flash_attention: d must be > 0 and the query heads (", q.size(1),
              ") a multiple of the key/value heads (", k.size(1), ")");
  const int64_t b = q.size(0), sq = q.size(2), sk = k.size(2);
  check_index_tensor(q_pos, {sq}, "q_positions", q);
  check_index_tensor(k_pos, {sk}, "k_positions", q);
  TORCH_CHECK(q_seg.has_value() == k_seg.has_value(),
              "flash_attention: give q_segments and k_segments together, or neither");
  if (q_seg.has_value()) {
    check_index_tensor(*q_seg, {b, sq}, "q_segments", q);
    check_index_tensor(*k_seg, {b, sk}, "k_segments", q);
  }
  check_index_tensor(samples, {b}, "sample_ids", q);
  TORCH_CHECK(p >= 0.0 && p < 1.0, "dropout probability must be in [0, 1), got ", p);
  TORCH_CHECK(head_offset >= 0, "head_offset must be >= 0, got ", head_offset);
}

// The backward's extra inputs: dout and out like q, lse fp32 [b, n_q, s_q] (any strides).
inline void check_flash_attention_bwd(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                                      const at::Tensor& q) {
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() && dout.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "flash_attention_bwd: dout and out must match q in shape and dtype, got ", dout.sizes(), " ",
              dout.scalar_type(), ", ", out.sizes(), " ", out.scalar_type());
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && lse.size(2) == q.size(2) &&
                  lse.scalar_type() == at::kFloat,
              "flash_attention_bwd: lse must be fp32 [b, n_q, s_q], got ", lse.scalar_type(), " ", lse.sizes());
  TORCH_CHECK(dout.device() == q.device() && out.device() == q.device() && lse.device() == q.device(),
              "flash_attention_bwd: dout, out and lse must be on q's device");
}

}  // namespace msp

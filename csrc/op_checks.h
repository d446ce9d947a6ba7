// Argument checks and output shapes shared by the CPU and CUDA bindings, so both devices reject
// the same inputs with the same one-sentence messages and agree on every layout.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include "layout_index.h"

#include <cstdint>
#include <vector>

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

// flash_attention: q [b, n_q, s_q, d], k and v [b, n_kv, s_k, d] with any strides, one float
// dtype; n_q a multiple of n_kv (GQA); positions int64 [s_q] / [s_k]; segments both or neither,
// int64 [b, s_q] / [b, s_k]; sample ids int64 [b].
inline void check_index_tensor(const at::Tensor& t, at::IntArrayRef shape, const char* what, const at::Tensor& like) {
  TORCH_CHECK(t.sizes() == shape && t.scalar_type() == at::kLong, what, " must be int64 ", shape, ", got ",
              t.scalar_type(), " ", t.sizes());
  TORCH_CHECK(t.device() == like.device(), what, " must be on ", like.device());
}

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

// A layout op as a copy of contiguous runs: either a block transpose
// [a, b, run] -> [b, a, run], or a permutation of 2p chunks along one axis of [outer, 2p, run].
struct BlockTranspose {
  int64_t a, b, run;
  std::vector<int64_t> out_shape;
};

struct ZigzagPlan {
  int64_t outer, p, run;  // run = elements of one of the 2p chunks (chunk rows x inner)
};

inline void check_group(int64_t p, const char* name) { TORCH_CHECK(p >= 1, name, " must be >= 1, got ", p); }

inline BlockTranspose ulysses_pack_plan(const at::Tensor& x, int64_t p) {
  check_group(p, "ulysses_pack: p");
  TORCH_CHECK(x.dim() == 4, "ulysses_pack expects [s/p, b, n, d], got ", x.sizes());
  int64_t S = x.size(0), b = x.size(1), n = x.size(2), d = x.size(3);
  TORCH_CHECK(n % p == 0, "ulysses_pack: heads (", n, ") must be divisible by p (", p, ")");
  // [S*b, p, n/p*d] -> [p, S*b, n/p*d]
  return {S * b, p, (n / p) * d, {p, S, b, n / p, d}};
}

inline BlockTranspose ulysses_unpack_plan(const at::Tensor& x, int64_t p) {
  check_group(p, "ulysses_unpack: p");
  TORCH_CHECK(x.dim() == 5 && x.size(0) == p, "ulysses_unpack expects [p, s/p, b, n/p, d] with p=", p, ", got ",
              x.sizes());
  int64_t S = x.size(1), b = x.size(2), np = x.size(3), d = x.size(4);
  // [p, S*b, n/p*d] -> [S*b, p, n/p*d]
  return {p, S * b, np * d, {S, b, p * np, d}};
}

inline BlockTranspose gather_to_last_dim_plan(const at::Tensor& x, int64_t t) {
  check_group(t, "gather_to_last_dim: t");
  TORCH_CHECK(x.dim() >= 2 && x.size(0) % t == 0,
              "gather_to_last_dim expects [t*s, ..., l] with dim 0 divisible by t=", t, ", got ", x.sizes());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  int64_t last = shape.back(), middle = x.numel() / (x.size(0) * last);
  shape[0] /= t;
  shape.back() *= t;
  // [t, s*middle, l] -> [s*middle, t, l]
  return {t, shape[0] * middle, last, shape};
}

inline BlockTranspose last_dim_to_gather_plan(const at::Tensor& x, int64_t t) {
  check_group(t, "last_dim_to_gather: t");
  TORCH_CHECK(x.dim() >= 2 && x.size(-1) % t == 0,
              "last_dim_to_gather expects [s, ..., t*l] with the last dim divisible by t=", t, ", got ", x.sizes());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  int64_t last = shape.back() / t, rows = x.numel() / shape.back();
  shape[0] *= t;
  shape.back() = last;
  // [rows, t, l] -> [t, rows, l]
  return {rows, t, last, shape};
}

inline ZigzagPlan zigzag_plan(const at::Tensor& x, int64_t p, int64_t dim) {
  check_group(p, "zigzag_reorder: p");
  TORCH_CHECK(x.dim() >= 1, "zigzag_reorder needs at least one dimension");
  int64_t nd = x.dim();
  TORCH_CHECK(dim >= -nd && dim < nd, "zigzag_reorder: dim ", dim, " out of range for ", x.sizes());
  if (dim < 0) dim += nd;
  int64_t len = x.size(dim);
  TORCH_CHECK(len % (2 * p) == 0, "zigzag_reorder: size ", len, " of dim ", dim, " must be divisible by 2p = ", 2 * p);
  int64_t outer = 1;
  for (int64_t i = 0; i < dim; ++i) outer *= x.size(i);
  int64_t run = len == 0 ? 0 : x.numel() / outer / (2 * p);
  return {outer, p, run};
}

}  // namespace msp

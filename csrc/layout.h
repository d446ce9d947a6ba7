// The layout ops' argument checks and plans (which contiguous runs go where, the output shape), shared
// by their CPU implementation (layout.cpp) and their CUDA binding (cuda/layout_binding.cpp), so both
// devices agree on every layout.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "op_checks.h"

namespace msp {

// A layout op as a copy of contiguous runs: either a block transpose
// [a, b, run] -> [b, a, run], or a permutation of 2p chunks along one axis of [outer, 2p, run].
struct BlockTranspose {
  int64_t a, b, run;
  std::vector<int64_t> out_shape;
};

struct ZigzagPlan {
  int64_t outer, p, run;  // run = elements of one of the 2p chunks (chunk rows x inner)
};

// A group size (p, t): at least 1.
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

// Layout ops for the collectives on the CPU: Ulysses pack/unpack, dim-0 gather -> last-dim
// concatenation and back, zigzag chunk reorder.
//
// Design: each op is a copy of contiguous runs (op_checks.h plans them): a block transpose
// [a, b, run] -> [b, a, run] or a permutation of 2p chunks of [outer, 2p, run]. The copy is
// dtype-agnostic (bytes), one memcpy per run, runs spread over threads with at::parallel_for.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "layout_index.h"
#include "op_checks.h"

namespace msp {
namespace {

// dst run o <- src run source(o), each `bytes` long. Long runs are cut into pieces so that a
// permutation of a few huge chunks (zigzag) still uses every thread.
template <typename Source>
void parallel_copy_runs(char* dst, const char* src, int64_t runs, int64_t bytes, Source source) {
  if (bytes == 0 || runs == 0) return;
  const int64_t piece = std::min<int64_t>(bytes, 1 << 16);
  const int64_t pieces = (bytes + piece - 1) / piece;
  at::parallel_for(0, runs * pieces, std::max<int64_t>(1, (1 << 16) / piece), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t o = t / pieces, off = (t % pieces) * piece;
      std::memcpy(dst + o * bytes + off, src + source(o) * bytes + off, std::min(piece, bytes - off));
    }
  });
}

at::Tensor run_block_transpose(const at::Tensor& x_in, const BlockTranspose& plan) {
  at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(plan.out_shape, x.options());
  parallel_copy_runs(static_cast<char*>(out.data_ptr()), static_cast<const char*>(x.const_data_ptr()),
                     plan.a * plan.b, plan.run * x.element_size(),
                     [&](int64_t o) { return transpose_source<int64_t>(o, plan.a, plan.b); });
  return out;
}

at::Tensor ulysses_pack_cpu(const at::Tensor& x, int64_t p) {
  return run_block_transpose(x, ulysses_pack_plan(x, p));
}

at::Tensor ulysses_unpack_cpu(const at::Tensor& x, int64_t p) {
  return run_block_transpose(x, ulysses_unpack_plan(x, p));
}

at::Tensor gather_to_last_dim_cpu(const at::Tensor& x, int64_t t) {
  return run_block_transpose(x, gather_to_last_dim_plan(x, t));
}

at::Tensor last_dim_to_gather_cpu(const at::Tensor& x, int64_t t) {
  return run_block_transpose(x, last_dim_to_gather_plan(x, t));
}

at::Tensor zigzag_reorder_cpu(const at::Tensor& x_in, int64_t p, int64_t dim, bool inverse) {
  const ZigzagPlan plan = zigzag_plan(x_in, p, dim);
  at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  parallel_copy_runs(static_cast<char*>(out.data_ptr()), static_cast<const char*>(x.const_data_ptr()),
                     plan.outer * 2 * p, plan.run * x.element_size(), [&](int64_t o) {
                       int64_t outer = o / (2 * p), slot = o % (2 * p);
                       return outer * 2 * p + zigzag_source<int64_t>(slot, p, inverse);
                     });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_sp, CPU, m) {
  m.impl("ulysses_pack", &ulysses_pack_cpu);
  m.impl("ulysses_unpack", &ulysses_unpack_cpu);
  m.impl("gather_to_last_dim", &gather_to_last_dim_cpu);
  m.impl("last_dim_to_gather", &last_dim_to_gather_cpu);
  m.impl("zigzag_reorder", &zigzag_reorder_cpu);
}

}  // namespace msp

// The CUDA binding of the layout ops: plans (../layout.h), output allocation, and the launch (layout.cu) on
// the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../layout.h"
#include "binding.h"
#include "layout.h"

namespace msp {
namespace {

at::Tensor transpose_cuda(const at::Tensor& x_in, const BlockTranspose& plan, const char* op) {
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.contiguous(), out = at::empty(plan.out_shape, x.options());
  check_launch(cuda::block_transpose(x.const_data_ptr(), out.data_ptr(), plan.a, plan.b, plan.run * x.element_size(),
                                     current_stream()),
               op);
  return out;
}

at::Tensor ulysses_pack_cuda(const at::Tensor& x, int64_t p) {
  return transpose_cuda(x, ulysses_pack_plan(x, p), "ulysses_pack");
}

at::Tensor ulysses_unpack_cuda(const at::Tensor& x, int64_t p) {
  return transpose_cuda(x, ulysses_unpack_plan(x, p), "ulysses_unpack");
}

at::Tensor gather_to_last_dim_cuda(const at::Tensor& x, int64_t t) {
  return transpose_cuda(x, gather_to_last_dim_plan(x, t), "gather_to_last_dim");
}

at::Tensor last_dim_to_gather_cuda(const at::Tensor& x, int64_t t) {
  return transpose_cuda(x, last_dim_to_gather_plan(x, t), "last_dim_to_gather");
}

at::Tensor zigzag_reorder_cuda(const at::Tensor& x_in, int64_t p, int64_t dim, bool inverse) {
  const ZigzagPlan plan = zigzag_plan(x_in, p, dim);
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.contiguous(), out = at::empty(x.sizes(), x.options());
  check_launch(cuda::zigzag_reorder(x.const_data_ptr(), out.data_ptr(), plan.outer, p, plan.run * x.element_size(),
                                    inverse, current_stream()),
               "zigzag_reorder");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_sp, CUDA, m) {
  m.impl("ulysses_pack", &ulysses_pack_cuda);
  m.impl("ulysses_unpack", &ulysses_unpack_cuda);
  m.impl("gather_to_last_dim", &gather_to_last_dim_cuda);
  m.impl("last_dim_to_gather", &last_dim_to_gather_cuda);
  m.impl("zigzag_reorder", &zigzag_reorder_cuda);
}

}  // namespace msp

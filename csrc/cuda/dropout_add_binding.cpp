// The CUDA binding of dropout_add: checks (../dropout_add.h), output and scratch allocation, and the launch
// (dropout_add.cu) on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../dropout_add.h"
#include "binding.h"
#include "dropout_add.h"

namespace msp {
namespace {

const void* data_or_null(const at::Tensor& t) { return t.defined() ? t.const_data_ptr() : nullptr; }

at::Tensor da_fwd_cuda(const at::Tensor& x_in, const c10::optional<at::Tensor>& y_in,
                       const c10::optional<at::Tensor>& res_in, const at::Tensor& positions_in,
                       const at::Tensor& samples_in, double p, int64_t seed, int64_t layer, int64_t site,
                       int64_t feature_offset, c10::optional<at::ScalarType> out_dtype) {
  const at::ScalarType out_type =
      check_dropout_add(x_in, y_in, res_in, positions_in, samples_in, p, feature_offset, out_dtype);
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.contiguous(), positions = positions_in.contiguous(), samples = samples_in.contiguous();
  at::Tensor y = y_in.has_value() ? y_in->contiguous() : at::Tensor();
  at::Tensor res = res_in.has_value() ? res_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_type));
  const bool is_bias = y.defined() && y.dim() == 1;
  cuda::DropoutAddFwd args{x.const_data_ptr(),
                           is_bias ? y.const_data_ptr() : nullptr,
                           is_bias ? nullptr : data_or_null(y),
                           data_or_null(res),
                           out.data_ptr(),
                           positions.const_data_ptr<int64_t>(),
                           samples.const_data_ptr<int64_t>(),
                           x.size(0),
                           x.size(1),
                           x.size(2),
                           cuda_dtype(x.scalar_type()),
                           cuda_dtype(out_type),
                           make_dropout_params(p, seed, layer, site, feature_offset)};
  check_launch(cuda::dropout_add_fwd(args, current_stream()), "dropout_add_fwd");
  return out;
}

std::tuple<at::Tensor, at::Tensor> da_bwd_cuda(const at::Tensor& grad_in, const at::Tensor& pos_in,
                                               const at::Tensor& samples_in, double p, int64_t seed, int64_t layer,
                                               int64_t site, int64_t feature_offset, bool bias_grad,
                                               c10::optional<at::ScalarType> grad_x_dtype) {
  const at::ScalarType dx_type = check_dropout_add_bwd(grad_in, pos_in, samples_in, p, feature_offset, grad_x_dtype);
  c10::cuda::CUDAGuard guard(grad_in.device());
  at::Tensor g = grad_in.contiguous(), gx = at::empty(g.sizes(), g.options().dtype(dx_type));
  at::Tensor positions = pos_in.contiguous(), samples = samples_in.contiguous();
  const int64_t s = g.size(0), b = g.size(1), h = g.size(2);
  const cuda::DType dtype = cuda_dtype(g.scalar_type());
  at::Tensor gbias = at::empty({bias_grad ? h : 0}, g.options().dtype(at::kFloat));
  at::Tensor scratch =
      at::empty({bias_grad ? cuda::dropout_add_bwd_scratch(s, b, h, dtype) : 0}, g.options().dtype(at::kFloat));
  cuda::DropoutAddBwd args{g.const_data_ptr(),
                           gx.data_ptr(),
                           bias_grad ? gbias.data_ptr<float>() : nullptr,
                           scratch.data_ptr<float>(),
                           positions.const_data_ptr<int64_t>(),
                           samples.const_data_ptr<int64_t>(),
                           s,
                           b,
                           h,
                           dtype,
                           cuda_dtype(dx_type),
                           make_dropout_params(p, seed, layer, site, feature_offset)};
  check_launch(cuda::dropout_add_bwd(args, current_stream()), "dropout_add_bwd");
  return {gx, gbias};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_sp, CUDA, m) {
  m.impl("dropout_add_fwd", &da_fwd_cuda);
  m.impl("dropout_add_bwd", &da_bwd_cuda);
}

}  // namespace msp

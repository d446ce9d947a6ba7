// The CUDA binding of layer_norm: checks (../layer_norm.h), output and scratch allocation, and the launch
// (layer_norm.cu) on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../layer_norm.h"
#include "binding.h"
#include "layer_norm.h"

namespace msp {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> ln_fwd_cuda(const at::Tensor& x_in, const at::Tensor& w_in,
                                                           const at::Tensor& b_in, double eps) {
  const int64_t h = check_layer_norm(x_in, w_in, b_in);
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), b = b_in.contiguous();
  const int64_t rows = x.numel() / h;
  at::Tensor y = at::empty_like(x);
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat)), rstd = at::empty_like(mean);
  cuda::LayerNormFwd args{x.const_data_ptr(),
                          w.const_data_ptr(),
                          b.const_data_ptr(),
                          y.data_ptr(),
                          mean.data_ptr<float>(),
                          rstd.data_ptr<float>(),
                          rows,
                          h,
                          static_cast<float>(eps),
                          cuda_dtype(x.scalar_type()),
                          cuda_dtype(w.scalar_type())};
  check_launch(cuda::layer_norm_fwd(args, current_stream()), "layer_norm_fwd");
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ln_bwd_cuda(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                           const at::Tensor& w_in, const at::Tensor& mean_in,
                                                           const at::Tensor& rstd_in) {
  int64_t rows = 0;
  const int64_t h = check_layer_norm_bwd(dy_in, x_in, w_in, mean_in, rstd_in, &rows);
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), w = w_in.contiguous();
  at::Tensor mean = mean_in.contiguous(), rstd = rstd_in.contiguous(), dx = at::empty_like(x);
  const cuda::DType dtype = cuda_dtype(x.scalar_type());
  at::Tensor sums = at::empty({2 * h}, x.options().dtype(at::kFloat));
  at::Tensor scratch = at::empty({cuda::layer_norm_bwd_scratch(rows, h, dtype)}, x.options().dtype(at::kFloat));
  cuda::LayerNormBwd args{dy.const_data_ptr(),
                          x.const_data_ptr(),
                          w.const_data_ptr(),
                          mean.const_data_ptr<float>(),
                          rstd.const_data_ptr<float>(),
                          dx.data_ptr(),
                          sums.data_ptr<float>(),
                          scratch.data_ptr<float>(),
                          rows,
                          h,
                          dtype,
                          cuda_dtype(w.scalar_type())};
  check_launch(cuda::layer_norm_bwd(args, current_stream()), "layer_norm_bwd");
  // Copies: the two gradients must not share one storage (optimisers update them in place).
  at::Tensor gw = sums.narrow(0, 0, h).to(w.scalar_type(), false, /*copy=*/true);
  at::Tensor gb = sums.narrow(0, h, h).to(w.scalar_type(), false, /*copy=*/true);
  return {dx, gw, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_sp, CUDA, m) {
  m.impl("layer_norm_fwd", &ln_fwd_cuda);
  m.impl("layer_norm_bwd", &ln_bwd_cuda);
}

}  // namespace msp

// The CUDA binding of rms_norm: checks (../rms_norm.h), output and scratch allocation, and the launch
// (rms_norm.cu) on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../rms_norm.h"
#include "binding.h"
#include "rms_norm.h"

namespace msp {
namespace {

std::tuple<at::Tensor, at::Tensor> rms_fwd_cuda(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  const int64_t h = check_rms_norm(x_in, w_in);
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t rows = x.numel() / h;
  at::Tensor y = at::empty_like(x), rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  cuda::RmsNormFwd args{x.const_data_ptr(),
                        w.const_data_ptr(),
                        y.data_ptr(),
                        rstd.data_ptr<float>(),
                        rows,
                        h,
                        static_cast<float>(eps),
                        cuda_dtype(x.scalar_type()),
                        cuda_dtype(w.scalar_type())};
  check_launch(cuda::rms_norm_fwd(args, current_stream()), "rms_norm_fwd");
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_bwd_cuda(const at::Tensor& dy_in, const at::Tensor& x_in, const at::Tensor& w_in,
                                                const at::Tensor& rstd_in) {
  int64_t rows = 0;
  const int64_t h = check_rms_norm_bwd(dy_in, x_in, w_in, rstd_in, &rows);
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), w = w_in.contiguous();
  at::Tensor rstd = rstd_in.contiguous(), dx = at::empty_like(x);
  const cuda::DType dtype = cuda_dtype(x.scalar_type());
  at::Tensor gw = at::empty({h}, x.options().dtype(at::kFloat));
  at::Tensor scratch = at::empty({cuda::rms_norm_bwd_scratch(rows, h, dtype)}, x.options().dtype(at::kFloat));
  cuda::RmsNormBwd args{dy.const_data_ptr(),
                        x.const_data_ptr(),
                        w.const_data_ptr(),
                        rstd.const_data_ptr<float>(),
                        dx.data_ptr(),
                        gw.data_ptr<float>(),
                        scratch.data_ptr<float>(),
                        rows,
                        h,
                        dtype,
                        cuda_dtype(w.scalar_type())};
  check_launch(cuda::rms_norm_bwd(args, current_stream()), "rms_norm_bwd");
  return {dx, gw.to(w.scalar_type())};  // fp32 weights: gw itself, a tensor of its own
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_sp, CUDA, m) {
  m.impl("rms_norm_fwd", &rms_fwd_cuda);
  m.impl("rms_norm_bwd", &rms_bwd_cuda);
}

}  // namespace msp

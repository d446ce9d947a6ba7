// The CUDA binding of embedding_dropout: checks (../embedding_dropout.h), output allocation, and the launch
// (embedding_dropout.cu) on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../embedding_dropout.h"
#include "binding.h"
#include "embedding_dropout.h"

namespace msp {
namespace {

at::Tensor emb_fwd_cuda(const at::Tensor& x_in, const c10::optional<at::Tensor>& y_in, const at::Tensor& positions_in,
                        const at::Tensor& samples_in, double p, int64_t seed, int64_t layer, int64_t site,
                        int64_t feature_offset, c10::optional<at::ScalarType> out_dtype) {
  const at::ScalarType out_type =
      check_embedding_dropout(x_in, y_in, positions_in, samples_in, p, feature_offset, out_dtype);
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.contiguous(), positions = positions_in.contiguous(), samples = samples_in.contiguous();
  at::Tensor y = y_in.has_value() ? y_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_type));
  cuda::EmbeddingDropoutFwd args{x.const_data_ptr(),
                                 y.defined() ? y.const_data_ptr() : nullptr,
                                 out.data_ptr(),
                                 positions.const_data_ptr<int64_t>(),
                                 samples.const_data_ptr<int64_t>(),
                                 x.size(0),
                                 x.size(1),
                                 x.size(2),
                                 cuda_dtype(x.scalar_type()),
                                 cuda_dtype(out_type),
                                 make_dropout_params(p, seed, layer, site, feature_offset)};
  check_launch(cuda::embedding_dropout_fwd(args, current_stream()), "embedding_dropout_fwd");
  return out;
}

at::Tensor emb_bwd_cuda(const at::Tensor& grad_in, const at::Tensor& positions_in, const at::Tensor& samples_in,
                        double p, int64_t seed, int64_t layer, int64_t site, int64_t feature_offset,
                        at::ScalarType grad_dtype) {
  check_embedding_dropout_bwd(grad_in, positions_in, samples_in, p, feature_offset, grad_dtype);
  c10::cuda::CUDAGuard guard(grad_in.device());
  at::Tensor g = grad_in.contiguous(), positions = positions_in.contiguous(), samples = samples_in.contiguous();
  at::Tensor gx = at::empty(g.sizes(), g.options().dtype(grad_dtype));
  cuda::EmbeddingDropoutBwd args{g.const_data_ptr(),
                                 gx.data_ptr(),
                                 positions.const_data_ptr<int64_t>(),
                                 samples.const_data_ptr<int64_t>(),
                                 g.size(0),
                                 g.size(1),
                                 g.size(2),
                                 cuda_dtype(g.scalar_type()),
                                 cuda_dtype(grad_dtype),
                                 make_dropout_params(p, seed, layer, site, feature_offset)};
  check_launch(cuda::embedding_dropout_bwd(args, current_stream()), "embedding_dropout_bwd");
  return gx;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_sp, CUDA, m) {
  m.impl("embedding_dropout_fwd", &emb_fwd_cuda);
  m.impl("embedding_dropout_bwd", &emb_bwd_cuda);
}

}  // namespace msp

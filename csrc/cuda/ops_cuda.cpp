// CUDA bindings of the megatron_sp ops: argument checks (shared with the CPU, op_checks.h), output
// allocation, and a call into the torch-free launchers (launchers.h) on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../op_checks.h"
#include "launchers.h"

namespace msp {
namespace {

cuda::DType cuda_dtype(at::ScalarType t) {
  if (t == at::kBFloat16) return cuda::DType::kBF16;
  if (t == at::kHalf) return cuda::DType::kF16;
  TORCH_CHECK(t == at::kFloat, "megatron_sp CUDA ops support fp32/bf16/fp16, got ", t);
  return cuda::DType::kF32;
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "megatron_sp::", op, " failed to launch: ", cudaGetErrorString(err));
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

at::Tensor bda_fwd_cuda(const at::Tensor& x_in, const c10::optional<at::Tensor>& bias_in, const at::Tensor& res_in,
                        const at::Tensor& positions_in, const at::Tensor& samples_in, double p, int64_t seed,
                        int64_t layer, int64_t site, int64_t feature_offset) {
  check_bias_dropout_add(x_in, bias_in, res_in, positions_in, samples_in, p, feature_offset);
  c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in.contiguous(), res = res_in.contiguous(), out = at::empty_like(x);
  at::Tensor positions = positions_in.contiguous(), samples = samples_in.contiguous();
  at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  cuda::BiasDropoutAddFwd args{x.const_data_ptr(),
                               bias.defined() ? bias.const_data_ptr() : nullptr,
                               res.const_data_ptr(),
                               out.data_ptr(),
                               positions.const_data_ptr<int64_t>(),
                               samples.const_data_ptr<int64_t>(),
                               x.size(0),
                               x.size(1),
                               x.size(2),
                               cuda_dtype(x.scalar_type()),
                               make_dropout_params(p, seed, layer, site, feature_offset)};
  check_launch(cuda::bias_dropout_add_fwd(args, current_stream()), "bias_dropout_add_fwd");
  return out;
}

std::tuple<at::Tensor, at::Tensor> bda_bwd_cuda(const at::Tensor& grad_in, const at::Tensor& pos_in,
                                                const at::Tensor& samples_in, double p, int64_t seed, int64_t layer,
                                                int64_t site, int64_t feature_offset, bool bias_grad) {
  TORCH_CHECK(grad_in.dim() == 3, "bias_dropout_add_bwd expects grad_out [s, b, h], got ", grad_in.sizes());
  check_dropout_index(pos_in, samples_in, grad_in.size(0), grad_in.size(1), grad_in);
  check_dropout_scalars(p, feature_offset);
  c10::cuda::CUDAGuard guard(grad_in.device());
  at::Tensor g = grad_in.contiguous(), gx = at::empty_like(g);
  at::Tensor positions = pos_in.contiguous(), samples = samples_in.contiguous();
  const int64_t s = g.size(0), b = g.size(1), h = g.size(2);
  const cuda::DType dtype = cuda_dtype(g.scalar_type());
  at::Tensor gbias = at::empty({bias_grad ? h : 0}, g.options().dtype(at::kFloat));
  at::Tensor scratch =
      at::empty({bias_grad ? cuda::bias_dropout_add_bwd_scratch(s, b, h, dtype) : 0}, g.options().dtype(at::kFloat));
  cuda::BiasDropoutAddBwd args{g.const_data_ptr(),
                               gx.data_ptr(),
                               bias_grad ? gbias.data_ptr<float>() : nullptr,
                               scratch.data_ptr<float>(),
                               positions.const_data_ptr<int64_t>(),
                               samples.const_data_ptr<int64_t>(),
                               s,
                               b,
                               h,
                               dtype,
                               make_dropout_params(p, seed, layer, site, feature_offset)};
  check_launch(cuda::bias_dropout_add_bwd(args, current_stream()), "bias_dropout_add_bwd");
  return {gx, gbias};
}

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

cuda::FlashStrides flash_strides(const at::Tensor& t) {
  if (t.dim() == 3) return {t.stride(0), t.stride(1), t.stride(2), 0};
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// The index tensors of a flash_attention call, made contiguous, and the launch scalars.
struct FlashIndex {
  at::Tensor q_pos, k_pos, q_seg, k_seg, samples;
  DropoutParams drop;

  FlashIndex(const at::Tensor& q_positions, const at::Tensor& k_positions, const c10::optional<at::Tensor>& q_segments,
             const c10::optional<at::Tensor>& k_segments, const at::Tensor& sample_ids, double p, int64_t seed,
             int64_t layer)
      : q_pos(q_positions.contiguous()),
        k_pos(k_positions.contiguous()),
        q_seg(q_segments ? q_segments->contiguous() : at::Tensor()),
        k_seg(k_segments ? k_segments->contiguous() : at::Tensor()),
        samples(sample_ids.contiguous()),
        drop(make_dropout_params(p, seed, layer, /*site=*/1, 0)) {}  // SITE_ATTENTION_PROBS

  const int64_t* seg(const at::Tensor& t) const { return t.defined() ? t.const_data_ptr<int64_t>() : nullptr; }
};

void check_flash_cuda(const at::Tensor& q) {
  TORCH_CHECK(q.size(3) <= cuda::kFlashMaxHeadDim, "flash_attention on CUDA supports head dims up to ",
              cuda::kFlashMaxHeadDim, ", got ", q.size(3));
}

at::Tensor seq_major_like(const at::Tensor& t) {  // [b, n, s, d] view of an [s, b, n, d] tensor
  return at::empty({t.size(2), t.size(0), t.size(1), t.size(3)}, t.options()).permute({1, 2, 0, 3});
}

std::tuple<at::Tensor, at::Tensor> flash_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& q_positions, const at::Tensor& k_positions,
                                                  const c10::optional<at::Tensor>& q_segments,
                                                  const c10::optional<at::Tensor>& k_segments,
                                                  const at::Tensor& sample_ids, double p, int64_t seed, int64_t layer,
                                                  int64_t head_offset) {
  check_flash_attention(q, k, v, q_positions, k_positions, q_segments, k_segments, sample_ids, p, head_offset);
  check_flash_cuda(q);
  c10::cuda::CUDAGuard guard(q.device());
  const FlashIndex ix(q_positions, k_positions, q_segments, k_segments, sample_ids, p, seed, layer);
  at::Tensor out = seq_major_like(q);
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  cuda::FlashAttentionFwd args{q.const_data_ptr(),
                               k.const_data_ptr(),
                               v.const_data_ptr(),
                               flash_strides(q),
                               flash_strides(k),
                               flash_strides(v),
                               ix.q_pos.const_data_ptr<int64_t>(),
                               ix.k_pos.const_data_ptr<int64_t>(),
                               ix.seg(ix.q_seg),
                               ix.seg(ix.k_seg),
                               ix.samples.const_data_ptr<int64_t>(),
                               out.data_ptr(),
                               lse.data_ptr<float>(),
                               q.size(0),
                               q.size(1),
                               k.size(1),
                               q.size(2),
                               k.size(2),
                               q.size(3),
                               cuda_dtype(q.scalar_type()),
                               ix.drop,
                               p > 0.0,
                               head_offset};
  check_launch(cuda::flash_attention_fwd(args, current_stream()), "flash_attention_fwd");
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& q_positions, const at::Tensor& k_positions,
    const c10::optional<at::Tensor>& q_segments, const c10::optional<at::Tensor>& k_segments,
    const at::Tensor& sample_ids, double p, int64_t seed, int64_t layer, int64_t head_offset) {
  check_flash_attention(q, k, v, q_positions, k_positions, q_segments, k_segments, sample_ids, p, head_offset);
  check_flash_attention_bwd(dout, out, lse, q);
  check_flash_cuda(q);
  c10::cuda::CUDAGuard guard(q.device());
  const FlashIndex ix(q_positions, k_positions, q_segments, k_segments, sample_ids, p, seed, layer);
  at::Tensor dq = seq_major_like(q), dk = seq_major_like(k), dv = seq_major_like(v);
  const int64_t scratch_floats = cuda::flash_attention_bwd_scratch(q.size(0), q.size(1), q.size(2));
  at::Tensor scratch = at::empty({scratch_floats}, q.options().dtype(at::kFloat));
  cuda::FlashAttentionBwd args{dout.const_data_ptr(),
                               q.const_data_ptr(),
                               k.const_data_ptr(),
                               v.const_data_ptr(),
                               out.const_data_ptr(),
                               flash_strides(dout),
                               flash_strides(q),
                               flash_strides(k),
                               flash_strides(v),
                               flash_strides(out),
                               lse.const_data_ptr<float>(),
                               flash_strides(lse),
                               ix.q_pos.const_data_ptr<int64_t>(),
                               ix.k_pos.const_data_ptr<int64_t>(),
                               ix.seg(ix.q_seg),
                               ix.seg(ix.k_seg),
                               ix.samples.const_data_ptr<int64_t>(),
                               dq.data_ptr(),
                               dk.data_ptr(),
                               dv.data_ptr(),
                               scratch.data_ptr<float>(),
                               q.size(0),
                               q.size(1),
                               k.size(1),
                               q.size(2),
                               k.size(2),
                               q.size(3),
                               cuda_dtype(q.scalar_type()),
                               ix.drop,
                               p > 0.0,
                               head_offset};
  check_launch(cuda::flash_attention_bwd(args, current_stream()), "flash_attention_bwd");
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_sp, CUDA, m) {
  m.impl("bias_dropout_add_fwd", &bda_fwd_cuda);
  m.impl("bias_dropout_add_bwd", &bda_bwd_cuda);
  m.impl("layer_norm_fwd", &ln_fwd_cuda);
  m.impl("layer_norm_bwd", &ln_bwd_cuda);
  m.impl("rms_norm_fwd", &rms_fwd_cuda);
  m.impl("rms_norm_bwd", &rms_bwd_cuda);
  m.impl("ulysses_pack", &ulysses_pack_cuda);
  m.impl("ulysses_unpack", &ulysses_unpack_cuda);
  m.impl("gather_to_last_dim", &gather_to_last_dim_cuda);
  m.impl("last_dim_to_gather", &last_dim_to_gather_cuda);
  m.impl("zigzag_reorder", &zigzag_reorder_cuda);
  m.impl("flash_attention_fwd", &flash_fwd_cuda);
  m.impl("flash_attention_bwd", &flash_bwd_cuda);
}

}  // namespace msp

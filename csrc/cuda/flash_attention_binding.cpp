// The CUDA binding of flash_attention: checks (../flash_attention.h), output and scratch allocation, and the
// launches (flash_attention.cu) on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../flash_attention.h"
#include "binding.h"
#include "flash_attention.h"

namespace msp {
namespace {

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

// Device scratch of `bytes` (at least 1: a pointer to pass) on t's device.
at::Tensor scratch_for(int64_t bytes, const at::Tensor& t) {
  return at::empty({bytes > 0 ? bytes : 1}, t.options().dtype(at::kByte));
}

at::Tensor seq_major_like(const at::Tensor& t) {  // [b, n, s, d] view of an [s, b, n, d] tensor
  return at::empty({t.size(2), t.size(0), t.size(1), t.size(3)}, t.options()).permute({1, 2, 0, 3});
}

std::tuple<at::Tensor, at::Tensor> flash_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& q_positions, const at::Tensor& k_positions,
                                                  const c10::optional<at::Tensor>& q_segments,
                                                  const c10::optional<at::Tensor>& k_segments,
                                                  const at::Tensor& sample_ids, double p, int64_t seed, int64_t layer,
                                                  int64_t head_offset, int64_t window) {
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
                               nullptr,
                               q.size(0),
                               q.size(1),
                               k.size(1),
                               q.size(2),
                               k.size(2),
                               q.size(3),
                               cuda_dtype(q.scalar_type()),
                               ix.drop,
                               p > 0.0,
                               head_offset,
                               window};
  const at::Tensor scratch = scratch_for(cuda::flash_attention_fwd_scratch(args), q);
  args.scratch = scratch.data_ptr();
  check_launch(cuda::flash_attention_fwd(args, current_stream()), "flash_attention_fwd");
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& q_positions, const at::Tensor& k_positions,
    const c10::optional<at::Tensor>& q_segments, const c10::optional<at::Tensor>& k_segments,
    const at::Tensor& sample_ids, double p, int64_t seed, int64_t layer, int64_t head_offset, int64_t window) {
  check_flash_attention(q, k, v, q_positions, k_positions, q_segments, k_segments, sample_ids, p, head_offset);
  check_flash_attention_bwd(dout, out, lse, q);
  check_flash_cuda(q);
  c10::cuda::CUDAGuard guard(q.device());
  const FlashIndex ix(q_positions, k_positions, q_segments, k_segments, sample_ids, p, seed, layer);
  at::Tensor dq = seq_major_like(q), dk = seq_major_like(k), dv = seq_major_like(v);
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
                               nullptr,
                               q.size(0),
                               q.size(1),
                               k.size(1),
                               q.size(2),
                               k.size(2),
                               q.size(3),
                               cuda_dtype(q.scalar_type()),
                               ix.drop,
                               p > 0.0,
                               head_offset,
                               window};
  const at::Tensor scratch = scratch_for(cuda::flash_attention_bwd_scratch(args), q);
  args.scratch = scratch.data_ptr();
  check_launch(cuda::flash_attention_bwd(args, current_stream()), "flash_attention_bwd");
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_sp, CUDA, m) {
  m.impl("flash_attention_fwd", &flash_fwd_cuda);
  m.impl("flash_attention_bwd", &flash_bwd_cuda);
}

}  // namespace msp

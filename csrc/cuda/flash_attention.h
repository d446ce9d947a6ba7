// The launchers of flash_attention's CUDA kernels (flash_attention.cu), called by its binding
// (flash_attention_binding.cpp). Torch-free (see dtype.h): the kernels include it, and so does the binding.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../philox.h"
#include "dtype.h"

namespace msp {
namespace cuda {

// Element strides of a [b, n, s, d] tensor (lse [b, n, s]: d unused).
struct FlashStrides {
  int64_t b, n, s, d;
};

constexpr int64_t kFlashMaxHeadDim = 128;  // the kernels' shared-memory tiles are sized for it

struct FlashAttentionFwd {
  const void *q, *k, *v;  // [b, nq, sq, d], [b, nkv, sk, d]: dtype, any strides
  FlashStrides q_strides, k_strides, v_strides;
  const int64_t* q_positions;     // [sq]
  const int64_t* k_positions;     // [sk]
  const int64_t* q_segments;      // [b, sq] contiguous, or nullptr (then k_segments too)
  const int64_t* k_segments;      // [b, sk]
  const int64_t* samples;         // [b]
  void* out;                      // [sq, b, nq, d] contiguous, dtype
  float* lse;                     // [b, nq, sq]
  void* scratch;                  // flash_attention_fwd_scratch(*this) bytes, 16-byte aligned
  int64_t b, nq, nkv, sq, sk, d;  // 0 < d <= kFlashMaxHeadDim, nq % nkv == 0, b, nq <= 65535
  DType dtype;                    // (else cudaErrorInvalidValue)
  DropoutParams drop;             // the attention-probability site (feature_offset unused)
  bool dropout;                   // p > 0
  int64_t head_offset;            // global index of local query head 0
  int64_t window;                 // a key is visible only when q - k <= window; < 0: no sliding window
};

struct FlashAttentionBwd {
  const void *dout, *q, *k, *v, *out;  // dtype, any strides; dout, out like q
  FlashStrides dout_strides, q_strides, k_strides, v_strides, out_strides;
  const float* lse;  // [b, nq, sq], any strides
  FlashStrides lse_strides;
  const int64_t *q_positions, *k_positions, *q_segments, *k_segments, *samples;  // as above
  void *dq, *dk, *dv;                                                            // [s, b, n, d] contiguous, dtype
  void* scratch;                  // flash_attention_bwd_scratch(*this) bytes, 16-byte aligned
  int64_t b, nq, nkv, sq, sk, d;  // as in the forward
  DType dtype;
  DropoutParams drop;
  bool dropout;
  int64_t head_offset;
  int64_t window;
};

// Bytes of device scratch a call needs (sizes, dtype and positions' presence of args; its pointers unused).
int64_t flash_attention_fwd_scratch(const FlashAttentionFwd& args);
int64_t flash_attention_bwd_scratch(const FlashAttentionBwd& args);
cudaError_t flash_attention_fwd(const FlashAttentionFwd& args, cudaStream_t stream);
cudaError_t flash_attention_bwd(const FlashAttentionBwd& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace msp

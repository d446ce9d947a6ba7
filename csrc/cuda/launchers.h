// Host-side entry points of the CUDA kernels: raw pointers, sizes and a stream, no torch types.
//
// Design: the kernels (csrc/cuda/*.cu) include only CUDA headers and this file, so nvcc can compile
// them alone (tests/test_cuda_compile.py does, on machines without a GPU or a CUDA torch); the torch
// binding (ops_cuda.cpp) checks arguments, allocates outputs and calls these. Every launcher
// returns the launch's cudaError_t; the binding turns a failure into a Python error.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "../philox.h"

namespace msp {
namespace cuda {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct BiasDropoutAddFwd {
  const void* x;             // [s, b, h], dtype
  const void* bias;          // [h], dtype, or nullptr
  const void* residual;      // [s, b, h], dtype
  void* out;                 // [s, b, h], dtype
  const int64_t* positions;  // [s]
  const int64_t* samples;    // [b]
  int64_t s, b, h;
  DType dtype;
  DropoutParams drop;
};

struct BiasDropoutAddBwd {
  const void* grad;  // [s, b, h], dtype
  void* grad_x;      // [s, b, h], dtype
  float* grad_bias;  // [h] fp32, or nullptr when no bias gradient is wanted
  float* scratch;    // bias_dropout_add_bwd_scratch(...) floats
  const int64_t* positions;
  const int64_t* samples;
  int64_t s, b, h;
  DType dtype;
  DropoutParams drop;
};

struct LayerNormFwd {
  const void* x;       // [rows, h], dtype
  const void* weight;  // [h], weight_dtype
  const void* bias;    // [h], weight_dtype
  void* y;             // [rows, h], dtype
  float* mean;         // [rows]
  float* rstd;         // [rows]
  int64_t rows, h;
  float eps;
  DType dtype, weight_dtype;
};

struct LayerNormBwd {
  const void* grad;         // [rows, h], dtype
  const void* x;            // [rows, h], dtype
  const void* weight;       // [h], weight_dtype
  const float* mean;        // [rows]
  const float* rstd;        // [rows]
  void* grad_x;             // [rows, h], dtype
  float* grad_weight_bias;  // [2h] fp32: grad_weight then grad_bias
  float* scratch;           // layer_norm_bwd_scratch(...) floats
  int64_t rows, h;
  DType dtype, weight_dtype;
};

struct RmsNormFwd {
  const void* x;       // [rows, h], dtype
  const void* weight;  // [h], weight_dtype
  void* y;             // [rows, h], dtype
  float* rstd;         // [rows]
  int64_t rows, h;     // rows < 2^31, h > 0 (else cudaErrorInvalidValue)
  float eps;
  DType dtype, weight_dtype;
};

struct RmsNormBwd {
  const void* grad;    // [rows, h], dtype
  const void* x;       // [rows, h], dtype
  const void* weight;  // [h], weight_dtype
  const float* rstd;   // [rows]
  void* grad_x;        // [rows, h], dtype
  float* grad_weight;  // [h] fp32
  float* scratch;      // rms_norm_bwd_scratch(...) floats
  int64_t rows, h;     // h > 0 (else cudaErrorInvalidValue)
  DType dtype, weight_dtype;
};

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
  int64_t b, nq, nkv, sq, sk, d;  // 0 < d <= kFlashMaxHeadDim, nq % nkv == 0, b, nq <= 65535
  DType dtype;                    // (else cudaErrorInvalidValue)
  DropoutParams drop;             // the attention-probability site (feature_offset unused)
  bool dropout;                   // p > 0
  int64_t head_offset;            // global index of local query head 0
};

struct FlashAttentionBwd {
  const void *dout, *q, *k, *v, *out;  // dtype, any strides; dout, out like q
  FlashStrides dout_strides, q_strides, k_strides, v_strides, out_strides;
  const float* lse;  // [b, nq, sq], any strides
  FlashStrides lse_strides;
  const int64_t *q_positions, *k_positions, *q_segments, *k_segments, *samples;  // as above
  void *dq, *dk, *dv;                                                            // [s, b, n, d] contiguous, dtype
  float* scratch;                 // flash_attention_bwd_scratch(b, nq, sq) floats
  int64_t b, nq, nkv, sq, sk, d;  // as in the forward
  DType dtype;
  DropoutParams drop;
  bool dropout;
  int64_t head_offset;
};

int64_t bias_dropout_add_bwd_scratch(int64_t s, int64_t b, int64_t h, DType dtype);
cudaError_t bias_dropout_add_fwd(const BiasDropoutAddFwd& args, cudaStream_t stream);
cudaError_t bias_dropout_add_bwd(const BiasDropoutAddBwd& args, cudaStream_t stream);

int64_t layer_norm_bwd_scratch(int64_t rows, int64_t h, DType dtype);
cudaError_t layer_norm_fwd(const LayerNormFwd& args, cudaStream_t stream);
cudaError_t layer_norm_bwd(const LayerNormBwd& args, cudaStream_t stream);

int64_t rms_norm_bwd_scratch(int64_t rows, int64_t h, DType dtype);
cudaError_t rms_norm_fwd(const RmsNormFwd& args, cudaStream_t stream);
cudaError_t rms_norm_bwd(const RmsNormBwd& args, cudaStream_t stream);

int64_t flash_attention_bwd_scratch(int64_t b, int64_t nq, int64_t sq);
cudaError_t flash_attention_fwd(const FlashAttentionFwd& args, cudaStream_t stream);
cudaError_t flash_attention_bwd(const FlashAttentionBwd& args, cudaStream_t stream);

// dst run o <- src run transpose_source(o, a, b) for o < a*b: [a, b, run] -> [b, a, run].
cudaError_t block_transpose(const void* src, void* dst, int64_t a, int64_t b, int64_t run_bytes, cudaStream_t stream);
// dst [outer, 2p, run] <- src chunks in zigzag order (layout_index.h).
cudaError_t zigzag_reorder(const void* src, void* dst, int64_t outer, int64_t p, int64_t run_bytes, bool inverse,
                           cudaStream_t stream);

}  // namespace cuda
}  // namespace msp

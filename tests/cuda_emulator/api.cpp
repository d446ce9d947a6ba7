// C entry points (for ctypes) to the CUDA launchers of csrc/cuda/launchers.h, built against the
// emulator. Pointers are host memory; dtype codes are msp::cuda::DType (0 fp32, 1 bf16, 2 fp16).
#include "cuda/launchers.h"

using msp::cuda::DType;

extern "C" {

void emu_set_sm_count(int sms) { msp_emu::set_sm_count(sms); }

// Traffic counting (library built with sanitizer "traffic"): out = loaded, stored, distinct loaded,
// distinct stored bytes of the region.
int emu_traffic_watch(const void* begin, int64_t bytes) {
  return msp_emu::traffic_watch(begin, static_cast<size_t>(bytes));
}
void emu_traffic_of(int region, uint64_t* out) {
  const msp_emu::Traffic t = msp_emu::traffic_of(region);
  out[0] = t.loaded, out[1] = t.stored, out[2] = t.distinct_loaded, out[3] = t.distinct_stored;
}
void emu_traffic_clear() { msp_emu::traffic_clear(); }

int64_t emu_bda_bwd_scratch(int64_t s, int64_t b, int64_t h, int dtype) {
  return msp::cuda::bias_dropout_add_bwd_scratch(s, b, h, static_cast<DType>(dtype));
}

int emu_bda_fwd(const void* x, const void* bias, const void* residual, void* out, const int64_t* positions,
                const int64_t* samples, int64_t s, int64_t b, int64_t h, int dtype, double p, int64_t seed,
                int64_t layer, int64_t site, int64_t feature_offset) {
  msp::cuda::BiasDropoutAddFwd a{x,
                                 bias,
                                 residual,
                                 out,
                                 positions,
                                 samples,
                                 s,
                                 b,
                                 h,
                                 static_cast<DType>(dtype),
                                 msp::make_dropout_params(p, seed, layer, site, feature_offset)};
  return msp::cuda::bias_dropout_add_fwd(a, nullptr);
}

int emu_bda_bwd(const void* grad, void* grad_x, float* grad_bias, float* scratch, const int64_t* positions,
                const int64_t* samples, int64_t s, int64_t b, int64_t h, int dtype, double p, int64_t seed,
                int64_t layer, int64_t site, int64_t feature_offset) {
  msp::cuda::BiasDropoutAddBwd a{grad,
                                 grad_x,
                                 grad_bias,
                                 scratch,
                                 positions,
                                 samples,
                                 s,
                                 b,
                                 h,
                                 static_cast<DType>(dtype),
                                 msp::make_dropout_params(p, seed, layer, site, feature_offset)};
  return msp::cuda::bias_dropout_add_bwd(a, nullptr);
}

int64_t emu_ln_bwd_scratch(int64_t rows, int64_t h, int dtype) {
  return msp::cuda::layer_norm_bwd_scratch(rows, h, static_cast<DType>(dtype));
}

int emu_ln_fwd(const void* x, const void* weight, const void* bias, void* y, float* mean, float* rstd, int64_t rows,
               int64_t h, float eps, int dtype, int weight_dtype) {
  msp::cuda::LayerNormFwd a{
      x, weight, bias, y, mean, rstd, rows, h, eps, static_cast<DType>(dtype), static_cast<DType>(weight_dtype)};
  return msp::cuda::layer_norm_fwd(a, nullptr);
}

int emu_ln_bwd(const void* grad, const void* x, const void* weight, const float* mean, const float* rstd, void* grad_x,
               float* grad_weight_bias, float* scratch, int64_t rows, int64_t h, int dtype, int weight_dtype) {
  msp::cuda::LayerNormBwd a{grad,
                            x,
                            weight,
                            mean,
                            rstd,
                            grad_x,
                            grad_weight_bias,
                            scratch,
                            rows,
                            h,
                            static_cast<DType>(dtype),
                            static_cast<DType>(weight_dtype)};
  return msp::cuda::layer_norm_bwd(a, nullptr);
}

int64_t emu_rms_bwd_scratch(int64_t rows, int64_t h, int dtype) {
  return msp::cuda::rms_norm_bwd_scratch(rows, h, static_cast<DType>(dtype));
}

int emu_rms_fwd(const void* x, const void* weight, void* y, float* rstd, int64_t rows, int64_t h, float eps, int dtype,
                int weight_dtype) {
  msp::cuda::RmsNormFwd a{
      x, weight, y, rstd, rows, h, eps, static_cast<DType>(dtype), static_cast<DType>(weight_dtype)};
  return msp::cuda::rms_norm_fwd(a, nullptr);
}

int emu_rms_bwd(const void* grad, const void* x, const void* weight, const float* rstd, void* grad_x,
                float* grad_weight, float* scratch, int64_t rows, int64_t h, int dtype, int weight_dtype) {
  msp::cuda::RmsNormBwd a{grad,
                          x,
                          weight,
                          rstd,
                          grad_x,
                          grad_weight,
                          scratch,
                          rows,
                          h,
                          static_cast<DType>(dtype),
                          static_cast<DType>(weight_dtype)};
  return msp::cuda::rms_norm_bwd(a, nullptr);
}

int emu_block_transpose(const void* src, void* dst, int64_t a, int64_t b, int64_t run_bytes) {
  return msp::cuda::block_transpose(src, dst, a, b, run_bytes, nullptr);
}

int emu_zigzag_reorder(const void* src, void* dst, int64_t outer, int64_t p, int64_t run_bytes, int inverse) {
  return msp::cuda::zigzag_reorder(src, dst, outer, p, run_bytes, inverse != 0, nullptr);
}

// flash_attention: strides are 4 int64 per tensor (b, n, s, d; lse: d ignored) in argument order;
// sizes = (b, nq, nkv, sq, sk, d).
static msp::cuda::FlashStrides strides_at(const int64_t* s, int i) {
  return {s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]};
}

int64_t emu_flash_bwd_scratch(int64_t b, int64_t nq, int64_t sq) {
  return msp::cuda::flash_attention_bwd_scratch(b, nq, sq);
}

int emu_flash_fwd(const void* q, const void* k, const void* v, const int64_t* strides, const int64_t* q_pos,
                  const int64_t* k_pos, const int64_t* q_seg, const int64_t* k_seg, const int64_t* samples, void* out,
                  float* lse, const int64_t* sizes, int dtype, double p, int64_t seed, int64_t layer,
                  int64_t head_offset) {
  msp::cuda::FlashAttentionFwd a{q,
                                 k,
                                 v,
                                 strides_at(strides, 0),
                                 strides_at(strides, 1),
                                 strides_at(strides, 2),
                                 q_pos,
                                 k_pos,
                                 q_seg,
                                 k_seg,
                                 samples,
                                 out,
                                 lse,
                                 sizes[0],
                                 sizes[1],
                                 sizes[2],
                                 sizes[3],
                                 sizes[4],
                                 sizes[5],
                                 static_cast<DType>(dtype),
                                 msp::make_dropout_params(p, seed, layer, 1, 0),
                                 p > 0.0,
                                 head_offset};
  return msp::cuda::flash_attention_fwd(a, nullptr);
}

int emu_flash_bwd(const void* dout, const void* q, const void* k, const void* v, const void* out, const float* lse,
                  const int64_t* strides, const int64_t* q_pos, const int64_t* k_pos, const int64_t* q_seg,
                  const int64_t* k_seg, const int64_t* samples, void* dq, void* dk, void* dv, float* scratch,
                  const int64_t* sizes, int dtype, double p, int64_t seed, int64_t layer, int64_t head_offset) {
  msp::cuda::FlashAttentionBwd a{dout,
                                 q,
                                 k,
                                 v,
                                 out,
                                 strides_at(strides, 0),
                                 strides_at(strides, 1),
                                 strides_at(strides, 2),
                                 strides_at(strides, 3),
                                 strides_at(strides, 4),
                                 lse,
                                 strides_at(strides, 5),
                                 q_pos,
                                 k_pos,
                                 q_seg,
                                 k_seg,
                                 samples,
                                 dq,
                                 dk,
                                 dv,
                                 scratch,
                                 sizes[0],
                                 sizes[1],
                                 sizes[2],
                                 sizes[3],
                                 sizes[4],
                                 sizes[5],
                                 static_cast<DType>(dtype),
                                 msp::make_dropout_params(p, seed, layer, 1, 0),
                                 p > 0.0,
                                 head_offset};
  return msp::cuda::flash_attention_bwd(a, nullptr);
}

}  // extern "C"

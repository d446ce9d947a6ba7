// What the flash_attention CUDA kernels share (flash_attention.cu: entry points and tile summaries;
// flash_attention_simt.cu: the SIMT kernels; flash_attention_fwd_mma.cu / _bwd_mma.cu: the tensor-core
// kernels): the index and dropout of a call, the tile summaries that let a tile pair be skipped or
// left unmasked, and each path's launcher. Torch-free.
#pragma once

#include <math.h>
#include <stdint.h>

#include "../philox.h"
#include "common.cuh"
#include "flash_attention.h"

namespace msp {
namespace cuda {
namespace flash {

constexpr int64_t kNoPosition = INT64_MAX;  // keys past the end: visible to no query
constexpr int64_t kNoWindow = INT64_MAX;    // no sliding window: q - k <= kNoWindow always
constexpr int kTile = 64;                   // rows of a summary tile (the tensor-core tiles are multiples)
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// Everything besides the tensors: sizes, index tensors, dropout.
struct Attn {
  const int64_t *q_pos, *k_pos, *q_seg, *k_seg, *samples;  // segments [b, s] or nullptr
  int64_t b, nq, nkv, sq, sk;
  int d, rep;
  float scale;   // 1 / sqrt(d)
  bool dropout;  // p > 0
  DropoutParams drop;
  int64_t head_offset;
  int64_t window;  // kNoWindow, or visible only when q - k <= window

  // Key kpos visible to query qpos by position (causal, within the window). Evaluated with &&, the
  // difference is taken only for real positions (padding rows and keys fail the first test).
  __device__ __forceinline__ bool sees(int64_t kpos, int64_t qpos) const {
    return kpos <= qpos && qpos - kpos <= window;
  }

  // Multiplier of the attention probability (sample bi, local head h, query qpos, key kpos): one
  // Philox call for one element (the fp32 kernels; the tensor-core ones share a call among 4 keys).
  __device__ __forceinline__ float keep(int64_t bi, int64_t h, int64_t qpos, int64_t kpos) const {
    if (!dropout) return 1.0f;
    return keep_factor(drop, word(head_offset + h, qpos, kpos, samples[bi])) * drop.scale;
  }

  // The element's Philox word: feature = global head * 2^20 + key position (attention_keep_mask).
  __device__ __forceinline__ uint32_t word(int64_t global_head, int64_t qpos, int64_t kpos, int64_t sample) const {
    const int64_t f = (global_head << 20) + kpos;
    const Words4 w = dropout_words(drop, static_cast<uint64_t>(f >> 2), qpos, sample);
    const int lane = static_cast<int>(f & 3);
    return lane == 0 ? w.w[0] : lane == 1 ? w.w[1] : lane == 2 ? w.w[2] : w.w[3];
  }
};

template <typename Args>
Attn attn_of(const Args& x) {
  return Attn{x.q_positions,
              x.k_positions,
              x.q_segments,
              x.k_segments,
              x.samples,
              x.b,
              x.nq,
              x.nkv,
              x.sq,
              x.sk,
              static_cast<int>(x.d),
              static_cast<int>(x.nq / x.nkv),
              static_cast<float>(1.0 / sqrt(static_cast<double>(x.d))),
              x.dropout,
              x.drop,
              x.head_offset,
              x.window < 0 ? kNoWindow : x.window};
}

__host__ __device__ inline unsigned tiles(int64_t n, int tile) { return static_cast<unsigned>((n + tile - 1) / tile); }

// ---- tile summaries ---------------------------------------------------------------------------
// Per kTile rows of a position vector: the smallest and largest position, flags, and per sample the
// smallest and largest document segment. Built once per call (flash_attention.cu), read by every
// block: a tile pair is skipped when no key is visible to any query, left unmasked when all are.

enum Flags : int64_t {
  kAligned = 1,
  kFull = 2
};  // kAligned: every 4 rows 4m..4m+3 hold positions
    // P..P+3 with P % 4 == 0 (one Philox group)
struct Summary {
  const int64_t* tile;  // [tiles][3]: lo, hi, flags
  const int64_t* seg;   // [b][tiles][2]: lo, hi; nullptr without segments
  int64_t tiles;

  __device__ __forceinline__ int64_t lo(int64_t t) const { return tile[3 * t]; }
  __device__ __forceinline__ int64_t hi(int64_t t) const { return tile[3 * t + 1]; }
  __device__ __forceinline__ bool has(int64_t t, int64_t flag) const { return (tile[3 * t + 2] & flag) != 0; }
  __device__ __forceinline__ int64_t seg_lo(int64_t bi, int64_t t) const { return seg[2 * (bi * tiles + t)]; }
  __device__ __forceinline__ int64_t seg_hi(int64_t bi, int64_t t) const { return seg[2 * (bi * tiles + t) + 1]; }
};

// int64 words of the summaries of n positions for b samples.
inline int64_t summary_words(int64_t n, int64_t b, bool segments) {
  return tiles(n, kTile) * (3 + (segments ? 2 * b : 0));
}

inline Summary summary_at(const int64_t* words, int64_t n, int64_t b, bool segments) {
  const int64_t t = tiles(n, kTile);
  return Summary{words, segments ? words + 3 * t : nullptr, t};
}

enum class Visibility { kNone, kSome, kAll };

// Query summary tiles [qt, qt + nqt) (clipped) against key tile kt, for sample bi; window: Attn's.
__device__ __forceinline__ Visibility visibility(const Summary& q, int64_t qt, int nqt, const Summary& k, int64_t kt,
                                                 int64_t bi, int64_t window) {
  int64_t q_lo = kNoPosition, q_hi = -kNoPosition - 1, s_lo = kNoPosition, s_hi = -kNoPosition - 1;
  bool full = k.has(kt, kFull) && qt + nqt <= q.tiles;
  for (int64_t t = qt; t < qt + nqt && t < q.tiles; ++t) {
    q_lo = q.lo(t) < q_lo ? q.lo(t) : q_lo, q_hi = q.hi(t) > q_hi ? q.hi(t) : q_hi;
    full = full && q.has(t, kFull);
    if (q.seg)
      s_lo = q.seg_lo(bi, t) < s_lo ? q.seg_lo(bi, t) : s_lo, s_hi = q.seg_hi(bi, t) > s_hi ? q.seg_hi(bi, t) : s_hi;
  }
  if (k.lo(kt) > q_hi) return Visibility::kNone;
  if (window != kNoWindow && q_lo - k.hi(kt) > window) return Visibility::kNone;  // positions are real here
  bool all = full && k.hi(kt) <= q_lo && (window == kNoWindow || q_hi - k.lo(kt) <= window);
  if (q.seg) {
    const int64_t ks_lo = k.seg_lo(bi, kt), ks_hi = k.seg_hi(bi, kt);
    if (ks_hi < s_lo || ks_lo > s_hi) return Visibility::kNone;
    all = all && s_lo == s_hi && ks_lo == ks_hi && s_lo == ks_lo;
  }
  return all ? Visibility::kAll : Visibility::kSome;
}

// ---- launchers of the paths (flash_attention.cu picks one) -----------------------------------

struct FlashIndexSummaries {
  Summary q, k;
};

// The fp32 SIMT kernels (any dtype; fp32 always, 16-bit on GPUs before sm_80).
cudaError_t simt_fwd(const FlashAttentionFwd& x, cudaStream_t stream);
cudaError_t simt_bwd(const FlashAttentionBwd& x, float* delta, cudaStream_t stream);
// The tensor-core kernels (bf16/fp16, sm_80+); scratch: flash_attention.cu's layout.
cudaError_t mma_fwd(const FlashAttentionFwd& x, const FlashIndexSummaries& sums, cudaStream_t stream);
cudaError_t mma_bwd(const FlashAttentionBwd& x, const FlashIndexSummaries& sums, float* delta, float* dq_accum,
                    cudaStream_t stream);

}  // namespace flash
}  // namespace cuda
}  // namespace msp

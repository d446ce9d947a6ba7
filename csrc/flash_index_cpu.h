// Visibility and dropout bookkeeping of the CPU blockwise attention (flash_attention.cpp,
// flash_attention_bwd.cpp): per-block summaries of the positions and document segments that
// let a block pair be skipped (nothing visible) or left unmasked (everything visible), the row
// mask, and the attention-dropout words (philox.py's attention_keep_mask, bit for bit).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "flash_block_cpu.h"
#include "philox.h"
#include "philox_cpu.h"

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast", "no-trapping-math")

namespace msp {
namespace flash {

constexpr int64_t kSiteAttentionProbs = 1;  // philox.py's SITE_ATTENTION_PROBS

struct Strides {
  int64_t b, n, s, d;
};

inline Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)}; }

struct BlockRange {
  int64_t lo, hi;    // smallest and largest value in the block
  bool consecutive;  // values[j] == values[0] + j (key positions: Philox groups in a row)
};

inline std::vector<BlockRange> block_ranges(const int64_t* values, int64_t n) {
  std::vector<BlockRange> out;
  for (int64_t s = 0; s < n; s += kBlock) {
    BlockRange r{values[s], values[s], true};
    for (int64_t j = s; j < std::min(n, s + kBlock); ++j) {
      r.lo = std::min(r.lo, values[j]), r.hi = std::max(r.hi, values[j]);
      r.consecutive = r.consecutive && values[j] == values[s] + (j - s);
    }
    out.push_back(r);
  }
  return out;
}

enum class Visibility { kNone, kAll, kSome };

// Positions, segments and sample ids of one call, with their per-block summaries; window: a key is
// visible only when query position - key position <= window (kNoWindow: no sliding window).
constexpr int64_t kNoWindow = INT64_MAX;

struct AttnIndex {
  const int64_t *q_pos, *k_pos, *q_seg, *k_seg, *samples;  // segments [b, s] or nullptr
  int64_t sq, sk, nqb, nkb, window;
  std::vector<BlockRange> qb, kb, qsegb, ksegb;  // segment ranges: [b][blocks]

  Visibility visibility(int64_t bi, int64_t i, int64_t j) const {
    const BlockRange &q = qb[i], &k = kb[j];
    if (k.lo > q.hi) return Visibility::kNone;
    if (window != kNoWindow && q.lo - k.hi > window) return Visibility::kNone;  // the window ends before
    bool all = k.hi <= q.lo && (window == kNoWindow || q.hi - k.lo <= window);
    if (q_seg != nullptr) {
      const BlockRange &qs = qsegb[bi * nqb + i], &ks = ksegb[bi * nkb + j];
      if (ks.hi < qs.lo || ks.lo > qs.hi) return Visibility::kNone;
      all = all && qs.lo == qs.hi && ks.lo == ks.hi && qs.lo == ks.lo;
    }
    return all ? Visibility::kAll : Visibility::kSome;
  }
};

inline AttnIndex make_index(const at::Tensor& q_pos, const at::Tensor& k_pos, const at::Tensor& q_seg,
                            const at::Tensor& k_seg, const at::Tensor& samples, int64_t window) {
  AttnIndex ix;
  ix.window = window < 0 ? kNoWindow : window;
  ix.q_pos = q_pos.data_ptr<int64_t>(), ix.k_pos = k_pos.data_ptr<int64_t>();
  ix.q_seg = q_seg.defined() ? q_seg.data_ptr<int64_t>() : nullptr;
  ix.k_seg = k_seg.defined() ? k_seg.data_ptr<int64_t>() : nullptr;
  ix.samples = samples.data_ptr<int64_t>();
  ix.sq = q_pos.size(0), ix.sk = k_pos.size(0);
  ix.nqb = (ix.sq + kBlock - 1) / kBlock, ix.nkb = (ix.sk + kBlock - 1) / kBlock;
  ix.qb = block_ranges(ix.q_pos, ix.sq), ix.kb = block_ranges(ix.k_pos, ix.sk);
  for (int64_t bi = 0; ix.q_seg != nullptr && bi < samples.size(0); ++bi) {
    for (const BlockRange& r : block_ranges(ix.q_seg + bi * ix.sq, ix.sq)) ix.qsegb.push_back(r);
    for (const BlockRange& r : block_ranges(ix.k_seg + bi * ix.sk, ix.sk)) ix.ksegb.push_back(r);
  }
  return ix;
}

// Sizes and scalars shared by all tasks.
struct Problem {
  int64_t b, nq, nkv, sq, sk, d, rep, dp;  // dp: d padded to the GEMM tile
  float scale;                             // 1 / sqrt(d)
  bool dropout;                            // p > 0
  DropoutParams drop;                      // attention-probability site, feature offset 0
  int64_t head_offset;
};

inline Problem make_problem(const at::Tensor& q, const at::Tensor& k, double p, int64_t seed, int64_t layer,
                            int64_t head_offset) {
  Problem pr;
  pr.b = q.size(0), pr.nq = q.size(1), pr.nkv = k.size(1), pr.sq = q.size(2), pr.sk = k.size(2);
  pr.d = q.size(3), pr.rep = pr.nq / pr.nkv, pr.dp = flash::padded_cols(pr.d);
  pr.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(pr.d)));
  pr.dropout = p > 0.0;
  pr.drop = make_dropout_params(p, seed, layer, kSiteAttentionProbs, 0);
  pr.head_offset = head_offset;
  return pr;
}

// The keys [k0, k0 + nk) of one block as the row kernels see them.
struct KeyBlock {
  const int64_t* pos;
  const int64_t* seg;  // nullptr without segments
  int64_t n;
  bool consecutive;
  int64_t window;  // AttnIndex's
};

inline KeyBlock key_block(const AttnIndex& ix, int64_t bi, int64_t j) {
  const int64_t k0 = j * kBlock;
  return {ix.k_pos + k0, ix.k_seg ? ix.k_seg + bi * ix.sk + k0 : nullptr, std::min(kBlock, ix.sk - k0),
          ix.kb[j].consecutive, ix.window};
}

// Scores of one query row: s[j] * scale where key j is visible, -inf elsewhere and in the padding.
// qpos and the key positions are real ones (>= 0), so qpos - pos cannot overflow.
MSP_CPU_INLINE void mask_row(float* s, float scale, const KeyBlock& kb, int64_t qpos, int64_t qseg, Visibility vis) {
  if (vis == Visibility::kAll) {
#pragma omp simd
    for (int64_t j = 0; j < kb.n; ++j) s[j] *= scale;
  } else if (kb.window != kNoWindow) {
    const int64_t w = kb.window;
#pragma omp simd
    for (int64_t j = 0; j < kb.n; ++j) {
      const bool seen = kb.pos[j] <= qpos && qpos - kb.pos[j] <= w && (kb.seg == nullptr || kb.seg[j] == qseg);
      s[j] = seen ? s[j] * scale : kNegInf;
    }
  } else if (kb.seg == nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < kb.n; ++j) s[j] = kb.pos[j] <= qpos ? s[j] * scale : kNegInf;
  } else {
#pragma omp simd
    for (int64_t j = 0; j < kb.n; ++j) s[j] = kb.pos[j] <= qpos && kb.seg[j] == qseg ? s[j] * scale : kNegInf;
  }
  for (int64_t j = kb.n; j < kBlock; ++j) s[j] = kNegInf;
}

// Philox words of (query qpos, keys of kb) for global head `head`: feature head * 2^20 + key
// position, counter (feature / 4, qpos, sample), word feature % 4 (philox.py's
// attention_keep_mask). buf holds kBlock + 8 words; returns the word of key 0.
inline const uint32_t* keep_words(const DropoutParams& d, int64_t head, const KeyBlock& kb, int64_t qpos,
                                  int64_t sample, uint32_t* buf) {
  const uint64_t s = static_cast<uint64_t>(sample);
  const uint32_t c1 = static_cast<uint32_t>(qpos), c2 = static_cast<uint32_t>(s), c3 = static_cast<uint32_t>(s >> 32);
  const int64_t feature0 = (head << 20) + kb.pos[0];
  if (kb.consecutive) {
    const int64_t lane0 = feature0 & 3, groups = (lane0 + kb.n + 3) / 4;
    philox_groups(d, static_cast<uint32_t>(feature0 >> 2), groups, c1, c2, c3, buf);
    return buf + lane0;
  }
  for (int64_t j = 0; j < kb.n; ++j) {
    const int64_t f = (head << 20) + kb.pos[j];
    buf[j] = philox4x32_10(static_cast<uint32_t>(f >> 2), c1, c2, c3, d.k0, d.k1).w[f & 3];
  }
  return buf;
}

MSP_CPU_INLINE void apply_keep(float* x, const uint32_t* words, const DropoutParams& d, int64_t n) {
  const uint32_t thr = d.threshold;
  const float scale = d.scale;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] *= words[j] >= thr ? scale : 0.0f;
}

}  // namespace flash
}  // namespace msp

#pragma GCC pop_options

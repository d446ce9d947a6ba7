// Blockwise ("flash") attention backward on the CPU: (dq, dk, dv) from (dout, q, k, v, out, lse),
// exactly the function of flash_attention_bwd_reference (megatron_sp/ops/flash_attention.py).
//
// Design: D = rowsum(dO * O) first (one parallel pass). Then tasks over (batch, key/value head,
// chunk of key blocks) in the FlashAttention-2 order: per key block, K (as K^T and K), V^T are
// packed once and dK, dV accumulate in fp32 block buffers over every query head of the GQA group
// and every visible query block, so no two tasks write the same dK/dV rows and the sum over the
// group's query heads needs no second pass. Per block pair (flash_block_cpu.h GEMMs):
//   S = Q K^T, P = exp(S * scale - lse) on the visible keys (0 for a row with lse = -inf),
//   dP = dO V^T, the dropout mask redrawn (flash_index_cpu.h) for P_d = P * keep / (1 - p) and
//   dP_d = dP * keep / (1 - p), dS = P * (dP_d - D), dV += P_d^T dO, dK += dS^T Q, dQ += dS K.
// dQ rows are shared by all key blocks: each chunk adds into its own fp32 copy of dQ, and the
// copies are summed in a fixed order at the end. There is one chunk per (batch, group) unless there
// are fewer of those than twice the threads (a short batch, few key/value heads); then the key
// blocks are split so every thread has work, at the price of one fp32 dQ copy per chunk (results
// then depend on the thread count by rounding only). Outputs dq, dk, dv are laid out [s, b, n, d]
// in memory (returned as [b, n, s, d] views), like the forward's out.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_simd.h"
#include "flash_attention.h"
#include "flash_block_cpu.h"
#include "flash_index_cpu.h"

namespace msp {
namespace flash {
namespace {

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast", "no-trapping-math")

template <typename T>
struct BwdIo {
  const T *dout, *q, *k, *v, *out;
  Strides dos, qs, ks, vs, os;
  const float* lse;
  int64_t lse_b, lse_n, lse_s;  // lse [b, nq, sq] with any strides
  const float* delta;           // [b, nq, sq]
  float* dq32;                  // [chunks][b * nq][nqb * kBlock][dp], unscaled
  T *dk, *dv;                   // [sk, b, nkv, d]
  int64_t chunks;
};

int64_t bwd_workspace_floats(int64_t dp) { return 7 * kBlock * dp + 2 * kBlock * kBlock; }

// delta[row] = sum_c dout[row, c] * out[row, c] for rows r0 .. r1 of [b * nq * sq].
template <typename T>
MSP_CPU_INLINE void delta_rows(const Problem* pr, const BwdIo<T>* io, float* delta, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r % pr->sq, h = (r / pr->sq) % pr->nq, bi = r / (pr->sq * pr->nq);
    const T* g = io->dout + bi * io->dos.b + h * io->dos.n + i * io->dos.s;
    const T* o = io->out + bi * io->os.b + h * io->os.n + i * io->os.s;
    const int64_t gs = io->dos.d, os = io->os.d;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < pr->d; ++c) sum += to_f32(g[c * gs]) * to_f32(o[c * os]);
    delta[r] = sum;
  }
}
MSP_SIMD_VARIANTS(delta_rows)

// One query row of a block pair: s (scores) becomes P_d, dp (dO V^T) becomes dS.
MSP_CPU_INLINE void bwd_row(float* s, float* dp, float lse, float delta, const uint32_t* words,
                            const DropoutParams& drop, int64_t n) {
  if (lse == kNegInf) {  // the query sees no key at all: P = 0
    std::fill(s, s + kBlock, 0.0f), std::fill(dp, dp + kBlock, 0.0f);
    return;
  }
  row_exp_sum(s, kBlock, lse);  // masked scores are -inf: P = 0 there and in the padding
  if (words == nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < kBlock; ++j) dp[j] = s[j] * (dp[j] - delta);
    return;
  }
  const uint32_t thr = drop.threshold;
  const float scale = drop.scale;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float keep = words[j] >= thr ? scale : 0.0f, p = s[j];
    dp[j] = p * (dp[j] * keep - delta);
    s[j] = p * keep;
  }
  std::fill(dp + n, dp + kBlock, 0.0f);
}

// The pair (query block i of head h, key block kb): P_d and dS into S and dP, then the three
// gradient products. K^T, K, V^T of the key block are packed by the caller; dq_chunk: the task's
// fp32 copy of dQ.
template <typename T>
MSP_CPU_INLINE void bwd_pair(const Problem* pr, const AttnIndex* ix, const BwdIo<T>* io, int64_t bi, int64_t h,
                             int64_t i, const KeyBlock& kb, Visibility vis, float* dq_chunk, float* ws,
                             uint32_t* words) {
  const int64_t dp = pr->dp, d = pr->d, q0 = i * kBlock;
  const int64_t rows = std::min(kBlock, pr->sq - q0), mrows = padded_rows(rows);
  float *Kt = ws, *Kn = Kt + kBlock * dp, *Vt = Kn + kBlock * dp, *dK = Vt + kBlock * dp;
  float *dV = dK + kBlock * dp, *Q = dV + kBlock * dp, *dO = Q + kBlock * dp;
  float *S = dO + kBlock * dp, *dP = S + kBlock * kBlock;
  pack_rows(io->q + bi * io->qs.b + h * io->qs.n + q0 * io->qs.s, io->qs.s, io->qs.d, rows, d, Q, dp, mrows);
  pack_rows(io->dout + bi * io->dos.b + h * io->dos.n + q0 * io->dos.s, io->dos.s, io->dos.d, rows, d, dO, dp, mrows);
  gemm<false, false>(mrows, kBlock, dp, Q, dp, Kt, kBlock, S, kBlock);    // S = Q K^T
  gemm<false, false>(mrows, kBlock, dp, dO, dp, Vt, kBlock, dP, kBlock);  // dP = dO V^T
  const int64_t sample = ix->samples[bi], head = pr->head_offset + h;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t qi = q0 + r, qpos = ix->q_pos[qi];
    float* s = S + r * kBlock;
    mask_row(s, pr->scale, kb, qpos, ix->q_seg ? ix->q_seg[bi * pr->sq + qi] : 0, vis);
    const uint32_t* w = pr->dropout ? keep_words(pr->drop, head, kb, qpos, sample, words) : nullptr;
    bwd_row(s, dP + r * kBlock, io->lse[bi * io->lse_b + h * io->lse_n + qi * io->lse_s],
            io->delta[(bi * pr->nq + h) * pr->sq + qi], w, pr->drop, kb.n);
  }
  std::fill(S + rows * kBlock, S + mrows * kBlock, 0.0f);  // padding rows: no contribution
  std::fill(dP + rows * kBlock, dP + mrows * kBlock, 0.0f);
  gemm<true, true>(kBlock, dp, mrows, S, kBlock, dO, dp, dV, dp);  // dV += P_d^T dO
  gemm<true, true>(kBlock, dp, mrows, dP, kBlock, Q, dp, dK, dp);  // dK += dS^T Q
  float* dq = dq_chunk + ((bi * pr->nq + h) * ix->nqb * kBlock + q0) * dp;
  gemm<false, true>(mrows, dp, kBlock, dP, kBlock, Kn, dp, dq, dp);  // dQ += dS K
}

// Task (batch, key/value head g, chunk of key blocks): dK, dV of those blocks, their dQ terms.
template <typename T>
MSP_CPU_INLINE void bwd_task(const Problem* pr, const AttnIndex* ix, const BwdIo<T>* io, int64_t task, float* ws,
                             uint32_t* words) {
  const int64_t chunks = io->chunks, c = task % chunks, g = (task / chunks) % pr->nkv;
  const int64_t bi = task / (chunks * pr->nkv), dp = pr->dp, d = pr->d;
  float *Kt = ws, *Kn = Kt + kBlock * dp, *Vt = Kn + kBlock * dp, *dK = Vt + kBlock * dp;
  float* dV = dK + kBlock * dp;
  float* dq_chunk = io->dq32 + c * pr->b * pr->nq * ix->nqb * kBlock * dp;
  for (int64_t j = ix->nkb * c / chunks; j < ix->nkb * (c + 1) / chunks; ++j) {
    const KeyBlock kb = key_block(*ix, bi, j);
    const int64_t k0 = j * kBlock;
    const T* kp = io->k + bi * io->ks.b + g * io->ks.n + k0 * io->ks.s;
    const T* vp = io->v + bi * io->vs.b + g * io->vs.n + k0 * io->vs.s;
    pack_transposed(kp, io->ks.s, io->ks.d, kb.n, d, Kt, dp);
    pack_rows(kp, io->ks.s, io->ks.d, kb.n, d, Kn, dp, kBlock);
    pack_transposed(vp, io->vs.s, io->vs.d, kb.n, d, Vt, dp);
    std::fill(dK, dK + 2 * kBlock * dp, 0.0f);  // dK and dV
    for (int64_t h = g * pr->rep; h < (g + 1) * pr->rep; ++h)
      for (int64_t i = 0; i < ix->nqb; ++i) {
        const Visibility vis = ix->visibility(bi, i, j);
        if (vis != Visibility::kNone) bwd_pair(pr, ix, io, bi, h, i, kb, vis, dq_chunk, ws, words);
      }
    for (int64_t r = 0; r < kb.n; ++r) {
      const int64_t at = ((k0 + r) * pr->b + bi) * pr->nkv * d + g * d;
#pragma omp simd
      for (int64_t col = 0; col < d; ++col) {
        io->dk[at + col] = from_f32<T>(dK[r * dp + col] * pr->scale);
        io->dv[at + col] = from_f32<T>(dV[r * dp + col]);
      }
    }
  }
}
MSP_SIMD_VARIANTS(bwd_task)

// dq [sq, b, nq, d] rows r0 .. r1 (of [b * nq * sq]) = scale * sum over chunks of dq32.
template <typename T>
MSP_CPU_INLINE void dq_rows(const Problem* pr, const AttnIndex* ix, const BwdIo<T>* io, T* dq, int64_t r0, int64_t r1) {
  const int64_t dp = pr->dp, d = pr->d, copy = pr->b * pr->nq * ix->nqb * kBlock * dp;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r % pr->sq, bh = r / pr->sq, bi = bh / pr->nq, h = bh % pr->nq;
    const float* src = io->dq32 + (bh * ix->nqb * kBlock + i) * dp;
    T* dst = dq + (i * pr->b + bi) * pr->nq * d + h * d;
#pragma omp simd
    for (int64_t col = 0; col < d; ++col) {
      float sum = src[col];
      for (int64_t c = 1; c < io->chunks; ++c) sum += src[c * copy + col];
      dst[col] = from_f32<T>(sum * pr->scale);
    }
  }
}
MSP_SIMD_VARIANTS(dq_rows)

#pragma GCC pop_options

// Chunks of key blocks per (batch, key/value head): enough tasks for about two per thread.
int64_t key_chunks(int64_t groups, int64_t nkb) {
  const int64_t want = 2 * static_cast<int64_t>(at::get_num_threads());
  if (groups >= want || nkb <= 1) return 1;
  return std::min(nkb, (want + groups - 1) / groups);
}

at::Tensor grad_like(const at::Tensor& t) {  // [b, n, s, d] view of an [s, b, n, d] tensor
  return at::empty({t.size(2), t.size(0), t.size(1), t.size(3)}, t.options()).permute({1, 2, 0, 3});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& q_pos_in, const at::Tensor& k_pos_in,
    const c10::optional<at::Tensor>& q_seg_in, const c10::optional<at::Tensor>& k_seg_in, const at::Tensor& samples_in,
    double p, int64_t seed, int64_t layer, int64_t head_offset, int64_t window) {
  check_flash_attention(q, k, v, q_pos_in, k_pos_in, q_seg_in, k_seg_in, samples_in, p, head_offset);
  check_flash_attention_bwd(dout, out, lse, q);
  const at::Tensor q_pos = q_pos_in.contiguous(), k_pos = k_pos_in.contiguous();
  const at::Tensor q_seg = q_seg_in ? q_seg_in->contiguous() : at::Tensor();
  const at::Tensor k_seg = k_seg_in ? k_seg_in->contiguous() : at::Tensor();
  const at::Tensor samples = samples_in.contiguous();
  const Problem pr = make_problem(q, k, p, seed, layer, head_offset);
  const AttnIndex ix = make_index(q_pos, k_pos, q_seg, k_seg, samples, window);
  const int64_t chunks = key_chunks(pr.b * pr.nkv, ix.nkb);
  const at::TensorOptions f32 = q.options().dtype(at::kFloat);
  at::Tensor delta = at::empty({pr.b * pr.nq * pr.sq}, f32);
  at::Tensor dq32 = at::zeros({chunks * pr.b * pr.nq * ix.nqb * kBlock * pr.dp}, f32);
  at::Tensor dq = grad_like(q), dk = grad_like(k), dv = grad_like(v);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "flash_bwd", [&] {
    using T = scalar_t;
    const BwdIo<T> io{dout.const_data_ptr<T>(),
                      q.const_data_ptr<T>(),
                      k.const_data_ptr<T>(),
                      v.const_data_ptr<T>(),
                      out.const_data_ptr<T>(),
                      strides_of(dout),
                      strides_of(q),
                      strides_of(k),
                      strides_of(v),
                      strides_of(out),
                      lse.const_data_ptr<float>(),
                      lse.stride(0),
                      lse.stride(1),
                      lse.stride(2),
                      delta.data_ptr<float>(),
                      dq32.data_ptr<float>(),
                      dk.data_ptr<T>(),
                      dv.data_ptr<T>(),
                      chunks};
    const int64_t rows = pr.b * pr.nq * pr.sq;
    at::parallel_for(0, rows, 256,
                     [&](int64_t r0, int64_t r1) { delta_rows_simd<T>(&pr, &io, delta.data_ptr<float>(), r0, r1); });
    at::parallel_for(0, pr.b * pr.nkv * chunks, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> ws(bwd_workspace_floats(pr.dp));
      std::vector<uint32_t> words(kBlock + 8);
      for (int64_t t = t0; t < t1; ++t) bwd_task_simd<T>(&pr, &ix, &io, t, ws.data(), words.data());
    });
    at::parallel_for(0, rows, 64,
                     [&](int64_t r0, int64_t r1) { dq_rows_simd<T>(&pr, &ix, &io, dq.data_ptr<T>(), r0, r1); });
  });
  return {dq, dk, dv};
}

TORCH_LIBRARY_IMPL(megatron_sp, CPU, m) { m.impl("flash_attention_bwd", &bwd_cpu); }

}  // namespace
}  // namespace flash
}  // namespace msp

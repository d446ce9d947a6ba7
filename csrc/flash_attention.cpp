// Blockwise ("flash") attention forward on the CPU with the parallelism-invariant attention
// dropout; the reference is megatron_sp/ops/flash_attention.py (same function, same mask bits).
//
// Design: queries and keys are cut into 64-row blocks. Visibility (key position <= query
// position, within the sliding window when one is given, equal document segments) is summarised per block
// (flash_index_cpu.h), so a block pair is skipped when nothing is visible and left unmasked when everything is. The
// inputs may have any strides (q, k, v are permuted views of the fused QKV projection): each block is packed into a
// zero-padded fp32 buffer (flash_block_cpu.h), so fp32/bf16/fp16 share one fp32 path.
// at::parallel_for runs over (batch, query head, query block); per key block: S = Q K^T
// (register-tiled GEMM), mask, online softmax (running max m, sum l of the un-dropped
// probabilities, the accumulator rescaled by exp(m_old - m_new)), the dropout keep words of the
// block's (sample, head, query, key) coordinates drawn by Philox (several 4-feature groups per
// vector, philox_cpu.h) and applied to the probabilities, then acc += P V. Memory per thread: one
// block pair (~100 KiB at d = 64), never s x s. The backward is flash_attention_bwd.cpp.
// out is laid out [s, b, n, d] in memory (returned as a [b, n, s, d] view), so the caller's
// permute back to [s, b, n * d] is free.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
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

// ---- forward ------------------------------------------------------------------------------------

template <typename T>
struct FwdIo {
  const T *q, *k, *v;
  Strides qs, ks, vs;
  T* out;      // [sq, b, nq, d]
  float* lse;  // [b, nq, sq]
};

int64_t fwd_workspace_floats(int64_t dp) { return 4 * kBlock * dp + kBlock * kBlock + 2 * kBlock; }

// Online-softmax update of row r of one block pair; s: the row's masked scores, becomes P.
MSP_CPU_INLINE void softmax_update(float* s, float& m, float& l, float* acc_row, int64_t dp) {
  const float m_new = std::max(m, row_max(s, kBlock));
  const float base = m_new == kNegInf ? 0.0f : m_new;  // a row that has seen nothing so far
  const float sum = row_exp_sum(s, kBlock, base);
  const float correction = std::exp(m - base);
  l = l * correction + sum;
  if (correction != 1.0f) scale_row(acc_row, dp, correction);
  m = m_new;
}

// Task (batch, query head, query block): out and lse of its rows over every key block.
template <typename T>
MSP_CPU_INLINE void fwd_task(const Problem* pr, const AttnIndex* ix, const FwdIo<T>* io, int64_t task, float* ws,
                             uint32_t* words) {
  const int64_t dp = pr->dp, d = pr->d, i = task % ix->nqb, h = (task / ix->nqb) % pr->nq;
  const int64_t bi = task / (ix->nqb * pr->nq), g = h / pr->rep, q0 = i * kBlock;
  const int64_t rows = std::min(kBlock, pr->sq - q0), mrows = padded_rows(rows);
  float *Q = ws, *Kt = Q + kBlock * dp, *V = Kt + kBlock * dp, *acc = V + kBlock * dp;
  float *S = acc + kBlock * dp, *m = S + kBlock * kBlock, *l = m + kBlock;
  pack_rows(io->q + bi * io->qs.b + h * io->qs.n + q0 * io->qs.s, io->qs.s, io->qs.d, rows, d, Q, dp, mrows);
  std::fill(acc, acc + kBlock * dp, 0.0f);
  std::fill(m, m + kBlock, kNegInf);
  std::fill(l, l + kBlock, 0.0f);
  const int64_t sample = ix->samples[bi], head = pr->head_offset + h;
  for (int64_t j = 0; j < ix->nkb; ++j) {
    const Visibility vis = ix->visibility(bi, i, j);
    if (vis == Visibility::kNone) continue;
    const KeyBlock kb = key_block(*ix, bi, j);
    const int64_t k0 = j * kBlock;
    pack_transposed(io->k + bi * io->ks.b + g * io->ks.n + k0 * io->ks.s, io->ks.s, io->ks.d, kb.n, d, Kt, dp);
    pack_rows(io->v + bi * io->vs.b + g * io->vs.n + k0 * io->vs.s, io->vs.s, io->vs.d, kb.n, d, V, dp, kBlock);
    gemm<false, false>(mrows, kBlock, dp, Q, dp, Kt, kBlock, S, kBlock);  // S = Q K^T
    for (int64_t r = 0; r < rows; ++r) {
      float* s = S + r * kBlock;
      const int64_t qpos = ix->q_pos[q0 + r];
      mask_row(s, pr->scale, kb, qpos, ix->q_seg ? ix->q_seg[bi * pr->sq + q0 + r] : 0, vis);
      softmax_update(s, m[r], l[r], acc + r * dp, dp);
      if (pr->dropout)  // on the normalised probabilities; l keeps the un-dropped sum
        apply_keep(s, keep_words(pr->drop, head, kb, qpos, sample, words), pr->drop, kb.n);
    }
    gemm<false, true>(mrows, dp, kBlock, S, kBlock, V, dp, acc, dp);  // acc += P V
  }
  for (int64_t r = 0; r < rows; ++r) {
    const bool seen = l[r] > 0.0f;
    const float inv = seen ? 1.0f / l[r] : 0.0f;
    T* o = io->out + ((q0 + r) * pr->b + bi) * pr->nq * d + h * d;
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) o[c] = from_f32<T>(acc[r * dp + c] * inv);
    io->lse[(bi * pr->nq + h) * pr->sq + q0 + r] = seen ? m[r] + std::log(l[r]) : kNegInf;
  }
}
MSP_SIMD_VARIANTS(fwd_task)

#pragma GCC pop_options

std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& q_pos_in, const at::Tensor& k_pos_in,
                                           const c10::optional<at::Tensor>& q_seg_in,
                                           const c10::optional<at::Tensor>& k_seg_in, const at::Tensor& samples_in,
                                           double p, int64_t seed, int64_t layer, int64_t head_offset, int64_t window) {
  check_flash_attention(q, k, v, q_pos_in, k_pos_in, q_seg_in, k_seg_in, samples_in, p, head_offset);
  const at::Tensor q_pos = q_pos_in.contiguous(), k_pos = k_pos_in.contiguous();
  const at::Tensor q_seg = q_seg_in ? q_seg_in->contiguous() : at::Tensor();
  const at::Tensor k_seg = k_seg_in ? k_seg_in->contiguous() : at::Tensor();
  const at::Tensor samples = samples_in.contiguous();
  const Problem pr = make_problem(q, k, p, seed, layer, head_offset);
  const AttnIndex ix = make_index(q_pos, k_pos, q_seg, k_seg, samples, window);
  at::Tensor out = at::empty({pr.sq, pr.b, pr.nq, pr.d}, q.options()).permute({1, 2, 0, 3});
  at::Tensor lse = at::empty({pr.b, pr.nq, pr.sq}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "flash_fwd", [&] {
    const FwdIo<scalar_t> io{q.const_data_ptr<scalar_t>(),
                             k.const_data_ptr<scalar_t>(),
                             v.const_data_ptr<scalar_t>(),
                             strides_of(q),
                             strides_of(k),
                             strides_of(v),
                             out.data_ptr<scalar_t>(),
                             lse.data_ptr<float>()};
    at::parallel_for(0, pr.b * pr.nq * ix.nqb, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> ws(fwd_workspace_floats(pr.dp));
      std::vector<uint32_t> words(kBlock + 8);
      for (int64_t t = t0; t < t1; ++t) fwd_task_simd<scalar_t>(&pr, &ix, &io, t, ws.data(), words.data());
    });
  });
  return {out, lse};
}

// flash_attention_fwd  q [b, n_q, s_q, d], k, v [b, n_kv, s_k, d] (any strides) -> (out [b, n_q, s_q, d] laid out
//                      [s_q, b, n_q, d], lse [b, n_q, s_q] fp32)
// flash_attention_bwd  (dout, q, k, v, out, lse, ...) -> (dq, dk, dv), laid out [s, b, n, d]
//                      (its CPU kernel: flash_attention_bwd.cpp)
TORCH_LIBRARY_FRAGMENT(megatron_sp, m) {
  m.def(
      "flash_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor q_positions, Tensor k_positions, Tensor? q_segments, "
      "Tensor? k_segments, Tensor sample_ids, float p, int seed, int layer, int head_offset, int window=-1) -> "
      "(Tensor, Tensor)");
  m.def(
      "flash_attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor q_positions, "
      "Tensor k_positions, Tensor? q_segments, Tensor? k_segments, Tensor sample_ids, float p, int seed, int layer, "
      "int head_offset, int window=-1) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_sp, CPU, m) { m.impl("flash_attention_fwd", &fwd_cpu); }

}  // namespace
}  // namespace flash
}  // namespace msp

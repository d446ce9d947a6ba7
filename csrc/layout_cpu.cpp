// Layout ops for the collectives on the CPU: Ulysses pack/unpack, dim-0 gather -> last-dim
// concatenation and back, zigzag chunk reorder.
//
// Design: each op is a copy of contiguous runs (op_checks.h plans them): a block transpose
// [a, b, run] -> [b, a, run] or a permutation of 2p chunks of [outer, 2p, run]. The copy is
// dtype-agnostic (bytes): runs are copied with inlined vector moves (AVX-512/AVX2 variants,
// cpu_simd.h), or with streaming stores when the output is much larger than the caches, spread
// over threads with at::parallel_for.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <immintrin.h>
#include <unistd.h>

#include "cpu_simd.h"
#include "layout_index.h"
#include "op_checks.h"

namespace msp {
namespace {

// Fixed-size 64-byte memcpy compiles to vector moves of the variant's width; no call per run.
MSP_CPU_INLINE void copy_bytes(char* dst, const char* src, int64_t n) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) std::memcpy(dst + i, src + i, 64);
  if (i < n) std::memcpy(dst + i, src + i, n - i);
}

#if defined(__x86_64__) && defined(__GNUC__)
// Streaming (non-temporal) stores: no read-for-ownership of the destination, a third less memory
// traffic for outputs far larger than the caches.
MSP_TARGET_AVX2 inline void stream_bytes(char* dst, const char* src, int64_t n) {
  int64_t i = 0;
  const int64_t head = std::min<int64_t>(n, (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31);
  std::memcpy(dst, src, head);
  for (i = head; i + 32 <= n; i += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
  if (i < n) std::memcpy(dst + i, src + i, n - i);
}
#endif

// Task t of a copy cut into `pieces` pieces per run: output run t / pieces, bytes [off, off+len).
template <typename Source>
MSP_CPU_INLINE void copy_pieces(char* dst, const char* src, int64_t bytes, int64_t piece,
                                int64_t pieces, int64_t t0, int64_t t1, Source source) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t o = t / pieces, off = (t % pieces) * piece;
    copy_bytes(dst + o * bytes + off, src + source(o) * bytes + off, std::min(piece, bytes - off));
  }
}

template <typename Source>
void stream_pieces(char* dst, const char* src, int64_t bytes, int64_t piece, int64_t pieces,
                   int64_t t0, int64_t t1, Source source) {
#if defined(__x86_64__) && defined(__GNUC__)
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t o = t / pieces, off = (t % pieces) * piece;
    stream_bytes(dst + o * bytes + off, src + source(o) * bytes + off, std::min(piece, bytes - off));
  }
  _mm_sfence();
#endif
}
MSP_SIMD_VARIANTS(copy_pieces)

// Outputs at least a quarter of the last-level cache are written with streaming stores (measured
// on a 32 MiB-L3 CPU: 1.5-2x faster than cached stores at 16 MiB, slower at 4 MiB).
inline int64_t stream_threshold() {
  static const int64_t threshold = [] {
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return std::max<int64_t>(int64_t(8) << 20, l3 > 0 ? l3 / 4 : 0);
  }();
  return threshold;
}

// dst run o <- src run source(o), each `bytes` long. Long runs are cut into pieces so that a
// permutation of a few huge chunks (zigzag) still uses every thread.
template <typename Source>
void parallel_copy_runs(char* dst, const char* src, int64_t runs, int64_t bytes, Source source) {
  if (bytes == 0 || runs == 0) return;
  const int64_t piece = std::min<int64_t>(bytes, 1 << 16);
  const int64_t pieces = (bytes + piece - 1) / piece;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / piece);
  const bool stream = runs * bytes >= stream_threshold() && simd_level() != SimdLevel::kBaseline;
  at::parallel_for(0, runs * pieces, grain, [&](int64_t t0, int64_t t1) {
    if (stream) stream_pieces<Source>(dst, src, bytes, piece, pieces, t0, t1, source);
    else copy_pieces_simd<Source>(dst, src, bytes, piece, pieces, t0, t1, source);
  });
}

at::Tensor run_block_transpose(const at::Tensor& x_in, const BlockTranspose& plan) {
  at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(plan.out_shape, x.options());
  parallel_copy_runs(static_cast<char*>(out.data_ptr()), static_cast<const char*>(x.const_data_ptr()),
                     plan.a * plan.b, plan.run * x.element_size(),
                     [&](int64_t o) { return transpose_source<int64_t>(o, plan.a, plan.b); });
  return out;
}

at::Tensor ulysses_pack_cpu(const at::Tensor& x, int64_t p) {
  return run_block_transpose(x, ulysses_pack_plan(x, p));
}

at::Tensor ulysses_unpack_cpu(const at::Tensor& x, int64_t p) {
  return run_block_transpose(x, ulysses_unpack_plan(x, p));
}

at::Tensor gather_to_last_dim_cpu(const at::Tensor& x, int64_t t) {
  return run_block_transpose(x, gather_to_last_dim_plan(x, t));
}

at::Tensor last_dim_to_gather_cpu(const at::Tensor& x, int64_t t) {
  return run_block_transpose(x, last_dim_to_gather_plan(x, t));
}

at::Tensor zigzag_reorder_cpu(const at::Tensor& x_in, int64_t p, int64_t dim, bool inverse) {
  const ZigzagPlan plan = zigzag_plan(x_in, p, dim);
  at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  parallel_copy_runs(static_cast<char*>(out.data_ptr()), static_cast<const char*>(x.const_data_ptr()),
                     plan.outer * 2 * p, plan.run * x.element_size(), [&](int64_t o) {
                       int64_t outer = o / (2 * p), slot = o % (2 * p);
                       return outer * 2 * p + zigzag_source<int64_t>(slot, p, inverse);
                     });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_sp, CPU, m) {
  m.impl("ulysses_pack", &ulysses_pack_cpu);
  m.impl("ulysses_unpack", &ulysses_unpack_cpu);
  m.impl("gather_to_last_dim", &gather_to_last_dim_cpu);
  m.impl("last_dim_to_gather", &last_dim_to_gather_cpu);
  m.impl("zigzag_reorder", &zigzag_reorder_cpu);
}

}  // namespace msp

// Layout ops for the collectives on the CPU: Ulysses pack/unpack, dim-0 gather -> last-dim
// concatenation and back, zigzag chunk reorder.
//
// Design: each op is a copy of contiguous runs (layout.h plans them): a block transpose
// [a, b, run] -> [b, a, run] or a permutation of 2p chunks of [outer, 2p, run]. The copy is
// dtype-agnostic (bytes). A task walks consecutive output runs with an incremental run iterator
// (one division per task, not per run) and copies each run with inlined vector moves (AVX-512/AVX2
// variants, cpu_simd.h), or with streaming stores when the output is much larger than the caches.
// Runs over 64 KiB are cut into pieces so that a permutation of a few huge chunks (zigzag) still
// uses every thread. Block transposes of short runs (under 16 KiB: one or a few heads, the Ulysses
// and TP-gather cases) go to ATen's strided copy instead: TensorIterator's parallel, vectorised
// copy loop measured 10-25% faster than this run copy there on a 2-core AVX-512 VM, and matching
// the reference is the point of the CPU op.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/copy.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MSP_HAS_STREAM 1
#else
#define MSP_HAS_STREAM 0
#endif

#include "cpu_simd.h"
#include "layout.h"
#include "layout_index.h"

namespace msp {
namespace {

// Output run o of [a, b, run] -> [b, a, run] reads input run i * b + j, where o = j * a + i.
struct TransposeRuns {
  int64_t a, b, i = 0, j = 0;
  void seek(int64_t o) { j = o / a, i = o - j * a; }
  int64_t source() const { return i * b + j; }
  void next() {
    if (++i == a) i = 0, ++j;
  }
};

// Output run o = outer * 2p + slot reads input run outer * 2p + zigzag_source(slot).
struct ZigzagRuns {
  int64_t p;
  bool inverse;
  int64_t outer = 0, slot = 0;
  void seek(int64_t o) { outer = o / (2 * p), slot = o - outer * 2 * p; }
  int64_t source() const { return outer * 2 * p + zigzag_source<int64_t>(slot, p, inverse); }
  void next() {
    if (++slot == 2 * p) slot = 0, ++outer;
  }
};

// Fixed-size 64-byte memcpy compiles to vector moves of the variant's width; no call per run.
MSP_CPU_INLINE void copy_bytes(char* dst, const char* src, int64_t n) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) std::memcpy(dst + i, src + i, 64);
  if (i < n) std::memcpy(dst + i, src + i, n - i);
}

#if MSP_HAS_STREAM
// Streaming (non-temporal) stores: no read-for-ownership of the destination, a third less memory
// traffic for outputs far larger than the caches.
MSP_TARGET_AVX2 inline void stream_bytes(char* dst, const char* src, int64_t n) {
  const int64_t head = std::min<int64_t>(n, (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31);
  std::memcpy(dst, src, head);
  int64_t i = head;
  for (; i + 32 <= n; i += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
  if (i < n) std::memcpy(dst + i, src + i, n - i);
}
#endif

struct CopyPlan {
  char* dst;
  const char* src;
  int64_t bytes;   // one run
  int64_t piece;   // bytes per task item (a whole run, or a 64 KiB piece of one)
  int64_t pieces;  // pieces per run
  bool stream;
};

MSP_CPU_INLINE void copy_piece(const CopyPlan& c, int64_t out_off, int64_t in_off, int64_t n) {
#if MSP_HAS_STREAM
  if (c.stream) return stream_bytes(c.dst + out_off, c.src + in_off, n);
#endif
  copy_bytes(c.dst + out_off, c.src + in_off, n);
}

// Items t0 .. t1-1: a run each when pieces == 1, else piece t % pieces of run t / pieces.
template <typename Runs>
MSP_CPU_INLINE void copy_items(const CopyPlan& c, Runs runs, int64_t t0, int64_t t1) {
  if (c.pieces == 1) {
    runs.seek(t0);
    for (int64_t o = t0; o < t1; ++o, runs.next()) copy_piece(c, o * c.bytes, runs.source() * c.bytes, c.bytes);
  } else {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t o = t / c.pieces, off = (t % c.pieces) * c.piece;
      runs.seek(o);
      copy_piece(c, o * c.bytes + off, runs.source() * c.bytes + off, std::min(c.piece, c.bytes - off));
    }
  }
#if MSP_HAS_STREAM
  if (c.stream) _mm_sfence();
#endif
}
MSP_SIMD_VARIANTS(copy_items)

// Outputs of at least a quarter of the last-level cache (and 8 MiB) use streaming stores:
// measured on a 32 MiB-L3 CPU, faster than cached stores at 16 MiB and slower at 4 MiB.
int64_t stream_threshold() {
  static const int64_t threshold = [] {
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return std::max<int64_t>(int64_t(8) << 20, l3 > 0 ? l3 / 4 : 0);
  }();
  return threshold;
}

template <typename Runs>
void parallel_copy_runs(const at::Tensor& x, at::Tensor& out, int64_t runs, int64_t run_elems, Runs iter) {
  const int64_t bytes = run_elems * x.element_size();
  if (bytes == 0 || runs == 0) return;
  CopyPlan c{static_cast<char*>(out.data_ptr()),
             static_cast<const char*>(x.const_data_ptr()),
             bytes,
             std::min<int64_t>(bytes, 1 << 16),
             0,
             false};
  c.pieces = (bytes + c.piece - 1) / c.piece;
  c.stream = MSP_HAS_STREAM && runs * bytes >= stream_threshold() && simd_level() != SimdLevel::kBaseline;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / c.piece);
  at::parallel_for(0, runs * c.pieces, grain, [&](int64_t t0, int64_t t1) { copy_items_simd<Runs>(c, iter, t0, t1); });
}

constexpr int64_t kShortRunBytes = 16 << 10;

at::Tensor run_block_transpose(const at::Tensor& x_in, const BlockTranspose& plan) {
  at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(plan.out_shape, x.options());
  if (plan.a * plan.b * plan.run == 0) return out;
  if (plan.run * x.element_size() < kShortRunBytes) {  // [a, b, run] -> [b, a, run], strided
    out.view({plan.b, plan.a, plan.run}).copy_(x.view({plan.a, plan.b, plan.run}).transpose(0, 1));
    return out;
  }
  parallel_copy_runs(x, out, plan.a * plan.b, plan.run, TransposeRuns{plan.a, plan.b});
  return out;
}

at::Tensor ulysses_pack_cpu(const at::Tensor& x, int64_t p) { return run_block_transpose(x, ulysses_pack_plan(x, p)); }

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
  parallel_copy_runs(x, out, plan.outer * 2 * p, plan.run, ZigzagRuns{p, inverse});
  return out;
}

}  // namespace

// ulysses_pack        [s/p, b, n, d] -> [p, s/p, b, n/p, d]   (all_to_all send buffer)
// ulysses_unpack      [p, s/p, b, n/p, d] -> [s/p, b, n, d]   (its inverse)
// gather_to_last_dim  [t*s, ..., l] -> [s, ..., t*l]           (dim-0 all-gather -> cat(-1))
// last_dim_to_gather  [s, ..., t*l] -> [t*s, ..., l]           (its inverse)
// zigzag_reorder      2p chunks along dim: rank r gets chunks r and 2p-1-r (or the inverse)
TORCH_LIBRARY_FRAGMENT(megatron_sp, m) {
  m.def("ulysses_pack(Tensor x, int p) -> Tensor");
  m.def("ulysses_unpack(Tensor x, int p) -> Tensor");
  m.def("gather_to_last_dim(Tensor x, int t) -> Tensor");
  m.def("last_dim_to_gather(Tensor x, int t) -> Tensor");
  m.def("zigzag_reorder(Tensor x, int p, int dim, bool inverse) -> Tensor");
}

TORCH_LIBRARY_IMPL(megatron_sp, CPU, m) {
  m.impl("ulysses_pack", &ulysses_pack_cpu);
  m.impl("ulysses_unpack", &ulysses_unpack_cpu);
  m.impl("gather_to_last_dim", &gather_to_last_dim_cpu);
  m.impl("last_dim_to_gather", &last_dim_to_gather_cpu);
  m.impl("zigzag_reorder", &zigzag_reorder_cpu);
}

}  // namespace msp

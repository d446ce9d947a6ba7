// The emulator's own ops in the emulated library (torch.ops.megatron_sp_emulated, beside the CUDA
// bindings of csrc/cuda/ registered there for CPU tensors): the SM count cudaDeviceGetAttribute
// reports (it sizes the persistent grids), and the global-memory traffic counters of build mode
// "traffic" (bench/kernel_traffic.py) for given tensors and for every allocation an op makes; and
// one-warp probes of the warp-matrix model (warp_matrix.cpp), which tests/cuda_emulator/warp_checks.py
// compares with plain matrix products built from the PTX ISA's fragment formulas.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include "msp_cuda_emulator.h"

namespace {

struct Watched {
  c10::DataPtr inner;
  int region;
};

void release_watched(void* ctx) {
  auto* w = static_cast<Watched*>(ctx);
  msp_emu::traffic_release(w->region, w->inner.get());
  delete w;
}

// torch's CPU allocator with each allocation watched as a traffic region (its outputs and scratch).
struct WatchingAllocator final : c10::Allocator {
  c10::Allocator* base = nullptr;

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    if (n == 0) return inner;
    void* data = inner.get();
    const int region = msp_emu::traffic_watch(data, n);
    return {data, new Watched{std::move(inner), region}, &release_watched, c10::Device(c10::kCPU)};
  }

  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }
};

WatchingAllocator watching;

void set_sm_count(int64_t sms) { msp_emu::set_sm_count(static_cast<int>(sms)); }

void traffic_watch(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous() && t.numel() > 0, "traffic_watch takes a non-empty contiguous tensor");
  msp_emu::traffic_watch(t.data_ptr(), t.numel() * t.element_size());
}

// While on, every CPU allocation is watched. The allocator is swapped in and out at priority 0,
// torch's own CPU allocator's.
void traffic_watch_allocations(bool on) {
  if (on == (watching.base != nullptr)) return;
  if (on) {
    watching.base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&watching, 0);
    TORCH_CHECK(c10::GetCPUAllocator() == &watching, "another CPU allocator has precedence over torch's own");
  } else {
    c10::SetCPUAllocator(watching.base, 0);
    watching.base = nullptr;
  }
}

// [regions, 6] int64: begin address, bytes, loaded, stored, distinct loaded, distinct stored bytes.
at::Tensor traffic_regions() {
  const int n = msp_emu::traffic_region_count();
  at::Tensor out = at::empty({n, 6}, at::TensorOptions().dtype(at::kLong));
  int64_t* row = out.data_ptr<int64_t>();
  for (int r = 0; r < n; ++r, row += 6) {
    const msp_emu::Traffic t = msp_emu::traffic_of(r);
    const uint64_t values[6] = {t.begin, t.bytes, t.loaded, t.stored, t.distinct_loaded, t.distinct_stored};
    for (int i = 0; i < 6; ++i) row[i] = static_cast<int64_t>(values[i]);
  }
  return out;
}

void traffic_clear() { msp_emu::traffic_clear(); }

// One warp runs mma.sync m16n8k16 (kind 0 bf16, 1 fp16): lane l passes a[l] (4 registers), b[l]
// (2), c[l] (4 fp32 accumulators); returns d [32, 4].
at::Tensor warp_mma(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, int64_t kind) {
  TORCH_CHECK(a.dtype() == at::kInt && a.is_contiguous() && a.numel() == 128, "warp_mma: a is [32, 4] int32");
  TORCH_CHECK(b.dtype() == at::kInt && b.is_contiguous() && b.numel() == 64, "warp_mma: b is [32, 2] int32");
  TORCH_CHECK(c.dtype() == at::kFloat && c.is_contiguous() && c.numel() == 128, "warp_mma: c is [32, 4] fp32");
  at::Tensor d = c.clone();
  const uint32_t* ap = reinterpret_cast<const uint32_t*>(a.const_data_ptr<int32_t>());
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(b.const_data_ptr<int32_t>());
  float* dp = d.data_ptr<float>();
  const int k = static_cast<int>(kind);
  msp_emu::launch(
      reinterpret_cast<const void*>(&warp_mma),
      [&] {
        const unsigned l = msp_emu::context.lane;
        const uint32_t ar[4] = {ap[4 * l], ap[4 * l + 1], ap[4 * l + 2], ap[4 * l + 3]},
                       br[2] = {bp[2 * l], bp[2 * l + 1]};
        float dr[4] = {dp[4 * l], dp[4 * l + 1], dp[4 * l + 2], dp[4 * l + 3]};
        msp_emu::mma_m16n8k16(k, dr, ar, br);
        for (int i = 0; i < 4; ++i) dp[4 * l + i] = dr[i];
      },
      dim3(1), dim3(32));
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "warp_mma: the launch failed");
  return d;
}

// One warp runs ldmatrix.m8n8.x{count}[.trans] on `shared` (int16, copied into the launch's dynamic
// shared memory), lane l giving the row at element offset rows[l] (rows [32] int64; lanes past
// 8 count give none); returns the registers [32, count] (int32).
at::Tensor warp_ldmatrix(const at::Tensor& shared, const at::Tensor& rows, int64_t count, bool trans) {
  TORCH_CHECK(shared.dtype() == at::kShort && shared.is_contiguous(), "warp_ldmatrix: shared is int16");
  TORCH_CHECK(rows.dtype() == at::kLong && rows.numel() == 32, "warp_ldmatrix: rows is [32] int64");
  TORCH_CHECK(count == 1 || count == 2 || count == 4, "warp_ldmatrix: count is 1, 2 or 4");
  at::Tensor regs = at::zeros({32, count}, at::TensorOptions().dtype(at::kInt));
  const int64_t* rp = rows.const_data_ptr<int64_t>();
  const int16_t* src = shared.const_data_ptr<int16_t>();
  int32_t* out = regs.data_ptr<int32_t>();
  const size_t bytes = shared.numel() * 2;
  const int n = static_cast<int>(count);
  msp_emu::launch(
      reinterpret_cast<const void*>(&warp_ldmatrix),
      [&] {
        unsigned char* smem = static_cast<unsigned char*>(msp_emu::dynamic_shared_memory());
        if (msp_emu::context.lane == 0) memcpy(smem, src, bytes);
        __syncwarp();
        const unsigned l = msp_emu::context.lane;
        uint32_t r[4] = {};
        msp_emu::ldmatrix(n, trans, r, l < 8u * n ? smem + 2 * rp[l] : nullptr);
        for (int j = 0; j < n; ++j) out[n * l + j] = static_cast<int32_t>(r[j]);
      },
      dim3(1), dim3(32), bytes);
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "warp_ldmatrix: the launch failed");
  return regs;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_sp_emulated, m) {
  m.def("set_sm_count(int sms) -> ()", &set_sm_count);
  m.def("traffic_watch(Tensor t) -> ()", &traffic_watch);
  m.def("traffic_watch_allocations(bool on) -> ()", &traffic_watch_allocations);
  m.def("traffic_regions() -> Tensor", &traffic_regions);
  m.def("traffic_clear() -> ()", &traffic_clear);
  m.def("warp_mma(Tensor a, Tensor b, Tensor c, int kind) -> Tensor", &warp_mma);
  m.def("warp_ldmatrix(Tensor shared, Tensor rows, int count, bool trans) -> Tensor", &warp_ldmatrix);
}

// The emulator's own ops in the emulated library (torch.ops.megatron_sp_emulated, beside the CUDA
// bindings of csrc/cuda/ registered there for CPU tensors): the SM count cudaDeviceGetAttribute
// reports (it sizes the persistent grids), and the global-memory traffic counters of build mode
// "traffic" (bench/kernel_traffic.py) for given tensors and for every allocation an op makes.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(megatron_sp_emulated, m) {
  m.def("set_sm_count(int sms) -> ()", &set_sm_count);
  m.def("traffic_watch(Tensor t) -> ()", &traffic_watch);
  m.def("traffic_watch_allocations(bool on) -> ()", &traffic_watch_allocations);
  m.def("traffic_regions() -> Tensor", &traffic_regions);
  m.def("traffic_clear() -> ()", &traffic_clear);
}

// The execution engine of the CUDA emulator (include/msp_cuda_emulator.h): blocks in sequence,
// the threads of a block as OS threads, barriers for __syncthreads and warp shuffles.
#include <stdio.h>
#include <stdlib.h>

#include <atomic>
#include <barrier>
#include <condition_variable>
#include <functional>
#include <latch>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "msp_cuda_emulator.h"

namespace msp_emu {

thread_local ThreadContext context;

namespace {

cudaError_t last_error = cudaSuccess;
int sm_count = 2;

[[noreturn]] void fail(const char* what) {
  const ThreadContext& c = context;
  fprintf(stderr,
          "msp_cuda_emulator: %s (block (%u, %u, %u) of (%u, %u, %u), thread (%u, %u, %u) of "
          "(%u, %u, %u))\n",
          what, c.block.x, c.block.y, c.block.z, c.grid_dim.x, c.grid_dim.y, c.grid_dim.z, c.thread.x, c.thread.y,
          c.thread.z, c.block_dim.x, c.block_dim.y, c.block_dim.z);
  fflush(stderr);
  abort();
}

}  // namespace

struct Warp {
  std::unique_ptr<std::barrier<>> barrier;
  uint32_t slots[32];
  std::atomic<int> exited{0};
  int size = 0;
};

struct Block {
  std::unique_ptr<std::barrier<>> barrier;
  std::unique_ptr<Warp[]> warps;

  void reset(int threads) {
    barrier = std::make_unique<std::barrier<>>(threads);
    const int count = (threads + 31) / 32;
    warps = std::make_unique<Warp[]>(count);
    for (int w = 0; w < count; ++w) {
      warps[w].size = threads - 32 * w < 32 ? threads - 32 * w : 32;
      warps[w].barrier = std::make_unique<std::barrier<>>(warps[w].size);
    }
  }

  // A thread that returned from the kernel no longer takes part in the block's barriers.
  void leave(unsigned int warp) {
    warps[warp].exited.fetch_add(1);
    warps[warp].barrier->arrive_and_drop();
    barrier->arrive_and_drop();
  }
};

void syncthreads() { context.live->barrier->arrive_and_wait(); }

// A barrier of the warp's live lanes (an exited lane has dropped out of it, as on the GPU).
void syncwarp(unsigned int mask) {
  if (mask != 0xFFFFFFFFu) fail("__syncwarp: only the full-warp mask is emulated");
  context.live->warps[context.warp].barrier->arrive_and_wait();
}

uint32_t shfl_xor(uint32_t bits, unsigned int mask, int lane_mask, int width) {
  Warp& w = context.live->warps[context.warp];
  if (mask != 0xFFFFFFFFu || width != 32 || w.size != 32)
    fail("__shfl_xor_sync: only full-warp shuffles are emulated (mask 0xffffffff, width 32)");
  if (lane_mask < 0 || lane_mask > 31) fail("__shfl_xor_sync: lane mask out of range");
  w.slots[context.lane] = bits;
  w.barrier->arrive_and_wait();
  if (w.exited.load() != 0) fail("__shfl_xor_sync with exited lanes in the warp (undefined)");
  const uint32_t got = w.slots[context.lane ^ static_cast<unsigned int>(lane_mask)];
  w.barrier->arrive_and_wait();
  return got;
}

void set_sm_count(int sms) { sm_count = sms > 0 ? sms : 1; }

namespace {

// The OS threads that play a block's threads, kept across launches (creating up to 1024 threads per
// launch cost more than the kernels): thread t takes part in every launch of more than t threads.
struct ThreadPool {
  std::mutex m;
  std::condition_variable wake;
  uint64_t generation = 0;  // one per launch
  int active = 0;
  const std::function<void(int)>* work = nullptr;
  int size = 0;

  // Thread t < n runs work(t); the caller keeps `work` alive until every one of them has returned.
  void start(int n, const std::function<void(int)>& job) {
    {
      std::lock_guard<std::mutex> lock(m);
      for (; size < n; ++size) std::thread([this, t = size] { serve(t); }).detach();
      work = &job;
      active = n;
      ++generation;
    }
    wake.notify_all();
  }

  void serve(int t) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job;
      {
        std::unique_lock<std::mutex> lock(m);
        wake.wait(lock, [&] { return generation != seen && t < active; });
        seen = generation;
        job = work;
      }
      (*job)(t);
    }
  }
};

ThreadPool& pool() {
  static ThreadPool* p = new ThreadPool;  // never destroyed: its detached threads wait on it until exit
  return *p;
}

}  // namespace

void launch(const std::function<void()>& body, dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 0x7FFFFFFFu || grid.y > 65535 || grid.z > 65535 || shared_bytes > 48 * 1024) {
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  const int n = static_cast<int>(threads);
  Block live;
  uint3 current{0, 0, 0};
  bool done = false;
  std::barrier<> start(n + 1), finish(n + 1);
  std::latch returned(n);
  const std::function<void(int)> work = [&](int t) {
    ThreadContext& c = context;
    const unsigned int u = static_cast<unsigned int>(t);
    c.thread = {u % block.x, (u / block.x) % block.y, u / (block.x * block.y)};
    c.block_dim = block;
    c.grid_dim = grid;
    c.warp = u / 32;
    c.lane = u % 32;
    for (;;) {
      start.arrive_and_wait();
      if (done) break;
      c.block = current;
      c.live = &live;
      body();
      live.leave(c.warp);
      finish.arrive_and_wait();
    }
    returned.count_down();
  };
  pool().start(n, work);
  for (unsigned int z = 0; z < grid.z; ++z)
    for (unsigned int y = 0; y < grid.y; ++y)
      for (unsigned int x = 0; x < grid.x; ++x) {
        live.reset(n);
        current = {x, y, z};
        start.arrive_and_wait();
        finish.arrive_and_wait();
      }
  done = true;
  start.arrive_and_wait();
  returned.wait();  // this launch's state (on this stack) outlives every use of it
}

void launch_bounded(int max_threads, const std::function<void()>& body, dim3 grid, dim3 block, size_t shared_bytes,
                    cudaStream_t stream) {
  if (uint64_t(block.x) * block.y * block.z > uint64_t(max_threads)) {
    last_error = cudaErrorLaunchOutOfResources;
    return;
  }
  launch(body, grid, block, shared_bytes, stream);
}

// ---- traffic counting ------------------------------------------------------------------------

namespace {

struct Region {
  uintptr_t begin = 0, end = 0;
  bool live = false;  // false once its memory was freed (traffic_release): a new allocation may reuse it
  std::atomic<uint64_t> loaded{0}, stored{0};
  std::unique_ptr<std::atomic<uint64_t>[]> load_bits, store_bits;  // one bit per byte
};

constexpr int kMaxRegions = 64;
Region regions[kMaxRegions];
std::atomic<int> region_count{0};

void mark(std::atomic<uint64_t>* bits, uintptr_t offset, uintptr_t size) {
  for (uintptr_t b = offset; b < offset + size; ++b)
    bits[b >> 6].fetch_or(uint64_t(1) << (b & 63), std::memory_order_relaxed);
}

void count(uintptr_t addr, uintptr_t size, bool store) {
  const int n = region_count.load(std::memory_order_acquire);
  for (int r = 0; r < n; ++r) {
    Region& g = regions[r];
    if (g.live && addr >= g.begin && addr < g.end) {
      if (addr + size > g.end) fail("access straddles the end of a watched region");
      (store ? g.stored : g.loaded).fetch_add(size, std::memory_order_relaxed);
      mark(store ? g.store_bits.get() : g.load_bits.get(), addr - g.begin, size);
      return;
    }
  }
}

uint64_t distinct(const std::atomic<uint64_t>* bits, uintptr_t bytes) {
  uint64_t total = 0;
  for (uintptr_t w = 0; w < (bytes + 63) / 64; ++w) total += __builtin_popcountll(bits[w].load());
  return total;
}

}  // namespace

int traffic_watch(const void* begin, size_t bytes) {
  const int r = region_count.load();
  if (r == kMaxRegions) fail("too many watched regions");
  Region& g = regions[r];
  g.begin = reinterpret_cast<uintptr_t>(begin);
  g.end = g.begin + bytes;
  g.live = true;
  g.loaded = 0;
  g.stored = 0;
  const size_t words = (bytes + 63) / 64;
  g.load_bits = std::make_unique<std::atomic<uint64_t>[]>(words);
  g.store_bits = std::make_unique<std::atomic<uint64_t>[]>(words);
  for (size_t w = 0; w < words; ++w) g.load_bits[w] = 0, g.store_bits[w] = 0;
  region_count.store(r + 1, std::memory_order_release);
  return r;
}

int traffic_region_count() { return region_count.load(); }

Traffic traffic_of(int r) {
  const Region& g = regions[r];
  return {g.begin,
          g.end - g.begin,
          g.loaded.load(),
          g.stored.load(),
          distinct(g.load_bits.get(), g.end - g.begin),
          distinct(g.store_bits.get(), g.end - g.begin)};
}

void traffic_release(int r, const void* begin) {
  if (r < region_count.load() && regions[r].begin == reinterpret_cast<uintptr_t>(begin)) regions[r].live = false;
}

void traffic_clear() { region_count.store(0); }

}  // namespace msp_emu

// Called by code built with -fsanitize=kernel-address --param
// asan-instrumentation-with-call-threshold=0 (the kernel files in "traffic" builds) for every
// memory access.
extern "C" {
#define MSP_EMU_ACCESS(n)                                                           \
  void __asan_load##n##_noabort(uintptr_t addr) { msp_emu::count(addr, n, false); } \
  void __asan_store##n##_noabort(uintptr_t addr) { msp_emu::count(addr, n, true); }
MSP_EMU_ACCESS(1)
MSP_EMU_ACCESS(2)
MSP_EMU_ACCESS(4)
MSP_EMU_ACCESS(8)
MSP_EMU_ACCESS(16)
void __asan_loadN_noabort(uintptr_t addr, uintptr_t size) { msp_emu::count(addr, size, false); }
void __asan_storeN_noabort(uintptr_t addr, uintptr_t size) { msp_emu::count(addr, size, true); }
void __asan_handle_no_return() {}
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  if (attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = msp_emu::sm_count;
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  cudaError_t e = msp_emu::last_error;
  msp_emu::last_error = cudaSuccess;
  return e;
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t) {
  memset(ptr, value, bytes);
  return cudaSuccess;
}

const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorLaunchOutOfResources:
      return "too many resources requested for launch";
  }
  return "unknown error";
}

// The execution engine of the CUDA emulator (include/msp_cuda_emulator.h): blocks in sequence,
// the threads of a block as OS threads, barriers for __syncthreads and warp shuffles.
#include <stdio.h>
#include <stdlib.h>

#include <atomic>
#include <barrier>
#include <condition_variable>
#include <functional>
#include <latch>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "emulator_internal.h"
#include "msp_cuda_emulator.h"

namespace msp_emu {

thread_local ThreadContext context;

namespace {

cudaError_t last_error = cudaSuccess;
int sm_count = 2;
constexpr size_t kDefaultDynamicShared = 48 * 1024, kMaxDynamicShared = 227 * 1024;  // an H200's opt-in limit
std::map<const void*, size_t> dynamic_shared_limit;  // cudaFuncAttributeMaxDynamicSharedMemorySize per kernel
std::mutex attribute_mutex;

}  // namespace

void fail(const char* what) {
  const ThreadContext& c = context;
  fprintf(stderr,
          "msp_cuda_emulator: %s (block (%u, %u, %u) of (%u, %u, %u), thread (%u, %u, %u) of "
          "(%u, %u, %u))\n",
          what, c.block.x, c.block.y, c.block.z, c.grid_dim.x, c.grid_dim.y, c.grid_dim.z, c.thread.x, c.thread.y,
          c.thread.z, c.block_dim.x, c.block_dim.y, c.block_dim.z);
  fflush(stderr);
  abort();
}

struct Warp {
  std::unique_ptr<std::barrier<>> barrier;
  LaneSlot slots[2][32] = {};  // a collective uses set `seq % 2`: a lane refills a set only after every
                               // lane has passed the barrier of the collective in between (zeroed per block)
  int size = 0;
};

struct Block {
  std::unique_ptr<std::barrier<>> barrier;
  std::unique_ptr<Warp[]> warps;
  unsigned char* dynamic = nullptr;  // the launch's dynamic shared memory
  size_t dynamic_bytes = 0;

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

const LaneSlot* exchange(const LaneSlot& mine, const char* what) {
  Warp& w = context.live->warps[context.warp];
  if (w.size != 32) fail(what);  // names the operation: only full warps are emulated
  const unsigned int seq = ++context.collectives;
  LaneSlot* set = w.slots[seq & 1];
  set[context.lane] = mine;
  set[context.lane].seq = seq;
  w.barrier->arrive_and_wait();
  // A lane that exited before this collective left the barrier and its slot stale (an older seq). The
  // count of exited lanes is no test: a lane may leave the kernel right after this barrier.
  for (int l = 0; l < 32; ++l) {
    if (set[l].seq != seq) fail("a warp-collective operation with exited lanes in the warp (undefined)");
    if (set[l].op != mine.op) fail("the lanes of a warp are in different warp-collective operations (divergence)");
  }
  return set;
}

uint32_t shfl_xor(uint32_t bits, unsigned int mask, int lane_mask, int width) {
  if (mask != 0xFFFFFFFFu || width != 32)
    fail("__shfl_xor_sync: only full-warp shuffles are emulated (mask 0xffffffff, width 32)");
  if (lane_mask < 0 || lane_mask > 31) fail("__shfl_xor_sync: lane mask out of range");
  LaneSlot mine{kShuffle, {bits}, nullptr};
  const LaneSlot* all = exchange(mine, "__shfl_xor_sync: only full-warp shuffles are emulated");
  return all[context.lane ^ static_cast<unsigned int>(lane_mask)].words[0];
}

unsigned char* dynamic_shared_begin() { return context.live->dynamic; }
size_t dynamic_shared_bytes() { return context.live->dynamic_bytes; }

void* dynamic_shared_memory() {
  if (context.live->dynamic_bytes == 0) fail("dynamic shared memory used by a launch that requested none");
  return context.live->dynamic;
}

cudaError_t set_function_attribute(const void* kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 || size_t(value) > kMaxDynamicShared)
    return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(attribute_mutex);
  dynamic_shared_limit[kernel] = size_t(value);
  return cudaSuccess;
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

namespace {

size_t dynamic_limit(const void* kernel) {
  std::lock_guard<std::mutex> lock(attribute_mutex);
  const auto it = dynamic_shared_limit.find(kernel);
  return it == dynamic_shared_limit.end() ? kDefaultDynamicShared : it->second;
}

}  // namespace

void launch(const void* kernel, const std::function<void()>& body, dim3 grid, dim3 block, size_t shared_bytes,
            cudaStream_t) {
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.x > 0x7FFFFFFFu || grid.y > 65535 || grid.z > 65535) {
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  if (shared_bytes > dynamic_limit(kernel)) {  // over 48 KiB without the opt-in attribute
    last_error = cudaErrorInvalidValue;
    return;
  }
  const int n = static_cast<int>(threads);
  std::unique_ptr<unsigned char[]> dynamic(shared_bytes ? new unsigned char[shared_bytes] : nullptr);
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
      c.collectives = 0;
      async_copies_reset();
      body();
      async_copies_check_drained();
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
        live.dynamic = dynamic.get(), live.dynamic_bytes = shared_bytes;
        if (shared_bytes) memset(dynamic.get(), 0xA5, shared_bytes);  // what an earlier block left: not zeros
        current = {x, y, z};
        start.arrive_and_wait();
        finish.arrive_and_wait();
      }
  done = true;
  start.arrive_and_wait();
  returned.wait();  // this launch's state (on this stack) outlives every use of it
}

void launch_bounded(int max_threads, const void* kernel, const std::function<void()>& body, dim3 grid, dim3 block,
                    size_t shared_bytes, cudaStream_t stream) {
  if (uint64_t(block.x) * block.y * block.z > uint64_t(max_threads)) {
    last_error = cudaErrorLaunchOutOfResources;
    return;
  }
  launch(kernel, body, grid, block, shared_bytes, stream);
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

}  // namespace

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

namespace {

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
  switch (attr) {  // an H200 (sm_90) with the SM count the case asked for
    case cudaDevAttrMultiProcessorCount:
      *value = msp_emu::sm_count;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(msp_emu::kMaxDynamicShared);
      return cudaSuccess;
  }
  return cudaErrorInvalidValue;
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

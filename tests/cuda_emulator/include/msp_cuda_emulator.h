// A CPU stand-in for the slice of CUDA that csrc/cuda/*.cu uses, so that the kernels themselves
// (indexing, vector paths, grid-stride loops, warp and block reductions, launch sizing) run and are
// checked on a machine without a GPU. Test-only: tests/test_cuda_emulated.py builds the kernels
// against it with AddressSanitizer and compares them with the references.
//
// Model: a launch runs its blocks one after another; the threads of a block are real OS threads,
// so __syncthreads is a barrier (__syncwarp one of the warp's lanes), a warp shuffle is an exchange
// through the warp's slots between two warp barriers, and __shared__ arrays are static storage (one block is live at a
// time). Threads that return early leave the barriers (as exited threads do on the GPU). A shuffle over a warp with an
// exited lane, a partial warp or a mask other than the full warp is reported as an error; an invalid launch
// configuration, or more threads than the kernel's __launch_bounds__, fails the launch (cudaGetLastError then returns
// it). fp32 arithmetic is the host's IEEE single precision (build with -ffp-contract=off so `a * b + c` is not fused:
// the GPU may fuse it, so results are compared with tolerances wherever the kernel does not use the explicitly rounded
// __fadd_rn/__fmul_rn).
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchOutOfResources = 701,
};
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
typedef struct CUstream_st* cudaStream_t;

cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaGetLastError();
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream);
const char* cudaGetErrorString(cudaError_t err);

// Storage types without implicit conversions (torch compiles .cu files with
// __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__, so the kernels must not rely on
// them either).
struct __nv_bfloat16 {
  uint16_t bits;
};
struct __half {
  uint16_t bits;
};

inline float __bfloat162float(__nv_bfloat16 v) {
  uint32_t u = uint32_t(v.bits) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return {static_cast<uint16_t>((u >> 16) | 0x40u)};  // NaN
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return {static_cast<uint16_t>(u >> 16)};
}
inline float __half2float(__half v) {
  _Float16 h;
  memcpy(&h, &v.bits, 2);
  return static_cast<float>(h);
}
inline __half __float2half_rn(float f) {
  _Float16 h = static_cast<_Float16>(f);  // IEEE round to nearest even
  __half r;
  memcpy(&r.bits, &h, 2);
  return r;
}

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float rsqrtf(float v) { return 1.0f / sqrtf(v); }
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return static_cast<unsigned int>((uint64_t(a) * b) >> 32);
}

namespace msp_emu {

struct Block;
struct ThreadContext {
  uint3 thread, block;
  dim3 block_dim, grid_dim;
  Block* live = nullptr;
  unsigned int warp = 0, lane = 0;
};
extern thread_local ThreadContext context;

void syncthreads();
void syncwarp(unsigned int mask);
uint32_t shfl_xor(uint32_t bits, unsigned int mask, int lane_mask, int width);
// Runs `body` (one kernel call with its arguments bound) as the kernel `grid` x `block` launch.
void launch(const std::function<void()>& body, dim3 grid, dim3 block, size_t shared_bytes = 0,
            cudaStream_t stream = nullptr);
// The same for a kernel declared __launch_bounds__(max_threads): more threads per block fail the
// launch with cudaErrorLaunchOutOfResources, as on the GPU.
void launch_bounded(int max_threads, const std::function<void()>& body, dim3 grid, dim3 block, size_t shared_bytes = 0,
                    cudaStream_t stream = nullptr);
// The SM count cudaDeviceGetAttribute reports (it sizes the persistent grids).
void set_sm_count(int sms);

// Global-memory traffic (build mode "traffic": the kernel files are compiled with
// -fsanitize=kernel-address in call mode, so every load and store they make calls the emulator).
// Accesses inside a watched region are counted: bytes requested (every access) and distinct bytes
// touched, for loads and stores separately. Accesses elsewhere (the stack, __shared__) are not.
// tests/cuda_emulator/control.cpp watches tensors, and the allocations an op makes, through it.
struct Traffic {
  uintptr_t begin, bytes;
  uint64_t loaded, stored, distinct_loaded, distinct_stored;
};
int traffic_watch(const void* begin, size_t bytes);   // returns the region's index
void traffic_release(int region, const void* begin);  // its memory is freed: stop counting there
int traffic_region_count();
Traffic traffic_of(int region);
void traffic_clear();

}  // namespace msp_emu

#define threadIdx (::msp_emu::context.thread)
#define blockIdx (::msp_emu::context.block)
#define blockDim (::msp_emu::context.block_dim)
#define gridDim (::msp_emu::context.grid_dim)

inline void __syncthreads() { msp_emu::syncthreads(); }
inline void __syncwarp(unsigned int mask = 0xFFFFFFFFu) { msp_emu::syncwarp(mask); }

inline float __shfl_xor_sync(unsigned int mask, float v, int lane_mask, int width = 32) {
  uint32_t bits;
  memcpy(&bits, &v, 4);
  bits = msp_emu::shfl_xor(bits, mask, lane_mask, width);
  memcpy(&v, &bits, 4);
  return v;
}

// Device helpers shared by the kernel files: dtype conversion, 128-bit vector access, block sums,
// launch sizing. Torch-free (see dtype.h).
//
// torch builds .cu files with -D__CUDA_NO_HALF_OPERATORS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__, so
// all conversions here are the explicit intrinsics; fp32 arithmetic uses __fadd_rn/__fmul_rn
// where an fma contraction would change the result the reference computes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "dtype.h"

namespace msp {
namespace cuda {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}

// N values of T in registers; a multiple of 16 bytes moves as 128-bit loads/stores.
template <typename T, int N>
struct alignas(16) Pack {
  T v[N];
};

// Raw load (kept as T, e.g. to cache a row in few registers) and conversion to fp32.
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* ptr) {
  Pack<T, N> p;
  if constexpr ((sizeof(T) * N) % 16 == 0) {
#pragma unroll
    for (int i = 0; i < int(sizeof(T) * N / 16); ++i)
      reinterpret_cast<uint4*>(&p)[i] = reinterpret_cast<const uint4*>(ptr)[i];
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p.v[i] = ptr[i];
  }
  return p;
}

template <typename T, int N>
__device__ __forceinline__ void pack_to_f32(const Pack<T, N>& p, float (&out)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_f32(p.v[i]);
}

template <typename T, int N>
__device__ __forceinline__ void load_f32(const T* ptr, float (&out)[N]) {
  pack_to_f32(load_pack<T, N>(ptr), out);
}

template <typename T, int N>
__device__ __forceinline__ void store_f32(T* ptr, const float (&in)[N]) {
  if constexpr ((sizeof(T) * N) % 16 == 0) {
    Pack<T, N> p;
#pragma unroll
    for (int i = 0; i < N; ++i) p.v[i] = from_f32<T>(in[i]);
#pragma unroll
    for (int i = 0; i < int(sizeof(T) * N / 16); ++i)
      reinterpret_cast<uint4*>(ptr)[i] = reinterpret_cast<const uint4*>(&p)[i];
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) ptr[i] = from_f32<T>(in[i]);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
// `shared` holds 32 floats; the trailing barrier lets the caller reuse it at once.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : 0.0f;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline int round_up(int64_t v, int64_t m) { return static_cast<int>((v + m - 1) / m * m); }

inline int sm_count() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms > 0 ? sms : 1;
}

// Sum over rows of a [rows, cols] fp32 matrix of per-block partials -> out [cols] fp32
// (column_sum.cu).
cudaError_t column_sum(const float* partial, int64_t rows, int64_t cols, float* out, cudaStream_t stream);

}  // namespace cuda
}  // namespace msp

// MSP_DISPATCH_DTYPE(dtype, T, body): runs body with T the CUDA storage type of dtype.
#define MSP_DISPATCH_DTYPE(dtype, T, ...) \
  switch (dtype) {                        \
    case ::msp::cuda::DType::kF32: {      \
      using T = float;                    \
      __VA_ARGS__;                        \
      break;                              \
    }                                     \
    case ::msp::cuda::DType::kBF16: {     \
      using T = __nv_bfloat16;            \
      __VA_ARGS__;                        \
      break;                              \
    }                                     \
    case ::msp::cuda::DType::kF16: {      \
      using T = __half;                   \
      __VA_ARGS__;                        \
      break;                              \
    }                                     \
  }

// Parameters (bias, LayerNorm weight) are either fp32 or the activation type T.
#define MSP_DISPATCH_PARAM(param_dtype, T, W, ...) \
  if ((param_dtype) == ::msp::cuda::DType::kF32) { \
    using W = float;                               \
    __VA_ARGS__;                                   \
  } else {                                         \
    using W = T;                                   \
    __VA_ARGS__;                                   \
  }

// A tensor that is either of the low-precision type T or fp32 (the fp32 residual stream and its gradient
// beside bf16/fp16 activations): W = float for kF32, else T.
#define MSP_DISPATCH_WIDE(dtype, T, W, ...)  \
  if ((dtype) == ::msp::cuda::DType::kF32) { \
    using W = float;                         \
    __VA_ARGS__;                             \
  } else {                                   \
    using W = T;                             \
    __VA_ARGS__;                             \
  }

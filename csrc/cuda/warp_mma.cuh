// Warp-level matrix primitives of the tensor-core kernels (flash_attention_mma_*.cu): mma.sync
// m16n8k16 (bf16/fp16 in, fp32 accumulators), ldmatrix, cp.async, dynamic shared memory. Torch-free.
//
// On a GPU each is one PTX instruction (inline asm, sm_80+). On the CPU emulator
// (tests/cuda_emulator/, which defines MSP_CUDA_EMULATOR) each calls the emulator's model of the
// same instruction: the PTX ISA's fragment layouts, lane by lane (tests/cuda_emulator/warp_matrix.cpp),
// so a kernel whose fragments are right on the emulator is right on the GPU.
//
// Fragments (PTX ISA 9.7.14.5.8, "Matrix Fragments for mma.m16n8k16 with floating point type";
// g = lane / 4, t = lane % 4):
//   A 16x16 row-major, 4 registers of 2 elements: a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..),
//     a[2] = (g, 2t+8..), a[3] = (g+8, 2t+8..)
//   B 16x8 (k x n), 2 registers: b[0] = (k 2t..2t+1, n g), b[1] = (k 2t+8..2t+9, n g)
//   C/D 16x8 fp32, 4 registers: c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1)
// ldmatrix.x4 (PTX ISA, "Warp-level matrix load instruction: ldmatrix"): lanes 8j..8j+7 give the 16-byte rows of 8x8
// matrix j; register j of lane l holds row l/4, columns 2(l%4)..+1 of matrix j (.trans: rows 2(l%4)..+1 of column l/4).
// So an S = Q K^T accumulator (C layout) is, packed to 16 bits, the A fragment of the P V product.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

namespace msp {
namespace cuda {

#if defined(MSP_CUDA_EMULATOR) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
#define MSP_HAS_MMA 1  // the tensor-core kernels' bodies compile (else they trap: never launched there)
#endif

template <typename T>
struct MmaKind;  // the element type of an mma: 0 bf16, 1 fp16 (the emulator's numbering)
template <>
struct MmaKind<__nv_bfloat16> {
  static constexpr int value = 0;
};
template <>
struct MmaKind<__half> {
  static constexpr int value = 1;
};

// d += A B for one m16n8k16 tile (fp32 accumulate), every lane of the warp taking part.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(MSP_CUDA_EMULATOR)
  const uint32_t b[2] = {b0, b1};
  ::msp_emu::mma_m16n8k16(MmaKind<T>::value, d, a, b);
#elif defined(MSP_HAS_MMA)
  if constexpr (MmaKind<T>::value == 0) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

#if !defined(MSP_CUDA_EMULATOR)
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

// Four 8x8 matrices of 16-bit elements from shared memory; `row` is this lane's row address
// (16-byte aligned): lanes 8j..8j+7 address the rows of matrix j.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
#if defined(MSP_CUDA_EMULATOR)
  ::msp_emu::ldmatrix(4, false, r, row);
#elif defined(MSP_HAS_MMA)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
#endif
}

// The same, each matrix transposed (lane l gets rows 2(l%4), 2(l%4)+1 of column l/4).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
#if defined(MSP_CUDA_EMULATOR)
  ::msp_emu::ldmatrix(4, true, r, row);
#elif defined(MSP_HAS_MMA)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
#endif
}

// Asynchronous global -> shared copy of 16 bytes (both 16-byte aligned); !valid writes 16 zero
// bytes and reads nothing. Completes at cp_async_wait (after cp_async_commit), not before.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
#if defined(MSP_CUDA_EMULATOR)
  ::msp_emu::cp_async(dst, src, 16, valid ? 16 : 0);
#elif defined(MSP_HAS_MMA)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(valid ? 16 : 0));
#endif
}

// The same for 4 or 8 bytes (index vectors, lse), through L1.
template <int kBytes>
__device__ __forceinline__ void cp_async_small(void* dst, const void* src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 8, "cp.async.ca copies 4, 8 or 16 bytes");
#if defined(MSP_CUDA_EMULATOR)
  ::msp_emu::cp_async(dst, src, kBytes, valid ? kBytes : 0);
#elif defined(MSP_HAS_MMA)
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(shared_address(dst)), "l"(src), "n"(kBytes),
               "r"(valid ? kBytes : 0));
#endif
}

// Closes the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#if defined(MSP_CUDA_EMULATOR)
  ::msp_emu::cp_async_commit();
#elif defined(MSP_HAS_MMA)
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most kPending of this thread's committed groups are in flight (their data is then
// visible to this thread; to the block after a __syncthreads).
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(MSP_CUDA_EMULATOR)
  ::msp_emu::cp_async_wait(kPending);
#elif defined(MSP_HAS_MMA)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
#endif
}

// The block's dynamic shared memory (the launch's third <<<>>> argument), 128-byte aligned.
__device__ __forceinline__ unsigned char* dynamic_shared_memory() {
#if defined(MSP_CUDA_EMULATOR)
  return static_cast<unsigned char*>(::msp_emu::dynamic_shared_memory());
#else
  extern __shared__ __align__(128) unsigned char msp_dynamic_shared[];
  return msp_dynamic_shared;
#endif
}

// Two fp32 values as one register of two 16-bit elements (lo in the low half), rounded to nearest.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}

__device__ __forceinline__ uint32_t shfl_xor_u32(uint32_t v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}

}  // namespace cuda
}  // namespace msp

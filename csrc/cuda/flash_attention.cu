// flash_attention's CUDA entry points (flash_attention.h): shape checks, the choice of kernels, the
// tile summaries and the scratch layout.
//
// Kernels: bf16/fp16 on sm_80+ run the tensor-core kernels (flash_attention_fwd_mma.cu,
// flash_attention_bwd_mma.cu); fp32 (kept exact: no tf32), and any dtype on older GPUs, the SIMT
// kernels (flash_attention_simt.cu). Both compute the reference's function with its dropout bits.
// Before a tensor-core call one small kernel summarises every 64 query and key positions (range,
// whether each 4 keys form one Philox group, documents per sample), so the kernels skip tile pairs
// nothing sees without loading them and leave fully visible ones unmasked.
//
// Scratch (16-byte aligned): query summaries, key summaries (int64), then for the backward D (fp32
// [b, nq, sq]) and the tensor-core dQ accumulator (fp32 [sq, b, nq, d]).
#include "flash_attention.cuh"

namespace msp {
namespace cuda {
namespace flash {
namespace {

constexpr int kSummaryThreads = 128;

// Summaries of n positions (and of segments [b, n]) into out: summary_words(n, b, seg != nullptr).
__global__ void __launch_bounds__(kSummaryThreads)
    flash_summary_kernel(const int64_t* pos, const int64_t* seg, int64_t n, int64_t b, int64_t* out) {
  const int64_t count = tiles(n, kTile), idx = int64_t(blockIdx.x) * kSummaryThreads + threadIdx.x;
  if (idx < count) {
    const int64_t j0 = idx * kTile, j1 = n - j0 < kTile ? n : j0 + kTile;
    int64_t lo = pos[j0], hi = pos[j0];
    bool aligned = true;
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t first = pos[j - ((j - j0) & 3)];  // of its group of 4
      lo = pos[j] < lo ? pos[j] : lo, hi = pos[j] > hi ? pos[j] : hi;
      aligned = aligned && (first & 3) == 0 && pos[j] == first + ((j - j0) & 3);
    }
    out[3 * idx] = lo, out[3 * idx + 1] = hi;
    out[3 * idx + 2] = (aligned ? kAligned : 0) | (j1 - j0 == kTile ? kFull : 0);
  } else if (seg != nullptr && idx < count * (1 + b)) {
    const int64_t r = idx - count, bi = r / count, j0 = (r % count) * kTile, j1 = n - j0 < kTile ? n : j0 + kTile;
    int64_t lo = seg[bi * n + j0], hi = lo;
    for (int64_t j = j0; j < j1; ++j)
      lo = seg[bi * n + j] < lo ? seg[bi * n + j] : lo, hi = seg[bi * n + j] > hi ? seg[bi * n + j] : hi;
    out[3 * count + 2 * r] = lo, out[3 * count + 2 * r + 1] = hi;
  }
}

cudaError_t summarize(const int64_t* pos, const int64_t* seg, int64_t n, int64_t b, int64_t* out, cudaStream_t stream) {
  const int64_t threads = tiles(n, kTile) * (1 + (seg ? b : 0));
  if (threads == 0) return cudaSuccess;
  flash_summary_kernel<<<tiles(threads, kSummaryThreads), kSummaryThreads, 0, stream>>>(pos, seg, n, b, out);
  return cudaGetLastError();
}

bool valid_shape(int64_t b, int64_t nq, int64_t nkv, int64_t d) {
  return d > 0 && d <= kFlashMaxHeadDim && nkv > 0 && nq % nkv == 0 && b <= 65535 && nq <= 65535;
}

bool tensor_cores(DType dtype) {
  if (dtype == DType::kF32) return false;
  int device = 0, major = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  return major >= 8;
}

// The scratch of a call: its summaries, then (backward) fp32 buffers.
struct Scratch {
  int64_t q_words, k_words;  // int64 words of the query and key summaries

  template <typename Args>
  explicit Scratch(const Args& x)
      : q_words(summary_words(x.sq, x.b, x.q_segments != nullptr)),
        k_words(summary_words(x.sk, x.b, x.q_segments != nullptr)) {}

  int64_t summary_bytes() const { return 8 * (q_words + k_words); }

  template <typename Args>
  FlashIndexSummaries summaries(const Args& x) const {
    const int64_t* words = static_cast<const int64_t*>(x.scratch);
    const bool seg = x.q_segments != nullptr;
    return {summary_at(words, x.sq, x.b, seg), summary_at(words + q_words, x.sk, x.b, seg)};
  }

  template <typename Args>
  cudaError_t build(const Args& x, cudaStream_t stream) const {
    int64_t* words = static_cast<int64_t*>(x.scratch);
    cudaError_t err = summarize(x.q_positions, x.q_segments, x.sq, x.b, words, stream);
    return err != cudaSuccess ? err : summarize(x.k_positions, x.k_segments, x.sk, x.b, words + q_words, stream);
  }

  float* floats(const FlashAttentionBwd& x) const {
    return reinterpret_cast<float*>(static_cast<unsigned char*>(x.scratch) + summary_bytes());
  }
};

}  // namespace
}  // namespace flash

int64_t flash_attention_fwd_scratch(const FlashAttentionFwd& x) { return flash::Scratch(x).summary_bytes(); }

int64_t flash_attention_bwd_scratch(const FlashAttentionBwd& x) {
  const int64_t rows = x.b * x.nq * x.sq;
  return flash::Scratch(x).summary_bytes() + 4 * rows * (1 + (flash::tensor_cores(x.dtype) ? x.d : 0));
}

cudaError_t flash_attention_fwd(const FlashAttentionFwd& x, cudaStream_t stream) {
  if (!flash::valid_shape(x.b, x.nq, x.nkv, x.d) || flash::tiles(x.sq, 16) > 0x7FFFFFFFu) return cudaErrorInvalidValue;
  if (x.b == 0 || x.nq == 0 || x.sq == 0) return cudaSuccess;
  if (!flash::tensor_cores(x.dtype)) return flash::simt_fwd(x, stream);
  const flash::Scratch scratch(x);
  cudaError_t err = scratch.build(x, stream);
  return err != cudaSuccess ? err : flash::mma_fwd(x, scratch.summaries(x), stream);
}

cudaError_t flash_attention_bwd(const FlashAttentionBwd& x, cudaStream_t stream) {
  if (!flash::valid_shape(x.b, x.nq, x.nkv, x.d)) return cudaErrorInvalidValue;
  if (x.b == 0 || x.nq == 0) return cudaSuccess;
  const flash::Scratch scratch(x);
  float* delta = scratch.floats(x);
  if (!flash::tensor_cores(x.dtype)) return flash::simt_bwd(x, delta, stream);
  cudaError_t err = scratch.build(x, stream);
  float* dq_accum = delta + x.b * x.nq * x.sq;
  return err != cudaSuccess ? err : flash::mma_bwd(x, scratch.summaries(x), delta, dq_accum, stream);
}

}  // namespace cuda
}  // namespace msp

// Philox4x32-10 and the parallelism-invariant dropout draw, shared by the C++ (CPU) and CUDA code.
//
// Design: this header is torch-free and compiles as plain C++ or as CUDA (__host__ __device__), so
// the CPU kernels, the CUDA kernels and the nvcc-only compile test all use the very same function.
// The Python reference is megatron_sp/ops/philox.py; for one element
//
//     key     = (seed mod 2^32, layer * 16 + site)
//     counter = (feature / 4, token_position, sample_id mod 2^32, sample_id div 2^32)
//     word    = Philox(key, counter)[feature % 4]
//     keep    = word >= round(p * 2^32)            (kept values are scaled by 1 / (1 - p))
//
// One Philox call therefore yields the words of four consecutive features 4g .. 4g+3, which is
// what the kernels vectorise over: a 128-bit fp32 load is exactly one Philox group.
#pragma once

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define MSP_HD __host__ __device__ __forceinline__
#else
#define MSP_HD inline __attribute__((always_inline))
#endif

namespace msp {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

struct Words4 {
  uint32_t w[4];
};

MSP_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  lo = a * b;
  hi = __umulhi(a, b);
#else
  uint64_t prod = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(prod >> 32);
  lo = static_cast<uint32_t>(prod);
#endif
}

MSP_HD Words4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < kPhiloxRounds; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(c0, kPhiloxM0, hi0, lo0);
    mulhilo32(c2, kPhiloxM1, hi1, lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0, c1 = lo1, c2 = n2, c3 = lo0;
    k0 += kPhiloxW0, k1 += kPhiloxW1;
  }
  return Words4{{c0, c1, c2, c3}};
}

// Everything a kernel needs to draw and apply one dropout site; built on the host once per call.
struct DropoutParams {
  uint32_t k0, k1;         // Philox key
  uint32_t threshold;      // drop iff word < threshold
  float scale;             // 1 / (1 - p), as the reference's fp32 multiply sees it
  int64_t feature_offset;  // global index of local feature 0
};

// The four words for features 4*group .. 4*group+3 of one (token position, sample) row.
MSP_HD Words4 dropout_words(const DropoutParams& d, uint64_t group, int64_t position, int64_t sample) {
  uint64_t s = static_cast<uint64_t>(sample);
  return philox4x32_10(static_cast<uint32_t>(group), static_cast<uint32_t>(position), static_cast<uint32_t>(s),
                       static_cast<uint32_t>(s >> 32), d.k0, d.k1);
}

// Multiplier (0 or 1) for one drawn word; a float so that x * keep * scale matches the reference
// bit for bit in fp32, including signed zeros and non-finite inputs.
MSP_HD float keep_factor(const DropoutParams& d, uint32_t word) { return word >= d.threshold ? 1.0f : 0.0f; }

// Host side: the same key, threshold and scale as philox.py's dropout_key / drop_threshold.
// nearbyint rounds half to even under the default rounding mode, like Python's round().
inline DropoutParams make_dropout_params(double p, int64_t seed, int64_t layer, int64_t site, int64_t feature_offset) {
  double t = nearbyint(p * 4294967296.0);
  DropoutParams d;
  d.k0 = static_cast<uint32_t>(static_cast<uint64_t>(seed));
  d.k1 = static_cast<uint32_t>(static_cast<uint64_t>(layer * 16 + site));
  d.threshold = t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
  d.scale = static_cast<float>(1.0 / (1.0 - p));
  d.feature_offset = feature_offset;
  return d;
}

}  // namespace msp

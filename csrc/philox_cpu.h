// Philox4x32-10 for many consecutive counter groups at once on the CPU (AVX-512 / AVX2 / scalar).
//
// Design: the dropout of one [s, b, h] row needs the words of groups first .. first+n-1 (four
// features per group) with the other three counter words fixed. Eight (AVX-512) or four (AVX2)
// groups run side by side in the 64-bit lanes of a vector: vpmuludq multiplies the low 32 bits of
// each lane into a full 64-bit product, so the hi word is a shift and the lo word the product
// itself. Bits above 32 in a lane are garbage that never reaches the low 32 bits (xor is bitwise,
// vpmuludq reads only the low half), and only the low halves are stored. The four word vectors are
// then transposed so that buf[4g + lane] holds word `lane` of group g, the scalar layout
// (philox.h), which the tests check bit for bit against ops/philox.py.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu_simd.h"
#include "philox.h"

namespace msp {

MSP_CPU_INLINE void philox_groups_scalar(const DropoutParams& d, uint32_t first, int64_t groups, uint32_t c1,
                                         uint32_t c2, uint32_t c3, uint32_t* buf) {
  for (int64_t g = 0; g < groups; ++g) {
    Words4 w = philox4x32_10(first + static_cast<uint32_t>(g), c1, c2, c3, d.k0, d.k1);
    for (int lane = 0; lane < 4; ++lane) buf[4 * g + lane] = w.w[lane];
  }
}

#if defined(__x86_64__) && defined(__GNUC__)

// GCC 12's intrinsic headers trip -Wmaybe-uninitialized on their own `__Y = __Y` placeholders.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

MSP_TARGET_AVX512 inline void philox_groups_avx512(const DropoutParams& d, uint32_t first, int64_t groups, uint32_t c1,
                                                   uint32_t c2, uint32_t c3, uint32_t* buf) {
  const __m512i m0 = _mm512_set1_epi64(kPhiloxM0), m1 = _mm512_set1_epi64(kPhiloxM1);
  const __m512i lanes = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
  __m512i key0[kPhiloxRounds], key1[kPhiloxRounds];
  for (int r = 0; r < kPhiloxRounds; ++r) {
    key0[r] = _mm512_set1_epi64(static_cast<uint32_t>(d.k0 + r * kPhiloxW0));
    key1[r] = _mm512_set1_epi64(static_cast<uint32_t>(d.k1 + r * kPhiloxW1));
  }
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    __m512i x0 = _mm512_add_epi64(_mm512_set1_epi64(first + static_cast<uint32_t>(g)), lanes);
    __m512i x1 = _mm512_set1_epi64(c1), x2 = _mm512_set1_epi64(c2), x3 = _mm512_set1_epi64(c3);
    for (int r = 0; r < kPhiloxRounds; ++r) {
      const __m512i p0 = _mm512_mul_epu32(x0, m0), p1 = _mm512_mul_epu32(x2, m1);
      x0 = _mm512_xor_si512(_mm512_xor_si512(_mm512_srli_epi64(p1, 32), x1), key0[r]);
      x2 = _mm512_xor_si512(_mm512_xor_si512(_mm512_srli_epi64(p0, 32), x3), key1[r]);
      x1 = p1;
      x3 = p0;
    }
    const __m256i w0 = _mm512_cvtepi64_epi32(x0), w1 = _mm512_cvtepi64_epi32(x1);
    const __m256i w2 = _mm512_cvtepi64_epi32(x2), w3 = _mm512_cvtepi64_epi32(x3);
    const __m256i t0 = _mm256_unpacklo_epi32(w0, w1), t1 = _mm256_unpackhi_epi32(w0, w1);
    const __m256i t2 = _mm256_unpacklo_epi32(w2, w3), t3 = _mm256_unpackhi_epi32(w2, w3);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    __m256i* out = reinterpret_cast<__m256i*>(buf + 4 * g);
    _mm256_storeu_si256(out + 0, _mm256_permute2x128_si256(u0, u1, 0x20));  // groups 0, 1
    _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(u2, u3, 0x20));  // groups 2, 3
    _mm256_storeu_si256(out + 2, _mm256_permute2x128_si256(u0, u1, 0x31));  // groups 4, 5
    _mm256_storeu_si256(out + 3, _mm256_permute2x128_si256(u2, u3, 0x31));  // groups 6, 7
  }
  philox_groups_scalar(d, first + static_cast<uint32_t>(g), groups - g, c1, c2, c3, buf + 4 * g);
}

MSP_TARGET_AVX2 inline void philox_groups_avx2(const DropoutParams& d, uint32_t first, int64_t groups, uint32_t c1,
                                               uint32_t c2, uint32_t c3, uint32_t* buf) {
  const __m256i m0 = _mm256_set1_epi64x(kPhiloxM0), m1 = _mm256_set1_epi64x(kPhiloxM1);
  const __m256i lanes = _mm256_setr_epi64x(0, 1, 2, 3);
  const __m256i low_words = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4) {
    __m256i x0 = _mm256_add_epi64(_mm256_set1_epi64x(first + static_cast<uint32_t>(g)), lanes);
    __m256i x1 = _mm256_set1_epi64x(c1), x2 = _mm256_set1_epi64x(c2), x3 = _mm256_set1_epi64x(c3);
    uint32_t k0 = d.k0, k1 = d.k1;
    for (int r = 0; r < kPhiloxRounds; ++r) {
      const __m256i p0 = _mm256_mul_epu32(x0, m0), p1 = _mm256_mul_epu32(x2, m1);
      x0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), x1), _mm256_set1_epi64x(k0));
      x2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), x3), _mm256_set1_epi64x(k1));
      x1 = p1;
      x3 = p0;
      k0 += kPhiloxW0, k1 += kPhiloxW1;
    }
    // Low 32 bits of the four lanes of each word vector, then a 4x4 transpose.
    const __m128i w0 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(x0, low_words));
    const __m128i w1 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(x1, low_words));
    const __m128i w2 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(x2, low_words));
    const __m128i w3 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(x3, low_words));
    const __m128i t0 = _mm_unpacklo_epi32(w0, w1), t1 = _mm_unpackhi_epi32(w0, w1);
    const __m128i t2 = _mm_unpacklo_epi32(w2, w3), t3 = _mm_unpackhi_epi32(w2, w3);
    __m128i* out = reinterpret_cast<__m128i*>(buf + 4 * g);
    _mm_storeu_si128(out + 0, _mm_unpacklo_epi64(t0, t2));
    _mm_storeu_si128(out + 1, _mm_unpackhi_epi64(t0, t2));
    _mm_storeu_si128(out + 2, _mm_unpacklo_epi64(t1, t3));
    _mm_storeu_si128(out + 3, _mm_unpackhi_epi64(t1, t3));
  }
  philox_groups_scalar(d, first + static_cast<uint32_t>(g), groups - g, c1, c2, c3, buf + 4 * g);
}

#pragma GCC diagnostic pop
#endif

// buf[4g + lane] = word `lane` of Philox(key, (first + g, c1, c2, c3)) for g < groups.
inline void philox_groups(const DropoutParams& d, uint32_t first, int64_t groups, uint32_t c1, uint32_t c2, uint32_t c3,
                          uint32_t* buf) {
#if defined(__x86_64__) && defined(__GNUC__)
  switch (simd_level()) {
    case SimdLevel::kAvx512:
      return philox_groups_avx512(d, first, groups, c1, c2, c3, buf);
    case SimdLevel::kAvx2:
      return philox_groups_avx2(d, first, groups, c1, c2, c3, buf);
    default:
      break;
  }
#endif
  philox_groups_scalar(d, first, groups, c1, c2, c3, buf);
}

}  // namespace msp

// CPU kernel helpers: fp32 conversions and run-time SIMD dispatch.
//
// Design: the extension is built with the compiler's baseline flags (no -march=native), so the hot
// per-row loops are written once as always-inline templates and instantiated three times through
// MSP_SIMD_VARIANTS: an AVX-512, an AVX2 and a baseline copy, chosen once at run time from cpuid.
// The loops are plain `#pragma omp simd` code that the compiler vectorises for each target.
// Threading is at::parallel_for outside these functions (a lambda does not inherit a target).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#define MSP_CPU_INLINE inline __attribute__((always_inline))

#if defined(__x86_64__) && defined(__GNUC__)
#define MSP_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")))
#define MSP_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,bmi2")))
#else
#define MSP_TARGET_AVX512
#define MSP_TARGET_AVX2
#endif

namespace msp {

enum class SimdLevel { kBaseline, kAvx2, kAvx512 };

// MEGATRON_SP_CPU_CAPABILITY=avx2|default caps the level (like torch's ATEN_CPU_CAPABILITY), so
// the tests can run every variant on one machine.
inline SimdLevel detect_simd_level() {
#if defined(__x86_64__) && defined(__GNUC__)
  const char* cap = std::getenv("MEGATRON_SP_CPU_CAPABILITY");
  const bool cap_default = cap != nullptr && std::strcmp(cap, "default") == 0;
  const bool cap_avx2 = cap != nullptr && std::strcmp(cap, "avx2") == 0;
  if (cap_default) return SimdLevel::kBaseline;
  __builtin_cpu_init();
  if (!cap_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return SimdLevel::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return SimdLevel::kAvx2;
#endif
  return SimdLevel::kBaseline;
}

inline SimdLevel simd_level() {
  static const SimdLevel level = detect_simd_level();
  return level;
}

// name<Ts...>(args...) -> name##_simd<Ts...>(args...), running the widest variant the CPU has.
#define MSP_SIMD_VARIANTS(name)                        \
  template <typename... Ts, typename... Args>          \
  MSP_TARGET_AVX512 auto name##_avx512(Args... args) { \
    return name<Ts...>(args...);                       \
  }                                                    \
  template <typename... Ts, typename... Args>          \
  MSP_TARGET_AVX2 auto name##_avx2(Args... args) {     \
    return name<Ts...>(args...);                       \
  }                                                    \
  template <typename... Ts, typename... Args>          \
  auto name##_simd(Args... args) {                     \
    switch (::msp::simd_level()) {                     \
      case ::msp::SimdLevel::kAvx512:                  \
        return name##_avx512<Ts...>(args...);          \
      case ::msp::SimdLevel::kAvx2:                    \
        return name##_avx2<Ts...>(args...);            \
      default:                                         \
        return name<Ts...>(args...);                   \
    }                                                  \
  }

MSP_CPU_INLINE float to_f32(float v) { return v; }
MSP_CPU_INLINE float to_f32(c10::BFloat16 v) { return static_cast<float>(v); }
MSP_CPU_INLINE float to_f32(c10::Half v) { return static_cast<float>(v); }

template <typename T>
MSP_CPU_INLINE T from_f32(float v) {
  return static_cast<T>(v);
}

}  // namespace msp

// What the CPU kernels of this folder share: bf16 <-> fp32 conversions that round as torch
// does, a vectorisable exp, and the multi-versioning attribute (one build runs on any
// x86-64 and takes AVX-512 / AVX2 where the CPU has them).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SHOAL_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
// A kernel in two versions, chosen with has_avx512(): one for AVX-512 alone, one cloned for
// AVX2 and the baseline (where 16-float vector types would spill).
#define SHOAL_WIDE __attribute__((target("arch=x86-64-v4")))
#define SHOAL_NARROW_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
inline bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512cd");
}
#else
#define SHOAL_CLONES
#define SHOAL_WIDE
#define SHOAL_NARROW_CLONES
inline bool has_avx512() { return false; }
#endif
#define SHOAL_INLINE inline __attribute__((always_inline))

namespace shoal_cpu {

SHOAL_INLINE float bf16_to_f32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

SHOAL_INLINE uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // nan
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Fixed-width float vectors (GCC/Clang vector extensions): 8 floats fill an AVX2 register;
// 16 fill an AVX-512 one and are for AVX-512 code only (elsewhere GCC spills them).
typedef float V16 __attribute__((vector_size(64)));
typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));

SHOAL_INLINE V16 load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
SHOAL_INLINE V8 load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
SHOAL_INLINE V8 load8(const uint16_t* p) {  // 8 bfloat16 values, widened
  V8 v;
  for (int i = 0; i < 8; ++i) v[i] = bf16_to_f32(p[i]);
  return v;
}

SHOAL_INLINE float to_f32(float x) { return x; }
SHOAL_INLINE float to_f32(uint16_t x) { return bf16_to_f32(x); }
SHOAL_INLINE void store(float* dst, float x) { *dst = x; }
SHOAL_INLINE void store(uint16_t* dst, float x) { *dst = f32_to_bf16(x); }
// x rounded to the storage type T and back: what a torch op in T's dtype hands the next one.
template <typename T>
SHOAL_INLINE float round_to(float x) {
  if constexpr (sizeof(T) == 2) return bf16_to_f32(f32_to_bf16(x));
  return x;
}

// exp in plain arithmetic, so loops over it vectorise (libm's expf does not without
// -ffast-math). Cephes' polynomial: about 1 ulp; x is clamped to [-87, 88] (exp(-87) ~ 0).
SHOAL_INLINE float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float t = x * 1.44269504f + shifter;
  float n = t - shifter;
  float r = x - n * 0.693359375f - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &t, sizeof bits);
  int32_t scale_bits = (bits - 0x4b400000 + 127) << 23;  // 2^n
  float two_n;
  std::memcpy(&two_n, &scale_bits, sizeof two_n);
  return y * two_n;
}

}  // namespace shoal_cpu

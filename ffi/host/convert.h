// Element conversions of the host device side. The sum is fp32 in rank order
// and rounds once to the element type with round-to-nearest-even, exactly
// as the CUDA side's __float2bfloat16 / __float2half_rn, so both give the
// same bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "base/layout.h"

namespace arx::host {

inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040);  // NaN stays NaN (quiet)
  u += 0x7fffu + ((u >> 16) & 1);                                              // round to nearest, ties to even
  return (uint16_t)(u >> 16);
}

// IEEE binary16, in integer arithmetic: C++ has no portable half type
// (GCC 12 for aarch64 has no _Float16 in C++).
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = h >> 10 & 0x1f, m = h & 0x3ff;
  uint32_t u;
  if (e == 0) {
    const float f = (float)m * (1.0f / 16777216.0f);  // m * 2^-24, exact
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else if (e == 31) {
    u = sign | 0x7f800000u | m << 13;  // inf, NaN
  } else {
    u = sign | (e - 15 + 127) << 23 | m << 13;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {  // round to nearest, ties to even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = (uint16_t)(u >> 16 & 0x8000);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7e00;   // NaN stays NaN (quiet)
  if (u >= 0x477ff000u) return sign | 0x7c00;  // >= 65520 rounds to infinity
  if (u < 0x38800000u) {                       // below 2^-14: subnormal or zero
    float a;
    std::memcpy(&a, &u, 4);
    const float s = a * 16777216.0f;  // |f| * 2^24 < 1024, exact
    uint32_t q = (uint32_t)s;
    const float frac = s - (float)q;
    if (frac > 0.5f || (frac == 0.5f && (q & 1))) ++q;  // may reach 0x400, the smallest normal
    return sign | (uint16_t)q;
  }
  uint32_t h = ((u >> 23) - 127 + 15) << 10 | (u >> 13 & 0x3ff);
  const uint32_t rest = u & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // a carry moves into the exponent, as it should
  return sign | (uint16_t)h;
}

// float8_e4m3fn (the fused MoE combine's expert outputs): 1 sign, 4 exponent
// bits (bias 7), 3 mantissa bits; no infinities; S.1111.111 is NaN. Exact
// in fp32, as the CUDA side's __nv_fp8_e4m3 -> float conversion.
inline float e4m3_to_f32(uint8_t v) {
  const uint32_t sign = (uint32_t)(v >> 7) << 31, e = (v >> 3) & 0xf, m = v & 7;
  uint32_t u;
  if (e == 0xf && m == 7) {
    u = sign | 0x7fc00000u;
  } else if (e == 0) {
    float f = (float)m * (1.0f / 512.0f);  // m / 8 * 2^-6, exact
    std::memcpy(&u, &f, 4);
    u |= sign;
  } else {
    u = sign | (e - 7 + 127) << 23 | m << 20;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The element types the reducing ops take, each as fp32 and back (one
// rounding, as above): the host's loops over them are written once, against
// E::kSize, E::load and E::store, and with_element picks E for a DType.
struct F32Element {
  static constexpr uint64_t kSize = 4;
  static float load(const uint8_t* p) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  static void store(uint8_t* p, float f) { std::memcpy(p, &f, 4); }
};
template <float (*ToF32)(uint16_t), uint16_t (*FromF32)(float)>
struct HalfElement {
  static constexpr uint64_t kSize = 2;
  static float load(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return ToF32(v);
  }
  static void store(uint8_t* p, float f) {
    const uint16_t v = FromF32(f);
    std::memcpy(p, &v, 2);
  }
};
using BF16Element = HalfElement<bf16_to_f32, f32_to_bf16>;
using F16Element = HalfElement<f16_to_f32, f32_to_f16>;

// f(E{}) for the element type of `t`.
template <typename F>
void with_element(DType t, F&& f) {
  switch (t) {
    case DType::kF32:
      return f(F32Element{});
    case DType::kBF16:
      return f(BF16Element{});
    case DType::kF16:
      return f(F16Element{});
  }
}

// The bits of a quiet NaN of each type: what a failed collective writes.
inline void fill_nan(DType t, void* out, uint64_t count) {
  switch (t) {
    case DType::kF32: {
      const uint32_t nan = 0x7fc00000u;
      for (uint64_t i = 0; i < count; ++i) std::memcpy((uint8_t*)out + 4 * i, &nan, 4);
      return;
    }
    case DType::kBF16:
    case DType::kF16: {
      const uint16_t nan = t == DType::kBF16 ? 0x7fc0 : 0x7e00;
      for (uint64_t i = 0; i < count; ++i) std::memcpy((uint8_t*)out + 2 * i, &nan, 2);
      return;
    }
  }
}

}  // namespace arx::host

// Element conversions of the host device side. The sum is fp32 in rank order
// and rounds once to the element type with round-to-nearest-even, exactly
// as the CUDA side's __float2bfloat16 / __float2half_rn, so both give the
// same bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "comm/layout.h"

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
  u += 0x7fffu + ((u >> 16) & 1);  // round to nearest, ties to even
  return (uint16_t)(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return (float)x;
}

inline uint16_t f32_to_f16(float f) {
  const _Float16 x = (_Float16)f;  // IEEE conversion: round to nearest even
  uint16_t h;
  std::memcpy(&h, &x, 2);
  return h;
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

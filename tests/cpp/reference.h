// The tests' numeric references, written independently of the library
// (host/convert.h, base/combine.h): conversions between float and bf16 /
// f16 / e4m3 rounding half to even, and the fused MoE combine's arithmetic
// as its contract defines it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "base/layout.h"

namespace arx::testing {

inline float ref_bf16(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t ref_to_bf16(float f) {  // round half to even on the dropped 16 bits
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t lo = u & 0xffff, hi = u >> 16;
  return (uint16_t)(hi + (lo > 0x8000 || (lo == 0x8000 && (hi & 1))));
}

inline float ref_f16(uint16_t h) {
  const int e = h >> 10 & 0x1f, m = h & 0x3ff;
  const double v = e ? std::ldexp(1024 + m, e - 25) : std::ldexp(m, -24);
  return (float)((h >> 15) ? -v : v);
}

inline uint16_t ref_to_f16(float f) {  // finite inputs; round half to even with rint
  const double a = std::fabs((double)f);
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (a < std::ldexp(1.0, -14)) return sign | (uint16_t)std::rint(a * std::ldexp(1.0, 24));
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  e -= 1;
  double q = std::rint((a / std::ldexp(1.0, e) - 1) * 1024);
  if (q == 1024) {
    q = 0;
    ++e;
  }
  return sign | (uint16_t)((e + 15) << 10 | (int)q);
}

inline float ref_e4m3(uint8_t v) {
  const int e = v >> 3 & 0xf, m = v & 7;
  const double a = e ? std::ldexp(8 + m, e - 10) : std::ldexp(m, -9);
  return (float)((v >> 7) ? -a : a);
}

inline float ref_load(DType t, const uint8_t* p) {
  uint16_t h;
  float f;
  switch (t) {
    case DType::kF32:
      std::memcpy(&f, p, 4);
      return f;
    case DType::kBF16:
      std::memcpy(&h, p, 2);
      return ref_bf16(h);
    case DType::kF16:
      std::memcpy(&h, p, 2);
      return ref_f16(h);
  }
  return 0;
}

inline void ref_store(DType t, uint8_t* p, float f) {
  uint16_t h;
  switch (t) {
    case DType::kF32:
      std::memcpy(p, &f, 4);
      return;
    case DType::kBF16:
      h = ref_to_bf16(f);
      std::memcpy(p, &h, 2);
      return;
    case DType::kF16:
      h = ref_to_f16(f);
      std::memcpy(p, &h, 2);
      return;
  }
}

// ---- the fused MoE combine ----------------------------------------------------

struct MoeCase {
  uint64_t rows, tokens, hidden, topk;
  bool e4m3;
};

// acc plus the term f * y as base/combine.h defines it, written out here:
// f split into hi (its 8 lowest significand bits cleared) and lo = f - hi,
// so that each product is exact and a contracted multiply-add or not gives
// the same bits; lo added only where it is not 0; a non-finite f whole.
inline float ref_add_term(float acc, float f, float y) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7F800000u) == 0x7F800000u) return acc + f * y;
  bits &= 0xFFFFFF00u;
  float hi;
  std::memcpy(&hi, &bits, 4);
  const float lo = f - hi;
  acc = acc + hi * y;
  return lo != 0.f ? acc + lo * y : acc;
}

// Token 0 made one that tells the documented arithmetic from a single
// rounding of each term (tests/bulk_reference.py, tie_token, says how):
// shared 1, y = 145 * 2^-7 (row 0), one weight 49265 * 2^-17 + 2^-25. Its
// row is 1.421875 in bf16; 1.4296875 with one rounding per term.
inline void tie_token(const MoeCase& c, std::vector<uint8_t>& y, std::vector<int32_t>& pos, std::vector<float>& w,
                      std::vector<uint16_t>& shared) {
  const uint16_t y_bits = ref_to_bf16(145.0f / 128), one = ref_to_bf16(1.0f);
  for (uint64_t h = 0; h < c.hidden; ++h) {
    std::memcpy(&y[h * 2], &y_bits, 2);
    shared[h] = one;
  }
  for (uint64_t q = 0; q < c.topk; ++q) {
    pos[q] = 0;
    w[q] = q == 0 ? std::ldexp(49265.0f, -17) + std::ldexp(1.0f, -25) : 0.0f;
  }
}

// Every rank's combined rows, computed here from the inputs.
inline std::vector<uint16_t> ref_combine(const MoeCase& c, uint64_t padded, const std::vector<uint8_t>& y,
                                         const std::vector<float>& scale, const std::vector<int32_t>& pos,
                                         const std::vector<float>& w, const std::vector<uint16_t>& shared) {
  std::vector<uint16_t> rows(padded * c.hidden, 0);
  for (uint64_t t = 0; t < c.tokens; ++t)
    for (uint64_t h = 0; h < c.hidden; ++h) {
      float acc = ref_bf16(shared[t * c.hidden + h]);
      for (uint64_t q = 0; q < c.topk; ++q) {
        const int64_t p = std::clamp<int64_t>(pos[t * c.topk + q], 0, (int64_t)c.rows - 1);
        if (c.e4m3) {
          const float f = w[t * c.topk + q] * scale[p * (c.hidden / 128) + h / 128];  // rounded
          acc = ref_add_term(acc, f, ref_e4m3(y[p * c.hidden + h]));
        } else {
          uint16_t b;
          std::memcpy(&b, &y[(p * c.hidden + h) * 2], 2);
          acc = ref_add_term(acc, w[t * c.topk + q], ref_bf16(b));
        }
      }
      rows[t * c.hidden + h] = ref_to_bf16(acc);
    }
  return rows;
}

}  // namespace arx::testing

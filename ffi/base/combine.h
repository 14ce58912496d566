// The fused MoE combine's arithmetic per term, one definition for both
// device sides, and the one jax_arx.moe_combine writes in jax ops
// (jax_arx/_bulk.py): with it the fused op equals
// psum_scatter(moe_combine(...)) bit for bit for any float32 weights,
// whether or not a compiler fuses a multiply and an add.
//
//   f  = w[t, k] (bf16 y), or w[t, k] * scale rounded (e4m3 y)
//   hi = f with its 8 lowest significand bits cleared, lo = f - hi (exact)
//   acc = acc + hi * y, rounded; then, where lo != 0, acc = acc + lo * y, rounded
//
// hi has at most 16 significant bits and lo at most 8; y has at most 8
// (bf16) or 4 (e4m3): each product fits float32's 24 bits, so it is exact,
// and a fused multiply-add gives the bits of a multiply and an add. (Unless
// a product falls below float32's normal range, 2^-126: not for any
// |w * y| >= 2^-100.) A non-finite f stays whole in hi, with lo = 0.
#pragma once

#include <cstdint>
#include <cstring>

#include "base/topology.h"  // ARX_HD

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace arx {

// The fused combine's operands, as the handlers check them
// (xla/handlers.h, moe_operands) and both device sides read them: row t <
// tokens of the combined output is shared[t] + sum_k w[t, k] * y[pos[t, k]];
// rows tokens <= t < padded are zero, and each rank gets padded / world of
// them. pos entries outside [0, rows) are clamped into it. Plain data, so
// that a kernel takes it by value.
struct MoeCombine {
  const void* y = nullptr;           // [rows, hidden] bf16, or e4m3 when y_scale is set
  const float* y_scale = nullptr;    // [rows, hidden / 128]: one scale per (row, 128 columns); null for bf16 y
  const int32_t* pos = nullptr;      // [tokens, topk]
  const float* w = nullptr;          // [tokens, topk]
  const uint16_t* shared = nullptr;  // [tokens, hidden] bf16
  uint64_t rows = 0, tokens = 0, padded = 0, hidden = 0, topk = 0;
};

struct WeightSplit {
  float hi, lo;
};

ARX_HD WeightSplit split_weight(float f) {
#if defined(__CUDA_ARCH__)
  if (!isfinite(f)) return {f, 0.f};
  const float hi = __uint_as_float(__float_as_uint(f) & 0xFFFFFF00u);
#else
  if (!std::isfinite(f)) return {f, 0.f};
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits &= 0xFFFFFF00u;
  float hi;
  std::memcpy(&hi, &bits, sizeof hi);
#endif
  return {hi, f - hi};
}

}  // namespace arx

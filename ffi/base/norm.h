// The epilogue of jax_arx.psum_add_norm, one definition of its arithmetic
// for both device sides:
//
//   hidden = round(round(sum of the partials) + residual)
//   normed = round(norm(hidden) * weight (+ bias))   per row of `width`
//
// the sum being psum's own (fp32 in rank order, rounded once), so hidden is
// jax_arx.psum(x) + residual bit for bit (an add of two values of one float
// type, in fp32 and rounded once, is what XLA does too). The norm is fp32,
// over the row's elements as stored in hidden (already rounded):
//   rms:   r = 1 / sqrt(sum(h * h) / width + eps);              out = (h * r) * w
//   layer: m = sum(h) / width; v = sum((h - m)^2) / width;
//          r = 1 / sqrt(v + eps);                               out = ((h - m) * r) * w
// then + b. Every operation rounds once (no fused multiply-add: the host
// side is built with -ffp-contract=off, the device side calls the _rn
// intrinsics); sqrt and the division are IEEE's, so host and GPU agree.
//
// The order of each sum over a row is fixed, whatever the threads that
// compute it: lane j of kNormLanes adds elements j, j + kNormLanes, ... in
// order from 0, then the lanes are added pairwise (lane_tree), halving.
// So every rank, algorithm and grid gets the same bits.
#pragma once

#include <cstdint>

#include "base/topology.h"  // ARX_HD

#if !defined(__CUDA_ARCH__)
#include <cmath>
#endif

namespace arx {

enum class NormKind : uint32_t { kRms = 0, kLayer = 1 };

// Lanes of a row's sums (see the top); a power of two. 256: every consumer
// thread of a split one-shot block (cuda/oneshot.cu) has a lane.
constexpr int kNormLanes = 256;

// What a fused call adds to a psum. hidden is the psum's output; normed
// gets the norm. Rows of `width` elements; weight and bias have `width`.
struct AddNorm {
  const void* residual = nullptr;  // the shape of hidden
  const void* weight = nullptr;
  const void* bias = nullptr;  // none: null
  void* normed = nullptr;      // null: a plain psum
  uint64_t width = 0;
  float eps = 0.f;
  NormKind kind = NormKind::kRms;
  ARX_HD bool on() const { return normed != nullptr; }
};

// The call site's tag with the epilogue mixed in: a peer that fused
// another norm (or none) at the same seq is a mismatch, never a sum.
ARX_HD uint64_t add_norm_tag(uint64_t tag, const AddNorm& n) {
  if (!n.on()) return tag;
  uint32_t eps_bits;
#if defined(__CUDA_ARCH__)
  eps_bits = __float_as_uint(n.eps);
#else
  __builtin_memcpy(&eps_bits, &n.eps, 4);
#endif
  const uint64_t k = (uint64_t)n.kind << 1 | (n.bias ? 1 : 0);
  return tag ^ (0xA24BAED4963EE407ull * (n.width * 4 + k + 1)) ^ (0x9FB21C651E98DF25ull * (eps_bits + 1ull));
}

// fp32 operations, each rounded once.
ARX_HD float norm_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

ARX_HD float norm_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

ARX_HD float norm_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// 1 / sqrt(stat / width + eps): the row's scale from its sum of squares.
ARX_HD float norm_scale(float stat, uint64_t width, float eps) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(stat, (float)width), eps)));
#else
  return 1.0f / std::sqrt(stat / (float)width + eps);
#endif
}

ARX_HD float norm_mean(float sum, uint64_t width) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(sum, (float)width);
#else
  return sum / (float)width;
#endif
}

// A lane's term of the second sum: h * h (rms, whose only sum it is) or
// (h - mean)^2 (layer).
ARX_HD float norm_term(NormKind kind, float h, float mean) {
  const float d = kind == NormKind::kLayer ? norm_sub(h, mean) : h;
  return norm_mul(d, d);
}

// One element of normed, before rounding to the element type.
ARX_HD float norm_out(NormKind kind, float h, float mean, float r, float w, const float* b) {
  const float d = kind == NormKind::kLayer ? norm_sub(h, mean) : h;
  const float y = norm_mul(norm_mul(d, r), w);
  return b ? norm_add(y, *b) : y;
}

}  // namespace arx

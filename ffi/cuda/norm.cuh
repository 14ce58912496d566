// The fused psum's epilogue on the GPU (base/norm.h), one row at a time by
// the threads of one block that summed it: the same operations in the same
// order as the host side's (ffi/host/norm.cc), whatever the block's size, so
// every kernel and every rank gives the same bits.
#pragma once

#include "base/norm.h"
#include "cuda/elements.cuh"
#include "cuda/grid.cuh"

namespace arx::cuda {

// Elements of a lane that a thread has in flight at once (loads before
// the adds; the order of the adds is the lane's).
constexpr int kNormUnroll = 8;

// The pairwise sum of lanes[0, kNormLanes) into lanes[0] (base/norm.h), by
// thread t of n; `bar` synchronizes the n threads, and has before the call.
template <typename Bar>
__device__ __forceinline__ float lane_tree(float* lanes, int t, int n, Bar bar) {
  for (int stride = kNormLanes / 2; stride > 0; stride >>= 1) {
    for (int j = t; j < stride; j += n) lanes[j] = norm_add(lanes[j], lanes[j + stride]);
    bar();
  }
  const float v = lanes[0];
  bar();  // every thread has read it before the lanes are written again
  return v;
}

// Row `row` of a fused call: hidden's row holds the psum (stored by these n
// threads before a `bar`, which synchronizes them and orders their memory
// accesses); it becomes psum + residual, and normed's row the norm. Thread
// t of the n threads of one block; no other thread touches the row. `lanes`:
// kNormLanes floats of shared memory for these threads alone.
template <DType D, typename Bar>
__device__ void add_norm_row(const AddNorm& nm, uint8_t* hidden, uint64_t row, int t, int n, float* lanes, Bar bar) {
  using E = Elem<D>;
  constexpr uint64_t S = E::kSize;
  const uint64_t width = nm.width, base = row * width * S;
  uint8_t* __restrict__ h = hidden + base;
  const uint8_t* __restrict__ r = static_cast<const uint8_t*>(nm.residual) + base;
  const uint8_t* __restrict__ w = static_cast<const uint8_t*>(nm.weight);
  const uint8_t* __restrict__ b = static_cast<const uint8_t*>(nm.bias);
  uint8_t* __restrict__ o = static_cast<uint8_t*>(nm.normed) + base;
  const bool layer = nm.kind == NormKind::kLayer;
  bar();  // the psum of the row is in place
  // hidden = psum + residual, rounded; the first sum (rms: of h * h; layer: of h).
  for (int j = t; j < kNormLanes; j += n) {
    float acc = 0.f;
    for (uint64_t e0 = (uint64_t)j; e0 < width; e0 += kNormUnroll * kNormLanes) {
      float p[kNormUnroll], q[kNormUnroll];
#pragma unroll
      for (int u = 0; u < kNormUnroll; ++u) {
        const uint64_t e = e0 + (uint64_t)u * kNormLanes;
        if (e < width) {
          p[u] = E::load(h + e * S);
          q[u] = E::load(r + e * S);
        }
      }
#pragma unroll
      for (int u = 0; u < kNormUnroll; ++u) {
        const uint64_t e = e0 + (uint64_t)u * kNormLanes;
        if (e >= width) break;
        const float v = E::round(norm_add(p[u], q[u]));
        E::store(h + e * S, v);
        acc = norm_add(acc, layer ? v : norm_mul(v, v));
      }
    }
    lanes[j] = acc;
  }
  bar();
  float stat = lane_tree(lanes, t, n, bar), mean = 0.f;
  if (layer) {  // the second sum, of (h - mean)^2, over the lanes' own elements
    mean = norm_mean(stat, width);
    for (int j = t; j < kNormLanes; j += n) {
      float acc = 0.f;
      for (uint64_t e0 = (uint64_t)j; e0 < width; e0 += kNormUnroll * kNormLanes) {
        float p[kNormUnroll];
#pragma unroll
        for (int u = 0; u < kNormUnroll; ++u) {
          const uint64_t e = e0 + (uint64_t)u * kNormLanes;
          if (e < width) p[u] = E::load(h + e * S);
        }
#pragma unroll
        for (int u = 0; u < kNormUnroll; ++u) {
          if (e0 + (uint64_t)u * kNormLanes >= width) break;
          acc = norm_add(acc, norm_term(nm.kind, p[u], mean));
        }
      }
      lanes[j] = acc;
    }
    bar();
    stat = lane_tree(lanes, t, n, bar);
  }
  const float scale = norm_scale(stat, width, nm.eps);
  // hidden's elements were stored by other threads: the bars above order them.
  for (uint64_t e = (uint64_t)t; e < width; e += (uint64_t)n) {
    const float bias = b ? E::load(b + e * S) : 0.f;
    E::store(o + e * S, norm_out(nm.kind, E::load(h + e * S), mean, scale, E::load(w + e * S), b ? &bias : nullptr));
  }
}

// normed = NaN over rows [lo, hi): what a failed fused call leaves there.
template <DType D>
__device__ void fill_nan_rows(const AddNorm& nm, uint64_t lo, uint64_t hi, int t, int n) {
  const uint64_t row = nm.width * Elem<D>::kSize;
  fill_nan_range<D>(static_cast<uint8_t*>(nm.normed), lo * row, hi * row, t, n);
}

}  // namespace arx::cuda

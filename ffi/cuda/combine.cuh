// The fused MoE combine's rows on NVIDIA GPUs: what bulk.cu's producers
// compute and send, piece by piece, for moe_combine_psum_scatter.
#pragma once

#include <cstdint>

#include "base/combine.h"
#include "cuda/elements.cuh"
#include "cuda/kernels.h"

namespace arx::cuda {

// One term of base/combine.h's sum: acc + hi * v, then + lo * v where lo
// is nonzero, each rounded.
__device__ __forceinline__ float add_term(float acc, const WeightSplit& f, float v) {
  acc = __fmaf_rn(f.hi, v, acc);
  return f.lo != 0.f ? __fmaf_rn(f.lo, v, acc) : acc;
}

// Rows [r0, r1) of destination j's part of the combined MoE output, bf16,
// row r at dst + (r - r0) * row_bytes: for token t = j * rows_per_rank + r,
//   acc = shared[t]; for k in order: acc += w[t, k] * y[pos[t, k]]
// (e4m3 y: w[t, k] * scale, that product rounded first), each term added
// as base/combine.h says, rounded once; zero past the tokens. The arithmetic of
// ffi/host/bulk.cc's combine_row, term by term, so both device sides give
// the same bits. `warp` of `warps` takes every warps-th row, its lanes the
// columns. A row's pos and w are read once, a term per lane (32 at a
// time), and handed out by shuffles; the y rows of kTermsInFlight terms are
// loaded before the first of their multiply-adds, which still run in k
// order. y, pos, w and shared are the call's operands: nothing writes
// them while the kernel runs, so they are read through the read-only path.
// Four terms: the kernel spills more past that (ptxas -v for sm_90);
// bench_prefill.py's cells (top-2) cannot tell it from two.
constexpr int kTermsInFlight = 4;

__device__ inline void combine_rows(const BulkOp& op, int j, uint64_t r0, uint64_t r1, uint8_t* dst, int warp,
                                    int warps) {
  const MoeCombine& a = op.moe;
  const uint64_t H = a.hidden, topk = a.topk;
  const int lane = threadIdx.x % 32;
  const unsigned all = 0xffffffffu;
  const bool vec = H % 8 == 0 && aligned16(dst) && aligned16(a.shared) && (a.y_scale || aligned16(a.y));
  for (uint64_t r = r0 + warp; r < r1; r += warps) {
    const uint64_t t = (uint64_t)j * op.rows_per_rank + r;
    uint8_t* row = dst + (r - r0) * op.row_bytes;
    if (t >= a.tokens) {  // padding rows are zero
      for (uint64_t b = lane * 16; b < op.row_bytes; b += 32 * 16) {
        if (b + 16 <= op.row_bytes && aligned16(row))
          *reinterpret_cast<uint4*>(row + b) = make_uint4(0, 0, 0, 0);
        else
          for (uint64_t q = b; q < min(b + 16, op.row_bytes); ++q) row[q] = 0;
      }
      continue;
    }
    const uint16_t* sh = a.shared + t * H;
    // Term q0 + lane's row of y (clamped, as jnp.take(mode="clip")) and
    // weight; the first 32 terms' once per row.
    auto term = [&](uint64_t q0, int64_t& p, float& wq) {
      p = 0;
      wq = 0.f;
      if (q0 + lane < topk) {
        p = __ldg(a.pos + t * topk + q0 + lane);
        p = p < 0 ? 0 : (p >= (int64_t)a.rows ? (int64_t)a.rows - 1 : p);
        wq = __ldg(a.w + t * topk + q0 + lane);
      }
    };
    int64_t p0;
    float w0;
    term(0, p0, w0);
    // Columns in groups of 8 (one 16-byte vector of bf16), or one at a time.
    const uint64_t per = vec ? 8 : 1;
    for (uint64_t h0 = lane * per; h0 < H + lane * per; h0 += 32 * per) {
      // Every lane takes part in the shuffles below; only those with columns
      // left compute.
      const bool cols = h0 < H;
      float acc[8];
      if (cols && vec) {
        const uint4 s = __ldg(reinterpret_cast<const uint4*>(sh + h0));
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] = Elem<DType::kBF16>::get(s, k);
      } else if (cols) {
        acc[0] = bf16_to_f32(__ldg(sh + h0));
      }
      for (uint64_t q0 = 0; q0 < topk; q0 += 32) {
        int64_t my_p = p0;
        float my_w = w0;
        if (q0 > 0) term(q0, my_p, my_w);
        const int terms = topk - q0 < 32 ? (int)(topk - q0) : 32;
        for (int q1 = 0; q1 < terms; q1 += kTermsInFlight) {
          // Term q1 + u's row of y and weight, from the lane that read them.
          auto row_of = [&](int u) { return (uint64_t)__shfl_sync(all, my_p, (q1 + u) & 31); };
          auto weight_of = [&](int u) { return __shfl_sync(all, my_w, (q1 + u) & 31); };
          if (a.y_scale) {
            // `per` e4m3 bytes per term, in 8 bytes: one load where aligned.
            unsigned long long y8[kTermsInFlight];
#pragma unroll
            for (int u = 0; u < kTermsInFlight; ++u) {
              const uint8_t* src = static_cast<const uint8_t*>(a.y) + row_of(u) * H + h0;
              if (!cols || q1 + u >= terms) continue;
              if (vec && ((uintptr_t)src & 7) == 0) {
                y8[u] = __ldg(reinterpret_cast<const unsigned long long*>(src));
              } else {
                y8[u] = 0;
                for (uint64_t k = 0; k < per; ++k) y8[u] |= (unsigned long long)__ldg(src + k) << (8 * k);
              }
            }
            // The weight times the 128-column block's scale, rounded, then per
            // element (8 columns never straddle a block: 128 % 8 == 0).
#pragma unroll
            for (int u = 0; u < kTermsInFlight; ++u) {
              const uint64_t pu = row_of(u);
              const float wu = weight_of(u);
              if (!cols || q1 + u >= terms) continue;
              const WeightSplit f = split_weight(__fmul_rn(wu, __ldg(a.y_scale + pu * (H / 128) + h0 / 128)));
              // Constant indices into acc (a loop to `per` would put it in
              // local memory).
#pragma unroll
              for (int k = 0; k < 8; ++k) {
                if (k > 0 && !vec) break;
                acc[k] = add_term(acc[k], f, e4m3_to_f32((uint32_t)(y8[u] >> (8 * k)) & 0xff));
              }
            }
          } else if (vec) {
            uint4 yv[kTermsInFlight];
#pragma unroll
            for (int u = 0; u < kTermsInFlight; ++u) {
              const uint64_t pu = row_of(u);
              if (cols && q1 + u < terms)
                yv[u] = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(a.y) + pu * H + h0));
            }
#pragma unroll
            for (int u = 0; u < kTermsInFlight; ++u) {
              const float wu = weight_of(u);
              if (!cols || q1 + u >= terms) continue;
              const WeightSplit f = split_weight(wu);
#pragma unroll
              for (int k = 0; k < 8; ++k) acc[k] = add_term(acc[k], f, Elem<DType::kBF16>::get(yv[u], k));
            }
          } else {
#pragma unroll
            for (int u = 0; u < kTermsInFlight; ++u) {
              const uint64_t pu = row_of(u);
              const float wu = weight_of(u);
              if (!cols || q1 + u >= terms) continue;
              const WeightSplit f = split_weight(wu);
              acc[0] = add_term(acc[0], f, bf16_to_f32(__ldg(static_cast<const uint16_t*>(a.y) + pu * H + h0)));
            }
          }
        }
      }
      if (!cols) continue;
      if (vec) {
        uint4 o;
#pragma unroll
        for (int k = 0; k < 8; ++k) Elem<DType::kBF16>::put(o, k, acc[k]);
        *reinterpret_cast<uint4*>(row + 2 * h0) = o;
      } else {
        *reinterpret_cast<uint16_t*>(row + 2 * h0) = (uint16_t)f32_to_bf16(acc[0]);
      }
    }
  }
}

}  // namespace arx::cuda

// Element types on the device: conversions on raw bits, the same as
// ffi/host/convert.h (so the CUDA and host device sides round alike), 16-byte
// vectors of each type, and the grid's thread numbering. Shared by the
// kernels of ffi/cuda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "base/layout.h"
#include "cuda/ptx.cuh"

namespace arx::cuda {

// Conversions on raw bits, the same as ffi/host/convert.h: bf16 rounds to
// nearest even by integer arithmetic (NaN stays a quiet NaN with its sign and
// top payload bits), f16 with cvt.rn (IEEE round to nearest even).

__device__ __forceinline__ float bf16_to_f32(uint32_t h) { return __uint_as_float(h << 16); }

__device__ __forceinline__ uint32_t f32_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) | 0x0040) & 0xffff;
  u += 0x7fffu + ((u >> 16) & 1);
  return u >> 16;
}

__device__ __forceinline__ float f16_to_f32(uint32_t h) { return __half2float(__ushort_as_half((unsigned short)h)); }

__device__ __forceinline__ uint32_t f32_to_f16(float f) { return __half_as_ushort(__float2half_rn(f)); }

// float8_e4m3fn (the fused MoE combine's expert outputs) -> fp32, exact; the
// same bits as ffi/host/convert.h's e4m3_to_f32 (S.1111.111 is NaN).
__device__ __forceinline__ float e4m3_to_f32(uint32_t v) {
  const uint32_t sign = (v >> 7 & 1) << 31, e = (v >> 3) & 0xf, m = v & 7;
  if (e == 0xf && m == 7) return __uint_as_float(sign | 0x7fc00000u);
  if (e == 0) return __uint_as_float(__float_as_uint((float)m * (1.0f / 512.0f)) | sign);  // m / 8 * 2^-6, exact
  return __uint_as_float(sign | (e - 7 + 127) << 23 | m << 20);
}

// An element type: its size, its DType, and 16-byte vectors of it.
template <DType D>
struct Elem;

template <>
struct Elem<DType::kF32> {
  static constexpr int kSize = 4, kPerVec = 4;
  static constexpr uint32_t kNan = 0x7fc00000u;
  __device__ static float get(const uint4& v, int k) { return __uint_as_float((&v.x)[k]); }
  __device__ static void put(uint4& v, int k, float f) { (&v.x)[k] = __float_as_uint(f); }
  __device__ static float load_cv(const uint8_t* p) { return __uint_as_float(ld_cv_u32(p)); }
  __device__ static float load(const uint8_t* p) { return *reinterpret_cast<const float*>(p); }
  __device__ static void store(uint8_t* p, float f) { *reinterpret_cast<float*>(p) = f; }
  __device__ static float round(float f) { return f; }  // f as this type holds it
};

template <DType D>
struct Elem16 {
  static constexpr int kSize = 2, kPerVec = 8;
  static constexpr uint32_t kNan = D == DType::kBF16 ? 0x7fc0u : 0x7e00u;
  __device__ static float to_f32(uint32_t h) { return D == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h); }
  __device__ static uint32_t from_f32(float f) { return D == DType::kBF16 ? f32_to_bf16(f) : f32_to_f16(f); }
  __device__ static float get(const uint4& v, int k) { return to_f32(((&v.x)[k >> 1] >> (16 * (k & 1))) & 0xffff); }
  __device__ static void put(uint4& v, int k, float f) {
    uint32_t& w = (&v.x)[k >> 1];
    const int shift = 16 * (k & 1);
    w = (w & ~(0xffffu << shift)) | (from_f32(f) << shift);
  }
  __device__ static float load_cv(const uint8_t* p) { return to_f32(ld_cv_u16(p)); }
  __device__ static float load(const uint8_t* p) { return to_f32(*reinterpret_cast<const uint16_t*>(p)); }
  __device__ static void store(uint8_t* p, float f) { *reinterpret_cast<uint16_t*>(p) = (uint16_t)from_f32(f); }
  __device__ static float round(float f) { return to_f32(from_f32(f)); }
};
template <>
struct Elem<DType::kBF16> : Elem16<DType::kBF16> {};
template <>
struct Elem<DType::kF16> : Elem16<DType::kF16> {};

// One 16-byte vector of the result from one vector of each of `world`
// sources: the fp32 sum in rank order from rank 0's element (not from +0.0,
// which would turn a sum of negative zeros positive), rounded once -- every
// rank gets the same bits, and the host side's sum_rank_order the same too.
// `part` may hold fewer than kMaxWorld sources (N >= world).
template <DType D, int N>
__device__ __forceinline__ uint4 sum_rank_order(const uint4 (&part)[N], int world) {
  using E = Elem<D>;
  float acc[E::kPerVec];
#pragma unroll
  for (int k = 0; k < E::kPerVec; ++k) acc[k] = E::get(part[0], k);
#pragma unroll
  for (int src = 1; src < N; ++src)
    if (src < world)
#pragma unroll
      for (int k = 0; k < E::kPerVec; ++k) acc[k] = __fadd_rn(acc[k], E::get(part[src], k));
  uint4 o;
#pragma unroll
  for (int k = 0; k < E::kPerVec; ++k) E::put(o, k, acc[k]);
  return o;
}

// One element of the result, the same sum: value(src) for src in rank order.
template <typename Value>
__device__ __forceinline__ float sum_one(int world, Value value) {
  float acc = value(0);
  for (int src = 1; src < world; ++src) acc = __fadd_rn(acc, value(src));
  return acc;
}

__device__ __forceinline__ uint64_t global_thread() { return (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ uint64_t grid_threads() { return (uint64_t)gridDim.x * blockDim.x; }
__device__ __forceinline__ bool aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

}  // namespace arx::cuda

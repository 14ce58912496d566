// The device side's accesses that only kernels make: words shared by the
// blocks of one grid (gpu scope), reads of peer data past the caches, the
// clock, barriers and prefetches. Words shared across the system (flags, the
// Control block, triggers) go through base/atomics.h, the same functions the
// host side uses, compiled as ld.acquire.sys / st.release.sys /
// st.relaxed.sys / fence.acq_rel.sys here.
#pragma once

#include <cstdint>

namespace arx::cuda {

// Device words (DeviceWords) are shared by the blocks of one grid only.
__device__ __forceinline__ unsigned long long ld_acquire_gpu(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_gpu(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long add_acq_rel_gpu(unsigned long long* p, unsigned long long v) {
  unsigned long long old;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
  return old;
}

// Fire and forget: no value comes back, so the thread does not wait for it.
__device__ __forceinline__ void red_max_relaxed_gpu(unsigned long long* p, unsigned long long v) {
  asm volatile("red.relaxed.gpu.global.max.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// A word in shared memory that one thread of a block hands to the others.
__device__ __forceinline__ void st_release_cta(unsigned* p, unsigned v) {
  asm volatile("st.release.cta.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned ld_acquire_cta(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.cta.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Barrier `id` (1..15; 0 is __syncthreads') among `threads` threads of the
// block, a multiple of 32: the warps that reach it with the same id.
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Peer data: bypass the caches (the proxy, a NIC or a peer GPU wrote it).
// The "memory" clobbers keep the compiler from moving these loads above the
// flag wait that announced the data (its acquire is an asm statement too,
// and volatile asm alone orders only asm among itself, not ordinary
// accesses the compiler might merge or hoist around it).
__device__ __forceinline__ uint4 ld_cv_v4(const void* p) {
  uint4 v;
  asm volatile("ld.global.cv.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ uint16_t ld_cv_u16(const void* p) {
  uint16_t v;
  asm volatile("ld.global.cv.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t ld_cv_u32(const void* p) {
  uint32_t v;
  asm volatile("ld.global.cv.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Nanoseconds, on a clock every multiprocessor shares. The waits are bounded
// in time with it, never in poll counts (a poll's cost varies tenfold with
// where the flag lives and what else runs).
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Asks L2 to fetch [p, p + bytes); p and bytes multiples of 16. sm_90+.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

}  // namespace arx::cuda

// Access to words shared with the device side, the proxy and peers: always
// atomic, with the order spelled out. Grace (ARM) reorders what x86 does not,
// so a plain or volatile access that passes every test here can tear or
// reorder there.
//
// The functions are ARX_HD: compiled for the host they are std::atomic_ref
// operations; compiled for a GPU they are the PTX accesses at system scope
// (the words are shared with the CPU, a NIC and other GPUs). Code written
// once over them (the channels, comm/channel.h) runs on both device sides.
#pragma once

#include <cstdint>

#include "base/layout.h"

#if !defined(__CUDA_ARCH__)
#include <atomic>
#include <chrono>
#include <thread>
#endif

namespace arx {

ARX_HD uint64_t load_acquire(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(p)).load(std::memory_order_acquire);
#endif
}

ARX_HD uint64_t load_relaxed(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(p)).load(std::memory_order_relaxed);
#endif
}

ARX_HD void store_release(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
  std::atomic_ref<uint64_t>(*p).store(v, std::memory_order_release);
#endif
}

// Ordered before a later release (or fence) by the same thread.
ARX_HD void store_relaxed(uint64_t* p, uint64_t v) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
  std::atomic_ref<uint64_t>(*p).store(v, std::memory_order_relaxed);
#endif
}

// Orders this thread's earlier accesses (and, cumulatively, those it has
// observed) before its later ones, at system scope.
ARX_HD void fence_acq_rel() {
#if defined(__CUDA_ARCH__)
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#else
  std::atomic_thread_fence(std::memory_order_acq_rel);
#endif
}

// A wait's look at a word that a peer releases, where a wait looks at
// several words in one turn, then fence_after_looks() once all of them
// showed what it waited for: together an acquire of each. On a GPU the
// look is a relaxed load, so that the looks at host memory (a bus round
// trip each) are in flight together, and the fence makes them acquires (a
// relaxed load that saw a release store, then a fence, is PTX's acquire
// pattern; acq_rel is the weakest fence that does so). On the host each
// look is an acquire load, as cheap there, and the fence is nothing:
// ThreadSanitizer, which the host side's tests run under, does not model
// fences.
ARX_HD uint64_t load_look(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
  return load_relaxed(p);
#else
  return load_acquire(p);
#endif
}
ARX_HD void fence_after_looks() {
#if defined(__CUDA_ARCH__)
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#endif
}

#if !defined(__CUDA_ARCH__)
// Set-up handshakes: the time `seconds` from now, and a wait, sleeping
// between looks, until `word` (written by another process, once) is
// non-zero; returns it, or 0 once `deadline` has passed. Not for a
// collective's path: it sleeps.
inline std::chrono::steady_clock::time_point deadline_in(double seconds) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
}
inline uint64_t wait_nonzero(const uint64_t* word, std::chrono::steady_clock::time_point deadline) {
  uint64_t value;
  while ((value = load_acquire(word)) == 0) {
    if (std::chrono::steady_clock::now() > deadline) return 0;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return value;
}
#endif

}  // namespace arx

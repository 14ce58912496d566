// Host-side access to words shared with the device side, the proxy and
// peers: always atomic, with the order spelled out. Grace (ARM) reorders
// what x86 does not, so a plain or volatile access that passes every test
// here can tear or reorder there.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace arx {

inline uint64_t load_acquire(const uint64_t* p) {
  return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(p)).load(std::memory_order_acquire);
}
inline uint64_t load_relaxed(const uint64_t* p) {
  return std::atomic_ref<uint64_t>(*const_cast<uint64_t*>(p)).load(std::memory_order_relaxed);
}
inline void store_release(uint64_t* p, uint64_t v) {
  std::atomic_ref<uint64_t>(*p).store(v, std::memory_order_release);
}
inline void store_relaxed(uint64_t* p, uint64_t v) {
  std::atomic_ref<uint64_t>(*p).store(v, std::memory_order_relaxed);
}

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

}  // namespace arx

// Host-side access to words shared with the device side, the proxy and
// peers: always atomic, with the order spelled out. Grace (ARM) reorders
// what x86 does not, so a plain or volatile access that passes every test
// here can tear or reorder there.
#pragma once

#include <atomic>
#include <cstdint>

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

}  // namespace arx

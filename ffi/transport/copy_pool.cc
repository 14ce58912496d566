#include "transport/copy_pool.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <system_error>

namespace arx {

int CopyPool::helpers_for(int64_t wanted, int ranks_here, unsigned cores) {
  if (wanted >= 0) return (int)std::min<int64_t>(wanted, kMaxHelpers);
  const int64_t share = ranks_here > 0 ? (int64_t)cores / ranks_here : 0;
  return (int)std::clamp<int64_t>(share - 2, 0, kMaxHelpers);
}

CopyPool::CopyPool(int helpers, int64_t idle_spin_ms) : idle_spin_ms_(idle_spin_ms) {
  for (int i = 0; i < std::min(helpers, kMaxHelpers); ++i) {
    auto h = std::make_unique<Helper>();
    try {
      h->thread = std::thread([this, p = h.get()] { serve(*p); });
    } catch (const std::system_error&) {
      break;  // no more threads: the parts that would have been theirs stay the caller's
    }
    helpers_.push_back(std::move(h));
  }
}

CopyPool::~CopyPool() {
  stop_.store(true);
  for (auto& h : helpers_) {
    // A bump with no part: the helper wakes, finds stop_ and leaves.
    h->posted.fetch_add(1);
    h->posted.notify_one();
  }
  for (auto& h : helpers_) h->thread.join();
}

void CopyPool::serve(Helper& h) {
  using Clock = std::chrono::steady_clock;
  uint64_t seen = 0;
  Clock::time_point last = Clock::now();
  for (;;) {
    uint64_t p = h.posted.load(std::memory_order_acquire);
    if (p == seen) {
      if (Clock::now() - last < std::chrono::milliseconds(idle_spin_ms_)) {
        // Yield even while spinning, as the proxy does: on a host with
        // fewer cores than spinning threads a pure spin starves the rest.
        std::this_thread::yield();
        continue;
      }
      h.posted.wait(seen, std::memory_order_acquire);
      continue;
    }
    if (stop_.load()) return;
    seen = p;
    std::memcpy(h.dst, h.src, h.len);
    h.finished.store(seen, std::memory_order_release);
    last = Clock::now();
  }
}

void CopyPool::copy(void* dst, const void* src, uint64_t len) {
  auto* to = static_cast<uint8_t*>(dst);
  auto* from = static_cast<const uint8_t*>(src);
  const uint64_t parts = std::min<uint64_t>(helpers_.size() + 1, len / kMinPart);
  if (parts <= 1) {
    std::memcpy(to, from, len);
    return;
  }
  // Parts of whole cache lines; the caller's (the last) takes the rest.
  const uint64_t part = len / parts / 64 * 64;
  for (uint64_t i = 0; i + 1 < parts; ++i) {
    Helper& h = *helpers_[i];
    h.dst = to + i * part;
    h.src = from + i * part;
    h.len = part;
    h.posted.fetch_add(1, std::memory_order_release);
    h.posted.notify_one();
  }
  const uint64_t own = (parts - 1) * part;
  std::memcpy(to + own, from + own, len - own);
  for (uint64_t i = 0; i + 1 < parts; ++i) {
    Helper& h = *helpers_[i];
    const uint64_t want = h.posted.load(std::memory_order_relaxed);
    while (h.finished.load(std::memory_order_acquire) != want) std::this_thread::yield();
  }
}

}  // namespace arx

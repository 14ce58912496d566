// Copies on several threads: the shm carrier's put moves its bytes with the
// proxy thread and up to kMaxHelpers helpers, as a NIC's engines would,
// instead of one memcpy (about 6 GB/s on one core, which made the proxy
// route's prefill figures measure memcpy, not the protocol).
//
// Ordering: copy() returns only when every helper has finished its part,
// each helper's last store ordered before its `finished` word (release)
// and the caller's look at that word (acquire) ordered before whatever the
// caller stores next. So the carrier's flag word, stored after copy()
// returns with release, covers every byte, whichever thread wrote it.
//
// One caller at a time (the proxy thread: transport.h, "the proxy is the
// only caller of put()"). Helpers spin for idle_spin_ms after their last
// part, as the proxy does (comm/proxy.cc, IdleNap), then block on their
// `posted` word until the next part or the pool's end.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

namespace arx {

class CopyPool {
 public:
  static constexpr int kMaxHelpers = 3;
  // A part is never smaller than this: below it the hand-over (a cache line
  // each way, a helper's wake) costs as much as the copy it would save.
  static constexpr uint64_t kMinPart = 32 << 10;

  // How many helpers a rank with `ranks_here` ranks on a host of `cores`
  // cores gets when `wanted` is -1 (auto): every rank keeps a core for its
  // own thread and one for its proxy, and the rest of its share goes to
  // helpers, at most kMaxHelpers. `wanted` >= 0 is taken as it is
  // (clamped to kMaxHelpers). The one place this policy lives.
  static int helpers_for(int64_t wanted, int ranks_here, unsigned cores);

  // Starts up to `helpers` threads; fewer when the system will not start
  // more (the copies stay correct with any number, none included).
  CopyPool(int helpers, int64_t idle_spin_ms);
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  int helpers() const { return (int)helpers_.size(); }
  // Copies [src, src + len) to dst (not overlapping); returns once every
  // byte is in place (see "Ordering" above).
  void copy(void* dst, const void* src, uint64_t len);

 private:
  struct Helper {
    // The part: written by the caller before `posted` (release), read by
    // the helper after it (acquire).
    uint8_t* dst = nullptr;
    const uint8_t* src = nullptr;
    uint64_t len = 0;
    std::atomic<uint64_t> posted{0};    // parts handed over (the caller's)
    std::atomic<uint64_t> finished{0};  // parts done (the helper's)
    std::thread thread;
  };
  void serve(Helper& h);

  std::vector<std::unique_ptr<Helper>> helpers_;
  std::atomic<bool> stop_{false};
  const int64_t idle_spin_ms_;
};

}  // namespace arx

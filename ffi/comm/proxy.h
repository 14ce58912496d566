// The proxy: one thread per endpoint that drains the trigger ring through
// the carrier, and watches for stalls and recorded failures. It knows
// nothing of collectives (a trigger is a put; layout.h) and nothing of
// carriers beyond the Transport interface.
//
// Order. The proxy takes entries strictly in index order, and puts each to
// its peers in send order (rank + 1, rank + 2, ...), every root's part
// followed by that root's flag word on the same ordered channel: so a peer
// that acquires the flag word sees the bytes (comm/channel.h).
//
// The ring is reused by index modulo kRing; a producer must never overwrite
// an entry the proxy has not taken. By (*) of channel.h, when a rank begins
// a collective, every peer has finished the collective two before it (in the
// endpoint's order, both families together: every rank issues them in one
// order), which needed every flag this rank sent for it, so the proxy has
// taken every entry of it and of everything before. What may be left is the
// entries of the two collectives before the one beginning, and its own: at
// most 3 x kMaxEntries, which must fit the ring (static_assert below). The
// host producer also checks Control::ring_consumed before it writes.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

#include "base/layout.h"

namespace arx {

class Endpoint;

// The most trigger entries one collective publishes: a piece per peer for
// each of kMaxPieces pieces (the bulk ops' per-destination pieces; psum takes
// fewer, see comm/plan.cc).
constexpr int kMaxEntries = kMaxPieces * (kMaxWorld - 1);
static_assert(3 * kMaxEntries <= kRing, "the trigger ring must hold three collectives' entries");

class Proxy {
 public:
  explicit Proxy(Endpoint& ep) : ep_(ep) {}
  ~Proxy() { stop(); }
  void start();
  void stop();
  // A collective begins on this endpoint: a napping proxy wakes now and spins
  // through it (proxy.cc, IdleNap). Any thread; an atomic add, and a futex
  // wake only when the proxy naps.
  void wake();

 private:
  void loop(uint64_t consumed);
  Endpoint& ep_;
  std::atomic<bool> stop_{false};
  std::atomic<uint32_t> bell_{0};
  std::atomic<bool> asleep_{false};
  static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free,
                "the bell is a futex word");
  std::thread thread_;
};

}  // namespace arx

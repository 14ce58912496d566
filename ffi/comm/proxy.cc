#include "comm/proxy.h"

#include <chrono>
#include <cstdio>
#include <string>

#include "base/atomics.h"
#include "comm/endpoint.h"

namespace arx {
namespace {

using Clock = std::chrono::steady_clock;

// Idle backoff: the exact busy poll while there is work and for
// idle_spin_ms after it, then a nap of idle_nap_us per turn, so an idle
// communicator does not burn a core. idle_nap_us = 0 keeps spinning.
struct IdleNap {
  Clock::duration spin;
  std::chrono::microseconds nap;
  Clock::time_point last = Clock::now();
  IdleNap(int64_t spin_ms, int64_t nap_us) : spin(std::chrono::milliseconds(spin_ms)), nap(nap_us) {}
  void busy() { last = Clock::now(); }
  void idle() {
    if (nap.count() > 0 && Clock::now() - last > spin) {
      std::this_thread::sleep_for(nap);
      return;
    }
    // Yield even while spinning: on a machine with fewer cores than
    // spinning threads, a pure spin starves the very peer it waits for.
    std::this_thread::yield();
  }
};

// Takes entry `consumed` if its producer has published it (tag = index + 1,
// acquired: the other fields were stored before it).
bool take(Control* ctl, Trigger* ring, uint64_t& consumed, Trigger& t) {
  Trigger& slot = ring[consumed % kRing];
  if (load_acquire(&slot.tag) != consumed + 1) return false;
  t.src = load_relaxed(&slot.src);
  t.len = load_relaxed(&slot.len);
  t.dst = load_relaxed(&slot.dst);
  t.flag = load_relaxed(&slot.flag);
  t.value = load_relaxed(&slot.value);
  t.dest = load_relaxed(&slot.dest);
  t.family = load_relaxed(&slot.family);
  t.tag = consumed + 1;
  ++consumed;
  // Release: the reads above come before a producer may reuse the entry.
  store_release(&ctl->ring_consumed, consumed);
  return true;
}

// One entry: its bytes to every peer it names, in send order, each root's
// part followed by its flag word.
Status post(Endpoint& ep, const Trigger& t) {
  const Layout& L = ep.layout();
  Transport* carrier = ep.transport();
  const int rank = ep.spec().rank, world = ep.spec().world, roots = carrier->roots();
  // A bad entry is a bug of a device side. The carriers refuse what would
  // land outside this rank's slots of a peer's inbox; the source must lie in
  // one of this rank's staging buffers.
  const bool in_send = t.src >= L.send && t.src <= L.send + 2 * L.send_bytes && t.len <= L.send + 2 * L.send_bytes - t.src;
  const uint64_t bulk_end = L.bulk_send + 2 * (uint64_t)world * L.bulk_lane;
  const bool in_bulk = t.src >= L.bulk_send && t.src <= bulk_end && t.len <= bulk_end - t.src;
  if (!(in_send || in_bulk) || (t.dest != kEveryPeer && (t.dest >= (uint64_t)world || t.dest == (uint64_t)rank)) ||
      t.family >= (uint64_t)kFamilies)
    return Status::Error(strf("jax_arx: %s: trigger %llu is malformed (%llu bytes at %llu to rank %lld, family %llu)",
                              ep.label().c_str(), (unsigned long long)t.tag - 1, (unsigned long long)t.len,
                              (unsigned long long)t.src, (long long)t.dest, (unsigned long long)t.family));
  const int n = t.dest == kEveryPeer ? world - 1 : 1;
  for (int i = 0; i < n; ++i) {
    const int peer = peer_in_send_order(rank, world, t.dest, i);
    for (int root = 0; root < roots; ++root) {
      uint64_t off, len;
      root_split(t.len, root, roots, off, len);
      ARX_RETURN_IF_ERROR(carrier->put(peer, root, ep.base() + t.src + off, t.dst + off, len,
                                       L.flag_offset((int)t.flag + root), t.value));
    }
  }
  return Status::Ok();
}

// Watchdog: a collective under way (begun past done) that has not finished
// for stall_report_s, or a peer ahead of this rank (it sent a seq this rank
// has not begun), is a stall: say so once, in words, with what each peer
// last sent. Slow peers (one still compiling) are the usual cause; a stall
// that lasts past the timeout fails the collective.
class Watchdog {
 public:
  explicit Watchdog(Endpoint& ep)
      : ep_(ep),
        after_(std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(ep.spec().config.stall_report_s))) {
    read(begun_, done_);
  }

  void look() {
    const auto now = Clock::now();
    if (now - last_look_ < std::chrono::milliseconds(50)) return;  // words of peers: not every turn
    last_look_ = now;
    uint64_t begun[kFamilies], done[kFamilies];
    read(begun, done);
    bool idle = true, moved = false;
    for (int f = 0; f < kFamilies; ++f) {
      moved |= done[f] != done_[f] || begun[f] != begun_[f];
      idle &= begun[f] <= done[f];
      begun_[f] = begun[f];
      done_[f] = done[f];
    }
    if (moved || idle) {
      last_move_ = now;
      reported_ = false;
      return;
    }
    if (reported_ || now - last_move_ < after_) return;
    reported_ = true;
    ep_.stats.stalls.fetch_add(1, std::memory_order_relaxed);
    fprintf(stderr,
            "jax_arx: %s: no progress for %.0f s: psum #%llu and bulk collective #%llu began, #%llu and #%llu "
            "finished. Last heard from each peer:%s. Waiting for the peers (one may be slow to start, stopped, "
            "or issuing other collectives); the collective fails after JAX_ARX_TIMEOUT_S=%g s\n",
            ep_.label().c_str(), std::chrono::duration<double>(now - last_move_).count(),
            (unsigned long long)begun[0], (unsigned long long)begun[1], (unsigned long long)done[0],
            (unsigned long long)done[1], ep_.heard_from_peers().c_str(), ep_.spec().config.timeout_s);
  }

 private:
  void read(uint64_t* begun, uint64_t* done) const {
    const Control* ctl = ep_.control();
    for (int f = 0; f < kFamilies; ++f) {
      begun[f] = load_relaxed(&ctl->begun[f]);
      done[f] = load_relaxed(&ctl->done[f]);
    }
  }
  Endpoint& ep_;
  const Clock::duration after_;
  uint64_t begun_[kFamilies] = {}, done_[kFamilies] = {};
  Clock::time_point last_move_ = Clock::now(), last_look_ = Clock::now();
  bool reported_ = false;
};

}  // namespace

void Proxy::start() {
  stop_ = false;
  // Where the ring stands now, read before the thread exists: a device side
  // may publish as soon as connect() returns, before the new thread first
  // runs, and an entry read as "already taken" would never be sent.
  const uint64_t consumed = load_acquire(&ep_.control()->ring_consumed);
  thread_ = std::thread([this, consumed] { loop(consumed); });
}

void Proxy::stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void Proxy::loop(uint64_t consumed) {
  const Config& cfg = ep_.spec().config;
  Control* ctl = ep_.control();
  Trigger* ring = reinterpret_cast<Trigger*>(ep_.base() + ep_.layout().ring);
  IdleNap nap(cfg.idle_spin_ms, cfg.idle_nap_us);
  Watchdog watchdog(ep_);
  bool failure_seen = false;
  while (!stop_.load(std::memory_order_relaxed)) {
    Status s = ep_.transport()->poll();
    Trigger t{};
    if (s.ok() && take(ctl, ring, consumed, t)) {
      s = post(ep_, t);
      nap.busy();
    }
    if (!s.ok()) {
      ep_.fail(s.message());
      return;
    }
    if (t.tag) continue;
    // A failure the device side recorded (a kernel that gave up) becomes
    // the endpoint's sticky failure here, so JAX_ARX_ON_FAILURE=abort acts
    // even when no host code of ours runs (replayed CUDA graphs).
    if (!failure_seen && load_acquire(&ctl->failed_seq) != 0) {
      failure_seen = true;
      ep_.failed();
    }
    watchdog.look();
    nap.idle();
  }
}

}  // namespace arx

// The protocol's sending half (see DESIGN.md, "The protocol").
//
// The device side publishes seq after its partial is in send[seq & 1]. The
// proxy sees it and, per peer, writes the partial into the peer's
// recv[seq & 1][rank], then writes the flag word (seq, descriptor) into the
// peer's flag for (rank, root), on the same ordered channel, so the data is
// in place before the flag.
//
// The proxy posts every seq in order, never skipping one. The device side
// can publish seq + 1 before the proxy has seen seq (finishing seq needs
// only the peers' data), and skipping seq would let peers accept seq + 1's
// flag over stale seq data.
//
// Two buffers by parity are enough: a rank reaches seq + 2 only after every
// peer consumed seq + 1, which needed this rank's seq + 1 flag, which the
// proxy posts after this rank's seq data was read (written out). So when
// the device side overwrites send[seq & 1] for seq + 2, the proxy is done
// with seq; and when a peer writes our recv[seq & 1] for seq + 2, we have
// finished summing seq.
//
// Rank r sends to r+1, r+2, ... in turn, so no receiver takes every sender
// at once. Every write is split over the carrier's roots, each half
// followed by its own flag on that root.
#include "comm/proxy.h"

#include <chrono>
#include <cstdio>
#include <string>

#include "comm/atomics.h"
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

// One seq: what the device side published, sent to every peer in turn.
Status post_seq(Endpoint& ep, uint64_t seq) {
  const Layout& L = ep.layout();
  Control* ctl = ep.control();
  Transport* t = ep.transport();
  const int rank = ep.spec().rank, world = ep.spec().world, roots = t->roots(), par = (int)(seq & 1);
  // Acquired through `published`: the device side stored these first.
  const Mode mode = (Mode)load_relaxed(&ctl->mode[par]);
  const uint64_t bytes = load_relaxed(&ctl->bytes[par]);
  const uint64_t flag = flag_word(seq, load_relaxed(&ctl->desc[par]));
  const uint64_t capacity = mode == Mode::kScatter ? L.send_bytes : L.slot_bytes;
  if (bytes > capacity)
    return Status::Error(strf("jax_arx: %s published %llu bytes at seq %llu, more than its buffer holds (%llu)",
                              ep.label().c_str(), (unsigned long long)bytes, (unsigned long long)seq,
                              (unsigned long long)capacity));
  const uint8_t* send = ep.base() + L.send_offset(par);
  for (int step = 1; step < world; ++step) {
    const int peer = (rank + step) % world;
    // kFull and kGather send this rank's whole buffer; kScatter sends peer
    // j only its chunk j. Either way it lands in the peer's recv[par][rank].
    uint64_t lo = 0, hi = bytes;
    switch (mode) {
      case Mode::kFull:
      case Mode::kGather:
        break;
      case Mode::kScatter:
        chunk_range(bytes, world, peer, lo, hi);
        break;
    }
    for (int root = 0; root < roots; ++root) {
      uint64_t off, len;
      root_split(hi - lo, root, roots, off, len);
      ARX_RETURN_IF_ERROR(t->put(peer, root, send + lo + off, L.recv_offset(par, rank) + off, len,
                                 L.flag_offset(flag_index(rank, root)), flag));
    }
  }
  return Status::Ok();
}

}  // namespace

void Proxy::start() {
  stop_ = false;
  thread_ = std::thread([this] { loop(); });
}

void Proxy::stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void Proxy::loop() {
  const Config& cfg = ep_.spec().config;
  Control* ctl = ep_.control();
  const Layout& L = ep_.layout();
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(ep_.base() + L.flags);
  const int rank = ep_.spec().rank, world = ep_.spec().world;
  IdleNap nap(cfg.idle_spin_ms, cfg.idle_nap_us);
  uint64_t posted = load_acquire(&ctl->published);
  uint64_t last_done = load_relaxed(&ctl->done);
  Clock::time_point last_move = Clock::now();
  bool stall_reported = false, failure_seen = false;
  const auto stall_after = std::chrono::duration<double>(cfg.stall_report_s);
  while (!stop_.load(std::memory_order_relaxed)) {
    Status s = ep_.transport()->poll();
    if (!s.ok()) {
      ep_.fail(s.message());
      return;
    }
    const uint64_t published = load_acquire(&ctl->published);
    if (published > posted) {
      nap.busy();
      ++posted;  // every seq, in order
      s = post_seq(ep_, posted);
      if (!s.ok()) {
        ep_.fail(s.message());
        return;
      }
      continue;
    }
    // A failure the device side recorded (a kernel that gave up) becomes
    // the endpoint's sticky failure here, so JAX_ARX_ON_FAILURE=abort acts
    // even when no host code of ours runs (replayed CUDA graphs).
    if (!failure_seen && load_acquire(&ctl->failed_seq) != 0) {
      failure_seen = true;
      ep_.failed();
    }
    // Watchdog: published work that has not completed for stall_report_s is
    // a stall, and so is a peer whose flags are ahead of what this rank
    // posted. Print what this rank sent and what it heard from each peer.
    const uint64_t done = load_relaxed(&ctl->done);
    bool behind = false;
    for (int j = 0; j < world; ++j)
      if (j != rank) behind |= flag_progress(load_relaxed(&flags[flag_index(j, 0)])) > posted;
    const auto now = Clock::now();
    if (done != last_done || (done >= posted && !behind)) {
      last_done = done;
      last_move = now;
      stall_reported = false;
    } else if (!stall_reported && now - last_move > stall_after) {
      stall_reported = true;
      std::string msg = strf("jax_arx %s STALL: published %llu posted %llu done %llu; flags from peers:",
                             ep_.label().c_str(), (unsigned long long)published, (unsigned long long)posted,
                             (unsigned long long)done);
      for (int j = 0; j < world; ++j) {
        if (j == rank) continue;
        msg += strf(" r%d=", j);
        for (int r = 0; r < ep_.roots(); ++r)
          msg += strf("%s%llu", r ? "/" : "",
                      (unsigned long long)flag_progress(load_relaxed(&flags[flag_index(j, r)])));
      }
      fprintf(stderr, "%s\n", msg.c_str());
    }
    nap.idle();
  }
}

}  // namespace arx

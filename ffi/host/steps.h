// What every collective of the host device side does besides copying and
// summing: take the next seq of its family, publish on the channel's ring,
// wait for the peers (comm/wait.h, with the host's way of waiting), record a
// failure and finish the seq. Written once; host/psum.cc and host/bulk.cc say
// only what to copy and sum per piece.
#pragma once

#include <sched.h>
#include <time.h>

#include <chrono>
#include <thread>

#include "base/atomics.h"
#include "comm/channel.h"
#include "comm/endpoint.h"
#include "comm/wait.h"

namespace arx::host {

// The host's way of waiting (comm/wait.h's Poll). It yields the core on
// every turn: on a machine with fewer cores than waiting threads, a spin
// that does not yield starves the very peer (or proxy) it waits for. After a
// few milliseconds it naps instead, so a long wait (a peer still compiling)
// costs no CPU.
//
// Time this thread did not run is not the peers' lateness. A look that comes
// more than kNotRunning after the one before it (the process was stopped,
// or starved of the CPU) moves the deadline on by that gap and counts it in
// `not_running`: the waits go on for the whole timeout of running time, so
// the frames that reached this rank while it was stopped are taken (the
// carrier's receiver runs again too) instead of a timeout declared on the
// first look after the resume that names a healthy peer; and a timeout that
// still comes says how long this rank itself was not running. Between two
// waits (or before the first) the thread works (copies, sums), so there the
// wall time it did not spend on the CPU is what did not run: a stop that
// falls between two waits of one collective is left out the same way.
struct HostPoll {
  using Clock = std::chrono::steady_clock;
  // Far above a turn's pause (50 us) and a scheduler's slice on a loaded
  // host, far below any timeout worth setting.
  static constexpr std::chrono::milliseconds kNotRunning{250};
  const Control* ctl;
  Clock::time_point start;
  Clock::duration timeout;
  Clock::time_point last{};       // the last look (set by begin())
  Clock::duration not_running{};  // the gaps left out of this collective's waits
  // The end of the last wait (end(); none yet: the start), with this
  // thread's CPU time then.
  Clock::time_point ended = start;
  int64_t ended_cpu = thread_cpu_ns();

  // Before a wait: the time since the last one ended (or the collective
  // began) was this rank's own work, but for what of it the thread was off
  // the CPU.
  void begin() {
    const Clock::time_point now = Clock::now();
    const Clock::duration off = (now - ended) - std::chrono::nanoseconds(thread_cpu_ns() - ended_cpu);
    if (off > kNotRunning) {
      not_running += off;
      start += off;
    }
    last = now;
    long_wait = false;
  }
  // After a wait that arrived.
  void end() {
    ended = Clock::now();
    ended_cpu = thread_cpu_ns();
  }
  static int64_t thread_cpu_ns() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
  }
  bool expired() {
    const Clock::time_point now = Clock::now();
    const Clock::duration gap = now - last;
    last = now;
    if (gap > kNotRunning) {
      not_running += gap;
      start += gap;
      return false;
    }
    return now - start > timeout;
  }
  bool aborted(uint32_t turn) const { return (turn & 15) == 15 && load_acquire(&ctl->abort) != 0; }
  bool stopped(uint32_t) const { return false; }
  // A wait 200 us into its collective is not about to end (a slow or
  // descheduled peer, a loaded host): from then on each turn naps instead
  // of yielding, so the wait leaves the cores to the peers it waits for
  // where the threads outnumber them (a yield hands the core over only to a
  // thread queued on the same one). Before, a turn only yields: the
  // latency of a wait that ends soon. The clock is read every 16th turn.
  // 200 us: a 4-rank suite beside a 2-rank one on 2 cores (commit body).
  mutable bool long_wait = false;
  void pause(uint32_t turn) const {
    if (!long_wait && (turn & 15) == 15) long_wait = Clock::now() - start > std::chrono::microseconds(200);
    if (long_wait)
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    else
      sched_yield();
  }
};

// One collective of family `f`, from its seq to its finish.
class Collective {
 public:
  Collective(Endpoint& ep, Family f, const Descriptor& d);

  uint64_t seq() const { return seq_; }
  int parity() const { return (int)(seq_ & 1); }

  // What the channel's handle needs of this seq (ch.open).
  SeqSend send() const { return SeqSend{parity(), flag_word(seq_, describe(d_)), d_, ring_}; }

  // Takes the `entries` trigger ring positions the seq's signals publish
  // at (out.entries; a DirectChannel takes none), before the first of them.
  // An error if the ring would overflow, which (*) of comm/proxy.h rules
  // out: a bug, reported instead of overwriting an entry not yet sent.
  Status reserve(uint64_t entries) {
    if (entries == 0) return Status::Ok();
    if (ring_ + entries - load_acquire(&ctl_->ring_consumed) > (uint64_t)kRing)
      return Status::Error(
          strf("jax_arx: %s: the trigger ring is full (%llu published, %llu taken); this is a "
               "bug in jax_arx",
               ep_.label().c_str(), (unsigned long long)ring_, (unsigned long long)load_acquire(&ctl_->ring_consumed)));
    store_relaxed(&ctl_->ring_published, ring_ + entries);
    return Status::Ok();
  }

  // The last signal of the seq is out (the trace's kPublished).
  void published() { ARX_STAMP(ep_.trace(), family_, seq_, kPublished, trace_now()); }

  // Waits for piece `piece` of this seq from every peer. False: a wait gave
  // up; the failure is recorded (the first one of the endpoint is kept).
  bool wait_peers(const Inbox& in, int piece);

  // Every path ends in one of these: the seq finished (the sequence state
  // stays consistent either way), and on failure `fill` writes NaN over the
  // output and the endpoint's sticky failure is returned. `why`: a failure
  // that no wait recorded (a ring error).
  Status finish();
  template <typename Fill>
  Status fail(Fill fill, const Status& why = Status::Ok()) {
    fill();
    if (!why.ok() && !ep_.failed()) ep_.fail(why.message());
    finish();
    ep_.failed();  // turns a recorded wait failure into the endpoint's sticky message
    return Status::Error(ep_.failure());
  }

 private:
  Endpoint& ep_;
  Control* ctl_;
  Family family_;
  Descriptor d_;
  uint64_t seq_, ring_;  // ring_: the ring position of the seq's first trigger
  HostPoll poll_;
};

// Runs body(channel) over the endpoint's channel of family `f`: the direct
// one where the peers' regions are mapped here, else the proxy's.
template <typename Body>
Status with_channel(Endpoint& ep, Family f, Body body) {
  if (ep.route().direct) return body(ep.direct_channel(f));
  return body(ep.proxy_channel(f));
}

// Copies bytes [lo, hi) of a part laid out as rows of `block` bytes,
// `stride` bytes apart in `strided` (row o at o * stride), to the same bytes
// of the contiguous `contig`; and back.
void gather_rows(uint8_t* contig, const uint8_t* strided, uint64_t lo, uint64_t hi, uint64_t block, uint64_t stride);
void scatter_rows(uint8_t* strided, const uint8_t* contig, uint64_t lo, uint64_t hi, uint64_t block, uint64_t stride);

// out[count] = sum over src of parts[src][count], fp32 in rank order
// starting from rank 0's element, rounded once to dtype: every rank gets the
// same bits. `out` may alias parts[i].
void sum_rank_order(DType dtype, const uint8_t* const* parts, int world, uint64_t count, void* out);

}  // namespace arx::host

// The host's way of waiting (host/steps.h, HostPoll): time the waiting
// thread did not run (the process stopped, or starved of the CPU) is left
// out of the timeout and counted, and otherwise a wait expires after the
// timeout of running time. A thread asleep stands in for a stopped one: the
// poll sees the same gap between two looks.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>

#include "host/steps.h"
#include "rig.h"

using namespace arx;
using host::HostPoll;
using std::chrono::milliseconds;

namespace {

HostPoll make(milliseconds timeout) {
  HostPoll p{nullptr, HostPoll::Clock::now(), std::chrono::duration_cast<HostPoll::Clock::duration>(timeout)};
  p.begin();
  return p;
}

// Looks every millisecond until the poll expires or `bound` has passed;
// returns the wait's running time then: the time since it began, less the
// gaps it left out (its start moves on by each). Measured from the poll's
// own start, so a test thread preempted on a loaded machine between
// make() and the first look does not shorten it.
// `starved`, when given, adds up the spans (from just before a look, or
// `since`, to just after the next) that came near kNotRunning: a loaded
// machine can keep this thread off the CPU that long, and the poll then
// rightly counts the gap, which lies inside such a span.
milliseconds look_until_expired(HostPoll& p, milliseconds bound, HostPoll::Clock::duration* starved = nullptr,
                                HostPoll::Clock::time_point since = HostPoll::Clock::now()) {
  const auto t0 = HostPoll::Clock::now();
  auto before_last = since;
  for (;;) {
    const auto before = HostPoll::Clock::now();
    const bool done = p.expired();
    const auto after = HostPoll::Clock::now();
    if (starved && after - before_last > HostPoll::kNotRunning - milliseconds(20)) *starved += after - before_last;
    before_last = before;
    if (done || after - t0 >= bound) break;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return std::chrono::duration_cast<milliseconds>(HostPoll::Clock::now() - p.start);
}

// After a stop: the wait expires after a timeout of running time, not at
// once and not never.
void expect_running_timeout(HostPoll& p, milliseconds timeout, const char* stop) {
  const milliseconds took = look_until_expired(p, milliseconds(5000));
  EXPECT(took >= timeout - milliseconds(5) && took < milliseconds(3000),
         "after %s the wait expired in %lld ms, not after a timeout (%lld ms) of running time", stop,
         (long long)took.count(), (long long)timeout.count());
}

}  // namespace

int main() {
  const milliseconds timeout(400);
  {  // A healthy wait: expires after the timeout, nothing left out.
    // Unless the machine kept this thread off the CPU near kNotRunning
    // between two looks (then at most those gaps count).
    const auto since = HostPoll::Clock::now();
    HostPoll p = make(timeout);
    HostPoll::Clock::duration starved{};
    const milliseconds took = look_until_expired(p, milliseconds(5000), &starved, since);
    EXPECT(took >= timeout - milliseconds(5) && took < milliseconds(3000), "a wait expired after %lld ms, not ~%lld",
           (long long)took.count(), (long long)timeout.count());
    EXPECT(p.not_running <= starved + milliseconds(5), "a wait that ran throughout counted %lld ns as not running",
           (long long)p.not_running.count());
  }
  {  // Stopped for three timeouts: the first look after it does not expire,
     // the gap is counted, and the wait goes on for a timeout of running time.
    HostPoll p = make(timeout);
    std::this_thread::sleep_for(3 * timeout);
    EXPECT(!p.expired(), "the first look after a stop declared the timeout (the stop counted as the peers' lateness)");
    EXPECT(p.not_running >= 3 * timeout, "a stop of %lld ms counted as %lld ms not running",
           (long long)(3 * timeout).count(),
           (long long)std::chrono::duration_cast<milliseconds>(p.not_running).count());
    expect_running_timeout(p, timeout, "the stop");
  }
  {  // begin(): the time before a wait, this rank's own work on the CPU, is no gap.
    // On a loaded machine the thread may be off the CPU for part of the
    // work: that part, measured here as the wall time less the thread's
    // CPU time, is what may count, and only past kNotRunning.
    HostPoll p = make(timeout);
    p.end();
    const auto t0 = HostPoll::Clock::now();
    const int64_t cpu0 = HostPoll::thread_cpu_ns();
    volatile uint64_t work = 0;
    while (HostPoll::Clock::now() - t0 < milliseconds(300)) work = work + 1;
    const auto off = (HostPoll::Clock::now() - t0) - std::chrono::nanoseconds(HostPoll::thread_cpu_ns() - cpu0);
    p.begin();
    p.expired();
    if (off < HostPoll::kNotRunning - milliseconds(50))
      EXPECT(p.not_running.count() == 0, "work between two waits counted as not running (%lld ms off the CPU)",
             (long long)std::chrono::duration_cast<milliseconds>(off).count());
    else
      EXPECT(p.not_running >= off - milliseconds(50) || p.not_running.count() == 0,
             "%lld ms off the CPU between two waits counted as %lld ms",
             (long long)std::chrono::duration_cast<milliseconds>(off).count(),
             (long long)std::chrono::duration_cast<milliseconds>(p.not_running).count());
  }
  {  // Stopped between two waits (off the CPU, not in a look): left out too.
    HostPoll p = make(timeout);
    p.end();
    std::this_thread::sleep_for(3 * timeout);
    p.begin();
    EXPECT(!p.expired(), "the first look of the wait after a stop declared the timeout");
    EXPECT(p.not_running >= 3 * timeout - milliseconds(5), "a stop of %lld ms between waits counted as %lld ms",
           (long long)(3 * timeout).count(),
           (long long)std::chrono::duration_cast<milliseconds>(p.not_running).count());
    expect_running_timeout(p, timeout, "a stop between waits");
  }
  printf("%s\n", testing::g_failures ? "FAILED" : "poll: ok");
  return testing::g_failures ? 1 : 0;
}

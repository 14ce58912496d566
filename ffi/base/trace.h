// Stage timestamps of each collective, for finding where a route's time
// goes (examples/bench_stages.py prints them as a table). Only in a trace
// build (CMake option JAX_ARX_TRACE=ON, which defines ARX_TRACE): in every
// other build ARX_STAMP compiles to nothing, so the shipped module pays not
// even a branch for it.
//
// One TraceBuffer per endpoint, in host memory that the endpoint's GPU also
// maps (cuda/attach.cc). Each stage of seq s of a family has one word, at
// s % kTraceSeqs, written by whoever reaches the stage (relaxed: read only
// after the run, once every collective is done):
//   kBegin      the kernel (or the host side) began the seq
//   kPublished  its last piece was signalled (the channel's put and signal)
//   kTaken      the proxy took its first trigger
//   kPosted     the proxy's last put of it returned (the carrier wrote the
//               bytes and the flag word, or posted them to the NIC)
//   kFlagSeen   the flag words of a peer's piece were seen (its header not yet)
//   kArrived    the last of the peers' pieces this rank waited for was seen
//   kEnd        the seq settled (the output written, the seq advanced)
//   kSeq        the seq itself (written with kBegin), to tell rows apart
// GPU stages read %globaltimer, host ones std::chrono::steady_clock, both
// in ns; the module's pinned_round_trip() measures the offset between the two.
// When several threads reach a stage, the last store wins: a stage's time
// is when some piece reached it, near the last one.
#pragma once

#include <chrono>
#include <cstdint>

#include "base/atomics.h"
#include "base/layout.h"

namespace arx {

enum TraceStage { kBegin = 0, kPublished, kTaken, kPosted, kArrived, kEnd, kFlagSeen, kSeq, kTraceStages };
constexpr int kTraceSeqs = 4096;

struct TraceBuffer {
  uint64_t t[kFamilies][kTraceSeqs][kTraceStages];
};

// The host stages' clock, in ns (host code only).
inline uint64_t trace_now() {
  return (uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace arx

#if defined(ARX_TRACE)
#define ARX_STAMP(buf, family, seq, stage, now)                                                            \
  do {                                                                                                     \
    if (buf) store_relaxed(&(buf)->t[(int)(family)][(seq) % ::arx::kTraceSeqs][(stage)], (uint64_t)(now)); \
  } while (0)
#else
#define ARX_STAMP(buf, family, seq, stage, now) \
  do {                                          \
  } while (0)
#endif

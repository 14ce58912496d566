// What the kernels of ffi/cuda share about one grid and one endpoint: the
// seq a kernel takes, the counters its blocks meet on, the way a GPU thread
// waits (comm/wait.h's Poll), what a block that gives up leaves behind, and
// the one step that settles a collective. Written once; the kernels say only
// what to copy and sum per piece.
#pragma once

#include <cstdint>

#include "base/atomics.h"
#include "base/layout.h"
#include "base/trace.h"
#include "comm/wait.h"
#include "cuda/device_side.h"
#include "cuda/elements.cuh"
#include "cuda/ptx.cuh"

namespace arx::cuda {

constexpr int kThreads = 512;

// Counting. Counters shared by the blocks of one grid carry the seq in their
// high bits (seq << 16 | count), so a count an earlier seq's grid left in the
// word is never counted towards this one. An endpoint's kernels of one family
// never overlap (stream order), so the word never holds a later seq than the
// arriving grid's.
//
// Tagging: raise the word to seq << 16 (a count of this seq's is kept, one of
// an earlier seq's dropped). Every block tags before it counts; a block may
// tag at its start (fire and forget), so that its arrival at the end is one
// atomic. No compare-and-swap loop: with one, every block that arrived at
// once retried, a round trip each (docs/performance.md).
__device__ __forceinline__ void tag_arrivals(unsigned long long* word, uint64_t seq) {
  red_max_relaxed_gpu(word, (unsigned long long)(seq << 16));
}

// Counts an arrival (`add`: 1, plus whatever a caller keeps above the count
// bits) on a word this block tagged for this seq; returns the word after it.
// acq_rel: what the arriving block did before it (its thread 0, after the
// block's barrier) is visible to whoever sees the count it made.
__device__ __forceinline__ unsigned long long count_arrival(unsigned long long* word, unsigned long long add) {
  return add_acq_rel_gpu(word, add) + add;
}

__device__ __forceinline__ unsigned long long tagged_arrive(unsigned long long* word, uint64_t seq) {
  tag_arrivals(word, seq);  // same thread, same word: ordered before the add
  return count_arrival(word, 1);
}

// Arrival fields: a word may count two kinds of arrival, 8 bits each (field
// 0 bits 0-7, field 1 bits 8-15). A grid has at most kMaxGridBlocks (255)
// blocks, each arriving once per field, so no count carries into the next
// field or into the seq.
__device__ __forceinline__ int arrivals(unsigned long long n, int field) { return (int)(n >> (8 * field) & 0xff); }

// Whether this thread is thread 0 of the last of `blocks` blocks to arrive
// on `word`'s `field` for seq; every thread of each block calls it. Each
// block's writes before the call reach system scope before its arrival
// (barrier, fence, then the acq_rel count), so the last arrival's thread
// sees them all and what it publishes next carries them.
__device__ __forceinline__ bool last_to_arrive(unsigned long long* word, uint64_t seq, int blocks, int field = 0) {
  __syncthreads();
  if (threadIdx.x != 0) return false;
  fence_acq_rel();
  tag_arrivals(word, seq);  // same thread, same word: ordered before the add
  const unsigned long long n = count_arrival(word, 1ull << (8 * field));
  return n >> 16 == seq && arrivals(n, field) == blocks;
}

// The seq a kernel of family `f` runs, and what every block needs of it:
// parity, descriptor, the start of its waits' bounds, whether an earlier
// collective failed (`prior`: recorded by an earlier kernel, so every block
// sees it; then nothing is written to the peers nor waited for, and the
// output is NaN), and the ring position of its first trigger. Thread 0 of
// each block tags the family's finished counter (settle counts on it).
// Under `prior` a kernel touches nothing but its DeviceWords and its output:
// no channel, no Control block. A closed endpoint keeps only its words,
// marked failed (state.h), and a graph replayed after it closed relies on
// this.
struct SeqStart {
  uint64_t seq;
  int par;
  Descriptor d;
  uint64_t desc;  // describe(d): what the flag words carry
  uint64_t start;
  bool prior;
  uint64_t ring;

  // What the channel's handle needs of this seq (ch.open).
  __device__ SeqSend send() const { return SeqSend{par, flag_word(seq, desc), d, ring}; }
};

__device__ __forceinline__ SeqStart begin(const Grid& g, Family f, const Descriptor& d) {
  DeviceWords* w = g.words;
  // Written by the previous kernel's last block; kernels on one stream are
  // ordered, so plain loads see them.
  const uint64_t seq = w->family[(int)f].seq + 1;
  if (threadIdx.x == 0) tag_arrivals(&w->family[(int)f].finished, seq);
  return SeqStart{seq, (int)(seq & 1), d, describe(d), globaltimer(), w->failed != 0, w->ring};
}

// The block that announces the seq to the host's watchdog (Control::begun:
// relaxed, read by messages only).
__device__ __forceinline__ void note_begun(const Grid& g, Family f, const SeqStart& s) {
  if (threadIdx.x == 0 && !s.prior) {
    ARX_STAMP(g.trace, f, s.seq, kBegin, globaltimer());
    ARX_STAMP(g.trace, f, s.seq, kSeq, s.seq);
    store_relaxed(&g.ctl->begun[(int)f], s.seq);
  }
}

// The trace's kPublished (base/trace.h), by the thread that signalled.
__device__ __forceinline__ void note_published(const Grid& g, Family f, const SeqStart& s) {
  ARX_STAMP(g.trace, f, s.seq, kPublished, globaltimer());
}

// A GPU thread's way of waiting (comm/wait.h): it spins. Between looks it
// checks, besides the clock, another waiter's give-up every 16th turn (a
// word in device memory) and Control::abort every 256th (a read of host
// memory, over the bus: the LL one-shot has thousands of threads waiting at
// once, and their reads of host memory must stay few).
struct DevicePoll {
  const Grid& g;
  uint64_t start;
  __device__ bool expired() const { return globaltimer() - start > g.timeout_ns; }
  __device__ bool aborted(uint32_t turn) const { return (turn & 255) == 255 && load_acquire(&g.ctl->abort) != 0; }
  __device__ bool stopped(uint32_t turn) const { return (turn & 15) == 15 && ld_acquire_gpu(&g.words->fail_any) != 0; }
  __device__ void pause(uint32_t) const {}
};

// A thread whose wait on source `src` ended otherwise than kArrived: what it
// found goes into the grid's DeviceWords::fail_* (the first mismatch or abort
// kind, missing bits, fail_any) for the last block out to record. kStopped:
// another waiter gave up first and said so.
__device__ inline void give_up(DeviceWords* w, WaitEnd e, uint64_t seen, int src,
                               const uint64_t (&theirs)[kDescriptorWords]) {
  switch (e) {
    case WaitEnd::kMismatch:
      if (atomicCAS(&w->fail_kind, 0ull, (unsigned long long)FailureKind::kMismatch) == 0ull) {
        w->fail_flag = seen;
        w->fail_src = (unsigned long long)src;
        for (int i = 0; i < kDescriptorWords; ++i) w->fail_theirs[i] = theirs[i];
      }
      break;
    case WaitEnd::kAborted:
      atomicCAS(&w->fail_kind, 0ull, (unsigned long long)FailureKind::kAborted);
      atomicOr(&w->fail_missing, 1ull << src);
      break;
    case WaitEnd::kTimeout:
      atomicOr(&w->fail_missing, 1ull << src);
      break;
    case WaitEnd::kStopped:
    case WaitEnd::kArrived:
      break;
  }
  atomicExch(&w->fail_any, 1ull);
}

// Piece `piece` of source `src`, waited for by one thread: false when it
// gave up (recorded as give_up says).
template <typename Ch>
__device__ __forceinline__ bool wait_for(const Grid& g, const Ch& ch, const SeqStart& s, int src, int piece) {
  DevicePoll poll{g, s.start};
  uint64_t seen = 0, theirs[kDescriptorWords];
  const WaitEnd e = wait_piece(ch.in, src, piece, s.seq, s.d, poll, seen, theirs,
                               [&] { ARX_STAMP(g.trace, ch.in.family, s.seq, kFlagSeen, globaltimer()); });
  if (e == WaitEnd::kArrived) {
    ARX_STAMP(g.trace, ch.in.family, s.seq, kArrived, globaltimer());
    return true;
  }
  give_up(g.words, e, seen, src, theirs);
  return false;
}

// The settle counter: seq << 16, then the blocks that gave up, then the
// blocks out, so that the last block out learns both from its own arrival.
constexpr unsigned long long kFinishedMask = 0xff, kGaveUpUnit = 1ull << 8, kGaveUpMask = 0xffull << 8;
constexpr int kMaxGridBlocks = 255;

// The one step every collective ends with, in every block, every thread:
// the last block out settles the seq. If any block gave up (or an earlier
// collective had failed, `prior`), it fills the whole output with NaN
// (`fill(t, n)`, by its threads; the other blocks are done, they arrived
// before it), records the failure (the first failure of the endpoint is the
// one kept: the details first, failed_seq last with release, as the host side
// records it) and marks the endpoint failed for good: after a failure the
// buffer reuse argument no longer holds, so nothing more may be sent.
// Otherwise it tells the peers' watchdogs (`ch.heard`). Either way the
// family's seq advances (the grid's counters stay consistent, the GPU stays
// usable), and so does the ring by the `entries` this collective published.
// `gave_up`: this thread's wait gave up.
template <typename Ch, typename Fill>
__device__ void settle(const Grid& g, const Ch& ch, Family f, const SeqStart& s, bool gave_up, uint64_t entries,
                       Fill fill) {
  __shared__ int s_last, s_any;
  DeviceWords* w = g.words;
  const int block_gave_up = __syncthreads_or(gave_up || s.prior);
  if (threadIdx.x == 0) {
    const unsigned long long n = count_arrival(&w->family[(int)f].finished, block_gave_up ? kGaveUpUnit + 1 : 1);
    s_last = n >> 16 == s.seq && (n & kFinishedMask) == gridDim.x;
    s_any = s_last && (n & kGaveUpMask) != 0;
  }
  __syncthreads();
  if (!s_last) return;
  if (s_any) fill((int)threadIdx.x, (int)blockDim.x);
  if (threadIdx.x != 0) return;
  if (s_any) {
    if (!s.prior) {
      const unsigned long long found = ld_acquire_gpu(&w->fail_kind);
      FailureRecord r;
      r.seq = s.seq;
      r.kind = found ? (FailureKind)found : FailureKind::kTimeout;
      r.missing = ld_acquire_gpu(&w->fail_missing);
      r.flag = w->fail_flag;
      r.src = w->fail_src;
      for (int i = 0; i < kDescriptorWords; ++i) r.theirs[i] = w->fail_theirs[i];
      r.mine = s.d;
      r.family = f;
      record_failure(g.ctl, r);
    }
    w->failed = 1;
    // Cleared for the next grid, which starts after this one completed.
    w->fail_any = w->fail_kind = w->fail_missing = w->fail_flag = w->fail_src = 0;
    for (int i = 0; i < kDescriptorWords; ++i) w->fail_theirs[i] = 0;
  } else {
    ch.heard(flag_word(s.seq, s.desc));
  }
  w->family[(int)f].seq = s.seq;
  ARX_STAMP(g.trace, f, s.seq, kEnd, globaltimer());
  if (!s.prior) {
    w->ring = s.ring + entries;
    store_relaxed(&g.ctl->done[(int)f], s.seq);  // for the watchdog: nothing is read on its strength
  }
}

// out[lo, hi) = NaN of D, by thread t of n; lo and hi in bytes, multiples of
// the element size. The NaN the host side's fill_nan leaves, bit for bit.
template <DType D>
__device__ void fill_nan_range(uint8_t* out, uint64_t lo, uint64_t hi, uint64_t t, uint64_t n) {
  using E = Elem<D>;
  for (uint64_t e = lo / E::kSize + t; e < hi / E::kSize; e += n) {
    if (E::kSize == 4)
      *reinterpret_cast<uint32_t*>(out + 4 * e) = E::kNan;
    else
      *reinterpret_cast<uint16_t*>(out + 2 * e) = (uint16_t)E::kNan;
  }
}

// Spreads one bulk L2 prefetch per thread (t of n) over each range the next
// kernels read.
__device__ inline void prefetch(const Prefetch& pf, uint64_t t, uint64_t n) {
  for (int r = 0; r < pf.count; ++r) {
    const uint64_t chunk = ((pf.bytes[r] + n - 1) / n + 15) & ~15ull, off = t * chunk;
    if (off >= pf.bytes[r]) continue;
    const uint64_t len = min(chunk, pf.bytes[r] - off) & ~15ull;
    for (uint64_t o = 0; o < len; o += 1u << 20)  // the instruction takes a 32-bit size
      prefetch_l2(static_cast<const uint8_t*>(pf.ptr[r]) + off + o, (uint32_t)min(len - o, (uint64_t)1 << 20));
  }
}

}  // namespace arx::cuda

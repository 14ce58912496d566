// The one wait of the piece channels (comm/channel.h), on both device sides,
// and the one failure record.
//
// A wait polls a flag word until its seq reaches the awaited one. At exactly
// that seq the word must carry the awaited descriptor's hash, or the peer
// issued a different collective (kMismatch). Past it, the peer finished the
// seq, which it could only do after agreeing with ours: arrived (channel.h,
// "Flag words"). Once a piece's words arrived, the peer's exact Descriptor
// in its header slot must be ours too (base/words.h, "Headers"): the hash alone
// lets one collective in 2^24 pass for another. Every wait is bounded in time (the Poll's clock, never a count of
// polls, which does not measure time) and by the endpoint's abort word; the
// Poll says how to spend the time between looks (the host yields the core,
// a GPU thread spins) and whether another waiter already gave up.
//
// A Poll has:
//   bool expired()             the timeout has passed since the wait began
//   bool aborted(uint32_t t)   the endpoint failed (looked at every few turns)
//   bool stopped(uint32_t t)   another waiter of the same collective gave up
//   void pause(uint32_t t)     between two looks
#pragma once

#include <cstdint>

#include "base/atomics.h"
#include "base/layout.h"
#include "comm/channel.h"

namespace arx {

enum class WaitEnd : uint32_t { kArrived = 0, kMismatch, kTimeout, kAborted, kStopped };

// Piece `piece` of seq from `src`, of the collective `d`: its word on every
// root of the channel (wait_words), then its header (check_header). The
// bytes it announces happen-before the return (acquire), in
// in.lane(seq & 1, src). On a mismatch, `theirs` gets the peer's header (all
// zero when the hash already differed); `seen`: the last word read (the
// disagreeing one, for a mismatch).
//
// wait_words looks at every root's word in each turn (load_look: on a GPU
// relaxed loads in flight together, since each look at host memory is a
// round trip over the bus and an acquire load per root would wait for the
// one before it), and fence_after_looks() once all have arrived makes the
// looks acquires (base/atomics.h).
template <typename Poll>
ARX_HD WaitEnd wait_words(const Inbox& in, int src, int piece, uint64_t seq, uint64_t desc, Poll& poll,
                          uint64_t& seen) {
  const int roots = in.words.roots;
  uint32_t pending = (1u << roots) - 1;
  for (uint32_t turn = 0;; ++turn) {
    uint64_t v[kRoots] = {};
    for (int r = 0; r < kRoots; ++r)
      if (r < roots && (pending >> r & 1)) v[r] = load_look(in.word(src, piece, r));
    for (int r = 0; r < kRoots; ++r) {
      if (r >= roots || !(pending >> r & 1)) continue;
      seen = v[r];
      if (flag_seq(seen) < seq) continue;
      if (flag_seq(seen) == seq && flag_desc(seen) != (desc & kDescMask)) return WaitEnd::kMismatch;
      pending &= ~(1u << r);
    }
    if (pending == 0) break;
    if (poll.aborted(turn)) return WaitEnd::kAborted;
    if (poll.stopped(turn)) return WaitEnd::kStopped;
    if (poll.expired()) return WaitEnd::kTimeout;
    poll.pause(turn);
  }
  fence_after_looks();
  return WaitEnd::kArrived;
}

// After wait_words arrived: the peer's exact Descriptor in its header slot of
// this parity must be ours. The slot still holds seq's header when the word
// was past seq: the peer writes it again only at seq + 2 (channel.h, "Buffer
// reuse"), so it may be read any time before this rank finishes seq, and it
// was written before the word that was acquired.
ARX_HD void load_header(const Inbox& in, int src, uint64_t seq, uint64_t (&theirs)[kDescriptorWords]) {
  const uint64_t* h = in.header((int)(seq & 1), src);
  for (int i = 0; i < kDescriptorWords; ++i) theirs[i] = load_relaxed(h + i);
}
ARX_HD bool header_matches(const Descriptor& d, const uint64_t (&theirs)[kDescriptorWords]) {
  return theirs[0] == d.op && theirs[1] == d.type && theirs[2] == d.count && theirs[3] == d.tag;
}

// `flags_seen()`: called between the two steps (a trace build's stamp).
struct NoHook {
  ARX_HD void operator()() const {}
};
template <typename Poll, typename Hook = NoHook>
ARX_HD WaitEnd wait_piece(const Inbox& in, int src, int piece, uint64_t seq, const Descriptor& d, Poll& poll,
                          uint64_t& seen, uint64_t (&theirs)[kDescriptorWords], Hook flags_seen = {}) {
  for (int i = 0; i < kDescriptorWords; ++i) theirs[i] = 0;
  const WaitEnd e = wait_words(in, src, piece, seq, describe(d), poll, seen);
  if (e != WaitEnd::kArrived) return e;
  flags_seen();
  load_header(in, src, seq, theirs);
  return header_matches(d, theirs) ? WaitEnd::kArrived : WaitEnd::kMismatch;
}

// The first failure of an endpoint, kept in its Control block for the host
// (jax_arx.check(), the proxy, the next handler) to turn into a message.
struct FailureRecord {
  uint64_t seq = 0;
  FailureKind kind = FailureKind::kNone;
  uint64_t missing = 0;                    // bit src per source that had not arrived (timeout, abort)
  uint64_t flag = 0;                       // mismatch: the word that disagreed
  uint64_t src = 0;                        // mismatch: its source
  Descriptor mine;                         // what this rank expected
  uint64_t theirs[kDescriptorWords] = {};  // mismatch: the peer's exact Descriptor, if it got that far
  Family family = Family::kPsum;
};

ARX_HD FailureKind failure_kind(WaitEnd e) {
  switch (e) {
    case WaitEnd::kMismatch:
      return FailureKind::kMismatch;
    case WaitEnd::kAborted:
      return FailureKind::kAborted;
    case WaitEnd::kTimeout:
    case WaitEnd::kStopped:
      return FailureKind::kTimeout;
    case WaitEnd::kArrived:
      break;
  }
  return FailureKind::kNone;
}

// The details first, failed_seq last with release, so a reader that sees
// failed_seq sees the rest. The first failure is the one kept; a later
// writer that races the first may overwrite details before failed_seq is
// set, which only mixes two true failures' details.
ARX_HD void record_failure(Control* ctl, const FailureRecord& r) {
  if (load_acquire(&ctl->failed_seq) != 0) return;
  store_relaxed(&ctl->failed_kind, (uint64_t)r.kind);
  store_relaxed(&ctl->failed_missing, r.kind == FailureKind::kMismatch ? 0 : r.missing);
  store_relaxed(&ctl->failed_flag, r.kind == FailureKind::kMismatch ? r.flag : 0);
  store_relaxed(&ctl->failed_src, r.kind == FailureKind::kMismatch ? r.src : 0);
  store_relaxed(&ctl->failed_desc, describe(r.mine));
  store_relaxed(&ctl->failed_family, (uint64_t)r.family);
  store_relaxed(&ctl->failed_op, r.mine.op);
  store_relaxed(&ctl->failed_type, r.mine.type);
  store_relaxed(&ctl->failed_count, r.mine.count);
  store_relaxed(&ctl->failed_tag, r.mine.tag);
  for (int i = 0; i < kDescriptorWords; ++i) store_relaxed(&ctl->failed_theirs[i], r.theirs[i]);
  store_release(&ctl->failed_seq, r.seq);
}

}  // namespace arx

// Relays: in a ring of 4 (base/topology.h) a rank reaches the rank two away,
// dest = rank + 2, only through next = rank + 1. The proxy (comm/proxy.cc)
// hands every put for dest to its Relay, which makes it a put of next's:
//   1. the bytes go to next's region: a put to every peer has put them there
//      already, in next's inbox lane for this rank (next comes first in send
//      order); a put to dest alone puts them into next's relay lane of the
//      same family and parity, at the same place in it (no flag);
//   2. a record {from (in next's region), len, dst, flag word} goes into
//      next's relay ring of the same root, and the count of records so far
//      into next's relay_word(root): a put with a flag word, after the bytes
//      on the same ordered channel.
// Next's proxy takes the records of each root in order and makes each put to
// dest on the same root. The relayed bytes land in dest's lane for this
// rank and the flag word in this rank's word there, exactly as a direct put
// would: device sides see no difference, and results are the same bits as
// in a mesh. A collective's exact Descriptor is relayed the same way, before
// any of its pieces on root 0: from next's header slot for this rank, which
// a put to every peer filled already, or else from next's relay headers
// (next's own slot is written once per seq: next may be reading it). Notices
// are records with no bytes.
//
// Buffer reuse under relays, by (*) of comm/channel.h:
//  - Next's inbox lane, header slot, relay lane and relay header of parity
//    s & 1, read by the relay for seq s: this rank writes them again for
//    s + 2 only once it began s + 2, when every peer, dest included, has
//    finished s; that needed this rank's flag words for s on every root, each
//    put by the relay after the bytes it read, on the same channel. So those
//    reads are over.
//  - Relayed flag words: this rank's words at dest have one writer, next,
//    which stores them in record order, that is in this rank's order: seqs
//    still only grow.
//  - Next's relay ring and this rank's staged records (relay_out), reused by
//    index modulo kRing: when this rank writes a record of collective c, dest
//    has finished c - 2 and everything before it, which needed every record
//    of them taken (and so read out of relay_out); the records of c - 1 and c
//    number at most 2 x kMaxRelayRecords < kRing (below), so the entry kRing
//    back belongs to c - 2 or earlier.
// A failed endpoint relays nothing more, as it sends nothing more.
#pragma once

#include <cstdint>

#include "base/layout.h"
#include "base/status.h"

namespace arx {

class Endpoint;
struct Trigger;

// The most records one collective puts on one root: a piece each (psum's
// pieces x roots fit a source's psum words; a bulk op sends kMaxPieces pieces
// to dest) and the header.
constexpr int kMaxRelayRecords = kPsumWords / kMaxRingWorld + 1;
static_assert(3 * kMaxRelayRecords <= kRing, "a relay ring must hold three collectives' records");
static_assert(kMaxPieces + 1 <= kMaxRelayRecords, "the bulk ops' records fit a relay ring too");

class Relay {
 public:
  explicit Relay(Endpoint& ep) : ep_(ep) {}

  // This rank's part of a put to `dest`, a rank it has no link to (the
  // proxy's trigger `t`): the header first where `header` (root 0), then
  // root's bytes [off, off + len) of the trigger with its flag word.
  Status header(const Trigger& t, int dest, const uint8_t* header);
  Status data(const Trigger& t, int dest, int root, uint64_t off, uint64_t len);
  // A notice (comm/proxy.cc) for `dest`: its flag word alone.
  Status notice(int dest, uint64_t flag_offset, uint64_t value);

  // The relay's part: makes the puts that prev's records ask for; `moved`
  // when it made any. An error is prev's or the carrier's, and fails the
  // endpoint.
  Status forward(bool& moved);

 private:
  Status record(int root, uint64_t from, uint64_t len, uint64_t dst, uint64_t flag_offset, uint64_t value);
  Endpoint& ep_;
  uint64_t sent_[kRoots] = {};   // records this rank put into next's rings, per root
  uint64_t taken_[kRoots] = {};  // records of prev's this rank has forwarded, per root
};

}  // namespace arx

// Channels: how a device side reaches its peers. The endpoint builds them
// (comm/endpoint.h; the CUDA side from the endpoint's resources, cuda/
// attach.cc); a device side -- kernels, or the CPU handler's thread -- reaches
// a peer only through one. They are plain data with ARX_HD methods, the same
// code on both device sides (base/atomics.h gives each its accesses), as
// MSCCL++'s device handles are.
//
// A collective is written once over "a channel": for each piece, where to
// write the bytes meant for a peer (put_dst), how to announce them (signal),
// how to wait for a peer's (wait_piece, comm/wait.h) and where they are then
// read (Inbox::lane). Two media carry the same protocol:
//   DirectChannel  store into each peer's inbox through a mapping of its
//                  memory (peers on one host: the pinned host region, or GPU
//                  memory mapped over NVLink / PCIe), then store the piece's
//                  flag word into the peer's flag page with release;
//   ProxyChannel   store into this rank's staging buffer, then publish a
//                  trigger; the proxy thread puts the bytes and the flag word
//                  through the carrier (shm, tcp, verbs), in that order on
//                  one ordered channel per root.
// The LL one-shot's lines, which carry their flags, go over either medium
// as a channel of their own whose inbox is ll_recv (make_*_channel with
// `ll_lines`): their bytes are announced with publish(), no flag word
// (cuda/ll.cu).
//
// The protocol both carry, per family (psum; the bulk collectives):
//   1. seq s of the family, parity s & 1; every rank issues the family's
//      collectives in the same order, so s names the same collective on every
//      rank (the descriptor in every flag word checks it);
//   2. the producer writes the bytes of piece p meant for peer j where
//      put_dst says, then signals (p, s): the flag word flag_word(s, desc)
//      lands in j's word (this rank, p, root) after the bytes it covers;
//   3. the consumer waits until every peer's word (peer, p, root), on every
//      root, reaches s, then reads lane(s & 1, peer);
//   4. the seq is finished when every piece is consumed.
//
// Buffer reuse: two buffers by parity are enough, on both media.
//  (*) A rank finishes seq s of a family only after every peer signalled s;
//      a peer signals s only after it began s, which it does only after it
//      finished every earlier collective of the endpoint (one after another:
//      under Endpoint::host_call_mu on the host, in stream order on a GPU),
//      s - 1 of the family included. So when a rank m begins s + 2, it has
//      finished s + 1, and every peer has finished s.
//  - Inbox: a peer writes m's lane [s & 1][peer] for s + 2 only once it began
//    s + 2, hence (by (*) with the roles swapped) after m finished s, whose
//    reads of that lane are over: collectives copy their results into XLA's
//    output buffer and never hand out a view of an inbox.
//  - Staging (ProxyChannel): m overwrites its staging for s + 2 only after
//    every peer finished s (*), which needed m's flag words for s on every
//    root; the carrier stores each after the bytes that the proxy read out of
//    the staging buffer for it, on the same channel, so those reads are over.
//  - Flag words: each (source, piece, root) word is written once per seq of
//    its family, by its source alone, with growing seqs. A word past s is from
//    a peer that finished s (it began s + 1), which needed this rank's flags
//    for s: it counts as arrived, and its bytes for s + 1 went to the other
//    parity, so lane [s & 1] still holds s's. It cannot be past s + 1: the
//    peer's s + 1 needs this rank's s + 1.
//  - The ring: see the proxy (comm/proxy.h).
// The argument needs an endpoint's collectives not to overlap. After a
// failure it no longer holds, so a failed endpoint writes nothing more to
// its peers (the failure is sticky; device sides check it first).
#pragma once

#include <cstdint>

#include "base/atomics.h"
#include "base/layout.h"

namespace arx {

// The receiving half, the same for both media: where this rank's inbox of
// one family is, and the flag words its peers store into.
struct Inbox {
  uint8_t* data = nullptr;    // lane (parity 0, source 0)
  uint64_t parity_bytes = 0;  // lane (0, j) -> lane (1, j)
  uint64_t lane_bytes = 0;    // lane (p, j) -> lane (p, j + 1)
  uint64_t* flags = nullptr;  // the flag page
  FlagWords words;
  Family family = Family::kPsum;

  ARX_HD uint8_t* lane(int parity, int src) const {
    return data + (uint64_t)parity * parity_bytes + (uint64_t)src * lane_bytes;
  }
  ARX_HD const uint64_t* word(int src, int piece, int root) const { return flags + words.index(src, piece, root); }
  // The exact Descriptor `src` issued at a seq of this parity (base/words.h, "Headers").
  ARX_HD const uint64_t* header(int parity, int src) const { return flags + header_word(family, parity, src); }
};

// The producer's destinations: `dest` is a peer's rank, or kEveryPeer (the
// same bytes to every peer, in send order rank + 1, rank + 2, ..., so no
// receiver takes every sender at once).
ARX_HD int peer_in_send_order(int rank, int world, uint64_t dest, int i) {
  return dest == kEveryPeer ? (rank + 1 + i) % world : (int)dest;
}

// One collective's seq as its channel needs it: the parity of its buffers,
// the flag word its signals carry, its exact Descriptor and the ring position
// of its first trigger (the device side's sequence state: SeqStart in
// cuda/grid.cuh, host::Collective in host/steps.h).
struct SeqSend {
  int par = 0;
  uint64_t value = 0;  // flag_word(seq, describe(d))
  Descriptor d;
  uint64_t ring = 0;
};

// Who the pieces of a collective go to: the same bytes to every peer
// (kEveryPeer), or a part of its own to each peer. Fixes how the
// collective's triggers are numbered in the ring.
enum class Fan { kEveryPeer, kEachPeer };

// Where the trigger of (piece, dest) lies among a collective's: piece-major,
// then destinations in send order. Producers may publish in any order of
// time (the blocks of a kernel do); the proxy takes the entries in index
// order, so this numbering is the order the pieces go out in.
ARX_HD uint64_t trigger_index(Fan fan, int rank, int world, int piece, uint64_t dest) {
  if (fan == Fan::kEveryPeer) return (uint64_t)piece;
  return (uint64_t)piece * (uint64_t)(world - 1) + (uint64_t)(((int)dest - rank + world) % world - 1);
}

// A collective's sending half on a channel, opened once per seq
// (`const auto out = ch.open(s, fan, lane)`): the collective says which
// piece goes to whom, the handle says where the bytes go and how a peer
// learns of them. `dest` is a peer's rank, or kEveryPeer (the same bytes to
// every peer, in send order rank + 1, rank + 2, ..., so no receiver takes
// every sender at once). Both media's handles have the same members:
//   fanout(dest)             how many places the bytes for `dest` go to;
//   put_dst(dest, i)         the i-th of them (the lane: add the piece's
//                            offset in it);
//   signal(dest, p, lo, hi)  announces bytes [lo, hi) of that lane as
//                            piece p of the seq;
//   publish(dest, p, lo, hi) the same without a flag word, for bytes that
//                            carry their own (LL lines): through the proxy,
//                            the put alone; direct, nothing left to do;
//   entries(pieces)          trigger ring entries the collective takes;
// and the channel says whether its puts are only staged (kStaged: nothing
// reaches a peer before the signal or publish, which therefore must follow
// every put it covers in a fence's order).

// Peers on one host, whose memory is mapped here. A put is a store into the
// peer's lane for this rank; the signal, one release store per peer into its
// word (this rank, piece, 0): the bytes of the piece must have reached system
// scope before it (the signalling thread fences after the producers'
// barrier; release and fences are cumulative). Before the flag word, the
// exact Descriptor into the peer's header slot, relaxed: the release orders
// it too. One root: no NIC to split over.
struct DirectChannel {
  Inbox in;
  int rank = 0, world = 0;
  uint8_t* peer_data[kMaxWorld] = {};    // each peer's inbox of this family: its lane (0, 0), mapped here
  uint64_t* peer_flags[kMaxWorld] = {};  // each peer's flag page, mapped here
  uint64_t* peer_heard[kMaxWorld] = {};  // this rank's heard word of the family in each peer's region (layout.h)

  static constexpr bool kStaged = false;
  struct Out;
  // `fan` and `lane` are the proxy's: a peer's lane is where its inbox has it.
  ARX_HD Out open(const SeqSend& s, Fan fan, uint64_t lane = 0) const;
  // Tells each peer's watchdog the last seq finished (relaxed: read by
  // messages only), where its flag page may be out of the host's reach.
  ARX_HD void heard(uint64_t value) const {
    for (int i = 0; i < world - 1; ++i) store_relaxed(peer_heard[(rank + 1 + i) % world], value);
  }
};

struct DirectChannel::Out {
  const DirectChannel& ch;
  SeqSend s;

  ARX_HD int fanout(uint64_t dest) const { return dest == kEveryPeer ? ch.world - 1 : 1; }
  // The peer's lane for this rank.
  ARX_HD uint8_t* put_dst(uint64_t dest, int i = 0) const {
    const int p = peer_in_send_order(ch.rank, ch.world, dest, i);
    return ch.peer_data[p] + (uint64_t)s.par * ch.in.parity_bytes + (uint64_t)ch.rank * ch.in.lane_bytes;
  }
  // The bytes are in the peers' lanes already ([lo, hi) is the proxy's).
  ARX_HD void signal(uint64_t dest, int piece, uint64_t lo, uint64_t hi) const {
    for (int i = 0; i < fanout(dest); ++i) {
      uint64_t* page = ch.peer_flags[peer_in_send_order(ch.rank, ch.world, dest, i)];
      uint64_t* h = page + header_word(ch.in.family, s.par, ch.rank);
      store_relaxed(h + 0, s.d.op);
      store_relaxed(h + 1, s.d.type);
      store_relaxed(h + 2, s.d.count);
      store_relaxed(h + 3, s.d.tag);
      store_release(page + ch.in.words.index(ch.rank, piece, 0), s.value);
    }
  }
  ARX_HD void publish(uint64_t, int, uint64_t, uint64_t) const {}
  ARX_HD uint64_t entries(int) const { return 0; }
};

ARX_HD DirectChannel::Out DirectChannel::open(const SeqSend& s, Fan, uint64_t) const { return Out{*this, s}; }

// Any carrier: the bytes are staged in this rank's region, and the signal
// publishes a trigger (layout.h) for the proxy, which puts them, split over
// the carrier's roots, each part followed by its own flag word (this rank,
// piece, root) on that root's ordered channel. Staging: the bytes for every
// peer (kEveryPeer) at lane 0, the bytes for peer j at lane j, `lane` bytes
// apart (the collective's choice: it must keep a lane inside the staging
// buffer). The bytes must have reached system scope before the signal (the
// tag's release orders them for the proxy, which acquires it). With piece
// 0 the exact Descriptor is staged too, and the proxy puts it into each
// peer's header slot before that piece, on root 0: every later piece's flag
// word on root 0 comes after it on the same ordered channel (the proxy takes
// piece 0's entries first: trigger_index numbers them piece-major), so a
// wait on any piece finds the header in place, written once per seq.
struct ProxyChannel {
  Inbox in;
  int rank = 0, world = 0;
  Family family = Family::kPsum;
  uint8_t* stage = nullptr;  // staging lane 0 of parity 0
  uint64_t stage_parity_bytes = 0;
  uint64_t stage_offset = 0;  // region offset of `stage`
  uint64_t inbox_offset = 0;  // region offset of in.data, here and in every peer's region
  Trigger* ring = nullptr;
  uint64_t* staged = nullptr;  // this family's staged headers, by parity (Layout::staged_header_offset)

  static constexpr bool kStaged = true;
  struct Out;
  // `lane`: how far apart the staging lanes of the peers are (kEachPeer).
  ARX_HD Out open(const SeqSend& s, Fan fan, uint64_t lane = 0) const;
  // The carrier's flag words are in the peers' host regions already.
  ARX_HD void heard(uint64_t) const {}
};

struct ProxyChannel::Out {
  const ProxyChannel& ch;
  SeqSend s;
  Fan fan;
  uint64_t lane;

  ARX_HD int fanout(uint64_t) const { return 1; }
  ARX_HD uint64_t stage_at(uint64_t dest) const {
    return (uint64_t)s.par * ch.stage_parity_bytes + (dest == kEveryPeer ? 0 : dest * lane);
  }
  // The staging lane for `dest`, whatever `i`: the proxy fans out.
  ARX_HD uint8_t* put_dst(uint64_t dest, int = 0) const { return ch.stage + stage_at(dest); }
  // Publishes the trigger of (piece, dest) at its index (trigger_index):
  // bytes [lo, hi) of the lane for `dest`, into the peers' lane for this
  // rank at lo, then the flag word into their word (this rank, piece, root).
  // A collective publishes each of its indices once.
  ARX_HD void signal(uint64_t dest, int piece, uint64_t lo, uint64_t hi) const {
    if (piece == 0) {
      uint64_t* h = ch.staged + s.par * kDescriptorWords;
      store_relaxed(h + 0, s.d.op);
      store_relaxed(h + 1, s.d.type);
      store_relaxed(h + 2, s.d.count);
      store_relaxed(h + 3, s.d.tag);
    }
    trigger(dest, piece, lo, hi, (uint64_t)ch.in.words.index(ch.rank, piece, 0),
            (uint64_t)ch.family | (piece == 0 ? kTriggerHeader : 0));
  }
  // The put alone: no flag word, no header (the bytes carry their own).
  ARX_HD void publish(uint64_t dest, int piece, uint64_t lo, uint64_t hi) const {
    trigger(dest, piece, lo, hi, kTriggerNoFlag, (uint64_t)ch.family);
  }
  ARX_HD void trigger(uint64_t dest, int piece, uint64_t lo, uint64_t hi, uint64_t flag, uint64_t family) const {
    const uint64_t at = s.ring + trigger_index(fan, ch.rank, ch.world, piece, dest);
    Trigger* t = ch.ring + at % kRing;
    store_relaxed(&t->src, ch.stage_offset + stage_at(dest) + lo);
    store_relaxed(&t->len, hi - lo);
    store_relaxed(&t->dst,
                  ch.inbox_offset + (uint64_t)s.par * ch.in.parity_bytes + (uint64_t)ch.rank * ch.in.lane_bytes + lo);
    store_relaxed(&t->flag, flag);
    store_relaxed(&t->value, s.value);
    store_relaxed(&t->dest, dest);
    store_relaxed(&t->family, family);
    store_release(&t->tag, at + 1);
  }
  ARX_HD uint64_t entries(int pieces) const {
    return (uint64_t)pieces * (fan == Fan::kEveryPeer ? 1 : (uint64_t)(ch.world - 1));
  }
};

ARX_HD ProxyChannel::Out ProxyChannel::open(const SeqSend& s, Fan fan, uint64_t lane) const {
  return Out{*this, s, fan, lane};
}

// The channels of one family, built from a region as a device side sees it
// (`base`: its address there; `peers[j]`: peer j's region mapped there, for
// the direct medium). `roots`: the carrier's. `ll_lines` (psum only): the
// LL one-shot's lines, whose inbox is ll_recv (a lane is an LL slot) and
// whose staging is the psum family's; they have no flag words of their own.
ProxyChannel make_proxy_channel(const Layout& L, Family f, int rank, int roots, uint8_t* base, bool ll_lines = false);
DirectChannel make_direct_channel(const Layout& L, Family f, int rank, uint8_t* base, uint8_t* const* peers,
                                  bool ll_lines = false);

}  // namespace arx

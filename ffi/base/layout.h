// The endpoint's memory, as every side sees it: the device side (host or
// CUDA) that copies, signals, waits and sums; the proxy that drains the
// trigger ring and moves bytes; and the carriers that write into a peer's
// region. Offsets, not pointers, cross process boundaries: each side adds its
// own base. Every rank of a communicator has the same layout (the geometry is
// checked at rendezvous), so an offset in this rank's region is the same
// offset in a peer's.
//
// One endpoint's region, in order:
//   control    the Control block: sequence state, failure record, abort,
//              the trigger ring's counters (this rank's writers only)
//   flags      kFlagWords words: the flag words peers write (base/words.h, "The flag page")
//   recv       psum inbox: [2 parities][world sources][slot_bytes]
//   ll_recv    LL inbox: [2 parities][world sources][kLLSlotBytes]
//   send       psum staging: [2 parities][send_bytes]
//   ring       kRing triggers: the device side -> the proxy (see proxy.h)
//   bulk_recv  bulk inbox: [2 parities][world sources][bulk_lane]
//   bulk_send  bulk staging: [2 parities][world destinations][bulk_lane]
//   relay      a ring of 4 only (base/topology.h): what prev sends to the
//              rank two away, for this rank's proxy to put on to it: psum
//              [2 parities][slot_bytes], bulk [2 parities][bulk_lane], the
//              headers of those [families][2 parities], and kRoots rings of
//              kRing records (comm/relay.h); then this
//              rank's own outgoing records, staged for the carrier
//              [kRoots][kRing] (written by this rank only)
// Peers write only their own parts of the inbox: their flag words, their
// psum slots recv[*][src], their LL slots ll_recv[*][src] and their bulk
// lanes bulk_recv[*][src], and, for a relay, the relayed source's (a carrier
// checks every remote write with Layout::may_write; prev alone writes the
// relay area); control, ring and the staging buffers only by this rank.
// flags, recv and ll_recv follow each other: the one window of the inbox
// that a NIC lets peers write (inbox_lo, inbox_hi).
//
// Two families of collectives use the endpoint, each with its own sequence
// numbers, buffers and flag words: psum (one-shot, two-shot, LL), and the
// bulk collectives (all_gather, reduce_scatter, the fused MoE combine), which
// move tens of MB per call in kMaxPieces pieces.
#pragma once

#include <cstddef>
#include <cstdint>

#include "base/topology.h"
#include "base/words.h"  // flag words, descriptors, the flag page, how payloads are cut

namespace arx {

// ---- the control block ------------------------------------------------------

// Why a wait gave up (Control::failed_kind).
enum class FailureKind : uint64_t {
  kNone = 0,
  kTimeout = 1,   // a peer's flag did not reach the seq within the timeout
  kMismatch = 2,  // a peer issued a different collective at this seq
  kAborted = 3,   // the endpoint had already failed (proxy, carrier, a peer's notice, an earlier call)
  kPeerLost = 4,  // in notices only: the sender lost its link to the ranks in the notice's mask
};

// The element types the reducing ops take (part of their descriptors).
enum class DType : uint32_t { kF32 = 1, kBF16 = 2, kF16 = 3 };

ARX_HD int dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }

// Pinned and shared between the device side, the proxy and the host; never
// written by peers. Each group of words has one writer.
struct alignas(64) Control {
  // Device side -> proxy and host, per family: the last seq the device side
  // began, and the last it finished (the host device side's sequence state;
  // the watchdog's "a collective is under way"). Relaxed: nothing is read on
  // their strength but messages.
  uint64_t begun[kFamilies];
  uint64_t done[kFamilies];
  uint64_t pad0[4];
  // Device side -> host: the first failed wait. failed_seq is stored last,
  // with release, so a reader that sees it non-zero sees the rest.
  uint64_t failed_seq;
  uint64_t failed_kind;     // FailureKind
  uint64_t failed_missing;  // bit src per source that had not arrived
  uint64_t failed_flag;     // for a mismatch: the flag word that disagreed
  uint64_t failed_src;      // for a mismatch: the peer that sent it
  uint64_t failed_desc;     // what this rank expected
  uint64_t failed_family;   // Family of the wait
  uint64_t failed_op;       // OpCode of the collective
  // Host (proxy, carrier, handler) -> device side: non-zero fails every wait
  // at once, so nothing spins on a link that is known to be gone.
  uint64_t abort;
  uint64_t failed_theirs[kDescriptorWords];        // for a mismatch: the peer's exact Descriptor (header)
  uint64_t failed_type, failed_count, failed_tag;  // what this rank expected: the rest of its Descriptor
  // The trigger ring (proxy.h): entries published by a host producer (the
  // next index; CUDA producers keep theirs on the device), and taken by the
  // proxy (proxy -> producers).
  uint64_t ring_published;
  uint64_t ring_consumed;
  uint64_t pad2[6];
};
static_assert(sizeof(Control) == 256, "Control is read by the device side and the proxy: keep its layout fixed");
static_assert(offsetof(Control, failed_seq) == 64 && offsetof(Control, abort) == 128, "Control layout");
static_assert(offsetof(Control, ring_published) == 192, "Control layout");
static_assert(sizeof(Control) <= 512 && 512 + 2 * (2 * kFamilies * kDescriptorWords * 8) <= kPage,
              "the staged headers and the proxy's copies fit page 0 after the Control block");

// ---- the trigger ring ---------------------------------------------------------
//
// What a device side asks the proxy to send, one put at a time: `len` bytes
// at `src` of this rank's region into `dst` of a peer's region, then the flag
// word `value` into the peer's word `flag` (root 0's; root r stores into flag
// + r), split over the carrier's roots. `dest` is a rank, or kEveryPeer: the
// same bytes to every peer, in send order (rank + 1, rank + 2, ...). Fixed
// size: the device side (host or kernel) writes it and the proxy reads it.
// Every field but tag is written first (relaxed), tag = index + 1 last with
// release; the proxy acquires tag, then reads. The proxy takes entries
// strictly in index order. The proxy knows nothing else of the collectives:
// psum and the bulk ops publish the same kind of entry.
constexpr int kRing = 256;
constexpr uint64_t kEveryPeer = ~0ull;
constexpr uint64_t kTriggerHeader = 1ull << 8;
// Trigger::flag of a put with no flag word after its bytes: LL lines, which
// carry their own (see "The LL one-shot").
constexpr uint64_t kTriggerNoFlag = ~0ull;

struct alignas(64) Trigger {
  uint64_t src;  // offset of the bytes in this rank's region
  uint64_t len;
  uint64_t dst;     // offset where they land in the peer's region
  uint64_t flag;    // flag page index of root 0's word, or kTriggerNoFlag
  uint64_t value;   // the flag word
  uint64_t dest;    // the peer's rank, or kEveryPeer
  uint64_t family;  // Family, | kTriggerHeader: put the staged header (family, parity) first
  uint64_t tag;     // ring index + 1, written last
};
static_assert(sizeof(Trigger) == 64, "Trigger is written by kernels and read by the proxy: keep its layout fixed");
static_assert(offsetof(Trigger, tag) == 56, "Trigger layout");

// A relay record (comm/relay.h): a put that prev asks this rank to make on
// its behalf to the rank two away. `from` is in this rank's region;
// flag_offset may be Transport's kNoFlag (~0).
struct alignas(64) RelayRecord {
  uint64_t from, len, dst, flag_offset, value, pad[3];
};
static_assert(sizeof(RelayRecord) == 64, "RelayRecord crosses the wire: keep its layout fixed");

// ---- the LL one-shot psum ------------------------------------------------------
//
// A one-shot psum of at most kLLMaxPayload bytes whose flags travel inside
// the data, as in NCCL's LL protocol (ffi/cuda/ll.cu): the reader needs no
// separate flag and no header after it, so it makes one round trip to the
// bytes where the pipelined one-shot makes three (flag, header, data). The
// partial goes in 16-byte lines of 8 payload bytes, {data0, flag, data1,
// flag} (32-bit words), each 8-byte half carrying its own copy of the line's
// flag: a line is written as two 8-byte single-copy-atomic accesses, so a
// reader may see one half new and the other old, but never a half whose data
// and flag disagree. A partial whose size is not a multiple of 8 pads its
// last line.
//
// Sender `src`'s lines for seq land in each peer's ll_recv[seq & 1][src],
// stored there by its kernel through the mapping of the peer's memory (the
// direct channel), or staged once and put by its proxy (the proxy channel)
// through a carrier whose puts land in whole aligned 8-byte words
// (Transport::whole_words: shm, verbs; not tcp, whose receiver's recv() may
// stop inside a word). The flag, ll_flag(seq, desc), is never 0 (bit 0 is
// set) and, for one seq, distinct for distinct descriptors (the 24-bit
// descriptor fills bits 8-31); bits 1-7 hold seq / 2 (the same slot's
// previous uses). Readers zero every line they consumed (the proof that a
// polled line holds 0 or the line of this seq is in ll.cu).
constexpr uint64_t kLLLineBytes = 16;
constexpr uint64_t kLLLinePayload = 8;
constexpr uint64_t kLLMaxPayload = 128 << 10;  // the largest LL partial: a slot holds its lines, twice its size
constexpr uint64_t kLLSlotBytes = kLLMaxPayload / kLLLinePayload * kLLLineBytes;
// The payload one block of the LL kernel owns at most (cuda/ll.cu): a fused
// call's rows are normed by the block that holds them (comm/plan.cc).
constexpr uint64_t kLLBlockPayload = 8 << 10;
static_assert(kLLSlotBytes % kPage == 0, "LL slots are whole pages");

ARX_HD uint32_t ll_flag(uint64_t seq, uint64_t desc) {
  return (uint32_t)(desc & kDescMask) << 8 | (uint32_t)((seq >> 1) & 0x7f) << 1 | 1u;
}

// ---- sizes and offsets ----------------------------------------------------------

// Sizes of one endpoint's buffers; every rank of a communicator must agree
// (checked at rendezvous).
struct Geometry {
  uint32_t world = 0;
  uint64_t slot_bytes = 0;  // psum: per source per parity (a one-shot partial, a two-shot piece)
  uint64_t send_bytes = 0;  // psum: per parity (a two-shot partial)
  uint64_t bulk_bytes = 0;  // bulk: per parity, every lane together (a whole gathered output; 0: none)
  TopologyKind topology = TopologyKind::kMesh;
};

struct Layout {
  int world = 0;
  Topology topo;
  uint64_t slot_bytes = 0, send_bytes = 0;
  uint64_t bulk_lane = 0;  // bulk: one source's (or destination's) part, the largest slice a bulk op takes
  uint64_t control = 0, flags = 0, recv = 0, send = 0, ring = 0, bulk_recv = 0, bulk_send = 0, ll_recv = 0;
  uint64_t relay = 0, relay_bulk = 0, relay_headers = 0, relay_ring = 0, relay_out = 0,
           total = 0;  // relay*: empty
                       // unless topo.relays()

  static uint64_t page_up(uint64_t x) { return (x + kPage - 1) / kPage * kPage; }

  static Layout of(const Geometry& g) {
    Layout l;
    l.world = (int)g.world;
    l.topo = Topology{(int)g.world, g.topology == TopologyKind::kRing};
    l.slot_bytes = g.slot_bytes;
    l.send_bytes = g.send_bytes;
    // A lane holds a world-th of bulk_bytes, rounded up to 16 bytes so that
    // every lane starts 16-aligned: a slice of up to bulk_bytes / world fits.
    l.bulk_lane = g.world ? (g.bulk_bytes / g.world + 15) / 16 * 16 : 0;
    l.control = 0;
    l.flags = kPage;
    l.recv = kPage + 8 * kFlagWords;
    l.ll_recv = page_up(l.recv + 2 * (uint64_t)g.world * g.slot_bytes);
    l.send = l.ll_recv + 2 * (uint64_t)g.world * kLLSlotBytes;
    l.ring = page_up(l.send + 2 * g.send_bytes);
    l.bulk_recv = page_up(l.ring + kRing * sizeof(Trigger));
    l.bulk_send = page_up(l.bulk_recv + 2 * (uint64_t)g.world * l.bulk_lane);
    l.relay = page_up(l.bulk_send + 2 * (uint64_t)g.world * l.bulk_lane);
    const bool relays = l.topo.relays();
    l.relay_bulk = page_up(l.relay + (relays ? 2 * g.slot_bytes : 0));
    l.relay_headers = page_up(l.relay_bulk + (relays ? 2 * l.bulk_lane : 0));
    l.relay_ring = page_up(l.relay_headers + (relays ? kPage : 0));
    l.relay_out = page_up(l.relay_ring + (relays ? (uint64_t)kRoots * kRing * sizeof(RelayRecord) : 0));
    l.total = page_up(l.relay_out + (relays ? (uint64_t)kRoots * kRing * sizeof(RelayRecord) : 0));
    return l;
  }
  ARX_HD uint64_t flag_offset(int index) const { return flags + 8 * (uint64_t)index; }
  // This rank's staged header of (family, parity), which its device side
  // writes (page 0, after the Control block); and the proxy's own copy of
  // it, which the proxy writes (atomically, from the staged one) and puts
  // into the peers' header slots: the device side may store the same words
  // again for the collective's next piece while the proxy sends them.
  ARX_HD uint64_t staged_header_offset(Family f, int parity) const {
    return control + 512 + ((uint64_t)f * 2 + parity) * kDescriptorWords * 8;
  }
  ARX_HD uint64_t proxy_header_offset(Family f, int parity) const {
    return staged_header_offset(f, parity) + 2 * kFamilies * kDescriptorWords * 8;
  }
  ARX_HD uint64_t handshake_offset(int src) const { return flags + 8 * (kHandshakeWord + (uint64_t)src); }
  ARX_HD uint64_t recv_offset(int parity, int src) const {
    return recv + ((uint64_t)parity * world + src) * slot_bytes;
  }
  ARX_HD uint64_t send_offset(int parity) const { return send + (uint64_t)parity * send_bytes; }
  ARX_HD uint64_t bulk_recv_offset(int parity, int src) const {
    return bulk_recv + ((uint64_t)parity * world + src) * bulk_lane;
  }
  ARX_HD uint64_t bulk_send_offset(int parity, int dest) const {
    return bulk_send + ((uint64_t)parity * world + dest) * bulk_lane;
  }
  ARX_HD uint64_t ll_recv_offset(int parity, int src) const {
    return ll_recv + ((uint64_t)parity * world + src) * kLLSlotBytes;
  }
  // The relay area (topo.relays() only): where prev's bytes for the rank two
  // away wait, by family and parity; the record ring of each root.
  ARX_HD uint64_t relay_offset(Family f, int parity) const {
    return f == Family::kPsum ? relay + (uint64_t)parity * slot_bytes : relay_bulk + (uint64_t)parity * bulk_lane;
  }
  ARX_HD uint64_t relay_lane_bytes(Family f) const { return f == Family::kPsum ? slot_bytes : bulk_lane; }
  ARX_HD uint64_t relay_header_offset(Family f, int parity) const {
    return relay_headers + ((uint64_t)f * 2 + parity) * kDescriptorWords * 8;
  }
  ARX_HD uint64_t relay_record_offset(int root, uint64_t index) const {
    return relay_ring + ((uint64_t)root * kRing + index % kRing) * sizeof(RelayRecord);
  }
  ARX_HD uint64_t relay_out_offset(int root, uint64_t index) const {
    return relay_out + ((uint64_t)root * kRing + index % kRing) * sizeof(RelayRecord);
  }
  // The inbox lane of `src` a put to `offset` lands in: its family and
  // parity (false if none), for a relay to stage it in the same place.
  ARX_HD bool lane_of(int src, uint64_t offset, Family& f, int& parity, uint64_t& lane_start) const {
    for (int p = 0; p < 2; ++p) {
      const uint64_t a = recv_offset(p, src), b = bulk_recv_offset(p, src);
      if (offset >= a && offset < a + slot_bytes) {
        f = Family::kPsum;
        parity = p;
        lane_start = a;
        return true;
      }
      if (bulk_lane && offset >= b && offset < b + bulk_lane) {
        f = Family::kBulk;
        parity = p;
        lane_start = b;
        return true;
      }
    }
    return false;
  }
  // Whether the rank `carrier` may write [offset, offset + len) of rank
  // `at`'s region, or store the flag word at `flag_offset` there: inside the
  // slots of a source it carries to `at` (its own over a link, or the one it
  // relays: base/topology.h), or, for prev of a relay, its relay area and
  // relay words. A carrier checks every remote write with these.
  ARX_HD bool may_write(int carrier, int at, uint64_t offset, uint64_t len) const {
    for (int src = 0; src < world; ++src)
      if (src != at && topo.carries(carrier, src, at) && src_may_write(src, offset, len)) return true;
    if (topo.relayed_source(at) != carrier || relay_out == relay) return false;
    return offset >= relay && offset <= relay_out && len <= relay_out - offset;
  }
  ARX_HD bool may_flag(int carrier, int at, uint64_t flag_offset) const {
    for (int src = 0; src < world; ++src)
      if (src != at && topo.carries(carrier, src, at) && src_may_flag(src, flag_offset)) return true;
    if (topo.relayed_source(at) != carrier) return false;
    return flag_offset == this->flag_offset(relay_word(0)) || flag_offset == this->flag_offset(relay_word(kRoots - 1));
  }
  // Whether `src` may write [offset, offset + len) of a peer's region: inside
  // one of its own inbox slots (recv[p][src], ll_recv[p][src],
  // bulk_recv[p][src]) or header slots.
  ARX_HD bool src_may_write(int src, uint64_t offset, uint64_t len) const {
    for (int p = 0; p < 2; ++p) {
      const uint64_t a = recv_offset(p, src), b = bulk_recv_offset(p, src), c = ll_recv_offset(p, src);
      if (offset >= a && offset <= a + slot_bytes && len <= a + slot_bytes - offset) return true;
      if (offset >= c && offset <= c + kLLSlotBytes && len <= c + kLLSlotBytes - offset) return true;
      if (bulk_lane && offset >= b && offset <= b + bulk_lane && len <= b + bulk_lane - offset) return true;
      for (int f = 0; f < kFamilies; ++f) {
        const uint64_t h = flag_offset(header_word((Family)f, p, src)), n = 8 * kDescriptorWords;
        if (offset >= h && offset <= h + n && len <= h + n - offset) return true;
      }
    }
    return false;
  }
  // Whether `src` may store the flag word at `offset`: an aligned word of its own.
  ARX_HD bool src_may_flag(int src, uint64_t offset) const {
    if (offset < flags || offset >= flags + 8 * kFlagWords || (offset - flags) % 8) return false;
    return src_owns_word(src, (int)((offset - flags) / 8), world);
  }
  // The whole inbox, [flags, end of ll_recv), bulk_recv and the relay area:
  // what any peer may write at all (the verbs carrier registers these for
  // remote writes).
  uint64_t inbox_lo() const { return flags; }
  uint64_t inbox_hi() const { return send; }
  uint64_t bulk_inbox_lo() const { return bulk_recv; }
  uint64_t bulk_inbox_hi() const { return bulk_send; }
  uint64_t relay_lo() const { return relay; }
  uint64_t relay_hi() const { return relay_out; }
};

}  // namespace arx

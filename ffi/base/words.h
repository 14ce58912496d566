// What crosses between ranks besides the bytes themselves: the flag words
// (seq and descriptor), the exact descriptors in the header slots, the flag
// page that holds both, and how a payload is cut into the pieces and halves
// that each get a flag word. Sender and receiver compute all of it the same
// way from the same numbers; base/layout.h places it in the region.
#pragma once

#include <cstdint>

#include "base/topology.h"  // ARX_HD too

namespace arx {

constexpr int kMaxWorld = 8;
// Every put through a carrier is split in half, one half per NIC function
// ("root"), each followed by its own flag word on that root's ordered
// channel.
constexpr int kRoots = 2;
constexpr uint64_t kPage = 4096;

enum class Family : uint32_t { kPsum = 0, kBulk = 1 };
constexpr int kFamilies = 2;

// ---- flag words -------------------------------------------------------------
//
// A flag word is (seq << kDescBits) | descriptor, stored by the sender after
// the bytes it announces (a carrier: on the same ordered channel; a kernel or
// host thread writing a peer's memory directly: with release, after a fence).
// The seq only grows, so "reached" is a comparison of the high bits. The
// descriptor (24 bits, `describe`) says what the sender issued at that seq: a
// peer that issued a different collective shows up as a mismatch when the
// seqs are equal, and is reported, never summed.
// 40 bits of seq last 2^40 calls: 127 days at 100k calls per second.
constexpr int kDescBits = 24;
constexpr uint64_t kDescMask = (1ull << kDescBits) - 1;

ARX_HD uint64_t flag_word(uint64_t seq, uint64_t desc) { return seq << kDescBits | (desc & kDescMask); }
ARX_HD uint64_t flag_seq(uint64_t flag) { return flag >> kDescBits; }
ARX_HD uint64_t flag_desc(uint64_t flag) { return flag & kDescMask; }

// What a collective is, for its descriptor.
enum class OpCode : uint64_t {
  kPsum = 1,         // one-shot psum
  kPsumScatter = 2,  // two-shot psum, first half: piece j to rank j
  kPsumGather = 3,   // two-shot psum, second half: the summed piece to every rank
  kAllGather = 4,
  kReduceScatter = 5,
  kMoeCombine = 6,  // the fused MoE combine + reduce-scatter
};

// What a collective is, exactly: its op, a type code (DType for the reducing
// ops; the XLA element type for all_gather, whose bytes are just bytes; the
// bulk ops add their row count << 8), the element count and the call site's
// tag (which also carries the algorithm's variant: a peer that cut the same
// collective differently must not match). It travels whole in the headers
// (below); its 24-bit hash, describe(), in every flag word.
struct Descriptor {
  uint64_t op = 0, type = 0, count = 0, tag = 0;
};

ARX_HD Descriptor descriptor(OpCode op, uint64_t type_code, uint64_t count, uint64_t tag) {
  Descriptor d;
  d.op = (uint64_t)op;
  d.type = type_code;
  d.count = count;
  d.tag = tag;
  return d;
}

ARX_HD uint64_t describe(const Descriptor& d) {
  uint64_t h = d.count * 0x9E3779B97F4A7C15ull ^ (d.type << 8 | d.op) * 0xC2B2AE3D27D4EB4Full;
  h ^= d.tag * 0xD6E8FEB86659FD93ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return h & kDescMask;
}

// The flag page (two pages of words). Each (source, piece, root) of a family
// has its own word, written once per seq of that family by that source
// alone, so a word says "piece p of seq s from src is in place" and nothing
// about other pieces; no argument about the order in which pieces travel is
// needed anywhere.
//   [kPsumWordBase, + kPsumWords)   psum: kPsumWords / world words per source,
//                                   split into pieces x roots (FlagWords)
//   [kBulkWordBase, + kBulkWords)   bulk: kMaxPieces pieces x kRoots per source
//   [kHeardWordBase, + 2 x kMaxWorld)  the last seq heard of each source, per
//                                   family, for the watchdog only (see "Heard")
//   [kHeaderWordBase, + kHeaderWords)  the exact descriptors ("Headers")
//   [kNoticeWordBase, + kMaxWorld)  a source's notice that it gave up
//                                   (comm/proxy.cc, "Notices")
//   [kRelayWordBase, + kRoots)      records prev put into the relay rings, per root
//   kPeerMemory*Word                the GPU inbox exchange (peer_memory.cc)
//   [kHandshakeWord, + kMaxWorld)   the carriers' set-up handshake
// Heard: where the flag words that kernels wait on live in GPU memory (psum
// inboxes in GPU memory), the host cannot read them; the kernels store the
// seq they finished into the peers' heard words too (relaxed), so the stall
// report and the failure messages can say what each peer last sent.
// Headers: the flag word's 24-bit descriptor is a hash, so two different
// collectives could pass for one. Every signal also puts the sender's exact
// Descriptor into the receiver's header slot (family, parity, sender), before
// the flag word on the same ordered channel; a wait compares it once the
// flag word arrived (comm/wait.h). The slot is reused by parity, as the
// inbox is (comm/channel.h).
constexpr uint64_t kFlagWords = 2 * kPage / 8;
constexpr int kPsumWordBase = 0;
constexpr int kPsumWords = 256;
constexpr int kBulkWordBase = kPsumWordBase + kPsumWords;
constexpr int kMaxPieces = 8;  // pieces of a bulk collective (per destination), at most
constexpr int kBulkWords = kMaxWorld * kMaxPieces * kRoots;
constexpr int kHeardWordBase = kBulkWordBase + kBulkWords;
constexpr int kDescriptorWords = 4;
constexpr int kHeaderWordBase = kHeardWordBase + kFamilies * kMaxWorld;
constexpr int kHeaderWords = kFamilies * 2 * kMaxWorld * kDescriptorWords;
constexpr int kNoticeWordBase = kHeaderWordBase + kHeaderWords;
constexpr int kRelayWordBase = kNoticeWordBase + kMaxWorld;
constexpr int kPeerMemoryOfferWord = kRelayWordBase + kRoots;
constexpr int kPeerMemoryBytesWord = kPeerMemoryOfferWord + 1;
constexpr int kPeerMemoryResultWord = kPeerMemoryOfferWord + 2;
constexpr uint64_t kPeerMemoryNone = ~0ull;
constexpr uint64_t kHandshakeWord = kFlagWords - kMaxWorld;
static_assert(kPeerMemoryResultWord < (int)kHandshakeWord, "the flag page overflows into the handshake");

// The header slot of (family, parity, source): kDescriptorWords words.
ARX_HD int header_word(Family f, int parity, int src) {
  return kHeaderWordBase + (((int)f * 2 + parity) * kMaxWorld + src) * kDescriptorWords;
}
ARX_HD int notice_word(int src) { return kNoticeWordBase + src; }
ARX_HD int relay_word(int root) { return kRelayWordBase + root; }

ARX_HD int heard_word(Family f, int src) { return kHeardWordBase + (int)f * kMaxWorld + src; }

// The words of one family as one channel uses them: source `src` owns
// `stride` words from base + src * stride, whatever the channel's roots (so
// a carrier can tell whose a word is), and its word for `piece` on `root` is
// the (piece * roots + root)-th of them. Sender and receiver compute the
// same (same world; the roots of the channel, which every rank agrees on).
struct FlagWords {
  int base = 0;
  int stride = 0;  // words per source
  int pieces = 0;  // per source: stride / roots
  int roots = 1;
  ARX_HD int index(int src, int piece, int root) const { return base + src * stride + piece * roots + root; }
};

ARX_HD int psum_stride(int world) { return kPsumWords / (world > 0 ? world : 1); }
ARX_HD FlagWords psum_words(int world, int roots) {
  return FlagWords{kPsumWordBase, psum_stride(world), psum_stride(world) / roots, roots};
}
ARX_HD FlagWords bulk_words(int roots) { return FlagWords{kBulkWordBase, kMaxPieces * kRoots, kMaxPieces, roots}; }

// Whether word `index` of the flag page belongs to source `src` (a carrier
// lets a peer store only its own words).
ARX_HD bool src_owns_word(int src, int index, int world) {
  if (index >= kPsumWordBase && index < kPsumWordBase + psum_stride(world) * world)
    return (index - kPsumWordBase) / psum_stride(world) == src;
  if (index >= kBulkWordBase && index < kBulkWordBase + kBulkWords)
    return (index - kBulkWordBase) / (kMaxPieces * kRoots) == src;
  return index == notice_word(src);
}

// ---- how a payload is cut --------------------------------------------------

// The split of `bytes` over the roots: root 0 takes the first half rounded
// up to 16 bytes (so the second half starts 16-aligned), root 1 the rest,
// possibly nothing. With one root, root 0 takes everything.
ARX_HD void root_split(uint64_t bytes, int root, int roots, uint64_t& off, uint64_t& len) {
  if (roots == 1) {
    off = 0;
    len = bytes;
    return;
  }
  uint64_t half = (bytes / 2 + 15) & ~15ull;
  if (half > bytes) half = bytes;
  off = root ? half : 0;
  len = root ? bytes - half : half;
}

// Piece c of n of `bytes`: [lo, hi), the one split of every collective
// that sends in pieces (the one-shot's pieces, the two-shot's piece j for
// rank j, a bulk lane's pieces; at most kMaxPieces for a bulk lane, all of
// them when n is not given). Pieces are 16-byte multiples except the last,
// which may be short or empty; every element type divides 16. An empty piece
// still carries its flag. A collective cut in fewer pieces leaves the flag
// words of the others alone: a later one that uses them waits for their seq
// to reach its own, as for any word.
ARX_HD uint64_t piece_step(uint64_t bytes, int n) { return ((bytes + n - 1) / n + 15) & ~15ull; }
ARX_HD void piece_range(uint64_t bytes, int n, int c, uint64_t& lo, uint64_t& hi) {
  const uint64_t step = piece_step(bytes, n);
  lo = step * c < bytes ? step * c : bytes;
  hi = step * (c + 1) < bytes ? step * (c + 1) : bytes;
}
ARX_HD void piece_range(uint64_t bytes, int c, uint64_t& lo, uint64_t& hi) {
  piece_range(bytes, kMaxPieces, c, lo, hi);
}

// Rows [lo, hi) of piece k of n of a destination's `rows`-row lane (the
// fused MoE combine). Sender and receiver compute the same split.
ARX_HD void row_piece(uint64_t rows, int n, int k, uint64_t& lo, uint64_t& hi) {
  lo = rows * (uint64_t)k / n;
  hi = rows * (uint64_t)(k + 1) / n;
}
ARX_HD void row_piece(uint64_t rows, int k, uint64_t& lo, uint64_t& hi) { row_piece(rows, kMaxPieces, k, lo, hi); }

}  // namespace arx

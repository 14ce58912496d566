// The endpoint's memory, as every side sees it: the device side (host or
// CUDA) that copies, publishes, waits and sums; the proxy that reads the
// control block and moves bytes; and the carriers that write into a peer's
// region. Offsets, not pointers, cross process boundaries: each side adds
// its own base.
//
// One endpoint's region, in order:
//   control   the Control block (device side writes, proxy and host read)
//   flags     kFlagWords words, written by peers only
//   recv      [2 parities][world][slot_bytes], written by peers only
//   send      [2 parities][send_bytes], written by the device side only
// flags and recv are contiguous: the inbox, the only window a peer may
// write into (Layout::inbox_*). Every remote write is checked against it.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define ARX_HD __host__ __device__ __forceinline__
#else
#define ARX_HD inline
#endif

namespace arx {

constexpr int kMaxWorld = 8;
// Every write is split in half, one half per NIC function ("root"), each
// followed by its own flag on that root's ordered channel.
constexpr int kRoots = 2;
constexpr uint64_t kPage = 4096;
constexpr uint64_t kFlagWords = kPage / 8;  // room for the prefill ops' flags too
// The last kMaxWorld words of the flag page are the carriers' set-up
// handshake: word kHandshakeWord + j is written by rank j once it can reach
// this region (shm: once it mapped it). Collectives never use them.
constexpr uint64_t kHandshakeWord = kFlagWords - kMaxWorld;

// What a published seq asks the proxy to send. Also part of the descriptor
// that travels in every flag word.
enum class Mode : uint64_t {
  kFull = 1,     // the whole partial to every peer (one-shot all-reduce)
  kScatter = 2,  // chunk j of the partial to rank j (two-shot, first half)
  kGather = 3,   // this rank's summed chunk to every peer (two-shot, second half)
};

// Element types the reducing ops accept (dtype part of the descriptor).
enum class DType : uint32_t { kF32 = 1, kBF16 = 2, kF16 = 3 };

ARX_HD int dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }

// A flag word is (progress << kDescBits) | descriptor. Progress is the seq
// (or, for pieced ops, seq * 16 + piece + 1) and only grows, so "reached"
// is a plain comparison of the high bits. The descriptor is a hash of what
// the sender published for that seq (mode, dtype, element count, and the
// call site's tag): a peer that issued a different collective at the same
// seq shows up as a mismatch when the progress is equal, and is reported,
// never summed. The tag tells apart two collectives of the same shape from
// different places of a program, which a runtime that executes independent
// calls concurrently (XLA's CPU thunk executor) could issue in different
// orders on different ranks.
// 40 bits of progress last 2^40 calls: 127 days at 100k calls per second.
constexpr int kDescBits = 24;
constexpr uint64_t kDescMask = (1ull << kDescBits) - 1;

ARX_HD uint64_t flag_word(uint64_t progress, uint64_t desc) { return progress << kDescBits | (desc & kDescMask); }
ARX_HD uint64_t flag_progress(uint64_t flag) { return flag >> kDescBits; }
ARX_HD uint64_t flag_desc(uint64_t flag) { return flag & kDescMask; }

ARX_HD uint64_t describe(Mode mode, DType dtype, uint64_t count, uint64_t tag) {
  uint64_t h = count * 0x9E3779B97F4A7C15ull ^ ((uint64_t)dtype << 8 | (uint64_t)mode) * 0xC2B2AE3D27D4EB4Full;
  h ^= tag * 0xD6E8FEB86659FD93ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return h & kDescMask;
}

// Index of the flag word that `src` writes over `root` in a receiver's
// flags (one-shot and two-shot ops).
ARX_HD int flag_index(int src, int root) { return src * kRoots + root; }

// The split of `bytes` over the roots: root 0 takes the first half rounded
// up to 16 bytes (so the second half starts 16-aligned), root 1 the rest,
// possibly nothing. With one root, root 0 takes everything.
ARX_HD void root_split(uint64_t bytes, int root, int roots, uint64_t& off, uint64_t& len) {
  if (roots == 1) { off = 0; len = bytes; return; }
  uint64_t half = (bytes / 2 + 15) & ~15ull;
  if (half > bytes) half = bytes;
  off = root ? half : 0;
  len = root ? bytes - half : half;
}

// Two-shot chunking of a partial of `bytes` over `world` ranks: chunk j is
// [lo, hi). Chunks are 16-byte multiples except the last, which takes the
// rest and may be short or empty; every element type divides 16.
ARX_HD void chunk_range(uint64_t bytes, int world, int j, uint64_t& lo, uint64_t& hi) {
  const uint64_t step = ((bytes + world - 1) / world + 15) & ~15ull;
  lo = step * j < bytes ? step * j : bytes;
  hi = step * (j + 1) < bytes ? step * (j + 1) : bytes;
}

// Why a device-side wait gave up (Control::failed_kind).
enum class FailureKind : uint64_t {
  kNone = 0,
  kTimeout = 1,   // a peer's flag did not reach the seq within the timeout
  kMismatch = 2,  // a peer published a different collective at this seq
  kAborted = 3,   // the endpoint had already failed (proxy, carrier, earlier call)
};

// Pinned and shared between the device side, the proxy and the host. Each
// group of words has one writer. Publish order: bytes/mode/desc, then a
// release store of `published`; the proxy acquire-loads `published` first.
struct alignas(64) Control {
  // Device side -> proxy.
  uint64_t published;  // last published seq
  uint64_t bytes[2];   // by parity: bytes of the partial in send[parity]
  uint64_t mode[2];    // by parity: Mode
  uint64_t desc[2];    // by parity: describe() of the collective
  uint64_t dtype[2];   // by parity: DType of the partial (scatter chunking)
  uint64_t done;       // last seq the device side finished (watchdog; host seq state)
  uint64_t pad0[6];
  // Device side -> host: the first failed wait. failed_seq is stored last,
  // with release, so a reader that sees it non-zero sees the rest.
  uint64_t failed_seq;
  uint64_t failed_kind;     // FailureKind
  uint64_t failed_missing;  // bit flag_index(src, root) per flag that had not arrived
  uint64_t failed_flag;     // for a mismatch: the flag word that disagreed
  uint64_t failed_src;      // for a mismatch: the peer that sent it
  uint64_t failed_desc;     // for a mismatch: what this rank expected
  uint64_t pad1[2];
  // Host (proxy, carrier, handler) -> device side: non-zero fails every wait
  // at once, so nothing spins on a link that is known to be gone.
  uint64_t abort;
  uint64_t pad2[7];
};
static_assert(sizeof(Control) == 256, "Control is read by the device side and the proxy: keep its layout fixed");
static_assert(offsetof(Control, failed_seq) == 128 && offsetof(Control, abort) == 192, "Control layout");

// Sizes of one endpoint's buffers; every rank of a communicator must agree
// (checked at rendezvous).
struct Geometry {
  uint32_t world = 0;
  uint64_t slot_bytes = 0;  // per peer per parity: a one-shot partial or a two-shot chunk
  uint64_t send_bytes = 0;  // per parity: a two-shot partial
};

struct Layout {
  uint64_t control = 0, flags = 0, recv = 0, send = 0, total = 0;
  uint64_t inbox_lo = 0, inbox_hi = 0;  // [flags, end of recv): what peers may write
  uint64_t slot_bytes = 0, send_bytes = 0;
  int world = 0;

  static Layout of(const Geometry& g) {
    Layout l;
    l.world = (int)g.world;
    l.slot_bytes = g.slot_bytes;
    l.send_bytes = g.send_bytes;
    l.control = 0;
    l.flags = kPage;
    l.recv = 2 * kPage;
    l.send = l.recv + 2 * (uint64_t)g.world * g.slot_bytes;
    l.total = (l.send + 2 * g.send_bytes + kPage - 1) / kPage * kPage;
    l.inbox_lo = l.flags;
    l.inbox_hi = l.send;
    return l;
  }
  ARX_HD uint64_t flag_offset(int index) const { return flags + 8 * (uint64_t)index; }
  ARX_HD uint64_t handshake_offset(int src) const { return flags + 8 * (kHandshakeWord + (uint64_t)src); }
  ARX_HD uint64_t recv_offset(int parity, int src) const {
    return recv + ((uint64_t)parity * world + src) * slot_bytes;
  }
  ARX_HD uint64_t send_offset(int parity) const { return send + (uint64_t)parity * send_bytes; }
  // A peer's write of `len` bytes at `offset` stays inside the inbox.
  ARX_HD bool inbox_contains(uint64_t offset, uint64_t len) const {
    return offset >= inbox_lo && offset <= inbox_hi && len <= inbox_hi - offset;
  }
  // A flag store lands on an aligned word of the flag page.
  ARX_HD bool is_flag(uint64_t offset) const {
    return offset >= flags && offset < flags + 8 * kFlagWords && (offset - flags) % 8 == 0;
  }
};

}  // namespace arx

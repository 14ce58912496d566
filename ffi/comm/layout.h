// The endpoint's memory, as every side sees it: the device side (host or
// CUDA) that copies, publishes, waits and sums; the proxy that reads the
// control block and moves bytes; and the carriers that write into a peer's
// region. Offsets, not pointers, cross process boundaries: each side adds
// its own base.
//
// One endpoint's region, in order:
//   control       the Control block (device side writes, proxy and host read)
//   flags         kFlagWords words, written by peers only
//   recv          [2 parities][world][slot_bytes], written by peers only
//   send          [2 parities][send_bytes], written by the device side only
// and, appended for the prefill-sized ops (all-gather, reduce-scatter, the
// fused MoE combine; see "Prefill-sized ops" below):
//   prefill_ctl   the PrefillControl block: the work ring (device side
//                 writes, proxy reads) and the prefill sequence state
//   prefill_send  [2 parities][prefill_slot_bytes], written by the device side only
//   prefill_recv  [2 parities][prefill_slot_bytes], written by peers only
// Peers may write into two windows, the inbox: [flags, send) (flags and
// recv are contiguous) and prefill_recv (Layout::inbox_*, prefill_inbox_*).
// Every remote write is checked against them (inbox_contains); everything
// else (control, send, prefill_ctl, prefill_send) only this rank writes.
// Appended last, for the LL one-shot psum (CUDA direct mode; see "The LL
// one-shot" below):
//   ll_recv       [2 parities][world][kLLSlotBytes], written by peers' kernels only
// ll_recv is outside the inbox: no carrier ever writes it (only a peer's
// kernel, through the peer's own mapping of this region on the shm carrier,
// stores there), so inbox_contains refuses a remote write to it.
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
  // 0: the wait was a psum's (flags flag_index, seq = Control seq); else
  // the WorkOp of a prefill op (flags prefill_flag_index, seq = prefill seq).
  // Kernels that only run psums never write it.
  uint64_t failed_op;
  uint64_t pad1[1];
  // Host (proxy, carrier, handler) -> device side: non-zero fails every wait
  // at once, so nothing spins on a link that is known to be gone.
  uint64_t abort;
  uint64_t pad2[7];
};
static_assert(sizeof(Control) == 256, "Control is read by the device side and the proxy: keep its layout fixed");
static_assert(offsetof(Control, failed_seq) == 128 && offsetof(Control, abort) == 192, "Control layout");
static_assert(offsetof(Control, failed_op) == 176, "Control layout");

// ---- Prefill-sized ops (the reference's arxbig) ---------------------------
//
// all_gather: the device side copies this rank's slice into
// prefill_send[s & 1] at rank * slice; the proxy writes it into the same
// place of every peer's prefill_recv[s & 1], then a flag. The device side
// waits for every peer's flags and copies the gathered slices into the
// output. reduce_scatter: the device side copies its whole input (world
// chunks of `slice` bytes) into prefill_send[s & 1]; the proxy writes chunk
// j into peer j's prefill_recv[s & 1] at rank * slice, then a flag; the
// device side waits and sums the world chunks for this rank in rank order
// (fp32, rounded once). The fused MoE combine writes its rows straight into
// prefill_send[s & 1] and publishes them piece by piece per destination
// (WorkOp::kRsPiece), then finishes as reduce_scatter does.
//
// Pieces. Each op goes out as kChunks pieces, so the wire starts on piece 0
// while the device side still copies piece 1. Producers publish pieces into
// the work ring (PrefillControl::ring); each entry carries its own index + 1
// (tag), written last with release, and the proxy consumes entries strictly
// in index order. A peer's flag for op s, piece c, has the progress
// s * 16 + c + 1 (prefill_progress): monotonic on each (peer, root) channel,
// since the proxy sends op s's pieces before op s + 1's, and in piece order
// per destination; and covering every earlier piece on that channel, since a
// channel delivers the data of pieces 0..c before the flag of piece c. The
// progress goes into the ordinary flag word (flag_word(progress, desc)), so
// the descriptor check works as for psum: a flag whose progress lies in op
// s's range [s * 16 + 1, s * 16 + 16] must carry op s's descriptor.
//
// Sequence state. The prefill ops have their own sequence counter s (1, 2,
// ...), one for all three kinds, kept with the endpoint (PrefillControl::
// done on the host; a device word on CUDA), apart from psum's Control::done:
// the one-shot proxy path posts every psum seq in order, without gaps, so
// the prefill ops cannot take numbers from it.
//
// Reuse. Two buffers by parity are enough, for the same reason as psum's.
// (*) A rank finishes op s only after it received every peer's pieces of s;
// a peer sends pieces of s only after it published s, which it does only
// after finishing s - 1 (ops of one endpoint run one after another: under
// Endpoint::host_call_mu on the host, in stream order on a GPU). So when a
// rank m has finished s + 1, every peer has finished s.
//  - A peer writes m's prefill_recv[s & 1] for s + 2 only after finishing
//    s + 1, which needed m's pieces of s + 1, which m published after
//    finishing s. m's reads of prefill_recv[s & 1] for s are over then: the
//    ops copy their results into XLA's output buffer and never hand out a
//    view of the slot (the reference returned such views, hence its three
//    all-gather slots; the copy makes parity enough).
//  - m overwrites prefill_send[s & 1] for s + 2 only after finishing s + 1,
//    so by (*) every peer has finished s, which needed every piece m's proxy
//    sent out of prefill_send[s & 1] for s: the flag a peer waited for
//    follows that piece's data on the same channel, so the data had been
//    read out of m's buffer.
//  - The ring. When m publishes entries of s + 2, every peer has finished s
//    (*), so m's proxy has consumed every entry of s that goes to a peer,
//    and every entry before those (index order). What is left unconsumed is
//    at most the trailing entries of s for m itself (kRsPiece rows that
//    never leave), s + 1 and s + 2: fewer than 3 * kChunks * kMaxWorld =
//    192 <= kWorkRing entries, so a producer never overwrites an entry the
//    proxy has not taken. (The host producer also checks it against
//    PrefillControl::consumed.)
// Rows. all_gather and reduce_scatter along an axis other than the first
// gather into, or scatter from, [outer][world][block] (outer: the product
// of the sizes before the axis). On the wire each rank's part stays
// contiguous ([outer][block]); the device side does the strided copies
// (host/prefill.cc gather_rows / scatter_rows): into prefill_send for
// reduce_scatter, out of prefill_recv for all_gather.
// Ring mode (relays through a neighbour, the reference's world 4) is not
// built: relays read the inbox to forward it, and the reference's proof for
// them needs three all-gather slots. Carry it over when adding them.
constexpr int kChunks = 8;    // pieces per op (per destination for kRsPiece)
constexpr int kWorkRing = 256;  // work ring entries; see "The ring" above

// What one work ring entry asks the proxy to send.
enum class WorkOp : uint64_t {
  kAllGather = 1,      // piece `piece` of this rank's slice, to every peer
  kReduceScatter = 2,  // piece `piece` of chunk j, to peer j, for every peer j
  kRsPiece = 3,        // piece = j * kChunks + k: row piece k of chunk j, to peer j only
};

// One work ring entry. Fixed size: the device side (host or kernel) writes
// it and the proxy reads it. All fields but tag are written first (relaxed),
// tag = index + 1 last with release; the proxy acquires tag, then reads.
struct alignas(64) WorkItem {
  uint64_t op;     // WorkOp
  uint64_t seq;    // prefill seq s
  uint64_t piece;  // see WorkOp
  uint64_t slice;  // bytes of one chunk (one rank's slice, or one destination's rows)
  uint64_t lo, hi;  // the piece: bytes [lo, hi) of the chunk
  uint64_t desc;   // describe_prefill() of the op: travels in every flag word
  uint64_t tag;    // ring index + 1, written last
};
static_assert(sizeof(WorkItem) == 64, "WorkItem is written by kernels and read by the proxy: keep its layout fixed");
static_assert(offsetof(WorkItem, tag) == 56, "WorkItem layout");

// The prefill ops' block: pinned, at Layout::prefill_ctl, never written by peers.
struct alignas(64) PrefillControl {
  WorkItem ring[kWorkRing];  // device side -> proxy
  uint64_t done;             // host device side: the last prefill seq finished (its sequence state; watchdog)
  uint64_t consumed;         // proxy -> device side: ring entries taken so far
  uint64_t published;        // host device side: ring entries published so far (the next index)
  uint64_t pad[5];
};
static_assert(sizeof(PrefillControl) == kWorkRing * 64 + 64, "PrefillControl layout");
static_assert(offsetof(PrefillControl, done) == kWorkRing * 64, "PrefillControl layout");

// Flag words of the prefill ops: one per (source, root), after the psum
// flags and before the handshake. Words [kPrefillFlagBase, + 2 * kMaxWorld *
// kRoots) are reserved, the second half for ring mode's second channel.
constexpr int kPrefillFlagBase = 128;
static_assert(kPrefillFlagBase + 2 * kMaxWorld * kRoots <= (int)kHandshakeWord, "prefill flags overlap the handshake");
ARX_HD int prefill_flag_index(int src, int root) { return kPrefillFlagBase + src * kRoots + root; }

// Flag words of the prefill ops in CUDA direct mode (ffi/cuda/prefill.cu):
// the kernels write a peer's prefill_recv themselves, piece by piece from
// many blocks at once, so a piece's flag cannot cover the earlier pieces as
// a carrier's ordered channel does; each (source, piece) has its own word,
// progress prefill_progress(seq, piece) with the op's descriptor, written
// only by kernels.
constexpr int kPrefillPieceFlagBase = kPrefillFlagBase + 2 * kMaxWorld * kRoots;
ARX_HD int prefill_piece_flag_index(int src, int piece) { return kPrefillPieceFlagBase + src * kChunks + piece; }

// Flag words of the pipelined one-shot psum (CUDA direct mode, ffi/cuda/
// allreduce.cu): the kernels write a partial into each peer's inbox chunk by
// chunk, each chunk followed by its own flag, so the peer sums chunk c as soon
// as chunk c is in. One word per (source, chunk), progress = seq, with psum's
// descriptor; written only by kernels, never by the proxy. Words
// [kPsumChunkFlagBase, + kPsumChunkFlagWords), split evenly among the sources
// of the communicator: a partial goes in at most psum_chunk_max(world) chunks.
constexpr int kPsumChunkFlagBase = 240;
constexpr int kPsumChunkFlagWords = 256;
static_assert(kPsumChunkFlagBase >= kPrefillPieceFlagBase + kMaxWorld * kChunks, "chunk flags overlap the prefill flags");
static_assert(kPsumChunkFlagBase + kPsumChunkFlagWords <= (int)kHandshakeWord, "chunk flags overlap the handshake");
ARX_HD int psum_chunk_max(int world) { return kPsumChunkFlagWords / (world > 0 ? world : 1); }
ARX_HD int psum_chunk_flag_index(int src, int chunk, int world) {
  return kPsumChunkFlagBase + src * psum_chunk_max(world) + chunk;
}

// The peer-memory exchange (CUDA direct mode, ffi/cuda/peer_memory.cc):
// words of the flag page that only their owner writes, in its own region,
// and the peers read through their shm mapping of it, at set-up only.
//   offer   0 until set; kPeerMemoryNone: this rank offers no inbox in GPU
//           memory; else pid << 32 | (fd + 1): the process and the file
//           descriptor of its exported allocation
//   bytes   the allocation's size
//   result  0 until set; 1: this rank mapped every peer's; 2: it did not
constexpr int kPeerMemoryOfferWord = kPsumChunkFlagBase + kPsumChunkFlagWords;
constexpr int kPeerMemoryBytesWord = kPeerMemoryOfferWord + 1;
constexpr int kPeerMemoryResultWord = kPeerMemoryOfferWord + 2;
constexpr uint64_t kPeerMemoryNone = ~0ull;
static_assert(kPeerMemoryResultWord < (int)kHandshakeWord, "the peer-memory words overlap the handshake");

// The progress of op `seq`, piece `piece`; op s owns [s * 16 + 1, s * 16 + 16].
ARX_HD uint64_t prefill_progress(uint64_t seq, int piece) { return seq * 16 + (uint64_t)piece + 1; }

// The descriptor of a prefill op: the op, a type code (the element type --
// DType for the reducing ops, the XLA element type for all-gather, whose
// bytes are just bytes -- or'ed with the row count << 8, see below), the
// element count (all-gather: this rank's; the others: the whole input) and
// the call site's tag. Kept apart from psum's by the op codes.
ARX_HD uint64_t describe_prefill(WorkOp op, uint64_t type_code, uint64_t count, uint64_t tag) {
  uint64_t h = count * 0x9E3779B97F4A7C15ull ^ (type_code << 8 | (uint64_t)op | 0x10000ull) * 0xC2B2AE3D27D4EB4Full;
  h ^= tag * 0xD6E8FEB86659FD93ull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return h & kDescMask;
}

// Piece c of a chunk of `bytes` (all-gather, reduce-scatter): [lo, hi).
// Pieces start 16-aligned, so each is a whole number of elements of every
// type (element sizes divide 16); the last takes the rest. Pieces may be
// empty: they still carry their flag.
ARX_HD void piece_range(uint64_t bytes, int c, uint64_t& lo, uint64_t& hi) {
  const uint64_t step = (bytes / kChunks + 15) & ~15ull;
  lo = step * c < bytes ? step * c : bytes;
  hi = c == kChunks - 1 ? bytes : (step * (c + 1) < bytes ? step * (c + 1) : bytes);
}

// Rows [lo, hi) of piece k of a destination's `rows`-row chunk (the fused
// MoE combine). Sender and receiver compute the same split.
ARX_HD void row_piece(uint64_t rows, int k, uint64_t& lo, uint64_t& hi) {
  lo = rows * (uint64_t)k / kChunks;
  hi = rows * (uint64_t)(k + 1) / kChunks;
}

// ---- The LL one-shot psum (CUDA direct mode) --------------------------------
//
// A one-shot psum of at most kLLMaxPayload bytes whose flags travel inside
// the data, as in NCCL's LL protocol (ffi/cuda/allreduce.cu, "the LL
// one-shot"): the reader needs no separate flag and the writer no fence, so
// the partial crosses the bus once each way. The partial goes in 16-byte
// lines of 8 payload bytes, {data0, flag, data1, flag} (32-bit words), each
// 8-byte half carrying its own copy of the line's flag: a line is written
// with one 16-byte store whose halves are each one 8-byte single-copy-atomic
// access, so a reader may see one half new and the other old, but never a
// half whose data and flag disagree. A partial whose size is not a multiple
// of 8 pads its last line (the reader ignores the padding).
//
// Sender `src` writes its lines for seq into each peer's
// ll_recv[seq & 1][src] (ll_recv_offset), straight through the mapping of
// the peer's region; no carrier and no proxy is involved, which is why the
// region is not in the inbox. Raw data of the other psum algorithms never
// lands there either, so a line's flag can only have been written by an LL
// kernel of that sender: the reader zeroes every line it consumed, and a
// line polled for seq holds either 0 or the flag of the line written for
// seq (the proof is in allreduce.cu).
//
// The flag, ll_flag(seq, desc), is never 0 (bit 0 is set) and, for one seq,
// distinct for distinct descriptors (the 24-bit descriptor fills bits 8-31),
// so a line of a peer that issued another collective at this seq is never
// taken for ours; bits 1-7 hold seq / 2 (the same slot's previous uses).
// The descriptor is describe(kFull, dtype, count, ll_tag(tag)): the LL tag
// keeps an LL one-shot apart from the other one-shot kernels in the flag
// words as well (a peer that ran another algorithm mismatches, see
// allreduce.cu).
constexpr uint64_t kLLLineBytes = 16;
constexpr uint64_t kLLLinePayload = 8;
// The largest LL partial (JAX_ARX_CUDA_LL_MAX_BYTES is capped here): each
// slot holds its lines, twice its size.
constexpr uint64_t kLLMaxPayload = 128 << 10;
// (ll_recv takes 2 * world slots: 1 MiB per endpoint at world 2, 4 MiB at 8,
// on every platform, since all sides share one layout.)
constexpr uint64_t kLLSlotBytes = kLLMaxPayload / kLLLinePayload * kLLLineBytes;
static_assert(kLLSlotBytes % kPage == 0, "LL slots are whole pages");

ARX_HD uint64_t ll_tag(uint64_t tag) { return tag ^ 0x9E3779B97F4A7C15ull; }

ARX_HD uint32_t ll_flag(uint64_t seq, uint64_t desc) {
  return (uint32_t)(desc & kDescMask) << 8 | (uint32_t)((seq >> 1) & 0x7f) << 1 | 1u;
}

// Sizes of one endpoint's buffers; every rank of a communicator must agree
// (checked at rendezvous).
struct Geometry {
  uint32_t world = 0;
  uint64_t slot_bytes = 0;  // per peer per parity: a one-shot partial or a two-shot chunk
  uint64_t send_bytes = 0;  // per parity: a two-shot partial
  uint64_t prefill_slot_bytes = 0;  // per parity: a prefill op's whole gathered output or input (0: none)
};

struct Layout {
  uint64_t control = 0, flags = 0, recv = 0, send = 0;
  uint64_t prefill_ctl = 0, prefill_send = 0, prefill_recv = 0, total = 0;
  uint64_t inbox_lo = 0, inbox_hi = 0;                  // [flags, end of recv): what peers may write
  uint64_t prefill_inbox_lo = 0, prefill_inbox_hi = 0;  // prefill_recv: what peers may write too
  uint64_t slot_bytes = 0, send_bytes = 0, prefill_slot_bytes = 0;
  int world = 0;
  uint64_t ll_recv = 0;  // appended after prefill_recv: see "The LL one-shot"

  static uint64_t page_up(uint64_t x) { return (x + kPage - 1) / kPage * kPage; }

  static Layout of(const Geometry& g) {
    Layout l;
    l.world = (int)g.world;
    l.slot_bytes = g.slot_bytes;
    l.send_bytes = g.send_bytes;
    l.prefill_slot_bytes = g.prefill_slot_bytes;
    l.control = 0;
    l.flags = kPage;
    l.recv = 2 * kPage;
    l.send = l.recv + 2 * (uint64_t)g.world * g.slot_bytes;
    // Appended: the offsets above do not depend on what follows.
    l.prefill_ctl = page_up(l.send + 2 * g.send_bytes);
    l.prefill_send = page_up(l.prefill_ctl + sizeof(PrefillControl));
    l.prefill_recv = page_up(l.prefill_send + 2 * g.prefill_slot_bytes);
    l.ll_recv = page_up(l.prefill_recv + 2 * g.prefill_slot_bytes);
    l.total = page_up(l.ll_recv + 2 * (uint64_t)g.world * kLLSlotBytes);
    l.inbox_lo = l.flags;
    l.inbox_hi = l.send;
    l.prefill_inbox_lo = l.prefill_recv;
    l.prefill_inbox_hi = l.prefill_recv + 2 * g.prefill_slot_bytes;
    return l;
  }
  ARX_HD uint64_t flag_offset(int index) const { return flags + 8 * (uint64_t)index; }
  ARX_HD uint64_t handshake_offset(int src) const { return flags + 8 * (kHandshakeWord + (uint64_t)src); }
  ARX_HD uint64_t recv_offset(int parity, int src) const {
    return recv + ((uint64_t)parity * world + src) * slot_bytes;
  }
  ARX_HD uint64_t send_offset(int parity) const { return send + (uint64_t)parity * send_bytes; }
  // Prefill ops: chunk `index` (a rank's slice, or a destination's rows)
  // of `chunk` bytes in prefill_send[parity] / prefill_recv[parity].
  ARX_HD uint64_t prefill_send_offset(int parity, int index, uint64_t chunk) const {
    return prefill_send + (uint64_t)parity * prefill_slot_bytes + (uint64_t)index * chunk;
  }
  ARX_HD uint64_t prefill_recv_offset(int parity, int src, uint64_t chunk) const {
    return prefill_recv + (uint64_t)parity * prefill_slot_bytes + (uint64_t)src * chunk;
  }
  // The LL one-shot: the lines `src` writes for parity `parity`.
  ARX_HD uint64_t ll_recv_offset(int parity, int src) const {
    return ll_recv + ((uint64_t)parity * world + src) * kLLSlotBytes;
  }
  // A peer's write of `len` bytes at `offset` stays inside one window of the inbox.
  ARX_HD bool inbox_contains(uint64_t offset, uint64_t len) const {
    return (offset >= inbox_lo && offset <= inbox_hi && len <= inbox_hi - offset) ||
           (offset >= prefill_inbox_lo && offset <= prefill_inbox_hi && len <= prefill_inbox_hi - offset);
  }
  // A flag store lands on an aligned word of the flag page.
  ARX_HD bool is_flag(uint64_t offset) const {
    return offset >= flags && offset < flags + 8 * kFlagWords && (offset - flags) % 8 == 0;
  }
};

}  // namespace arx

// The all-reduce kernels: one-shot (one kernel, one seq) and two-shot (mesh:
// a reduce-scatter kernel, then an all-gather kernel, a seq each). The steps
// are those of ffi/host/collectives.cc, and so are the bits: the sum is fp32
// in rank order starting from 0.0f, rounded once with the same rounding.
//
// One seq, in one grid of blocks:
//   1. every block copies its share of the partial into send[seq & 1], or,
//      in direct mode (shm carrier: the peers' regions are mapped here),
//      straight into every peer's recv[seq & 1][rank];
//   2. block 0 waits for the others' copies and publishes seq (direct mode:
//      the flag words into the peers' flags, with release, as a carrier
//      stores them; then bytes, mode, descriptor, dtype and `published` with
//      release, for the proxy) unless an earlier seq failed;
//   3. block 0 waits for every peer's flag on every root to reach seq, bounded
//      by the timeout in %globaltimer time and by Control::abort, and tells the
//      other blocks the outcome through the `go` word; the others wait on that
//      word in device memory, so only a few threads poll lines that the proxy
//      (or a NIC) is writing;
//   4. every block sums its share (or, if the seq failed, fills it with NaN);
//   5. the last block out stores seq_dev and Control::done.
//
// In direct mode the one-shot can instead go chunk by chunk, a flag per
// chunk, with no wait between blocks (oneshot_pipe_kernel, "the pipelined
// one-shot" below), or, at small sizes, in 16-byte lines that carry their
// flags inside the data, one bus trip each way (oneshot_ll_kernel, "the LL
// one-shot" below); ll_oneshot() and pipeline_chunks() decide which, per size.
// Where the inboxes live (DeviceView::peer_memory: in the receiving GPU's
// memory, mapped into the senders' GPUs, or in the pinned host region)
// changes none of the steps nor their proofs: every store to a peer and
// every wait is at system scope, which covers both.
//
// seq_dev (DeviceWords::seq) is read at kernel start and advanced by the last
// block out, so a CUDA graph that captured these kernels replays with the
// right seq: the launch path keeps no state on the host.
//
// Buffer reuse. Two buffers by parity are enough: this rank reaches seq + 2
// only after every peer consumed seq + 1, which needed this rank's seq + 1
// flag, which the proxy posts after this rank's seq data was read. The
// two-shot kernels lean on one more consequence: once the wait for seq is
// over, every peer published seq, so every peer had finished seq - 1, so
// every peer had received this rank's seq - 1 flags on every root, so the
// proxy had read everything it sent from send[(seq - 1) & 1]. The
// reduce-scatter kernel for seq therefore writes its summed chunk straight
// into send[(seq + 1) & 1] after its wait, and the all-gather kernel for
// seq + 1 publishes it without another copy.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "cuda/device_side.h"
#include "cuda/elements.cuh"
#include "cuda/grid.cuh"
#include "cuda/ptx.cuh"

namespace arx::cuda {
namespace {

constexpr int kThreads = 512;
// Vectors a thread sums per sweep, every load in flight before the first
// add. Measured on 2 H200s over PCIe (direct shm writes), 2 with one vector
// a thread and up to 64 blocks was slower than 1 with two vectors a thread
// and up to 32 blocks, at every size from 64 KB to 4 MB (e.g. 512 KB: 101
// against 70 us).
constexpr int kUnroll = 1;

// dst[0, bytes) = src[0, bytes), over the whole grid. 16-byte vectors where
// both sides allow, 2-byte units for the rest (every length here is a
// multiple of the element size, which is 2 or 4). `cv`: src was written by a
// peer, read it past the caches.
template <bool kCv>
__device__ void copy_bytes(uint8_t* dst, const uint8_t* src, uint64_t bytes) {
  const uint64_t nvec = aligned16(dst) && aligned16(src) ? bytes / 16 : 0;
  for (uint64_t i = global_thread(); i < nvec; i += grid_threads()) {
    const uint4 v = kCv ? ld_cv_v4(src + 16 * i) : *reinterpret_cast<const uint4*>(src + 16 * i);
    *reinterpret_cast<uint4*>(dst + 16 * i) = v;
  }
  for (uint64_t i = nvec * 8 + global_thread(); i < bytes / 2; i += grid_threads()) {
    const uint16_t h = kCv ? ld_cv_u16(src + 2 * i) : *reinterpret_cast<const uint16_t*>(src + 2 * i);
    *reinterpret_cast<uint16_t*>(dst + 2 * i) = h;
  }
}

template <DType D>
__device__ void fill_nan(uint8_t* out, uint64_t count) {
  using E = Elem<D>;
  for (uint64_t i = global_thread(); i < count; i += grid_threads()) {
    if (E::kSize == 4) *reinterpret_cast<uint32_t*>(out + 4 * i) = E::kNan;
    else *reinterpret_cast<uint16_t*>(out + 2 * i) = (uint16_t)E::kNan;
  }
}

// out[e] (and also[e], if given) = fp32 sum in rank order of every rank's
// element e, for e in [0, count): this rank's from `mine` (device memory),
// each peer's from its slot, slots + src * slot_bytes (pinned, written by
// the proxy).
// Rank order and one rounding give every rank the same bits.
template <DType D>
__device__ void reduce(const DeviceView& v, const uint8_t* slots, const uint8_t* mine, uint8_t* out, uint8_t* also,
                       uint64_t count) {
  using E = Elem<D>;
  const uint64_t bytes = count * E::kSize;
  const bool vec = aligned16(mine) && aligned16(out) && (!also || aligned16(also));
  const uint64_t nvec = vec ? bytes / 16 : 0;
  // Each thread takes kUnroll vectors a sweep and has every load of them in
  // flight before the first add: the peers' data is a bus round trip away.
  const uint64_t stride = grid_threads();
  for (uint64_t i0 = global_thread(); i0 < nvec; i0 += kUnroll * stride) {
    uint4 part[kUnroll][kMaxWorld];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = i0 + u * stride;
#pragma unroll
      for (int src = 0; src < kMaxWorld; ++src)
        if (src < v.world && i < nvec)
          part[u][src] = src == v.rank ? *reinterpret_cast<const uint4*>(mine + 16 * i)
                                       : ld_cv_v4(slots + src * v.slot_bytes + 16 * i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const uint64_t i = i0 + u * stride;
      if (i >= nvec) break;
      const uint4 o = sum_rank_order<D>(part[u], v.world);
      *reinterpret_cast<uint4*>(out + 16 * i) = o;
      if (also) *reinterpret_cast<uint4*>(also + 16 * i) = o;
    }
  }
  for (uint64_t e = nvec * E::kPerVec + global_thread(); e < count; e += grid_threads()) {
    float acc = 0.0f;
    for (int src = 0; src < v.world; ++src)
      acc = __fadd_rn(acc, src == v.rank ? E::load(mine + e * E::kSize) : E::load_cv(slots + src * v.slot_bytes + e * E::kSize));
    E::store(out + e * E::kSize, acc);
    if (also) E::store(also + e * E::kSize, acc);
  }
}

// ---- the steps of one seq -------------------------------------------------------

struct Outcome {
  bool failed;     // the seq failed: fill NaN
  bool published;  // this rank published the seq (Control::done follows it)
};

// Steps 2 and 3 for every block; returns the outcome every block agrees on.
// Every thread of the grid must call it.
__device__ Outcome publish_and_wait(const DeviceView& v, uint64_t seq, Mode mode, DType dtype, uint64_t bytes,
                                    uint64_t desc, const Prefetch* pf) {
  __shared__ int s_failed, s_published, s_kind;
  __shared__ unsigned long long s_missing;
  __shared__ uint64_t s_bad_flag, s_bad_src;
  Control* ctl = v.ctl;
  DeviceWords* w = v.words;
  // The partial reaches system scope before any flag that announces it.
  fence_sys();
  __syncthreads();
  const uint64_t start = globaltimer();
  if (blockIdx.x != 0) {
    if (threadIdx.x == 0) tagged_arrive(&w->arrived, seq);
  } else if (threadIdx.x == 0) {
    s_missing = 0;
    s_kind = (int)FailureKind::kNone;
    s_published = 0;
    // Wait for every other block's copy (they run alongside: the grid is a
    // few blocks on a GPU of a hundred multiprocessors).
    bool copied = gridDim.x == 1;
    while (!copied) {
      const unsigned long long a = ld_acquire_gpu(&w->arrived);
      copied = a >> 16 == seq && (a & 0xffff) == gridDim.x - 1;
      if (!copied && globaltimer() - start > v.timeout_ns) break;
    }
    // No fence here: every thread fenced its copies before the barrier, and
    // the arrivals chain them to this thread (acq_rel); the release stores
    // below carry them on.
    if (!copied) {
      s_kind = (int)FailureKind::kTimeout;  // blocks of this grid never ran: nothing was published
    } else if (recorded_failure(v)) {
      // An earlier seq failed: publish nothing, return at once. (A failure
      // the host knows of, Control::abort, ends the wait below at its first
      // look; reading it here would put a round trip over the bus on every
      // call's path.)
      s_kind = (int)FailureKind::kAborted;
    } else {
      if (v.direct) {
        // Direct mode: this grid's copies into the peers' inboxes are at
        // system scope (each thread's fence, then the blocks' arrivals), so
        // the flags may follow, with release, as a carrier would store them.
        const uint64_t f = flag_word(seq, desc);
        for (int step = 1; step < v.world; ++step) {
          const int peer = (v.rank + step) % v.world;
          for (int root = 0; root < v.roots; ++root) st_release_sys(v.peer_flags[peer] + flag_index(v.rank, root), f);
        }
      }
      const int par = (int)(seq & 1);
      st_relaxed_sys(&ctl->bytes[par], bytes);
      st_relaxed_sys(&ctl->mode[par], (uint64_t)mode);
      st_relaxed_sys(&ctl->desc[par], desc);
      st_relaxed_sys(&ctl->dtype[par], (uint64_t)dtype);
      st_release_sys(&ctl->published, seq);
      s_published = 1;
    }
  }
  // DRAM is idle while the peers' data is in flight: spread one bulk L2
  // prefetch per thread over each range the next kernels read.
  if (pf && pf->count > 0) {
    const uint64_t nthr = grid_threads(), t = global_thread();
    for (int r = 0; r < pf->count; ++r) {
      const uint64_t chunk = ((pf->bytes[r] + nthr - 1) / nthr + 15) & ~15ull, off = t * chunk;
      if (off >= pf->bytes[r]) continue;
      const uint64_t len = min(chunk, pf->bytes[r] - off) & ~15ull;
      for (uint64_t o = 0; o < len; o += 1u << 20)  // the instruction takes a 32-bit size
        prefetch_l2(static_cast<const uint8_t*>(pf->ptr[r]) + off + o, (uint32_t)min(len - o, (uint64_t)1 << 20));
    }
  }
  if (blockIdx.x == 0) {
    __syncthreads();
    const int nflags = v.world * kRoots;
    const int t = threadIdx.x, src = t / kRoots, root = t % kRoots;
    if (s_published && t < nflags && src != v.rank && root < v.roots) {
      // Wait until the flag reaches seq. A flag at exactly seq must carry our
      // descriptor. A flag past seq is from a peer that already finished seq,
      // which it could only do after agreeing with ours (it checked our seq
      // flag): it counts as arrived, and its seq + 1 data went to the other
      // parity, so recv[seq & 1] still holds seq's.
      const uint64_t* flag = v.flags + flag_index(src, root);
      for (uint32_t turn = 0;; ++turn) {
        const uint64_t f = ld_acquire_sys(flag);
        if (flag_progress(f) >= seq) {
          if (flag_progress(f) == seq && flag_desc(f) != flag_desc(flag_word(seq, desc))) {
            if (atomicCAS(&s_kind, (int)FailureKind::kNone, (int)FailureKind::kMismatch) ==
                (int)FailureKind::kNone) {
              s_bad_flag = f;
              s_bad_src = (uint64_t)src;
            }
          }
          break;
        }
        // Control::abort: the host knows the endpoint failed (a peer lost,
        // the proxy stopped); give up at once instead of at the timeout.
        if ((turn & 15) == 15 && ld_acquire_sys(&ctl->abort) != 0) {
          atomicOr(&s_missing, 1ull << flag_index(src, root));
          atomicCAS(&s_kind, (int)FailureKind::kNone, (int)FailureKind::kAborted);
          break;
        }
        if (globaltimer() - start > v.timeout_ns) {
          atomicOr(&s_missing, 1ull << flag_index(src, root));
          break;
        }
      }
    }
    __syncthreads();
    if (t == 0) {
      int kind = s_kind;
      if (kind == (int)FailureKind::kNone && s_missing) kind = (int)FailureKind::kTimeout;
      // The first failure is the one kept: its details first, failed_seq
      // last with release, as the host side records it. A failure known
      // before this seq (kAborted with nothing published) records nothing
      // new; blocks of this grid that never ran (kTimeout, nothing
      // published) do.
      if (kind != (int)FailureKind::kNone && (s_published || kind == (int)FailureKind::kTimeout))
        record_failure(v, seq, 0, (uint64_t)kind, s_missing, s_bad_flag, s_bad_src, desc);
      s_failed = kind != (int)FailureKind::kNone;
      // Later kernels of this endpoint read this instead of failed_seq (a
      // round trip over the bus). Any failure counts: after it the buffer
      // reuse argument no longer holds, so nothing more may be published.
      if (s_failed) w->failed = 1;
      // The peers' data (read next by every block) happens-before this
      // release through the flags' acquire loads above.
      st_release_gpu(&w->go, seq * 4 + (s_failed ? 1 : 0) + (s_published ? 2 : 0));
    }
    __syncthreads();
    return Outcome{s_failed != 0, s_published != 0};
  }
  // The other blocks: one thread polls the go word in device memory. Bounded
  // as well, past block 0's own bound, in case block 0 never ran.
  if (threadIdx.x == 0) {
    s_failed = 1;
    s_published = 0;
    while (true) {
      const unsigned long long g = ld_acquire_gpu(&w->go);
      if (g >> 2 == seq) {
        s_failed = (int)(g & 1);
        s_published = (int)((g >> 1) & 1);
        break;
      }
      if (g >> 2 > seq || globaltimer() - start > 2 * v.timeout_ns + 1000000000ull) break;
    }
  }
  __syncthreads();
  return Outcome{s_failed != 0, s_published != 0};
}

// Step 5: the last block out advances seq_dev and Control::done. Every
// thread of the grid must call it.
__device__ void finish(const DeviceView& v, uint64_t seq, Outcome o) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  const unsigned long long n = tagged_arrive(&v.words->finished, seq);
  if (n >> 16 != seq || (n & 0xffff) != gridDim.x) return;
  // seq_dev advances on every launch, failed or not, so the grid's counters
  // stay consistent and the GPU stays usable; the endpoint's failure is
  // sticky, so a failed endpoint publishes nothing more.
  v.words->seq = seq;
  // done is for the watchdog and for messages: nothing is read on its
  // strength, so it needs no fence on the kernel's path.
  if (o.published) st_relaxed_sys(&v.ctl->done, seq);
}

__device__ __forceinline__ uint64_t next_seq(const DeviceView& v) {
  // Written by the previous kernel's last block; kernels on one stream are
  // ordered, so a plain load sees it.
  return v.words->seq + 1;
}

// ---- the kernels ------------------------------------------------------------------

template <DType D>
__global__ void __launch_bounds__(kThreads, 1) oneshot_kernel(DeviceView v, const uint8_t* in, uint8_t* out,
                                                              uint64_t count, uint64_t tag, Prefetch pf) {
  using E = Elem<D>;
  const uint64_t seq = next_seq(v), bytes = count * E::kSize;
  const int par = (int)(seq & 1);
  if (v.direct) {
    // Straight into every peer's recv[par][rank]: free, since the peer
    // finished seq - 2 (which read it) before it sent the seq - 1 flag this
    // rank waited for before this kernel started. That holds only if seq - 1
    // succeeded: after a failure (recorded by an earlier kernel, so every
    // block sees it) nothing is written to the peers.
    if (!recorded_failure(v)) {
      for (int step = 1; step < v.world; ++step) {
        const int peer = (v.rank + step) % v.world;
        copy_bytes<false>(v.peer_recv[peer] + ((uint64_t)par * v.world + v.rank) * v.slot_bytes, in, bytes);
      }
    }
  } else {
    copy_bytes<false>(v.send + (uint64_t)par * v.send_bytes, in, bytes);
  }
  const Outcome o = publish_and_wait(v, seq, Mode::kFull, D, bytes, describe(Mode::kFull, D, count, tag), &pf);
  if (o.failed) {
    fill_nan<D>(out, count);
  } else {
    const uint8_t* slots = v.recv + (uint64_t)par * v.world * v.slot_bytes;
    // This rank's partial from `in` (device memory), not from its pinned copy.
    // With in == out each element is read and then written by one thread.
    reduce<D>(v, slots, in, out, nullptr, count);
  }
  finish(v, seq, o);
}

// Two-shot, first kernel: sends chunk j of the partial to rank j (published
// as a scatter for the proxy, or written directly), sums this rank's chunk
// from every rank, and writes it to out (and, for the proxy, to the
// all-gather's send buffer).
template <DType D>
__global__ void __launch_bounds__(kThreads, 1) scatter_kernel(DeviceView v, const uint8_t* in, uint8_t* out,
                                                              uint64_t count, uint64_t tag, Prefetch pf) {
  using E = Elem<D>;
  const uint64_t seq = next_seq(v), bytes = count * E::kSize;
  const int par = (int)(seq & 1);
  if (v.direct) {
    if (!recorded_failure(v)) {  // see oneshot_kernel
      for (int step = 1; step < v.world; ++step) {  // chunk j to rank j only
        const int peer = (v.rank + step) % v.world;
        uint64_t lo, hi;
        chunk_range(bytes, v.world, peer, lo, hi);
        copy_bytes<false>(v.peer_recv[peer] + ((uint64_t)par * v.world + v.rank) * v.slot_bytes, in + lo, hi - lo);
      }
    }
  } else {
    copy_bytes<false>(v.send + (uint64_t)par * v.send_bytes, in, bytes);
  }
  const Outcome o = publish_and_wait(v, seq, Mode::kScatter, D, bytes, describe(Mode::kScatter, D, count, tag), &pf);
  if (o.failed) {
    fill_nan<D>(out, count);
  } else {
    uint64_t lo, hi;
    chunk_range(bytes, v.world, v.rank, lo, hi);
    const uint8_t* slots = v.recv + (uint64_t)par * v.world * v.slot_bytes;
    // send[(seq + 1) & 1] is free once the wait for seq is over (see the
    // top). Direct mode needs no copy there: the all-gather sends from out.
    uint8_t* next_send = v.direct ? nullptr : v.send + (uint64_t)(par ^ 1) * v.send_bytes;
    reduce<D>(v, slots, in + lo, out + lo, next_send, (hi - lo) / E::kSize);
    if (next_send) fence_sys();  // the summed chunk reaches system scope before the next kernel publishes it
  }
  finish(v, seq, o);
}

// Two-shot, second kernel: publishes this rank's summed chunk (already in
// send[par]) as a gather, and assembles the peers' chunks into out.
template <DType D>
__global__ void __launch_bounds__(kThreads, 1) gather_kernel(DeviceView v, uint8_t* out, uint64_t count,
                                                             uint64_t tag) {
  using E = Elem<D>;
  const uint64_t seq = next_seq(v), bytes = count * E::kSize;
  const int par = (int)(seq & 1);
  uint64_t lo, hi;
  chunk_range(bytes, v.world, v.rank, lo, hi);
  if (v.direct) {
    // This rank's summed chunk, from out (the reduce-scatter kernel wrote
    // it), into every peer's recv[par][rank] (see oneshot_kernel).
    if (!recorded_failure(v)) {
      for (int step = 1; step < v.world; ++step) {
        const int peer = (v.rank + step) % v.world;
        copy_bytes<false>(v.peer_recv[peer] + ((uint64_t)par * v.world + v.rank) * v.slot_bytes, out + lo, hi - lo);
      }
    }
  }
  // A failed reduce-scatter (seq - 1) recorded its failure, so this
  // publishes nothing and fills NaN.
  const Outcome o = publish_and_wait(v, seq, Mode::kGather, D, hi - lo, describe(Mode::kGather, D, count, tag), nullptr);
  if (o.failed) {
    fill_nan<D>(out, count);
  } else {
    for (int src = 0; src < v.world; ++src) {
      if (src == v.rank) continue;  // already in out
      chunk_range(bytes, v.world, src, lo, hi);
      copy_bytes<true>(out + lo, v.recv + ((uint64_t)par * v.world + src) * v.slot_bytes, hi - lo);
    }
  }
  finish(v, seq, o);
}

// ---- the pipelined one-shot (direct mode) -----------------------------------------
//
// Direct mode, chunk by chunk. The partial is cut into `chunks` chunks
// (chunk_range over the chunk count), and block b of B takes chunks b,
// b + B, b + 2B, ...; one more block, the service block, does what belongs to
// the seq as a whole. For each of its chunks c, block b
//   1. copies chunk c of the partial into every peer's recv[seq & 1][rank];
//   2. fences (one thread, after the block's barrier: release is cumulative)
//      and stores its flag for (this rank, chunk c), flag_word(seq, desc),
//      into every peer's flags at psum_chunk_flag_index, as a carrier would;
//   3. waits for every peer's flag for (peer, chunk c) to reach seq, bounded
//      as publish_and_wait's wait is (%globaltimer, Control::abort), one
//      thread per peer polling;
//   4. sums chunk c (or fills it with NaN if the wait gave up).
// A block with several chunks splits its threads: half copy and flag chunk
// after chunk (the producers), half wait and sum chunk after chunk (the
// consumers), so that the writes to the peers (out of the GPU) overlap the
// reads of the peers' data (into it). No block waits for another: chunk c's
// path depends on no other chunk.
// The service block publishes the seq (bytes, mode, desc, dtype, then
// `published` with release) for the proxy's watchdog, and asks L2 for the
// prefetch ranges. The last block out of all B + 1 settles the seq for the
// grid: if any block gave up (DeviceWords::fail_*), it records the failure as
// publish_and_wait does (details first, failed_seq last with release), fills
// the whole output with NaN and marks the endpoint failed; else it stores the
// seq-level flags into the peers (flag_index: read only by the watchdog and
// the failure messages, which print what each peer last sent, so a relaxed
// store does). Either way it advances seq_dev and Control::done.
//
// Buffer reuse: parity is enough, for a reason at the level of the seq, not
// of the chunk. This rank writes chunk c of seq + 2 into a peer's
// recv[seq & 1][rank] only in its kernel for seq + 2, which starts after its
// kernel for seq + 1 completed. That kernel did not fail (after a failure
// nothing more is written), so its blocks acquired the peer's chunk flags
// for seq + 1 -- one would do: the peer stores a flag for seq + 1 only from
// its kernel for seq + 1, which starts after its kernel for seq completed,
// and with it every block's reads of recv[seq & 1], every chunk's. So the
// peer is done with all of seq, not just chunk c, before this rank writes
// any chunk of seq + 2. The argument needs an endpoint's kernels not to
// overlap (stream order): were they to overlap (programmatic dependent
// launch), a per-chunk version would not hold, since the peer's chunk-c flag
// for seq + 1 says nothing about its reads of another chunk for seq.
// A chunk flag past seq is from a peer that finished seq (its kernel for
// seq + 1 started after its kernel for seq completed, which needed this
// rank's chunk flags for seq): it counts as arrived, and the peer's seq + 1
// data went to the other parity, so recv[seq & 1] still holds seq's chunk c,
// visible here (the peer fenced it before its seq flag, and the seq + 1 flag
// comes after that). It cannot be past seq + 1: the peer's seq + 1 needs
// this rank's seq + 1 flags.
//
// Agreement: sender and receiver must cut the partial alike. The chunk count
// is a function of the size, the world, Config::cuda_chunk_bytes and
// DeviceView::peer_memory only (pipeline_chunks; the ranks agree on
// peer_memory at set-up), and it goes into the descriptor (pipe_tag), so a peer
// that cut differently, or did not pipeline, shows up as a mismatch (or a
// timeout), never as a wrong sum.

// Chunks of about this size when Config::cuda_chunk_bytes is 0. Measured on
// 2 H200s in one run (examples/bench_psum.py, bf16, 2 processes, jax_arx.psum,
// us at 8 KB / 64 KB / 256 KB / 512 KB / 2 MB / 4 MB):
//   16 KiB chunks            12.8 / 15.5 / 30.0 / 45.8 / 97.3 / 167.3
//   8 KiB chunks             11.8 / 18.3 / 38.1 / 51.2 / 96.5 / 166.9
//   one piece (oneshot_kernel) 12.5 / 21.9 / 41.5 / 71.3 / 132.3 / 212.8
//   NCCL (NVLink)            18.0 / 16.3 / 33.9 / 19.7 / 28.5 / 42.5
//   NCCL, NCCL_P2P_DISABLE=1 18.8 / 19.0 / 39.5 / 49.6 / 99.9 / 170.6
// At 8 KB, 2 MB and 4 MB both chunk sizes cut alike (one chunk; the cap of
// 128 chunks at world 2), so those differences are noise. Fewer, fatter
// blocks won at 64 KB - 512 KB (16 KiB: 4 / 16 / 32 blocks of one chunk;
// 8 KiB: 8 / 32 blocks, then 32 split blocks of two chunks).
// Those are inboxes in the host region. With the inboxes in GPU memory
// (DeviceView::peer_memory, NVLink here), fatter chunks won again, and by
// more. Same benchmark, one run, us at 8 KB / 16 KB / 32 KB / 64 KB /
// 128 KB / 256 KB (at 8 and 16 KB every series but the second is the LL
// one-shot, so those columns are noise):
//   16 KiB chunks            8.7 / 9.4 / 9.3 / 12.0 / 14.8 / 26.2
//   16 KiB chunks, LL off    8.7 / 8.6 / 11.4 / 11.4 / 13.4 / 28.1
//   32 KiB chunks            7.2 / 8.1 / 10.6 / 10.5 / 12.2 / 14.8
//   8 KiB chunks             8.4 / 10.4 / 12.0 / 13.1 / 25.5 / 51.8
//   4 KiB chunks             8.0 / 9.0 / 12.8 / 26.6 / 49.8 / 51.4
//   NCCL (NVLink)            14.1 / 15.1 / 14.8 / 15.5 / 20.2 / 16.1
// With GPU inboxes, after the counting fix (grid.cuh, tag_arrivals: each
// block had cost about 1 us more), one run, us at 256 KB / 512 KB / 2 MB /
// 4 MB (below 256 KB the default is LL now):
//   32 KiB chunks            10.5 / 11.3 / 22.4 / 33.5
//   8 KiB chunks             12.2 / 10.8 / 21.8 / 33.2
//   4 KiB chunks             10.0 / 16.1 / 21.4 / 33.2
// so 32 KiB stays.
constexpr uint64_t kPipeChunkBytes = 16 << 10;
constexpr uint64_t kPipeChunkBytesPeerMemory = 32 << 10;
// Blocks besides the service block: chunks beyond this many are taken in
// turns (split blocks, see above).
constexpr int kPipeBlocks = 32;
static_assert(kPipeBlocks + 1 <= (int)0xff, "pipe_finish counts the blocks out in 8 bits");
// Vectors a consumer thread has in flight from each peer before the adds.
constexpr int kPipeUnroll = 2;

// The call site's tag with the chunk count mixed in (see "Agreement").
__host__ __device__ inline uint64_t pipe_tag(uint64_t tag, int chunks) {
  return tag ^ (0x5851F42D4C957F2Dull * (uint64_t)(chunks + 1));
}

// dst[0, bytes) = src[0, bytes) by thread t of n threads of one block; src in
// device memory. Up to four loads in flight before their stores, also when
// a thread has fewer than four vectors (a 16 KiB chunk is two a thread).
__device__ void copy_chunk(uint8_t* dst, const uint8_t* src, uint64_t bytes, int t, int n) {
  const uint64_t nvec = aligned16(dst) && aligned16(src) ? bytes / 16 : 0;
  const uint64_t step = (uint64_t)n;
  for (uint64_t i = (uint64_t)t; i < nvec; i += 4 * step) {
    uint4 a[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (i + u * step < nvec) a[u] = *reinterpret_cast<const uint4*>(src + 16 * (i + u * step));
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (i + u * step < nvec) *reinterpret_cast<uint4*>(dst + 16 * (i + u * step)) = a[u];
  }
  for (uint64_t j = nvec * 8 + t; j < bytes / 2; j += step)
    *reinterpret_cast<uint16_t*>(dst + 2 * j) = *reinterpret_cast<const uint16_t*>(src + 2 * j);
}

// out[lo, hi) = NaN; lo and hi in bytes, multiples of the element size.
template <DType D>
__device__ void fill_nan_range(uint8_t* out, uint64_t lo, uint64_t hi, int t, int n) {
  using E = Elem<D>;
  for (uint64_t e = lo / E::kSize + t; e < hi / E::kSize; e += n) {
    if (E::kSize == 4) *reinterpret_cast<uint32_t*>(out + 4 * e) = E::kNan;
    else *reinterpret_cast<uint16_t*>(out + 2 * e) = (uint16_t)E::kNan;
  }
}

// reduce() for bytes [lo, hi) of the partial, by thread t of n threads of
// one block; lo is a multiple of 16 (chunk_range), hi of the element size.
// The same sum: fp32 in rank order from 0.0f, rounded once.
template <DType D>
__device__ void reduce_range(const DeviceView& v, const uint8_t* slots, const uint8_t* mine, uint8_t* out, uint64_t lo,
                             uint64_t hi, int t, int n) {
  using E = Elem<D>;
  const uint64_t step = (uint64_t)n;
  const uint64_t nvec = aligned16(mine) && aligned16(out) ? (hi - lo) / 16 : 0;
  for (uint64_t i0 = (uint64_t)t; i0 < nvec; i0 += kPipeUnroll * step) {
    uint4 part[kPipeUnroll][kMaxWorld];
#pragma unroll
    for (int u = 0; u < kPipeUnroll; ++u) {
      const uint64_t at = lo + 16 * (i0 + u * step);
#pragma unroll
      for (int src = 0; src < kMaxWorld; ++src)
        if (src < v.world && i0 + u * step < nvec)
          part[u][src] = src == v.rank ? *reinterpret_cast<const uint4*>(mine + at)
                                       : ld_cv_v4(slots + src * v.slot_bytes + at);
    }
#pragma unroll
    for (int u = 0; u < kPipeUnroll; ++u) {
      const uint64_t i = i0 + u * step;
      if (i >= nvec) break;
      const uint4 o = sum_rank_order<D>(part[u], v.world);
      *reinterpret_cast<uint4*>(out + lo + 16 * i) = o;
    }
  }
  for (uint64_t e = (lo + 16 * nvec) / E::kSize + t; e < hi / E::kSize; e += step) {
    float acc = 0.0f;
    for (int src = 0; src < v.world; ++src)
      acc = __fadd_rn(acc, src == v.rank ? E::load(mine + e * E::kSize)
                                         : E::load_cv(slots + src * v.slot_bytes + e * E::kSize));
    E::store(out + e * E::kSize, acc);
  }
}

// Step 3 for one (peer, chunk): waits until the peer's flag for chunk c
// reaches seq. false: this block gives up on the seq (see give_up_mismatch).
__device__ bool wait_chunk(const DeviceView& v, uint64_t seq, uint64_t desc, int src, int c, uint64_t start) {
  const uint64_t* flag = v.chunk_flags + psum_chunk_flag_index(src, c, v.world);
  unsigned long long missing = 0;
  for (int root = 0; root < v.roots; ++root) missing |= 1ull << flag_index(src, root);
  for (uint32_t turn = 0;; ++turn) {
    const uint64_t f = ld_acquire_sys(flag);
    if (flag_progress(f) >= seq) {
      // Past seq counts as arrived (see the top of this section); at exactly
      // seq it must carry our descriptor.
      if (flag_progress(f) == seq && flag_desc(f) != flag_desc(flag_word(seq, desc))) {
        give_up_mismatch(v.words, f, src);
        return false;
      }
      return true;
    }
    if (!keep_waiting(v, turn, start, missing)) return false;
  }
}

// The seq-level flag words, flag_word(seq, desc), into every peer's flags
// (flag_index(rank, root), every root), in send order, relaxed: the pipelined
// one-shot stores them after its last wait, for the watchdog and the failure
// messages only.
__device__ void store_seq_flags(const DeviceView& v, uint64_t seq, uint64_t desc) {
  const uint64_t f = flag_word(seq, desc);
  for (int step = 1; step < v.world; ++step) {
    const int peer = (v.rank + step) % v.world;
    for (int root = 0; root < v.roots; ++root) st_relaxed_sys(v.peer_flags[peer] + flag_index(v.rank, root), f);
  }
}

// The service block's part: publish the seq for the proxy's watchdog unless
// an earlier seq failed, and spread the L2 prefetches over the block. These
// kernels run in direct mode only, where the proxy sends nothing and reads
// nothing but `published` (it only follows the seqs): the seq alone,
// relaxed. (A release there, with bytes, mode, desc and dtype before it as
// publish_and_wait stores them for a proxy that sends, was a fence on every
// call's path.)
__device__ void pipe_service(const DeviceView& v, uint64_t seq, bool prior, const Prefetch& pf) {
  if (threadIdx.x == 0 && !prior) st_relaxed_sys(&v.ctl->published, seq);
  const uint64_t nthr = blockDim.x, t = threadIdx.x;
  for (int r = 0; r < pf.count; ++r) {
    const uint64_t chunk = ((pf.bytes[r] + nthr - 1) / nthr + 15) & ~15ull, off = t * chunk;
    if (off >= pf.bytes[r]) continue;
    const uint64_t len = min(chunk, pf.bytes[r] - off) & ~15ull;
    for (uint64_t o = 0; o < len; o += 1u << 20)  // the instruction takes a 32-bit size
      prefetch_l2(static_cast<const uint8_t*>(pf.ptr[r]) + off + o, (uint32_t)min(len - o, (uint64_t)1 << 20));
  }
}

// What the pipelined and LL one-shots begin with, in every block: the seq,
// its parity and descriptor (`tag`: the call site's, with the algorithm's
// mixed in), the start of the waits' bounds in %globaltimer time, and
// whether an earlier seq failed (`prior`: recorded by an earlier kernel, so
// every block sees it; then nothing is written to the peers nor waited
// for, and the output is NaN). Thread 0 of each block tags
// DeviceWords::finished for the seq (pipe_finish counts on it).
struct PipeSeq {
  uint64_t seq;
  int par;
  uint64_t desc, start;
  bool prior;
};

template <DType D>
__device__ PipeSeq pipe_begin(const DeviceView& v, uint64_t count, uint64_t tag) {
  const uint64_t seq = next_seq(v);
  if (threadIdx.x == 0) tag_arrivals(&v.words->finished, seq);
  return PipeSeq{seq, (int)(seq & 1), describe(Mode::kFull, D, count, tag), globaltimer(), recorded_failure(v)};
}

// DeviceWords::finished of the pipelined and LL one-shots: seq << 16, then
// the blocks that gave up on the seq, then the blocks out, so that the last
// block out learns both from its own arrival (grids of 255 blocks at most).
constexpr unsigned long long kFinishedMask = 0xff, kGaveUpUnit = 1ull << 8, kGaveUpMask = 0xffull << 8;

// Every block, at the end: the last one out settles the seq (see the top of
// this section). Every thread of the block must call it, and every block
// must have begun with pipe_begin (which tags DeviceWords::finished).
// `gave_up`: this thread's wait gave up on the seq (not an earlier seq's
// failure, `prior`). `flags_first`: the seq-level flag words are stored
// already (the LL one-shot).
template <DType D>
__device__ void pipe_finish(const DeviceView& v, uint64_t seq, uint64_t desc, bool prior, bool gave_up,
                            bool flags_first, uint8_t* out, uint64_t count) {
  __shared__ int s_last, s_any;
  DeviceWords* w = v.words;
  const int block_gave_up = __syncthreads_or(gave_up);
  if (threadIdx.x == 0) {
    // acq_rel: this block's work (and fail_* stores) before it, every other
    // block's after it for the last one.
    const unsigned long long n = count_arrival(&w->finished, block_gave_up ? kGaveUpUnit + 1 : 1);
    s_last = n >> 16 == seq && (n & kFinishedMask) == gridDim.x;
    s_any = s_last && (n & kGaveUpMask) != 0;
  }
  __syncthreads();
  if (!s_last) return;
  // A block gave up: the whole output is NaN, whatever the other blocks
  // summed (they are all done: they arrived before this block).
  if (s_any) fill_nan_range<D>(out, 0, count * Elem<D>::kSize, threadIdx.x, blockDim.x);
  if (threadIdx.x != 0) return;
  Control* ctl = v.ctl;
  if (s_any) {
    const unsigned long long found = ld_acquire_gpu(&w->fail_kind), missing = ld_acquire_gpu(&w->fail_missing);
    const uint64_t kind = found ? found : (uint64_t)FailureKind::kTimeout;
    // Nothing was waited for after an earlier failure (prior), so a failure
    // here always belongs to a seq this rank published.
    if (!prior) record_failure(v, seq, 0, kind, missing, w->fail_flag, w->fail_src, desc);
    w->failed = 1;  // sticky: nothing more is published (see "Buffer reuse")
    // Cleared for the next grid, which starts after this one completed.
    w->fail_any = w->fail_kind = w->fail_missing = w->fail_flag = w->fail_src = 0;
  } else if (!prior && !flags_first) {
    store_seq_flags(v, seq, desc);
  }
  v.words->seq = seq;
  if (!prior) st_relaxed_sys(&ctl->done, seq);  // for the watchdog: nothing is read on its strength
}

template <DType D>
__global__ void __launch_bounds__(kThreads, 1) oneshot_pipe_kernel(DeviceView v, const uint8_t* in, uint8_t* out,
                                                                   uint64_t count, uint64_t tag, Prefetch pf,
                                                                   int chunks) {
  using E = Elem<D>;
  const uint64_t bytes = count * E::kSize;
  const auto [seq, par, desc, start, prior] = pipe_begin<D>(v, count, pipe_tag(tag, chunks));
  const int blocks = (int)gridDim.x - 1;
  if ((int)blockIdx.x == blocks) {
    pipe_service(v, seq, prior, pf);
    pipe_finish<D>(v, seq, desc, prior, false, false, out, count);
    return;
  }
  __shared__ unsigned s_sent;      // chunks of this block whose copy has read `in`
  __shared__ volatile int s_failed;  // this block gave up on the seq
  const int b = (int)blockIdx.x, t = (int)threadIdx.x;
  const int mine = (chunks - b + blocks - 1) / blocks;  // chunks b, b + blocks, ...
  const bool split = mine > 1;
  const int nprod = split ? kThreads / 2 : kThreads;
  if (t == 0) {
    s_sent = 0;
    s_failed = prior ? 1 : 0;
  }
  __syncthreads();
  const uint64_t slot = ((uint64_t)par * v.world + v.rank) * v.slot_bytes;
  if (t < nprod) {  // producers (every thread, when the block has one chunk)
    for (int k = 0; k < mine; ++k) {
      const int c = b + k * blocks;
      uint64_t lo, hi;
      chunk_range(bytes, chunks, c, lo, hi);
      if (!prior) {
        for (int step = 1; step < v.world; ++step) {  // send order: rank + 1, rank + 2, ...
          const int peer = (v.rank + step) % v.world;
          copy_chunk(v.peer_recv[peer] + slot + lo, in + lo, hi - lo, t, nprod);
        }
      }
      if (split) bar_sync(1, nprod);
      else __syncthreads();
      if (t == 0) {
        // The consumers may now overwrite chunk c of `in` (in == out).
        st_release_cta(&s_sent, (unsigned)k + 1);
        if (!prior) {
          // The producers' copies (before the barrier) reach system scope
          // before the flags that announce them: the fence is cumulative.
          fence_sys();
          const uint64_t f = flag_word(seq, desc);
          for (int step = 1; step < v.world; ++step) {
            const int peer = (v.rank + step) % v.world;
            st_relaxed_sys(v.peer_chunk_flags[peer] + psum_chunk_flag_index(v.rank, c, v.world), f);
          }
        }
      }
    }
  }
  if (!split || t >= nprod) {  // consumers (every thread, likewise)
    const int ct = split ? t - nprod : t, ncons = split ? kThreads - nprod : kThreads;
    const uint8_t* slots = v.recv + (uint64_t)par * v.world * v.slot_bytes;
    for (int k = 0; k < mine; ++k) {
      const int c = b + k * blocks;
      uint64_t lo, hi;
      chunk_range(bytes, chunks, c, lo, hi);
      // One thread per peer polls its flag (in this rank's pinned region).
      if (ct < v.world && ct != v.rank && !s_failed && !wait_chunk(v, seq, desc, ct, c, start)) s_failed = 1;
      if (ct == 0)
        while (ld_acquire_cta(&s_sent) <= (unsigned)k) __nanosleep(32);
      if (split) bar_sync(2, ncons);
      else __syncthreads();
      // The peers' chunk c happens-before this through the flags' acquire
      // loads and the barrier. After a give-up the last block out fills the
      // whole output with NaN anyway; this keeps the chunk from a wrong sum
      // meanwhile.
      if (s_failed) fill_nan_range<D>(out, lo, hi, ct, ncons);
      else reduce_range<D>(v, slots, in, out, lo, hi, ct, ncons);
    }
  }
  pipe_finish<D>(v, seq, desc, prior, s_failed && !prior, false, out, count);
}

// ---- the LL one-shot (direct mode, small sizes) -----------------------------------
//
// Direct mode, with the flags inside the data (layout.h, "The LL one-shot";
// NCCL's LL protocol). The pipelined one-shot's reader makes two bus round
// trips per chunk, one for the flag and one for the data after it, and its
// writer fences between data and flag. Here the partial goes in 16-byte
// lines, {data0, f, data1, f}, f = ll_flag(seq, desc): the reader's poll of a
// line is its read of the data, and the writer needs no fence, since each
// 8-byte half is one single-copy-atomic access (the lines are stored and
// loaded as .v2.u64: the PTX memory model treats a vector access as one
// access per element, so a half never tears; the halves may arrive apart,
// which is why each has its own copy of f).
//
// One seq, one grid: B blocks of lines (ll_grid) and one service block. Thread
// g of the B blocks' N threads owns lines g, g + N, ... (kLLLinesPerThread at
// most) of the partial, 8 payload bytes each, and for each of them
//   1. reads its 8 bytes of `in` (device memory), before anything is written
//      to `out` (in may alias out: no other thread touches these bytes);
//   2. stores the line into every peer's ll_recv[seq & 1][rank] (send order
//      rank + 1, rank + 2, ...), one relaxed system-scope 16-byte store each,
//      no fence;
//   3. polls the same line of its own ll_recv[seq & 1][src], for every peer
//      src, until both flag words equal f (ll_wait), bounded as the
//      pipelined one-shot's waits are (keep_waiting: %globaltimer,
//      Control::abort, another waiter's give-up);
//   4. zeroes the lines it consumed (see "Stale lines");
//   5. sums in rank order, fp32 from 0.0f, rounded once (the bits of
//      reduce()), and writes its 8 bytes of out (NaN if it gave up).
// The service block announces the seq to every peer (ll_announce: the
// seq-level flag word, with release), publishes the seq for the proxy's
// watchdog and asks L2 for the prefetch ranges (pipe_service), then waits
// for every peer's announcement of seq (ll_await). The last block out
// settles the seq (pipe_finish: the failure record and the NaN fill, seq_dev,
// Control::done). After an earlier failure (prior), no thread writes or
// waits for anything: each fills its lines of out with NaN.
//
// Stale lines. Invariant: while an endpoint has not failed, every line of its
// ll_recv holds 0 except lines that a peer wrote for a seq this rank has not
// finished. It holds at the start (the region is created zeroed). An LL seq
// that succeeds has consumed every line each peer wrote for it (both cut the
// partial alike: the element count and dtype are in the descriptor, which f
// carries and compares) and zeroed them, and by "Buffer reuse" the zeroing
// precedes, in coherence order, the peer's next store to those lines (it
// also follows the value it overwrites: this rank read that value first). A
// failed seq may leave lines behind, but the failure is sticky
// (DeviceWords::failed): no later kernel of this endpoint polls a line. A seq
// of another algorithm leaves no line: if the peer ran LL at it, this rank's
// wait failed (see "Mismatch"). So a line polled for seq holds 0 or what the
// peer wrote for seq, and if the peer issued another collective at seq its f
// differs (ll_flag is injective in the 24-bit descriptor for a given seq),
// so the line is never taken. Without the zeroing, a line left 128 uses of the
// slot earlier (bits 1-7 of f wrap) by the same collective, a loop's
// every-step psum, would be summed as this seq's: never acceptable.
//
// Buffer reuse: parity is enough. This rank writes its lines of seq + 2 into
// a peer's ll_recv[seq & 1][rank] only in its kernel for seq + 2, which starts
// after its kernel for seq + 1 completed. That kernel did not fail (after a
// failure nothing more is written), so it acquired a word the peer released
// in its kernel for seq + 1: the announcement (ll_await, LL), a chunk flag
// (the pipelined one-shot, whose writer fences before it) or a flag word
// (publish_and_wait), whichever algorithm seq + 1 was. That kernel of the
// peer's started after its kernel for seq completed, so every read of its
// ll_recv[seq & 1] for seq, and every zeroing store, happens before that
// release (the kernel boundary orders them before the releasing thread, and
// the release is cumulative), hence before this rank's seq + 2 lines: the
// peer finds 0 or seq + 2's lines there. The same holds for this rank's own
// ll_recv, with the roles swapped. No fence is needed at the end of the
// kernel; there was one per block until the announcement took its place, and
// it cost about 1 us at every size. As for the pipelined one-shot, the
// argument needs an endpoint's kernels not to overlap (stream order).
//
// Mismatch. A peer that issued another collective at this seq must show up
// as an error, never as a sum. Its lines never match f (above). The
// announcement is flag_word(seq, desc), desc with the LL tag in it (ll_tag),
// and the service block's wait for the peer's (ll_await) compares it:
// progress seq with another descriptor is kMismatch, and the give-up ends
// the line waits too (DeviceWords::fail_any). A peer that ran the one-piece
// or two-shot kernels at this seq stored its word with its own descriptor
// (publish_and_wait): a mismatch here, and, since our word carries the LL
// tag, one there too. A peer that ran the pipelined one-shot stores its word
// only after its waits, which wait for chunk flags this kernel never
// stores: both sides time out. Either way, a failure. A word past seq: the
// peer announced seq + 1 at the start of its next kernel, so it finished
// seq -- it read all of this rank's lines, which each thread stores before
// it polls, so this rank may well still be polling -- and its own lines for
// seq were stored before that kernel started: the next polls take them. It
// cannot be past seq + 1: the peer's seq + 1 needs this rank's seq + 1
// lines. And a peer that had failed announces nothing (prior).
//
// Agreement: both sides choose LL from the size and the config alone
// (ll_oneshot), and the tag is in the descriptor, so a peer that chose
// otherwise is a mismatch or a timeout, never a wrong sum.

// Lines a thread owns at most: every line's polls of all the peers in flight
// at once, before the first check.
constexpr int kLLLinesPerThread = 2;
static_assert(kLLMaxPayload / kLLLinePayload / kLLLinesPerThread / kThreads + 1 <= 0xff,
              "pipe_finish counts the blocks out in 8 bits");

// One line: two 8-byte halves, each a single-copy-atomic element (see the
// top of this section), relaxed at system scope: the peers (and this rank's
// zeroing) write them, and the reader must see their stores, not a cached copy.
__device__ __forceinline__ void st_line(uint8_t* p, uint64_t lo, uint64_t hi) {
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(lo), "l"(hi) : "memory");
}

__device__ __forceinline__ void ld_line(const uint8_t* p, uint64_t& lo, uint64_t& hi) {
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(lo), "=l"(hi) : "l"(p) : "memory");
}

__device__ __forceinline__ bool aligned8(const void* p) { return ((uintptr_t)p & 7) == 0; }

// Payload bytes [8 * line, 8 * line + 8) of a partial of `bytes` bytes, zero
// past its end (the padding of the last line). Elements are 2 or 4 bytes, so
// 2-byte units cover any tail and any alignment.
__device__ __forceinline__ uint2 ll_payload(const uint8_t* p, uint64_t line, uint64_t bytes, bool aligned) {
  const uint64_t at = kLLLinePayload * line;
  if (aligned && at + kLLLinePayload <= bytes) return *reinterpret_cast<const uint2*>(p + at);
  uint32_t w0 = 0, w1 = 0;
#pragma unroll
  for (int h = 0; h < 4; ++h) {
    if (at + 2 * h >= bytes) break;
    const uint32_t u = (uint32_t)*reinterpret_cast<const uint16_t*>(p + at + 2 * h) << (16 * (h & 1));
    if (h < 2) w0 |= u;
    else w1 |= u;
  }
  return make_uint2(w0, w1);
}

// The inverse: the line's payload into out, without the padding.
__device__ __forceinline__ void ll_put(uint8_t* p, uint64_t line, uint64_t bytes, bool aligned, uint2 d) {
  const uint64_t at = kLLLinePayload * line;
  if (aligned && at + kLLLinePayload <= bytes) {
    *reinterpret_cast<uint2*>(p + at) = d;
    return;
  }
#pragma unroll
  for (int h = 0; h < 4; ++h) {
    if (at + 2 * h >= bytes) break;
    *reinterpret_cast<uint16_t*>(p + at + 2 * h) = (uint16_t)((h < 2 ? d.x : d.y) >> (16 * (h & 1)));
  }
}

// The sum of one line: fp32 in rank order from 0.0f, rounded once, with the
// conversions of reduce(), so the bits are those of every other algorithm.
// lo / hi: the lines as loaded, by source (data in their low halves).
template <DType D>
__device__ __forceinline__ uint2 ll_sum(const DeviceView& v, uint2 mine, const uint64_t (&lo)[kMaxWorld],
                                        const uint64_t (&hi)[kMaxWorld]) {
  using E = Elem<D>;
  constexpr int kPerLine = (int)kLLLinePayload / E::kSize;
  float acc[kPerLine];
#pragma unroll
  for (int j = 0; j < kPerLine; ++j) acc[j] = 0.0f;
#pragma unroll
  for (int src = 0; src < kMaxWorld; ++src) {  // rank order: every rank gets the same bits
    if (src >= v.world) break;
    const uint4 d = src == v.rank ? make_uint4(mine.x, mine.y, 0, 0)
                                  : make_uint4((uint32_t)lo[src], (uint32_t)hi[src], 0, 0);
#pragma unroll
    for (int j = 0; j < kPerLine; ++j) acc[j] = __fadd_rn(acc[j], E::get(d, j));
  }
  uint4 o = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int j = 0; j < kPerLine; ++j) E::put(o, j, acc[j]);
  return make_uint2(o.x, o.y);
}

// Step 3 for thread g's lines (g, g + nthr, ... below `lines`): polls them in
// every peer's slot of `slots` (this rank's ll_recv[seq & 1]) until each
// holds f = ll_flag(seq, desc) in both halves, leaving them in lo / hi.
// false: the thread gives up on the seq (see keep_waiting).
__device__ bool ll_wait(const DeviceView& v, uint32_t f, const uint8_t* slots, uint64_t g, uint64_t nthr,
                        uint64_t lines, uint64_t start, uint64_t (&lo)[kLLLinesPerThread][kMaxWorld],
                        uint64_t (&hi)[kLLLinesPerThread][kMaxWorld]) {
  uint32_t pending = 0;  // bit src * kLLLinesPerThread + k: line k from src not taken yet
#pragma unroll
  for (int src = 0; src < kMaxWorld; ++src)
#pragma unroll
    for (int k = 0; k < kLLLinesPerThread; ++k)
      if (src < v.world && src != v.rank && g + k * nthr < lines) pending |= 1u << (src * kLLLinesPerThread + k);
  for (uint32_t turn = 0; pending; ++turn) {
    // Every pending line's load in flight before the first check: each is a
    // bus round trip. A line taken keeps its registers.
#pragma unroll
    for (int src = 0; src < kMaxWorld; ++src)
#pragma unroll
      for (int k = 0; k < kLLLinesPerThread; ++k)
        if (pending >> (src * kLLLinesPerThread + k) & 1)
          ld_line(slots + src * kLLSlotBytes + kLLLineBytes * (g + k * nthr), lo[k][src], hi[k][src]);
    unsigned long long missing = 0;
#pragma unroll
    for (int src = 0; src < kMaxWorld; ++src) {
#pragma unroll
      for (int k = 0; k < kLLLinesPerThread; ++k) {
        const uint32_t bit = 1u << (src * kLLLinesPerThread + k);
        // Both halves: each carries its own flag, and they may arrive apart.
        if ((pending & bit) && (uint32_t)(lo[k][src] >> 32) == f && (uint32_t)(hi[k][src] >> 32) == f)
          pending &= ~bit;
      }
      if (pending >> (src * kLLLinesPerThread) & ((1u << kLLLinesPerThread) - 1))
        for (int root = 0; root < v.roots; ++root) missing |= 1ull << flag_index(src, root);
    }
    if (!pending) break;
    // A peer that issued another collective at this seq never writes our
    // lines; the service block finds it out (ll_await) and gives up for the
    // grid, which ends this wait too (keep_waiting).
    if (!keep_waiting(v, turn, start, missing)) return false;
  }
  return true;
}

// The service block's announcement of the seq (see "Buffer reuse" and
// "Mismatch"): flag_word(seq, desc) into every peer's chunk_flags page at
// flag_index(rank, root), with release, in send order. The release orders
// before the word everything this rank did before it, its earlier kernels'
// zeroing of their lines included (the kernel boundary orders those before
// this thread). With the inboxes in GPU memory that page is not the host
// region's, so the word goes into the host region's flags too, relaxed, for
// the watchdog, the failure messages and a peer that waits there
// (publish_and_wait).
__device__ void ll_announce(const DeviceView& v, uint64_t seq, uint64_t desc) {
  const uint64_t f = flag_word(seq, desc);
  for (int step = 1; step < v.world; ++step) {
    const int peer = (v.rank + step) % v.world;
    for (int root = 0; root < v.roots; ++root) {
      st_release_sys(v.peer_chunk_flags[peer] + flag_index(v.rank, root), f);
      if (v.peer_memory) st_relaxed_sys(v.peer_flags[peer] + flag_index(v.rank, root), f);
    }
  }
}

// The service block's wait for every peer's announcement of seq: thread t <
// world waits for peer t's word in this rank's chunk_flags page, with
// acquire, until its progress reaches seq; at exactly seq it must carry our
// descriptor (kMismatch otherwise). Past seq, the peer finished seq (it
// announced seq + 1 at its next kernel's start), which counts too: its
// release of seq + 1 comes after that of seq. With the inboxes in GPU
// memory, a peer that ran the one-piece or two-shot kernels at seq stores
// its word only into the host region's flags (publish_and_wait): read there
// every 256th turn (a read of host memory, over the bus), for the mismatch.
// false: this thread gave up on the seq (give_up_mismatch, keep_waiting).
__device__ bool ll_await(const DeviceView& v, uint64_t seq, uint64_t desc, uint64_t start) {
  const int src = (int)threadIdx.x;
  if (src >= v.world || src == v.rank) return true;
  const uint64_t want = flag_desc(flag_word(seq, desc));
  unsigned long long missing = 0;
  for (int root = 0; root < v.roots; ++root) missing |= 1ull << flag_index(src, root);
  for (uint32_t turn = 0;; ++turn) {
    const uint64_t w = ld_acquire_sys(v.chunk_flags + flag_index(src, 0));
    if (flag_progress(w) >= seq) {
      if (flag_progress(w) == seq && flag_desc(w) != want) {
        give_up_mismatch(v.words, w, src);
        return false;
      }
      return true;
    }
    if (v.peer_memory && (turn & 255) == 255) {
      const uint64_t h = ld_acquire_sys(v.flags + flag_index(src, 0));
      if (flag_progress(h) == seq && flag_desc(h) != want) {
        give_up_mismatch(v.words, h, src);
        return false;
      }
    }
    if (!keep_waiting(v, turn, start, missing)) return false;
  }
}

template <DType D>
__global__ void __launch_bounds__(kThreads, 1) oneshot_ll_kernel(DeviceView v, const uint8_t* in, uint8_t* out,
                                                                 uint64_t count, uint64_t tag, Prefetch pf) {
  using E = Elem<D>;
  const uint64_t bytes = count * E::kSize;
  const auto [seq, par, desc, start, prior] = pipe_begin<D>(v, count, ll_tag(tag));
  const int blocks = (int)gridDim.x - 1;
  if ((int)blockIdx.x == blocks) {
    if (threadIdx.x == 0 && !prior) ll_announce(v, seq, desc);
    pipe_service(v, seq, prior, pf);
    const bool ok = prior || ll_await(v, seq, desc, start);
    pipe_finish<D>(v, seq, desc, prior, !ok, true, out, count);
    return;
  }
  const uint64_t nthr = (uint64_t)blocks * blockDim.x, g = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t lines = (bytes + kLLLinePayload - 1) / kLLLinePayload;
  const bool aligned = aligned8(in) && aligned8(out);
  uint2 mine[kLLLinesPerThread];
#pragma unroll
  for (int k = 0; k < kLLLinesPerThread; ++k)
    mine[k] = g + k * nthr < lines ? ll_payload(in, g + k * nthr, bytes, aligned) : make_uint2(0, 0);
  if (!prior) {
    const uint64_t f = ll_flag(seq, desc);
    for (int step = 1; step < v.world; ++step) {  // send order: rank + 1, rank + 2, ...
      const int peer = (v.rank + step) % v.world;
      uint8_t* slot = v.peer_ll_recv[peer] + ((uint64_t)par * v.world + v.rank) * kLLSlotBytes;
#pragma unroll
      for (int k = 0; k < kLLLinesPerThread; ++k)
        if (g + k * nthr < lines)
          st_line(slot + kLLLineBytes * (g + k * nthr), f << 32 | mine[k].x, f << 32 | mine[k].y);
    }
  }
  uint8_t* slots = v.ll_recv + (uint64_t)par * v.world * kLLSlotBytes;
  uint64_t lo[kLLLinesPerThread][kMaxWorld] = {}, hi[kLLLinesPerThread][kMaxWorld] = {};
  const bool ok = !prior && ll_wait(v, ll_flag(seq, desc), slots, g, nthr, lines, start, lo, hi);
  if (ok) {
    // Zero the lines consumed (see "Stale lines"). After a give-up the
    // endpoint is failed for good and no line is polled again.
    for (int src = 0; src < v.world; ++src) {
      if (src == v.rank) continue;
#pragma unroll
      for (int k = 0; k < kLLLinesPerThread; ++k)
        if (g + k * nthr < lines) st_line(slots + src * kLLSlotBytes + kLLLineBytes * (g + k * nthr), 0, 0);
    }
  }
  // A thread that gave up writes NaN over its lines: the last block out
  // fills the whole output with NaN anyway; this keeps them from a wrong sum
  // meanwhile.
  const uint2 nan = E::kSize == 4 ? make_uint2(E::kNan, E::kNan)
                                  : make_uint2(E::kNan | E::kNan << 16, E::kNan | E::kNan << 16);
#pragma unroll
  for (int k = 0; k < kLLLinesPerThread; ++k)
    if (g + k * nthr < lines)
      ll_put(out, g + k * nthr, bytes, aligned, ok ? ll_sum<D>(v, mine[k], lo[k], hi[k]) : nan);
  pipe_finish<D>(v, seq, desc, prior, !ok && !prior, true, out, count);
}

// LL up to this size when Config::cuda_ll_max_bytes is -1 (the default): up
// to its cap, with the inboxes in GPU memory or in the host region. Measured
// on 2 H200s (examples/bench_psum.py, bf16, 2 processes, jax_arx.psum, k 64,
// 11 samples), us at 8 KB / 16 KB / 32 KB / 64 KB / 128 KB, after the
// counting fix (grid.cuh, tag_arrivals) and the announcement (ll_announce):
//   GPU inboxes, LL up to 128 KiB            8.4 / 7.6 / 7.7 / 8.1 / 8.4
//     the same, a second run                 8.7 / 9.1 / 8.5 / 8.1 / 8.2
//   GPU inboxes, LL up to 32 KiB, then
//     32 KiB chunks (the default before)     7.8 / 8.0 / 7.9 / 9.8 / 10.0
//   GPU inboxes, 4 KiB chunks (LL to 32 KiB) 7.4 / 7.6 / 7.9 / 8.3 / 7.9
//   host inboxes, LL up to 128 KiB           8.3 / 8.1 / 8.8 / 11.4 / 17.2
//   host inboxes, LL up to 16 KiB, then
//     16 KiB chunks (the default before)     8.4 / 8.2 / 10.7 / 13.4 / 18.1
//   NCCL (NVLink)                            10.9 / 18.2 / 18.7 / 18.6 / 21.0
// Before those two changes LL lost from 32 KB on (its grid's blocks met on
// a compare-and-swap loop, and each block fenced at the end), and earlier
// still it collapsed there (every waiting thread read host memory every
// 16th turn: keep_waiting's intervals).
constexpr uint64_t kLLDefaultMaxBytes = kLLMaxPayload;

// The LL grid: `blocks` blocks of `threads` threads (a multiple of 32, at
// most kThreads) such that each thread owns kLLLinesPerThread lines or fewer;
// the kernel gets one more block, the service block.
void ll_grid(uint64_t bytes, int& blocks, int& threads) {
  const uint64_t lines = (bytes + kLLLinePayload - 1) / kLLLinePayload;
  const uint64_t need = std::max<uint64_t>(1, (lines + kLLLinesPerThread - 1) / kLLLinesPerThread);
  if (need <= (uint64_t)kThreads) {
    blocks = 1;
    threads = (int)((need + 31) / 32 * 32);
  } else {
    blocks = (int)((need + kThreads - 1) / kThreads);
    threads = kThreads;
  }
}

// The one place that decides whether a one-shot goes LL: in direct mode, up
// to Config::cuda_ll_max_bytes (-1: kLLDefaultMaxBytes; 0: never), capped at
// kLLMaxPayload, the room of an ll_recv slot. Every rank computes the same
// from the same size and config (see "Agreement" in "the LL one-shot").
// Above it, pipeline_chunks() decides between the pipelined and the
// one-piece kernel.
bool ll_oneshot(const DeviceView& v, uint64_t bytes) {
  if (!v.direct || v.ll_max_bytes == 0) return false;
  const uint64_t limit = v.ll_max_bytes >= 0 ? (uint64_t)v.ll_max_bytes : kLLDefaultMaxBytes;
  return limit > 0 && bytes <= std::min(limit, kLLMaxPayload);
}

// The one place that decides whether a one-shot runs pipelined, and in how
// many chunks (0: not pipelined). Every rank computes the same from the same
// size, world, config and peer_memory (see "Agreement"); chunks of about
// Config::cuda_chunk_bytes, else kPipeChunkBytes, or
// kPipeChunkBytesPeerMemory with the inboxes in GPU memory. Config::cuda_pipeline -1 (the
// default) chooses per size: pipelined at every size, since it measured
// faster than the one-piece kernel at each from 8 KB to 4 MB (see
// kPipeChunkBytes; at 8 KB the two are within noise). 0 keeps the one-piece
// kernel, 1 pipelines at every size.
int pipeline_chunks(const DeviceView& v, uint64_t bytes) {
  if (!v.direct || v.pipeline == 0) return 0;
  const uint64_t target = v.chunk_bytes   ? v.chunk_bytes
                          : v.peer_memory ? kPipeChunkBytesPeerMemory
                                          : kPipeChunkBytes;
  return (int)std::clamp<uint64_t>((bytes + target - 1) / target, 1, (uint64_t)psum_chunk_max(v.world));
}

// Two 16-byte vectors a thread until the cap (see kUnroll for what was measured).
int grid_for(const DeviceView& v, uint64_t bytes) {
  const uint64_t per_block = (uint64_t)kThreads * 16 * 2;
  const uint64_t b = (bytes + per_block - 1) / per_block;
  return (int)std::max<uint64_t>(1, std::min<uint64_t>(b, (uint64_t)v.max_blocks));
}

template <DType D>
cudaError_t launch(const DeviceView& v, Algorithm algorithm, const void* in, void* out, uint64_t count, uint64_t tag,
                   const Prefetch& pf, cudaStream_t stream) {
  const uint64_t bytes = count * Elem<D>::kSize;
  auto* i = static_cast<const uint8_t*>(in);
  auto* o = static_cast<uint8_t*>(out);
  switch (algorithm) {
    case Algorithm::kOneShot:
      if (ll_oneshot(v, bytes)) {
        int blocks = 0, threads = 0;
        ll_grid(bytes, blocks, threads);
        oneshot_ll_kernel<D><<<blocks + 1, threads, 0, stream>>>(v, i, o, count, tag, pf);
        return cudaGetLastError();
      }
      if (const int chunks = pipeline_chunks(v, bytes)) {
        oneshot_pipe_kernel<D><<<std::min(chunks, kPipeBlocks) + 1, kThreads, 0, stream>>>(v, i, o, count, tag, pf,
                                                                                           chunks);
        return cudaGetLastError();
      }
      oneshot_kernel<D><<<grid_for(v, bytes), kThreads, 0, stream>>>(v, i, o, count, tag, pf);
      return cudaGetLastError();
    case Algorithm::kTwoShot: {
      scatter_kernel<D><<<grid_for(v, bytes), kThreads, 0, stream>>>(v, i, o, count, tag, pf);
      const cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) return e;
      gather_kernel<D><<<grid_for(v, bytes), kThreads, 0, stream>>>(v, o, count, tag);
      return cudaGetLastError();
    }
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_allreduce(const DeviceView& v, Algorithm algorithm, DType dtype, const void* in, void* out,
                             uint64_t count, uint64_t tag, const Prefetch& prefetch, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32: return launch<DType::kF32>(v, algorithm, in, out, count, tag, prefetch, stream);
    case DType::kBF16: return launch<DType::kBF16>(v, algorithm, in, out, count, tag, prefetch, stream);
    case DType::kF16: return launch<DType::kF16>(v, algorithm, in, out, count, tag, prefetch, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace arx::cuda

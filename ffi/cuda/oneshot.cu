// The one-shot psum over a channel (comm/channel.h): every rank puts its
// whole partial to every peer, piece by piece, and sums the pieces as they
// arrive. The sum is fp32 in rank order from rank 0's element, rounded once,
// as everywhere: the bits of ffi/host/psum.cc and of every other algorithm.
//
// The partial is cut into `pieces` pieces (piece_range; comm/plan.cc chooses
// how many), and block b of B takes pieces b, b + B, b + 2B, ...; one more
// block, the service block, does what belongs to the seq as a whole. For
// each of its pieces c, block b
//   1. copies piece c of the partial where the channel says (every peer's
//      inbox; or the staging buffer, once, for the proxy);
//   2. fences (one thread, after the block's barrier: release is cumulative)
//      and signals piece c (the flag words into the peers, or a trigger);
//   3. waits for every peer's piece c (one thread per peer);
//   4. sums piece c (or fills it with NaN if the wait gave up).
// A block with several pieces splits its threads: half copy and signal piece
// after piece (the producers), half wait and sum piece after piece (the
// consumers), so that the writes to the peers (out of the GPU) overlap the
// reads of the peers' data (into it). No block waits for another: piece c's
// path depends on no other piece. The service block announces the seq to the
// watchdog and asks L2 for the prefetch ranges; the last block out settles
// the seq (grid.cuh).
//
// A fused call (psum_add_norm, base/norm.h) cuts the partial on row
// boundaries instead (comm/plan.cc: at most one piece per row, each starting
// on a vector), so the consumers that summed a piece's rows norm them right
// after (cuda/norm.cuh), before the next piece.
//
// Buffer reuse and agreement: comm/channel.h; the piece count is a function
// of the size and what the ranks agreed on (comm/plan.cc), and it goes into
// the descriptor (pieces_tag), so a peer that cut differently is a mismatch,
// never a wrong sum. The argument needs an endpoint's kernels not to overlap
// (stream order): were they to overlap (programmatic dependent launch), a
// peer's piece-c flag for seq + 1 would say nothing about its reads of
// another piece for seq.
#include "cuda/device_side.h"
#include "cuda/grid.cuh"
#include "cuda/kernels.h"
#include "cuda/norm.cuh"

namespace arx::cuda {
namespace {

// Blocks besides the service block: pieces beyond this many are taken in
// turns (split blocks, see above).
constexpr int kPipeBlocks = 32;
static_assert(kPipeBlocks + 1 <= kMaxGridBlocks, "settle counts the blocks out in 8 bits");
// Vectors a consumer thread has in flight from each peer before the adds.
constexpr int kPipeUnroll = 2;

// The call site's tag with the piece count mixed in (see "agreement").
__host__ __device__ inline uint64_t pieces_tag(uint64_t tag, int pieces) {
  return tag ^ (0x5851F42D4C957F2Dull * (uint64_t)(pieces + 1));
}

// dst[0, bytes) = src[0, bytes) by thread t of n threads of one block; src in
// device memory. Up to four loads in flight before their stores, also when
// a thread has fewer than four vectors.
__device__ void copy_piece(uint8_t* dst, const uint8_t* src, uint64_t bytes, int t, int n) {
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

// out[lo, hi) = the rank-order sum of bytes [lo, hi) of every rank's partial:
// this rank's from `mine` (device memory), each peer's from its lane of the
// inbox (`lane0`: source 0's; `lane` bytes apart), read past the caches. By
// thread t of n threads of one block; lo is a multiple of 16.
template <DType D>
__device__ void reduce_range(int rank, int world, const uint8_t* lane0, uint64_t lane, const uint8_t* mine,
                             uint8_t* out, uint64_t lo, uint64_t hi, int t, int n) {
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
        if (src < world && i0 + u * step < nvec)
          part[u][src] = src == rank ? *reinterpret_cast<const uint4*>(mine + at) : ld_cv_v4(lane0 + src * lane + at);
    }
#pragma unroll
    for (int u = 0; u < kPipeUnroll; ++u) {
      const uint64_t i = i0 + u * step;
      if (i >= nvec) break;
      *reinterpret_cast<uint4*>(out + lo + 16 * i) = sum_rank_order<D>(part[u], world);
    }
  }
  for (uint64_t e = (lo + 16 * nvec) / E::kSize + t; e < hi / E::kSize; e += step) {
    const float acc = sum_one(world, [&](int src) {
      return src == rank ? E::load(mine + e * E::kSize) : E::load_cv(lane0 + src * lane + e * E::kSize);
    });
    E::store(out + e * E::kSize, acc);
  }
}

template <typename Ch, DType D>
__global__ void __launch_bounds__(kThreads, 1)
    oneshot_kernel(Grid g, Ch ch, const uint8_t* in, uint8_t* out, uint64_t count, uint64_t tag, Prefetch pf,
                   int pieces, AddNorm nm) {
  using E = Elem<D>;
  const uint64_t bytes = count * E::kSize;
  const uint64_t rows = nm.on() ? count / nm.width : 0, row_bytes = nm.on() ? nm.width * E::kSize : 0;
  // Piece c: bytes [lo, hi), and for a fused call rows [r0, r1) (see the top).
  auto piece = [&](int c, uint64_t& lo, uint64_t& hi, uint64_t& r0, uint64_t& r1) {
    if (!nm.on()) return piece_range(bytes, pieces, c, lo, hi);
    r0 = rows * (uint64_t)c / (uint64_t)pieces;
    r1 = rows * (uint64_t)(c + 1) / (uint64_t)pieces;
    lo = r0 * row_bytes;
    hi = r1 * row_bytes;
  };
  const SeqStart s = begin(g, Family::kPsum, descriptor(OpCode::kPsum, (uint64_t)D, count, pieces_tag(tag, pieces)));
  const int blocks = (int)gridDim.x - 1;
  const auto send = ch.open(s.send(), Fan::kEveryPeer);
  const uint64_t entries = send.entries(pieces);
  auto nan = [&](int t, int n) {
    fill_nan_range<D>(out, 0, bytes, t, n);
    if (nm.on()) fill_nan_rows<D>(nm, 0, rows, t, n);
  };
  if ((int)blockIdx.x == blocks) {
    note_begun(g, Family::kPsum, s);
    prefetch(pf, threadIdx.x, blockDim.x);
    settle(g, ch, Family::kPsum, s, false, entries, nan);
    return;
  }
  __shared__ unsigned s_sent;            // pieces of this block whose copy has read `in`
  __shared__ volatile int s_failed;      // this block gave up on the seq
  __shared__ float s_lanes[kNormLanes];  // a fused call's row sums (the consumers')
  const int b = (int)blockIdx.x, t = (int)threadIdx.x;
  const int mine = (pieces - b + blocks - 1) / blocks;  // pieces b, b + blocks, ...
  const bool split = mine > 1;
  const int nprod = split ? kThreads / 2 : kThreads;
  if (t == 0) {
    s_sent = 0;
    s_failed = s.prior ? 1 : 0;
  }
  __syncthreads();
  if (t < nprod) {  // producers (every thread, when the block has one piece)
    for (int k = 0; k < mine; ++k) {
      const int c = b + k * blocks;
      uint64_t lo, hi, r0 = 0, r1 = 0;
      piece(c, lo, hi, r0, r1);
      for (int i = 0; i < send.fanout(kEveryPeer) && !s.prior; ++i)  // send order: rank + 1, rank + 2, ...
        copy_piece(send.put_dst(kEveryPeer, i) + lo, in + lo, hi - lo, t, nprod);
      if (split)
        bar_sync(1, nprod);
      else
        __syncthreads();
      if (t == 0) {
        // The consumers may now overwrite piece c of `in` (in == out).
        st_release_cta(&s_sent, (unsigned)k + 1);
        if (!s.prior) {
          // The producers' copies (before the barrier) reach system scope
          // before the signal that announces them: the fence is cumulative.
          fence_acq_rel();
          send.signal(kEveryPeer, c, lo, hi);
          note_published(g, Family::kPsum, s);
        }
      }
    }
  }
  if (!split || t >= nprod) {  // consumers (every thread, likewise)
    const int ct = split ? t - nprod : t, ncons = split ? kThreads - nprod : kThreads;
    for (int k = 0; k < mine; ++k) {
      const int c = b + k * blocks;
      uint64_t lo, hi, r0 = 0, r1 = 0;
      piece(c, lo, hi, r0, r1);
      if (ct < ch.world && ct != ch.rank && !s_failed && !wait_for(g, ch, s, ct, c)) s_failed = 1;
      if (ct == 0)
        while (ld_acquire_cta(&s_sent) <= (unsigned)k) __nanosleep(32);
      if (split)
        bar_sync(2, ncons);
      else
        __syncthreads();
      // The peers' piece c happens-before this through the flags' acquire
      // loads and the barrier. After a give-up the last block out fills the
      // whole output with NaN anyway; this keeps the piece from a wrong sum
      // meanwhile.
      // s_failed changes only in the waits of the next piece, after every
      // consumer passed the bars of this one: they all take one branch.
      const bool failed = s_failed;
      if (failed)
        fill_nan_range<D>(out, lo, hi, ct, ncons);
      else
        reduce_range<D>(ch.rank, ch.world, ch.in.lane(s.par, 0), ch.in.lane_bytes, in, out, lo, hi, ct, ncons);
      if (nm.on()) {
        if (failed) fill_nan_rows<D>(nm, r0, r1, ct, ncons);
        auto bar = [&] {
          if (split)
            bar_sync(2, ncons);
          else
            __syncthreads();
        };
        for (uint64_t row = r0; row < r1 && !failed; ++row) add_norm_row<D>(nm, out, row, ct, ncons, s_lanes, bar);
      }
    }
  }
  settle(g, ch, Family::kPsum, s, s_failed && !s.prior, entries, nan);
}

template <typename Ch, DType D>
cudaError_t launch_typed(const Grid& g, const Ch& ch, const void* in, void* out, uint64_t count, uint64_t tag,
                         const Prefetch& pf, int pieces, const AddNorm& nm, cudaStream_t stream) {
  oneshot_kernel<Ch, D><<<std::min(pieces, kPipeBlocks) + 1, kThreads, 0, stream>>>(
      g, ch, static_cast<const uint8_t*>(in), static_cast<uint8_t*>(out), count, tag, pf, pieces, nm);
  return cudaGetLastError();  // may be an earlier kernel's error
}

}  // namespace

template <typename Ch>
cudaError_t launch_oneshot(const Grid& g, const Ch& ch, DType dtype, const void* in, void* out, uint64_t count,
                           uint64_t tag, const Prefetch& pf, int pieces, const AddNorm& nm, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32:
      return launch_typed<Ch, DType::kF32>(g, ch, in, out, count, tag, pf, pieces, nm, stream);
    case DType::kBF16:
      return launch_typed<Ch, DType::kBF16>(g, ch, in, out, count, tag, pf, pieces, nm, stream);
    case DType::kF16:
      return launch_typed<Ch, DType::kF16>(g, ch, in, out, count, tag, pf, pieces, nm, stream);
  }
  return cudaErrorInvalidValue;
}

template cudaError_t launch_oneshot<DirectChannel>(const Grid&, const DirectChannel&, DType, const void*, void*,
                                                   uint64_t, uint64_t, const Prefetch&, int, const AddNorm&,
                                                   cudaStream_t);
template cudaError_t launch_oneshot<ProxyChannel>(const Grid&, const ProxyChannel&, DType, const void*, void*, uint64_t,
                                                  uint64_t, const Prefetch&, int, const AddNorm&, cudaStream_t);

}  // namespace arx::cuda

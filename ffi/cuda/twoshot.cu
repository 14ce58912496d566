// The two-shot psum over a channel (comm/channel.h), for partials past the
// one-shot's slot: a reduce-scatter kernel (seq s: piece j of the partial to
// rank j, each rank sums its piece from every rank's), then an all-gather
// kernel (seq s + 1: each rank's summed piece to every rank). The sum is the
// one-shot's, fp32 in rank order from rank 0's element, rounded once, so the
// bits are the same whichever algorithm ran.
//
// Each kernel moves one piece per destination, in one grid of blocks:
//   1. every block copies its share of what goes out where the channel says
//      (each peer's inbox, or the staging buffer for the proxy);
//   2. block 0 waits for the others' copies and signals (the copies reached
//      system scope first: each thread's fence, then the blocks' arrivals,
//      acq_rel, chain them to the signalling thread);
//   3. block 0 waits for every peer's piece, bounded (grid.cuh), and tells
//      the other blocks the outcome through the `go` word, so only a few
//      threads poll words that a peer (or a NIC) is writing;
//   4. every block moves its share of the result (or NaN, if the seq failed);
//   5. the last block out settles the seq (grid.cuh).
// All the blocks of a grid must be resident at once (block 0 waits for the
// others): the grid is at most a quarter of the multiprocessors.
#include "cuda/device_side.h"
#include "cuda/grid.cuh"
#include "cuda/kernels.h"

namespace arx::cuda {
namespace {

// dst[0, bytes) = src[0, bytes), over the whole grid. 16-byte vectors where
// both sides allow, 2-byte units for the rest (every length here is a
// multiple of the element size, which is 2 or 4). kCv: src was written by a
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

// out[e] = the rank-order sum of every rank's element e, e in [0, count):
// this rank's from `mine` (device memory), each peer's from its lane of the
// inbox, read past the caches. Over the whole grid.
template <DType D>
__device__ void reduce(int rank, int world, const uint8_t* lane0, uint64_t lane, const uint8_t* mine, uint8_t* out,
                       uint64_t count) {
  using E = Elem<D>;
  const uint64_t nvec = aligned16(mine) && aligned16(out) ? count * E::kSize / 16 : 0;
  for (uint64_t i = global_thread(); i < nvec; i += grid_threads()) {
    uint4 part[kMaxWorld];
#pragma unroll
    for (int src = 0; src < kMaxWorld; ++src)  // every load in flight before the first add
      if (src < world)
        part[src] =
            src == rank ? *reinterpret_cast<const uint4*>(mine + 16 * i) : ld_cv_v4(lane0 + src * lane + 16 * i);
    *reinterpret_cast<uint4*>(out + 16 * i) = sum_rank_order<D>(part, world);
  }
  for (uint64_t e = nvec * E::kPerVec + global_thread(); e < count; e += grid_threads()) {
    const float acc = sum_one(world, [&](int src) {
      return src == rank ? E::load(mine + e * E::kSize) : E::load_cv(lane0 + src * lane + e * E::kSize);
    });
    E::store(out + e * E::kSize, acc);
  }
}

// Steps 2 and 3, in every block, every thread; `signal()` is called once, by
// block 0's thread 0. Returns whether the seq failed (an earlier failure,
// a wait that gave up, blocks that never ran); `gave_up`: this thread's wait
// gave up (for settle).
template <typename Ch, typename Signal>
__device__ bool signal_and_wait(const Grid& g, const Ch& ch, const SeqStart& s, Signal signal, const Prefetch* pf,
                                bool& gave_up) {
  __shared__ int s_failed;
  FamilyWords& fw = g.words->family[(int)Family::kPsum];
  // The copies reach system scope before any signal that announces them.
  fence_acq_rel();
  __syncthreads();
  gave_up = false;
  if (blockIdx.x != 0) {
    if (threadIdx.x == 0) tagged_arrive(&fw.arrived, s.seq);
  } else if (threadIdx.x == 0) {
    s_failed = s.prior;
    bool copied = gridDim.x == 1;
    while (!copied) {  // the other blocks run alongside: the grid is a few blocks on a GPU of a hundred
      const unsigned long long a = ld_acquire_gpu(&fw.arrived);
      copied = a >> 16 == s.seq && (a & 0xffff) == gridDim.x - 1;
      if (!copied && globaltimer() - s.start > g.timeout_ns) break;
    }
    if (!copied) {  // blocks of this grid never ran: nothing was signalled
      atomicExch(&g.words->fail_any, 1ull);
      s_failed = 1;
      gave_up = true;
    } else if (!s.prior) {
      signal();
    }
  }
  if (pf) prefetch(*pf, global_thread(), grid_threads());
  if (blockIdx.x == 0) {
    __syncthreads();
    const int t = (int)threadIdx.x;
    if (!s_failed && t < ch.world && t != ch.rank && !wait_for(g, ch, s, t, 0)) gave_up = true;
    const int any = __syncthreads_or(gave_up);
    if (t == 0) {
      if (any) s_failed = 1;
      // The peers' data (read next by every block) happens-before this
      // release through the waits' acquire loads.
      st_release_gpu(&fw.go, s.seq << 2 | (unsigned long long)(s_failed ? 1 : 0));
    }
    __syncthreads();
    return s_failed != 0;
  }
  // The other blocks: one thread polls the go word in device memory. Bounded
  // as well, past block 0's own bound, in case block 0 never ran.
  if (threadIdx.x == 0) {
    s_failed = 1;
    while (true) {
      const unsigned long long v = ld_acquire_gpu(&fw.go);
      if (v >> 2 == s.seq) {
        s_failed = (int)(v & 1);
        break;
      }
      if (v >> 2 > s.seq || globaltimer() - s.start > 2 * g.timeout_ns + 1000000000ull) break;
    }
  }
  __syncthreads();
  return s_failed != 0;
}

template <typename Ch, DType D>
__global__ void __launch_bounds__(kThreads, 1)
    scatter_kernel(Grid g, Ch ch, const uint8_t* in, uint8_t* out, uint64_t count, uint64_t tag, Prefetch pf) {
  using E = Elem<D>;
  const uint64_t bytes = count * E::kSize, lane = piece_step(bytes, ch.world);  // the pieces lie in place
  const SeqStart s = begin(g, Family::kPsum, descriptor(OpCode::kPsumScatter, (uint64_t)D, count, tag));
  const int rank = ch.rank, world = ch.world;
  if (blockIdx.x == 0) note_begun(g, Family::kPsum, s);
  const auto send = ch.open(s.send(), Fan::kEachPeer, lane);
  if (!s.prior) {
    for (int step = 1; step < world; ++step) {  // piece j to rank j only, in send order
      const int j = (rank + step) % world;
      uint64_t lo, hi;
      piece_range(bytes, world, j, lo, hi);
      copy_bytes<false>(send.put_dst((uint64_t)j), in + lo, hi - lo);
    }
  }
  bool gave_up = false;
  const bool failed = signal_and_wait(
      g, ch, s,
      [&] {
        for (int step = 1; step < world; ++step) {
          const int j = (rank + step) % world;
          uint64_t lo, hi;
          piece_range(bytes, world, j, lo, hi);
          send.signal((uint64_t)j, 0, 0, hi - lo);
        }
        note_published(g, Family::kPsum, s);
      },
      &pf, gave_up);
  uint64_t lo, hi;
  piece_range(bytes, world, rank, lo, hi);
  if (failed)
    fill_nan_range<D>(out, 0, bytes, global_thread(), grid_threads());
  else
    reduce<D>(rank, world, ch.in.lane(s.par, 0), ch.in.lane_bytes, in + lo, out + lo, (hi - lo) / E::kSize);
  settle(g, ch, Family::kPsum, s, gave_up, send.entries(1),
         [&](int t, int n) { fill_nan_range<D>(out, 0, bytes, t, n); });
}

// The second kernel: this rank's summed piece (in out, where the first kernel
// wrote it) to every peer, and every peer's piece into out.
template <typename Ch, DType D>
__global__ void __launch_bounds__(kThreads, 1)
    gather_kernel(Grid g, Ch ch, uint8_t* out, uint64_t count, uint64_t tag) {
  using E = Elem<D>;
  const uint64_t bytes = count * E::kSize;
  const SeqStart s = begin(g, Family::kPsum, descriptor(OpCode::kPsumGather, (uint64_t)D, count, tag));
  const int rank = ch.rank, world = ch.world;
  if (blockIdx.x == 0) note_begun(g, Family::kPsum, s);
  uint64_t lo, hi;
  piece_range(bytes, world, rank, lo, hi);
  // A failed reduce-scatter (seq - 1) recorded its failure: prior, so this
  // sends nothing and fills NaN.
  const auto send = ch.open(s.send(), Fan::kEveryPeer);
  for (int i = 0; i < send.fanout(kEveryPeer) && !s.prior; ++i)
    copy_bytes<false>(send.put_dst(kEveryPeer, i), out + lo, hi - lo);
  bool gave_up = false;
  const bool failed = signal_and_wait(
      g, ch, s,
      [&] {
        send.signal(kEveryPeer, 0, 0, hi - lo);
        note_published(g, Family::kPsum, s);
      },
      nullptr, gave_up);
  if (failed) {
    fill_nan_range<D>(out, 0, bytes, global_thread(), grid_threads());
  } else {
    for (int src = 0; src < world; ++src) {
      if (src == rank) continue;  // already in out
      uint64_t a, b;
      piece_range(bytes, world, src, a, b);
      copy_bytes<true>(out + a, ch.in.lane(s.par, src), b - a);
    }
  }
  settle(g, ch, Family::kPsum, s, gave_up, send.entries(1),
         [&](int t, int n) { fill_nan_range<D>(out, 0, bytes, t, n); });
}

// Two 16-byte vectors a thread until the cap (docs/performance.md).
int grid_for(const Grid& g, uint64_t bytes) {
  const uint64_t per_block = (uint64_t)kThreads * 16 * 2;
  const uint64_t b = (bytes + per_block - 1) / per_block;
  return (int)std::max<uint64_t>(1, std::min<uint64_t>(b, (uint64_t)g.max_blocks));
}

template <typename Ch, DType D>
cudaError_t launch_typed(const Grid& g, const Ch& ch, const void* in, void* out, uint64_t count, uint64_t tag,
                         const Prefetch& pf, cudaStream_t stream) {
  const int blocks = grid_for(g, count * Elem<D>::kSize);
  auto* o = static_cast<uint8_t*>(out);
  scatter_kernel<Ch, D><<<blocks, kThreads, 0, stream>>>(g, ch, static_cast<const uint8_t*>(in), o, count, tag, pf);
  const cudaError_t e = cudaGetLastError();  // may be an earlier kernel's error
  if (e != cudaSuccess) return e;
  gather_kernel<Ch, D><<<blocks, kThreads, 0, stream>>>(g, ch, o, count, tag);
  return cudaGetLastError();
}

}  // namespace

template <typename Ch>
cudaError_t launch_twoshot(const Grid& g, const Ch& ch, DType dtype, const void* in, void* out, uint64_t count,
                           uint64_t tag, const Prefetch& pf, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32:
      return launch_typed<Ch, DType::kF32>(g, ch, in, out, count, tag, pf, stream);
    case DType::kBF16:
      return launch_typed<Ch, DType::kBF16>(g, ch, in, out, count, tag, pf, stream);
    case DType::kF16:
      return launch_typed<Ch, DType::kF16>(g, ch, in, out, count, tag, pf, stream);
  }
  return cudaErrorInvalidValue;
}

template cudaError_t launch_twoshot<DirectChannel>(const Grid&, const DirectChannel&, DType, const void*, void*,
                                                   uint64_t, uint64_t, const Prefetch&, cudaStream_t);
template cudaError_t launch_twoshot<ProxyChannel>(const Grid&, const ProxyChannel&, DType, const void*, void*, uint64_t,
                                                  uint64_t, const Prefetch&, cudaStream_t);

}  // namespace arx::cuda

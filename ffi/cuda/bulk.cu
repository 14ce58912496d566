// The bulk collectives on NVIDIA GPUs over a channel (comm/channel.h):
// all-gather, reduce-scatter and the fused MoE combine + reduce-scatter, with
// the results of ffi/host/bulk.cc, bit for bit. One kernel per collective,
// one bulk seq per collective, kept on the device, so a CUDA graph that
// captured the launch replays correctly.
//
// A collective goes out in kMaxPieces pieces (per destination), and the grid is
// P producer blocks, each producing share g of every piece in order, then C
// consumer blocks, each waiting for and consuming share g of every piece in
// order (P = C but for the MoE rows, which take more: blocks_for). A
// producer block
//   1. produces its share of piece c: copies (all-gather, reduce-scatter) or
//      computes (the MoE rows) it, for every peer in send order (rank + 1,
//      rank + 2, ...), where the channel says (the peer's lane for this
//      rank; or the staging buffer, for the proxy);
//   2. arrives on the piece's counter (DeviceWords::piece_arrived[c]): the
//      last of the P blocks fences and signals the piece, for every
//      destination (the flag words into the peers, or triggers at fixed ring
//      positions, so the proxy sends them in piece order whichever block
//      finished first); then produces its share of this rank's own part,
//      into `out`: all-gather copies its slice, which no peer waits for; the
//      MoE computes its own rows and arrives again (a second count of the
//      same word), for this rank's consumers.
// A consumer block
//   3. waits for every peer's piece c (one thread per peer);
//   4. moves its share of piece c into `out` (all-gather: the peers' slices;
//      reduce-scatter and MoE: the rank-order fp32 sum, rounded once).
// The last block out settles the collective (grid.cuh).
//
// Blocks wait only for peers, never for another block of this grid (the
// piece's signal waits for the piece's last producer, which needs nothing to
// run; the MoE consumers wait for this rank's own rows, below), and
// producers never wait: a running block never holds back what a peer waits
// for. Buffer reuse by parity: comm/channel.h; each kernel has read
// everything it needs from its inbox into `out` before it completes.
//
// Rows. all_gather and reduce_scatter along an axis other than the first
// gather into, or scatter from, [outer][world][block]: a rank's part is
// `outer` rows of `block` bytes, `stride` = world * block apart; on the wire
// it is contiguous.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/combine.cuh"
#include "cuda/device_side.h"
#include "cuda/grid.cuh"
#include "cuda/kernels.h"

namespace arx::cuda {
namespace {

// Bytes of a piece one block takes, about: more blocks per piece while the
// pieces are big, up to the grid cap (Grid::max_blocks). With the inboxes
// in GPU memory four times the blocks; through host memory more blocks
// only add polls and reads on the bus, and were slower (bench_prefill.py,
// docs/performance.md, "Blocks per piece").
constexpr uint64_t kShareBytes = 256 << 10, kShareBytesGpuInboxes = 64 << 10;

// The grid: `producers` blocks, then `consumers` (bulk_kernel). Producers
// never wait, so one not yet resident runs once any block ends; the blocks
// that wait, the consumers, are at most half the grid cap (an eighth of the
// multiprocessors) per grid, so they never fill the GPU.
struct Blocks {
  int producers, consumers;
};

// MoE rows of a piece per producer block, about: two per warp. Not tuned
// (docs/performance.md, "The fused MoE combine on the whole GPU").
constexpr uint64_t kRowsPerProducer = 32;

// The two counts of DeviceWords::piece_arrived[c] (grid.cuh, arrival
// fields): producers done with the peers' part of piece c (the last one
// signals it), and, for the MoE rows, done with this rank's own part too
// (the consumers wait for it).
constexpr int kPeersField = 0, kOwnField = 1;

// Where byte p of a rank's part (contiguous on the wire) lies in the
// [outer][world][block] tensor, from that rank's first row.
__device__ __forceinline__ uint64_t row_at(uint64_t p, uint64_t block, uint64_t stride) {
  return stride == block ? p : p / block * stride + p % block;
}

// Share g of G of bytes [lo, hi) (lo 16-aligned): 16-aligned starts.
__device__ __forceinline__ void share_range(uint64_t lo, uint64_t hi, int g, int groups, uint64_t& a, uint64_t& b) {
  const uint64_t step = ((hi - lo) / groups + 15) & ~15ull;
  a = min(lo + step * g, hi);
  b = g == groups - 1 ? hi : min(lo + step * (g + 1), hi);
}

// Bytes [lo, hi) of a part: dst (rows if dst_rows, else contiguous) from src
// (likewise), by this block's threads. kCv: src is peer data (read past the
// caches). 16-byte vectors, four loads in flight, where the rows and the
// addresses allow; bytes otherwise.
template <bool kCv>
__device__ void copy_part(uint8_t* dst, bool dst_rows, const uint8_t* src, bool src_rows, uint64_t lo, uint64_t hi,
                          uint64_t block, uint64_t stride) {
  const int t = threadIdx.x, n = blockDim.x;
  const bool rows = dst_rows || src_rows;
  const bool vec = aligned16(dst) && aligned16(src) && lo % 16 == 0 && (!rows || stride == block || block % 16 == 0);
  auto d_at = [&](uint64_t p) { return dst_rows ? row_at(p, block, stride) : p; };
  auto s_at = [&](uint64_t p) { return src_rows ? row_at(p, block, stride) : p; };
  uint64_t done = lo;
  if (vec) {
    const uint64_t nvec = (hi - lo) / 16;
    uint64_t i = (uint64_t)t;
    for (; i + 3 * (uint64_t)n < nvec; i += 4 * (uint64_t)n) {
      uint4 a[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const uint8_t* p = src + s_at(lo + 16 * (i + u * (uint64_t)n));
        a[u] = kCv ? ld_cv_v4(p) : *reinterpret_cast<const uint4*>(p);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) *reinterpret_cast<uint4*>(dst + d_at(lo + 16 * (i + u * (uint64_t)n))) = a[u];
    }
    for (; i < nvec; i += n) {
      const uint8_t* p = src + s_at(lo + 16 * i);
      *reinterpret_cast<uint4*>(dst + d_at(lo + 16 * i)) = kCv ? ld_cv_v4(p) : *reinterpret_cast<const uint4*>(p);
    }
    done = lo + 16 * nvec;
  }
  for (uint64_t p = done + t; p < hi; p += n) {
    const uint8_t* s = src + s_at(p);
    dst[d_at(p)] = kCv ? (uint8_t)(ld_cv_u32(reinterpret_cast<const void*>((uintptr_t)s & ~(uintptr_t)3)) >>
                                   (8 * ((uintptr_t)s & 3)))
                       : *s;
  }
}

// out[p] for p in bytes [lo, hi) of this rank's result = the rank-order sum
// over sources, rounded once: this rank's own part from `own` (device memory;
// rows if own_rows), each peer's from its lane (`lane0`: source 0's, `lane`
// bytes apart; written by the peer or the proxy). out may be `own` (the MoE
// rows): each element is read, then written, by one thread.
template <DType D>
__device__ void reduce_part(const BulkOp& op, int rank, int world, const uint8_t* lane0, uint64_t lane,
                            const uint8_t* own, bool own_rows, uint8_t* out, uint64_t lo, uint64_t hi) {
  using E = Elem<D>;
  const int t = threadIdx.x, n = blockDim.x;
  auto o_at = [&](uint64_t p) { return own_rows ? row_at(p, op.block, op.stride) : p; };
  const bool vec = aligned16(own) && aligned16(out) && aligned16(lane0) && lane % 16 == 0 && lo % 16 == 0 &&
                   (!own_rows || op.stride == op.block || op.block % 16 == 0);
  // Source src's vector at byte p: this rank's own, or a peer's past the caches.
  auto load = [&](int src, uint64_t p) {
    return src == rank ? *reinterpret_cast<const uint4*>(own + o_at(p)) : ld_cv_v4(lane0 + src * lane + p);
  };
  uint64_t done = lo;
  if (vec) {
    const uint64_t nvec = (hi - lo) / 16;
    // kUnroll vectors per source in flight before the first add (the
    // peers' are reads over the bus), up to kUnrollWorld sources: past it
    // the registers would spill. Each element still read, then written,
    // by one thread.
    constexpr int kUnroll = 2, kUnrollWorld = 4;
    uint64_t i = (uint64_t)t;
    if (world <= kUnrollWorld)
      for (; i + (kUnroll - 1) * (uint64_t)n < nvec; i += kUnroll * (uint64_t)n) {
        uint4 part[kUnroll][kUnrollWorld];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const uint64_t p = lo + 16 * (i + u * (uint64_t)n);
#pragma unroll
          for (int src = 0; src < kUnrollWorld; ++src)
            if (src < world) part[u][src] = load(src, p);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          *reinterpret_cast<uint4*>(out + lo + 16 * (i + u * (uint64_t)n)) = sum_rank_order<D>(part[u], world);
      }
    for (; i < nvec; i += n) {
      const uint64_t p = lo + 16 * i;
      uint4 part[kMaxWorld];
#pragma unroll
      for (int src = 0; src < kMaxWorld; ++src)  // every load in flight before the first add
        if (src < world) part[src] = load(src, p);
      *reinterpret_cast<uint4*>(out + p) = sum_rank_order<D>(part, world);
    }
    done = lo + 16 * nvec;
  }
  for (uint64_t p = done + (uint64_t)t * E::kSize; p < hi; p += (uint64_t)n * E::kSize) {
    const float acc = sum_one(
        world, [&](int src) { return src == rank ? E::load(own + o_at(p)) : E::load_cv(lane0 + src * lane + p); });
    E::store(out + p, acc);
  }
}

// This block's share (g of `groups`) of piece c: bytes [lo, hi) of a lane,
// and for the MoE rows also rows [r0, r1) of a destination's part.
template <BulkKind K>
__device__ void share_of(const BulkOp& op, int c, int g, int groups, uint64_t& lo, uint64_t& hi, uint64_t& r0,
                         uint64_t& r1) {
  if (K == BulkKind::kMoe) {
    uint64_t plo, phi;
    row_piece(op.rows_per_rank, c, plo, phi);
    r0 = plo + (phi - plo) * g / groups;
    r1 = plo + (phi - plo) * (g + 1) / groups;
    lo = r0 * op.row_bytes;
    hi = r1 * op.row_bytes;
  } else {
    uint64_t plo, phi;
    piece_range(op.slice, c, plo, phi);
    share_range(plo, phi, g, groups, lo, hi);
    r0 = r1 = 0;
  }
}

// Piece c, whole: bytes [lo, hi) of a lane.
template <BulkKind K>
__device__ void piece_of(const BulkOp& op, int c, uint64_t& lo, uint64_t& hi) {
  if (K == BulkKind::kMoe) {
    row_piece(op.rows_per_rank, c, lo, hi);
    lo *= op.row_bytes;
    hi *= op.row_bytes;
  } else {
    piece_range(op.slice, c, lo, hi);
  }
}

// The destination of a piece's signal: all-gather sends the same slice to
// every peer; the others a part per destination.
template <BulkKind K>
__host__ __device__ constexpr bool fan_out() {
  return K == BulkKind::kGather;
}

template <typename Ch, BulkKind K, DType D>
__global__ void __launch_bounds__(kThreads, 1) bulk_kernel(Grid g, Ch ch, BulkOp op, Blocks b) {
  __shared__ int s_failed;
  DeviceWords* w = g.words;
  const SeqStart s = begin(g, Family::kBulk, op.d);
  const int P = b.producers, rank = ch.rank, world = ch.world;
  const bool producer = (int)blockIdx.x < P;
  const int gi = producer ? (int)blockIdx.x : (int)blockIdx.x - P;
  const int groups = producer ? P : b.consumers;
  const uint64_t lane = ch.in.lane_bytes;
  const auto send = ch.open(s.send(), fan_out<K>() ? Fan::kEveryPeer : Fan::kEachPeer, lane);
  if (blockIdx.x == 0) note_begun(g, Family::kBulk, s);
  if (threadIdx.x == 0) s_failed = s.prior ? 1 : 0;
  __syncthreads();

  for (int c = 0; c < kMaxPieces && !s.prior; ++c) {
    uint64_t lo, hi, r0, r1;
    share_of<K>(op, c, gi, groups, lo, hi, r0, r1);
    if (producer) {
      // 1. This block's share of piece c, destinations in send order.
      if (K == BulkKind::kGather) {
        for (int i = 0; i < send.fanout(kEveryPeer); ++i)
          copy_part<false>(send.put_dst(kEveryPeer, i), false, op.in, false, lo, hi, op.block, op.stride);
      } else if (K == BulkKind::kScatter) {
        for (int step = 1; step < world; ++step) {
          const int j = (rank + step) % world;
          copy_part<false>(send.put_dst((uint64_t)j), false, op.in + j * op.block, true, lo, hi, op.block, op.stride);
        }
      } else {
        for (int step = 1; step < world; ++step) {
          const int j = (rank + step) % world;
          combine_rows(op, j, r0, r1, send.put_dst((uint64_t)j) + lo, threadIdx.x / 32, kThreads / 32);
        }
      }
      // 2. The last producer of piece c signals it; its signal carries
      // every producer's writes (last_to_arrive).
      if (last_to_arrive(&w->piece_arrived[c], s.seq, P, kPeersField)) {
        uint64_t plo, phi;
        piece_of<K>(op, c, plo, phi);
        if (fan_out<K>()) {
          send.signal(kEveryPeer, c, plo, phi);
        } else {
          for (int step = 1; step < world; ++step) send.signal((uint64_t)((rank + step) % world), c, plo, phi);
        }
        note_published(g, Family::kBulk, s);
      }
      // This rank's own slice after the signal: the peers wait for the
      // piece, no one for this copy (the kernel's end does).
      if (K == BulkKind::kGather)
        copy_part<false>(op.out + rank * op.block, true, op.in, false, lo, hi, op.block, op.stride);
      // The MoE rows of this rank's own part after the signal too, into out,
      // where the consumers sum them in place; they wait for this count.
      if (K == BulkKind::kMoe) {
        combine_rows(op, rank, r0, r1, op.out + lo, threadIdx.x / 32, kThreads / 32);
        last_to_arrive(&w->piece_arrived[c], s.seq, P, kOwnField);
      }
    } else {
      // 3. Every peer's piece c: thread t waits for peer t. The MoE sum also
      // reads this rank's own rows, which the producers wrote: thread `rank`
      // waits for every producer's count of them (acquire).
      const int t = (int)threadIdx.x;
      if (t < world && t != rank && !s_failed && !wait_for(g, ch, s, t, c)) s_failed = 1;
      if (K == BulkKind::kMoe && t == rank) {
        while (true) {
          const unsigned long long n = ld_acquire_gpu(&w->piece_arrived[c]);
          if (n >> 16 > s.seq || (n >> 16 == s.seq && arrivals(n, kOwnField) >= P)) break;
          // The producers never wait; this bound is for a grid whose
          // producers could not be scheduled at all.
          if (globaltimer() - s.start > g.timeout_ns || ld_acquire_gpu(&w->fail_any) != 0) {
            atomicExch(&w->fail_any, 1ull);
            s_failed = 1;
            break;
          }
        }
      }
      __syncthreads();
      if (s_failed) break;  // the last block out fills the whole output with NaN
      // 4. This block's share of piece c into out. The peers' data
      // happens-before this through the flags' acquire loads and the barrier.
      const uint8_t* lane0 = ch.in.lane(s.par, 0);
      if (K == BulkKind::kGather) {
        for (int step = 1; step < world; ++step) {
          const int j = (rank + step) % world;
          copy_part<true>(op.out + j * op.block, true, lane0 + j * lane, false, lo, hi, op.block, op.stride);
        }
      } else if (K == BulkKind::kScatter) {
        reduce_part<D>(op, rank, world, lane0, lane, op.in + rank * op.block, true, op.out, lo, hi);
      } else {
        reduce_part<D>(op, rank, world, lane0, lane, op.out, false, op.out, lo, hi);
      }
      __syncthreads();  // s_failed is read by every thread at the next piece
    }
  }
  settle(g, ch, Family::kBulk, s, s_failed && !s.prior, send.entries(kMaxPieces), [&](int t, int n) {
    if (op.nan_type < 0) {
      for (uint64_t p = t; p < op.out_bytes; p += n) op.out[p] = 0xFF;
    } else {
      fill_nan_range<D>(op.out, 0, op.out_bytes, t, n);
    }
  });
}

// A consumer block per share of a piece, within the grid cap, and as many
// producers; the MoE rows a producer per kRowsPerProducer rows of a piece
// (every destination's), up to the multiprocessors the consumers leave:
// computing them is the work the unfused pair gives a whole GPU.
Blocks blocks_for(const Grid& g, const BulkOp& op, int world) {
  const int cap = std::max(1, std::min(g.max_blocks, kMaxGridBlocks) / 2);
  const uint64_t share = op.gpu_inboxes ? kShareBytesGpuInboxes : kShareBytes;
  Blocks b;
  b.consumers = b.producers = (int)std::clamp<uint64_t>((op.piece_bytes + share - 1) / share, 1, (uint64_t)cap);
  if (op.kind == BulkKind::kMoe) {
    const uint64_t rows = (op.rows_per_rank + kMaxPieces - 1) / kMaxPieces * (uint64_t)world;
    const int most = std::max(b.consumers, std::min(g.sms, kMaxGridBlocks) - b.consumers);
    b.producers = (int)std::clamp<uint64_t>((rows + kRowsPerProducer - 1) / kRowsPerProducer, (uint64_t)b.consumers,
                                            (uint64_t)most);
  }
  return b;
}

template <typename Ch, BulkKind K, DType D>
cudaError_t launch_kind(const Grid& g, const Ch& ch, const BulkOp& op, cudaStream_t stream) {
  const Blocks b = blocks_for(g, op, ch.world);
  bulk_kernel<Ch, K, D><<<b.producers + b.consumers, kThreads, 0, stream>>>(g, ch, op, b);
  return cudaGetLastError();  // may be an earlier kernel's error
}

template <typename Ch, BulkKind K>
cudaError_t launch_typed(const Grid& g, const Ch& ch, const BulkOp& op, cudaStream_t stream) {
  switch (op.dtype) {
    case DType::kF32:
      return launch_kind<Ch, K, DType::kF32>(g, ch, op, stream);
    case DType::kBF16:
      return launch_kind<Ch, K, DType::kBF16>(g, ch, op, stream);
    case DType::kF16:
      return launch_kind<Ch, K, DType::kF16>(g, ch, op, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

template <typename Ch>
cudaError_t launch_bulk(const Grid& g, const Ch& ch, const BulkOp& op, cudaStream_t stream) {
  switch (op.kind) {
    case BulkKind::kGather:
      return launch_typed<Ch, BulkKind::kGather>(g, ch, op, stream);
    case BulkKind::kScatter:
      return launch_typed<Ch, BulkKind::kScatter>(g, ch, op, stream);
    case BulkKind::kMoe:
      return launch_kind<Ch, BulkKind::kMoe, DType::kBF16>(g, ch, op, stream);
  }
  return cudaErrorInvalidValue;
}

template cudaError_t launch_bulk<DirectChannel>(const Grid&, const DirectChannel&, const BulkOp&, cudaStream_t);
template cudaError_t launch_bulk<ProxyChannel>(const Grid&, const ProxyChannel&, const BulkOp&, cudaStream_t);

}  // namespace arx::cuda

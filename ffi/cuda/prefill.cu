// The prefill ops on NVIDIA GPUs: all-gather, reduce-scatter and the fused
// MoE combine + reduce-scatter, on the layout and with the flags of
// layout.h ("Prefill-sized ops"), with the same results as ffi/host/
// prefill.cc, bit for bit. One kernel per op, one prefill seq s per op,
// kept on the device (DeviceWords::prefill_seq), so a CUDA graph that
// captured the launch replays correctly.
//
// An op goes out in kChunks pieces, and piece c is taken by kChunks x G
// blocks: block b works on piece c = b / G, share g = b % G (piece 0's
// blocks have the lowest indices, so the hardware starts them first). Each
// block
//   1. produces its share of piece c: copies (all-gather, reduce-scatter)
//      or computes (the MoE rows) it, for every destination in send order
//      (rank + 1, rank + 2, ...), into
//        direct mode (shm: the peers' regions are mapped here): each peer's
//          prefill_recv[s & 1] at rank * slice, where the peer reads it;
//        proxy mode (tcp): this rank's prefill_send[s & 1] at the
//          destination's chunk, for the proxy to send;
//   2. arrives on the piece's counter (DeviceWords::piece_arrived[c]): the
//      last of the G blocks publishes the piece, as a carrier would --
//        direct mode: piece c's flag word (prefill_piece_flag_index) in each
//          peer's flags, progress prefill_progress(s, c), with release;
//        proxy mode: the piece's work ring entries, at fixed indices
//          (DeviceWords::ring_published + the piece's place in the op), the
//          tag last with release; the proxy takes entries in index order,
//          so pieces go out in order whichever block finished first;
//   3. waits for every peer's piece c (one thread per peer; bounded by the
//      timeout in %globaltimer time and by Control::abort) -- direct mode:
//      the peer's word for piece c; proxy mode: the peer's flag on each of
//      its channels, which covers every earlier piece of the channel;
//   4. moves its share of piece c into `out` (all-gather: the peers'
//      slices; reduce-scatter and MoE: the rank-order fp32 sum, rounded
//      once).
// The last block out of the grid settles the op: on a failed wait the
// failure record (failed_op = the WorkOp), NaN over the whole output, the
// endpoint's sticky failure; then prefill_seq (and, in proxy mode,
// ring_published) advance.
//
// Why per-piece flag words in direct mode. A carrier's channel delivers a
// piece's data before its flag, and its flags in piece order, so one word
// per (source, root) covers every earlier piece. Here the blocks of
// different pieces run at once and finish in any order, so each (source,
// piece) has its own word.
//
// Blocks wait only for peers, never for another block of this grid, and
// each produces before it waits: a running block never holds back what a
// peer waits for. (The piece's publication waits for the piece's last
// block, which needs nothing to run.)
//
// Reuse of prefill_recv / prefill_send / the ring by parity: layout.h,
// "Reuse". Its premise, that ops of one endpoint run one after another,
// holds here by stream order (one kernel per op, kernels of an endpoint on
// XLA's stream of its device), and each kernel has read everything it
// needs from prefill_recv[s & 1] into `out` before it completes. The
// per-piece words keep the argument: a peer writes piece c of op s + 2 into
// prefill_recv[s & 1] only from its kernel for s + 2, which starts after
// its kernel for s + 1 completed, which waited for every piece of this
// rank's s + 1, which this rank's kernel for s + 1 published only after
// its kernel for s had completed -- with every read of s.
// A flag past op s (a later op's progress) comes from a peer that finished
// s, which needed this rank's pieces of s: it counts as arrived; its later
// data went to the other parity.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/device_side.h"
#include "cuda/elements.cuh"
#include "cuda/grid.cuh"
#include "cuda/ptx.cuh"

namespace arx::cuda {
namespace {

constexpr int kThreads = 512;
// Bytes of a piece one block takes, about: more blocks per piece while the
// pieces are big, up to the grid cap (DeviceView::max_blocks).
constexpr uint64_t kShareBytes = 256 << 10;

enum class Kind { kGather, kScatter, kMoe };

// One op, as the kernel needs it. `slice` is one chunk's bytes: all-gather,
// a rank's part; reduce-scatter and MoE, one destination's part. The
// gathered / scattered tensors are [outer][world][block]: a rank's part is
// `outer` rows of `block` bytes, `stride` = world * block apart; on the wire
// it is contiguous.
struct Op {
  const uint8_t* in;
  uint8_t* out;
  uint64_t slice, block, stride;
  uint64_t desc;
  int nan_type;  // DType of the NaN a failed op leaves, or -1: every byte 0xFF
  uint64_t out_bytes;
  int groups;    // G: blocks per piece
  // The MoE combine.
  MoeCombineArgs moe;
  uint64_t rows_per_rank, row_bytes;
};

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

// out[p] for p in bytes [lo, hi) of this rank's result = the rank-order fp32
// sum over sources, rounded once: this rank's own part from `own` (device
// memory; rows if own_rows), each peer's from prefill_recv[par] at src *
// slice (host memory, written by the peer or the proxy). The same sum as the
// host's sum_rank_order, so both device sides give the same bits. out may
// be `own` (the MoE rows): each element is read, then written, by one thread.
template <DType D>
__device__ void reduce_part(const DeviceView& v, const Op& op, const uint8_t* recv, const uint8_t* own, bool own_rows,
                            uint8_t* out, uint64_t lo, uint64_t hi) {
  using E = Elem<D>;
  const int t = threadIdx.x, n = blockDim.x;
  auto o_at = [&](uint64_t p) { return own_rows ? row_at(p, op.block, op.stride) : p; };
  const bool vec = aligned16(own) && aligned16(out) && aligned16(recv) && op.slice % 16 == 0 && lo % 16 == 0 &&
                   (!own_rows || op.stride == op.block || op.block % 16 == 0);
  uint64_t done = lo;
  if (vec) {
    const uint64_t nvec = (hi - lo) / 16;
    for (uint64_t i = (uint64_t)t; i < nvec; i += n) {
      const uint64_t p = lo + 16 * i;
      uint4 part[kMaxWorld];
#pragma unroll
      for (int src = 0; src < kMaxWorld; ++src)  // every load in flight before the first add
        if (src < v.world)
          part[src] = src == v.rank ? *reinterpret_cast<const uint4*>(own + o_at(p))
                                    : ld_cv_v4(recv + src * op.slice + p);
      const uint4 o = sum_rank_order<D>(part, v.world);
      *reinterpret_cast<uint4*>(out + p) = o;
    }
    done = lo + 16 * nvec;
  }
  for (uint64_t p = done + (uint64_t)t * E::kSize; p < hi; p += (uint64_t)n * E::kSize) {
    float acc = 0.0f;
    for (int src = 0; src < v.world; ++src)
      acc = __fadd_rn(acc, src == v.rank ? E::load(own + o_at(p)) : E::load_cv(recv + src * op.slice + p));
    E::store(out + p, acc);
  }
}

// Rows [r0, r1) of destination j's part of the combined MoE output, bf16,
// row r at dst + (r - r0) * row_bytes: for token t = j * rows_per_rank + r,
//   acc = shared[t]; for k in order: acc = fma(w[t, k], y[pos[t, k]], acc)
// (e4m3 y: fma(w[t, k] * scale, y, acc), the product w * scale rounded
// first), rounded once; zero past the tokens. The arithmetic of
// ffi/host/prefill.cc's combine_row, term by term, so both device sides give
// the same bits. A warp per row, its lanes over the columns.
__device__ void combine_rows(const Op& op, int j, uint64_t r0, uint64_t r1, uint8_t* dst) {
  const MoeCombineArgs& a = op.moe;
  const uint64_t H = a.hidden;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const bool vec = H % 8 == 0 && aligned16(dst) && aligned16(a.shared) && (a.y_scale || aligned16(a.y));
  for (uint64_t r = r0 + warp; r < r1; r += warps) {
    const uint64_t t = (uint64_t)j * op.rows_per_rank + r;
    uint8_t* row = dst + (r - r0) * op.row_bytes;
    if (t >= a.tokens) {  // padding rows are zero
      for (uint64_t b = lane * 16; b < op.row_bytes; b += 32 * 16) {
        if (b + 16 <= op.row_bytes && aligned16(row)) *reinterpret_cast<uint4*>(row + b) = make_uint4(0, 0, 0, 0);
        else for (uint64_t q = b; q < min(b + 16, op.row_bytes); ++q) row[q] = 0;
      }
      continue;
    }
    const uint16_t* sh = a.shared + t * H;
    // Columns in groups of 8 (one 16-byte vector of bf16), or one at a time.
    const uint64_t per = vec ? 8 : 1;
    for (uint64_t h0 = lane * per; h0 < H; h0 += 32 * per) {
      float acc[8];
      if (vec) {
        const uint4 s = *reinterpret_cast<const uint4*>(sh + h0);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] = Elem<DType::kBF16>::get(s, k);
      } else {
        acc[0] = bf16_to_f32(sh[h0]);
      }
      for (uint64_t q = 0; q < a.topk; ++q) {
        int64_t p = a.pos[t * a.topk + q];
        p = p < 0 ? 0 : (p >= (int64_t)a.rows ? (int64_t)a.rows - 1 : p);  // clamped, as jnp.take(mode="clip")
        const float wq = a.w[t * a.topk + q];
        if (a.y_scale) {
          // The weight times the 128-column block's scale, rounded, then per
          // element (8 columns never straddle a block: 128 % 8 == 0).
          const float f = __fmul_rn(wq, a.y_scale[(uint64_t)p * (H / 128) + h0 / 128]);
          const uint8_t* y8 = static_cast<const uint8_t*>(a.y) + (uint64_t)p * H + h0;
          for (uint64_t k = 0; k < per; ++k) acc[k] = __fmaf_rn(f, e4m3_to_f32(y8[k]), acc[k]);
        } else {
          const uint16_t* y = static_cast<const uint16_t*>(a.y) + (uint64_t)p * H + h0;
          if (vec) {
            const uint4 yv = *reinterpret_cast<const uint4*>(y);
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[k] = __fmaf_rn(wq, Elem<DType::kBF16>::get(yv, k), acc[k]);
          } else {
            acc[0] = __fmaf_rn(wq, bf16_to_f32(y[0]), acc[0]);
          }
        }
      }
      if (vec) {
        uint4 o;
#pragma unroll
        for (int k = 0; k < 8; ++k) Elem<DType::kBF16>::put(o, k, acc[k]);
        *reinterpret_cast<uint4*>(row + 2 * h0) = o;
      } else {
        *reinterpret_cast<uint16_t*>(row + 2 * h0) = (uint16_t)f32_to_bf16(acc[0]);
      }
    }
  }
}

// Step 3 for one peer: waits until `flag` reaches `want`. A flag inside op
// s's progress range must carry its descriptor (a mismatch otherwise); a
// flag past it counts as arrived (see the top). false: this block gives up,
// and what it found is in DeviceWords::fail_* for the last block out.
__device__ bool wait_flag(const DeviceView& v, const uint64_t* flag, uint64_t seq, uint64_t want, uint64_t desc,
                          int src, unsigned long long missing, uint64_t start) {
  const uint64_t op_lo = prefill_progress(seq, 0), op_hi = prefill_progress(seq, 15);
  for (uint32_t turn = 0;; ++turn) {
    const uint64_t f = ld_acquire_sys(flag);
    const uint64_t progress = flag_progress(f);
    if (progress >= op_lo && progress <= op_hi && flag_desc(f) != flag_desc(flag_word(0, desc))) {
      give_up_mismatch(v.words, f, src);
      return false;
    }
    if (progress >= want) return true;
    if (!keep_waiting(v, turn, start, missing)) return false;
  }
}

// One work ring entry at index idx (proxy mode): the fields, then the tag
// (idx + 1) with release; the proxy acquires the tag, then reads. The
// piece's data reached system scope before (the caller's fence).
__device__ void publish_entry(const DeviceView& v, uint64_t idx, WorkOp op, uint64_t seq, uint64_t piece,
                              uint64_t slice, uint64_t lo, uint64_t hi, uint64_t desc) {
  WorkItem* it = &v.pctl->ring[idx % kWorkRing];
  st_relaxed_sys(&it->op, (uint64_t)op);
  st_relaxed_sys(&it->seq, seq);
  st_relaxed_sys(&it->piece, piece);
  st_relaxed_sys(&it->slice, slice);
  st_relaxed_sys(&it->lo, lo);
  st_relaxed_sys(&it->hi, hi);
  st_relaxed_sys(&it->desc, desc);
  st_release_sys(&it->tag, idx + 1);
}

template <Kind K>
__host__ __device__ constexpr WorkOp work_op() {
  return K == Kind::kGather ? WorkOp::kAllGather : K == Kind::kScatter ? WorkOp::kReduceScatter : WorkOp::kRsPiece;
}

// Ring entries of one op (proxy mode): a piece for all peers at once, or,
// for the MoE rows, a piece per destination (layout.h, WorkOp).
template <Kind K>
__host__ __device__ int ring_entries(int world) {
  return K == Kind::kMoe ? kChunks * (world - 1) : kChunks;
}

// This block's share (share g of `groups`) of piece c: bytes [lo, hi) of a
// chunk, and for the MoE rows also rows [r0, r1) of a destination's part.
template <Kind K>
__device__ void share_of(const Op& op, int c, int g, int groups, uint64_t& lo, uint64_t& hi, uint64_t& r0,
                         uint64_t& r1) {
  if (K == Kind::kMoe) {
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

template <Kind K, DType D>
__global__ void __launch_bounds__(kThreads, 1) prefill_kernel(DeviceView v, Op op) {
  __shared__ int s_failed, s_last, s_any;
  DeviceWords* w = v.words;
  const uint64_t seq = w->prefill_seq + 1;  // the previous kernel's last block wrote it; stream order
  const int par = (int)(seq & 1);
  const int G = op.groups, rank = v.rank, world = v.world;
  const bool producer = (int)blockIdx.x < G;
  const int g = producer ? (int)blockIdx.x : (int)blockIdx.x - G;
  const uint64_t start = globaltimer();
  const uint64_t ring_base = w->ring_published;
  // An earlier op failed (recorded by an earlier kernel, so every block sees
  // it): publish nothing, wait for nothing, fill NaN.
  const bool prior = recorded_failure(v);
  const uint64_t S = v.prefill_slot_bytes;
  const uint8_t* recv = v.prefill_recv + (uint64_t)par * S;
  uint8_t* send = v.prefill_send + (uint64_t)par * S;
  auto peer_in = [&](int j) { return v.peer_prefill_recv[j] + (uint64_t)par * S + (uint64_t)rank * op.slice; };
  if (threadIdx.x == 0) s_failed = prior ? 1 : 0;
  __syncthreads();

  for (int c = 0; c < kChunks && !prior; ++c) {
    uint64_t lo, hi, r0, r1;
    share_of<K>(op, c, g, G, lo, hi, r0, r1);
    if (producer) {
      // 1. Produce this block's share of piece c, destinations in send order.
      if (K == Kind::kGather) {
        copy_part<false>(op.out + rank * op.block, true, op.in, false, lo, hi, op.block, op.stride);
        if (v.direct) {
          for (int step = 1; step < world; ++step)
            copy_part<false>(peer_in((rank + step) % world), false, op.in, false, lo, hi, op.block, op.stride);
        } else {
          copy_part<false>(send + rank * op.slice, false, op.in, false, lo, hi, op.block, op.stride);
        }
      } else if (K == Kind::kScatter) {
        for (int step = 1; step < world; ++step) {
          const int j = (rank + step) % world;
          copy_part<false>(v.direct ? peer_in(j) : send + j * op.slice, false, op.in + j * op.block, true, lo, hi,
                           op.block, op.stride);
        }
      } else {
        // This rank's own rows last, into out, where the consumers sum them
        // in place.
        for (int step = 1; step <= world; ++step) {
          const int j = (rank + step) % world;
          uint8_t* dst = j == rank ? op.out : v.direct ? peer_in(j) : send + j * op.slice;
          combine_rows(op, j, r0, r1, dst + lo);
        }
      }
      // 2. The last producer of piece c publishes it. This block's writes
      // (before the barrier) reach system scope before its arrival (fence,
      // then acq_rel); the last arrival's release stores carry them all.
      __syncthreads();
      if (threadIdx.x == 0) {
        fence_sys();
        const unsigned long long n = tagged_arrive(&w->piece_arrived[c], seq);
        if (world > 1 && n >> 16 == seq && (int)(n & 0xffff) == G) {
          const uint64_t f = flag_word(prefill_progress(seq, c), op.desc);
          if (v.direct) {
            for (int step = 1; step < world; ++step)
              st_release_sys(v.peer_flags[(rank + step) % world] + prefill_piece_flag_index(rank, c), f);
          } else if (K == Kind::kMoe) {
            uint64_t plo, phi;
            row_piece(op.rows_per_rank, c, plo, phi);
            for (int step = 1; step < world; ++step)
              publish_entry(v, ring_base + (uint64_t)c * (world - 1) + (step - 1), WorkOp::kRsPiece, seq,
                            (uint64_t)((rank + step) % world) * kChunks + c, op.slice, plo * op.row_bytes,
                            phi * op.row_bytes, op.desc);
          } else {
            uint64_t plo, phi;
            piece_range(op.slice, c, plo, phi);
            publish_entry(v, ring_base + c, work_op<K>(), seq, (uint64_t)c, op.slice, plo, phi, op.desc);
          }
        }
      }
    } else {
      // 3. Wait for every peer's piece c: thread t waits for peer t. The
      // MoE sum also reads this rank's own rows, which the producers wrote:
      // thread `rank` waits for the piece's last producer (acquire).
      const int t = (int)threadIdx.x;
      if (t < world && t != rank && !s_failed) {
        unsigned long long missing = 0;
        for (int root = 0; root < v.roots; ++root) missing |= 1ull << flag_index(t, root);
        const uint64_t want = prefill_progress(seq, c);
        bool ok = true;
        if (v.direct)
          ok = wait_flag(v, v.flags + prefill_piece_flag_index(t, c), seq, want, op.desc, t, missing, start);
        for (int root = 0; !v.direct && root < v.roots && ok; ++root)
          ok = wait_flag(v, v.flags + prefill_flag_index(t, root), seq, want, op.desc, t, missing, start);
        if (!ok) s_failed = 1;
      }
      if (K == Kind::kMoe && t == rank) {
        while (true) {
          const unsigned long long n = ld_acquire_gpu(&w->piece_arrived[c]);
          if (n >> 16 > seq || (n >> 16 == seq && (int)(n & 0xffff) >= G)) break;
          // The producers never wait; this bound is for a grid whose
          // producers could not be scheduled at all.
          if (globaltimer() - start > v.timeout_ns || ld_acquire_gpu(&w->fail_any) != 0) {
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
      if (K == Kind::kGather) {
        for (int step = 1; step < world; ++step) {
          const int j = (rank + step) % world;
          copy_part<true>(op.out + j * op.block, true, recv + j * op.slice, false, lo, hi, op.block, op.stride);
        }
      } else if (K == Kind::kScatter) {
        reduce_part<D>(v, op, recv, op.in + rank * op.block, true, op.out, lo, hi);
      } else {
        reduce_part<D>(v, op, recv, op.out, false, op.out, lo, hi);
      }
      __syncthreads();  // s_failed is read by every thread at the next piece
    }
  }

  // The last block out settles the op.
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long n = tagged_arrive(&w->prefill_finished, seq);
    s_last = n >> 16 == seq && (n & 0xffff) == gridDim.x;
    s_any = s_last && (prior || ld_acquire_gpu(&w->fail_any) != 0);
  }
  __syncthreads();
  if (!s_last) return;
  // A failed op: the whole output is NaN, whatever other blocks wrote (they
  // are all done: they arrived before this block).
  if (s_any) {
    if (op.nan_type < 0) {
      for (uint64_t p = threadIdx.x; p < op.out_bytes; p += blockDim.x) op.out[p] = 0xFF;
    } else {
      using E = Elem<D>;  // the NaN the host side's fill_nan leaves, bit for bit
      for (uint64_t e = threadIdx.x; e < op.out_bytes / E::kSize; e += blockDim.x) {
        if (E::kSize == 4) *reinterpret_cast<uint32_t*>(op.out + 4 * e) = E::kNan;
        else *reinterpret_cast<uint16_t*>(op.out + 2 * e) = (uint16_t)E::kNan;
      }
    }
  }
  if (threadIdx.x != 0) return;
  if (s_any && !prior) {
    const unsigned long long found = ld_acquire_gpu(&w->fail_kind);
    record_failure(v, seq, (uint64_t)work_op<K>(), found ? found : (uint64_t)FailureKind::kTimeout,
                   ld_acquire_gpu(&w->fail_missing), w->fail_flag, w->fail_src, op.desc);
    w->failed = 1;  // sticky: nothing more is published (the reuse argument no longer holds)
    // Cleared for the next grid, which starts after this one completed.
    w->fail_any = w->fail_kind = w->fail_missing = w->fail_flag = w->fail_src = 0;
  }
  // The sequence state advances on every launch, failed or not, so the
  // grid's counters stay consistent and the GPU stays usable; ring entries
  // only count when they were published.
  w->prefill_seq = seq;
  if (!prior && !v.direct && world > 1) w->ring_published = ring_base + ring_entries<K>(world);
  st_relaxed_sys(&v.pctl->done, seq);  // for the proxy's watchdog: nothing is read on its strength
}

// G producer blocks and G consumer blocks: one each per kShareBytes of a
// piece, within the grid cap.
int groups_for(const DeviceView& v, uint64_t piece_bytes) {
  const int cap = std::max(1, v.max_blocks / 2);
  return (int)std::clamp<uint64_t>((piece_bytes + kShareBytes - 1) / kShareBytes, 1, (uint64_t)cap);
}

template <Kind K, DType D>
cudaError_t launch_op(const DeviceView& v, Op op, uint64_t piece_bytes, cudaStream_t stream) {
  op.groups = groups_for(v, piece_bytes);
  prefill_kernel<K, D><<<2 * op.groups, kThreads, 0, stream>>>(v, op);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_all_gather(const DeviceView& v, const void* in, void* out, uint64_t bytes, uint64_t outer,
                              uint64_t type_code, int nan_type, uint64_t tag, cudaStream_t stream) {
  Op op{};
  op.in = static_cast<const uint8_t*>(in);
  op.out = static_cast<uint8_t*>(out);
  op.slice = bytes;
  op.block = outer ? bytes / outer : bytes;
  op.stride = op.block * v.world;
  op.desc = describe_prefill(WorkOp::kAllGather, type_code | outer << 8, bytes, tag);
  op.nan_type = nan_type;
  op.out_bytes = bytes * v.world;
  const uint64_t piece = bytes / kChunks + 16;
  switch (nan_type) {  // the element type only matters for the NaN fill
    case (int)DType::kF32: return launch_op<Kind::kGather, DType::kF32>(v, op, piece, stream);
    case (int)DType::kF16: return launch_op<Kind::kGather, DType::kF16>(v, op, piece, stream);
    default: return launch_op<Kind::kGather, DType::kBF16>(v, op, piece, stream);
  }
}

cudaError_t launch_reduce_scatter(const DeviceView& v, DType dtype, const void* in, void* out, uint64_t count,
                                  uint64_t outer, uint64_t tag, cudaStream_t stream) {
  Op op{};
  op.in = static_cast<const uint8_t*>(in);
  op.out = static_cast<uint8_t*>(out);
  op.slice = count * dtype_size(dtype);
  op.block = outer ? op.slice / outer : op.slice;
  op.stride = op.block * v.world;
  op.desc = describe_prefill(WorkOp::kReduceScatter, (uint64_t)dtype | outer << 8, count * v.world, tag);
  op.nan_type = (int)dtype;
  op.out_bytes = op.slice;
  // Each share goes to world - 1 peers and is summed from world sources.
  const uint64_t piece = op.slice / kChunks * v.world + 16;
  switch (dtype) {
    case DType::kF32: return launch_op<Kind::kScatter, DType::kF32>(v, op, piece, stream);
    case DType::kBF16: return launch_op<Kind::kScatter, DType::kBF16>(v, op, piece, stream);
    case DType::kF16: return launch_op<Kind::kScatter, DType::kF16>(v, op, piece, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_moe_combine(const DeviceView& v, const MoeCombineArgs& a, uint16_t* out, uint64_t tag,
                               cudaStream_t stream) {
  Op op{};
  op.out = reinterpret_cast<uint8_t*>(out);
  op.moe = a;
  op.rows_per_rank = a.padded / v.world;
  op.row_bytes = a.hidden * 2;
  op.slice = op.rows_per_rank * op.row_bytes;
  op.block = op.stride = op.slice;
  op.desc = describe_prefill(WorkOp::kRsPiece, (uint64_t)DType::kBF16, a.padded * a.hidden, tag);
  op.nan_type = (int)DType::kBF16;
  op.out_bytes = op.slice;
  // Computing a row reads topk rows of y: a share is worth more blocks.
  const uint64_t piece = op.slice / kChunks * v.world * std::max<uint64_t>(a.topk, 1) + 16;
  return launch_op<Kind::kMoe, DType::kBF16>(v, op, piece, stream);
}

}  // namespace arx::cuda

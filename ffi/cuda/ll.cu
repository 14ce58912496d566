// The LL one-shot psum (layout.h, "The LL one-shot"; NCCL's LL protocol),
// over either medium (cuda/device_side.h, LLChannel). The pipelined
// one-shot's reader makes a bus round trip for the flag, one for the header
// and one for the data after them, and its writer fences between data and
// flag. Here the partial goes in 16-byte lines, {data0, f, data1, f}, f =
// ll_flag(seq, desc): the reader's poll of a line is its read of the data.
// Each 8-byte half is one single-copy-atomic access (the lines are stored
// and loaded as .v2.u64: the PTX memory model treats a vector access as one
// access per element, so a half never tears; the halves may arrive apart,
// which is why each has its own copy of f), and a carrier that puts lines
// puts whole words (Transport::whole_words).
//
// One seq, one grid: B blocks of lines (ll_grid) and one service block. Thread
// g of the B blocks' N threads owns lines g, g + N, ... (kLLLinesPerThread at
// most) of the partial, 8 payload bytes each, and for each of them
//   1. reads its 8 bytes of `in` (device memory), before anything is written
//      to `out` (in may alias out: no other thread touches these bytes);
//   2. stores the line where the lines' channel says, one relaxed
//      system-scope 16-byte store each: direct, into every peer's
//      ll_recv[seq & 1][rank] (send order rank + 1, rank + 2, ...), no fence;
//      through the proxy, into the staging buffer once, and the last block
//      done with its stores (a grid counter, after a fence per block)
//      publishes the whole partial's lines as one put, without a flag word
//      (the staging is read before the trigger: comm/channel.h, kStaged);
//   3. polls the same line of its own ll_recv[seq & 1][src], for every peer
//      src, until both flag words equal f (ll_wait), bounded as every wait is
//      (grid.cuh, DevicePoll);
//   4. zeroes the lines it consumed (see "Stale lines");
//   5. sums in rank order from rank 0's element, rounded once (the bits of
//      every other algorithm), and writes its 8 bytes of out (NaN if it gave
//      up).
// A fused call (psum_add_norm, base/norm.h) gives each block whole rows
// instead, contiguous lines (comm/plan.cc: a row fits a block and starts on
// a line, or one block holds the whole partial): thread t of block b owns the
// lines lo_b + t, lo_b + t + T, ... of its block's range, and once every
// thread of the block has written its sums, the block norms its rows
// (cuda/norm.cuh). Which thread owns which line changes nothing below: each
// line still has one owner, who stores, polls, zeroes and sums it.
// The service block announces the seq to every peer over the psum channel
// (flag_word(seq, desc) into the peer's psum word (this rank, piece 0) --
// the word the other psum algorithms signal their first piece in -- with
// the exact descriptor in its header slot; through the proxy that trigger
// comes first, before the lines'), announces it to the watchdog and asks L2
// for the prefetch ranges, then waits for every peer's announcement of seq.
// The last block out settles the seq (grid.cuh). After an earlier failure
// (prior), no thread writes or waits for anything.
//
// Stale lines. Invariant: while an endpoint has not failed, every line of its
// ll_recv holds 0 except lines that a peer wrote for a seq this rank has not
// finished. It holds at the start (the memory is created zeroed). An LL seq
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
// differs (ll_flag is injective in the 24-bit descriptor for a given seq), so
// the line is never taken. Without the zeroing, a line left 128 uses of the
// slot earlier (bits 1-7 of f wrap) by the same collective, a loop's
// every-step psum, would be summed as this seq's: never acceptable.
//
// Buffer reuse: parity is enough. This rank's lines of seq + 2 reach a
// peer's ll_recv[seq & 1][rank] only after its kernel for seq + 2 stored
// them (and, through the proxy, published them), which starts after its
// kernel for seq + 1 completed. That kernel did not fail (after a failure
// nothing more is written), so it acquired a word the peer's seq + 1
// released: the announcement (LL), or a piece's flag word (the other
// algorithms, whose writers fence before it), stored by the peer's kernel
// or by its proxy after acquiring the kernel's trigger. That kernel of the
// peer's started after its kernel for seq completed, so every read of its
// ll_recv[seq & 1] for seq, and every zeroing store, happens before that
// release (the kernel boundary orders them before the releasing thread, and
// release is cumulative, also through the proxy's acquire and release),
// hence before this rank's seq + 2 lines: the peer finds 0 or seq + 2's
// lines there. The same holds for this rank's own ll_recv, with the roles
// swapped. No fence is needed at the end of the kernel. The staging buffer
// (proxy): this rank overwrites its lines of seq at seq + 2, after every
// peer finished seq (comm/channel.h, (*)); a peer that finished seq had
// every line of this rank's put, each written there after the proxy (or
// the NIC) read it out of the staging buffer, so those reads are over,
// although no flag word followed them. The argument needs an endpoint's
// kernels not to overlap (stream order).
//
// Mismatch. A peer that issued another collective at this seq must show up
// as an error, never as a sum. Its lines never match f (above). The
// announcement goes into the word where the other psum algorithms signal
// their first piece, with the LL descriptor (ll_tag in it): whichever
// algorithm a peer ran at this seq, the wait for its word finds that seq
// with another descriptor, a mismatch, and the give-up ends the line waits
// too (DeviceWords::fail_any); the peer's own wait on this rank's word finds
// the same. A word past seq: the peer announced seq + 1 at the start of its
// next kernel, so it finished seq -- it read all of this rank's lines, which
// each thread stores before it polls -- and its own lines for seq were
// stored (or put) before that kernel started: the next polls take them. It
// cannot be past seq + 1: the peer's seq + 1 needs this rank's seq + 1 lines.
#include "cuda/device_side.h"
#include "cuda/grid.cuh"
#include "cuda/kernels.h"
#include "cuda/norm.cuh"

namespace arx::cuda {
namespace {

// Lines a thread owns at most: every line's polls of all the peers in flight
// at once, before the first check.
constexpr int kLLLinesPerThread = 2;
static_assert(kLLMaxPayload / kLLLinePayload / kLLLinesPerThread / kThreads + 1 <= kMaxGridBlocks,
              "settle counts the blocks out in 8 bits");
static_assert(kLLBlockPayload == kLLLinePayload * kLLLinesPerThread * kThreads, "what comm/plan.cc assumes");

// The LL tag keeps an LL one-shot apart from the other psum algorithms in
// the descriptor (see "Mismatch").
__host__ __device__ inline uint64_t ll_tag(uint64_t tag) { return tag ^ 0x9E3779B97F4A7C15ull; }

// One line: two 8-byte halves, each a single-copy-atomic element (see the
// top), relaxed at system scope: the peers (and this rank's zeroing) write
// them, and the reader must see their stores, not a cached copy.
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
    const uint32_t u = (uint32_t) * reinterpret_cast<const uint16_t*>(p + at + 2 * h) << (16 * (h & 1));
    if (h < 2)
      w0 |= u;
    else
      w1 |= u;
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

// The sum of one line: the rank-order sum of every algorithm, so the bits are
// those of every other. lo / hi: the lines as loaded, by source (data in
// their low halves).
template <DType D>
__device__ __forceinline__ uint2 ll_sum(int rank, int world, uint2 mine, const uint64_t (&lo)[kMaxWorld],
                                        const uint64_t (&hi)[kMaxWorld]) {
  uint4 part[kMaxWorld];
#pragma unroll
  for (int src = 0; src < kMaxWorld; ++src)
    part[src] = src == rank ? make_uint4(mine.x, mine.y, 0, 0) : make_uint4((uint32_t)lo[src], (uint32_t)hi[src], 0, 0);
  const uint4 o = sum_rank_order<D>(part, world);  // the upper halves of the vectors are ignored
  return make_uint2(o.x, o.y);
}

// Step 3 for the thread's lines (first, first + stride, ... below `end`): polls them in
// every peer's slot of `in` (this rank's ll_recv, lanes of parity seq & 1) until each
// holds f in both halves, leaving them in lo / hi. false: the thread gave up
// on the seq (what it found is in DeviceWords::fail_*).
__device__ bool ll_wait(const Grid& g, const SeqStart& s, int rank, int world, uint32_t f, const Inbox& in,
                        uint64_t first, uint64_t stride, uint64_t end, uint64_t (&lo)[kLLLinesPerThread][kMaxWorld],
                        uint64_t (&hi)[kLLLinesPerThread][kMaxWorld]) {
  uint32_t pending = 0;  // bit src * kLLLinesPerThread + k: line k from src not taken yet
#pragma unroll
  for (int src = 0; src < kMaxWorld; ++src)
#pragma unroll
    for (int k = 0; k < kLLLinesPerThread; ++k)
      if (src < world && src != rank && first + k * stride < end) pending |= 1u << (src * kLLLinesPerThread + k);
  const DevicePoll poll{g, s.start};
  for (uint32_t turn = 0; pending; ++turn) {
    // Every pending line's load in flight before the first check: each is a
    // bus round trip. A line taken keeps its registers.
#pragma unroll
    for (int src = 0; src < kMaxWorld; ++src)
#pragma unroll
      for (int k = 0; k < kLLLinesPerThread; ++k)
        if (pending >> (src * kLLLinesPerThread + k) & 1)
          ld_line(in.lane(s.par, src) + kLLLineBytes * (first + k * stride), lo[k][src], hi[k][src]);
#pragma unroll
    for (int src = 0; src < kMaxWorld; ++src)
#pragma unroll
      for (int k = 0; k < kLLLinesPerThread; ++k) {
        const uint32_t bit = 1u << (src * kLLLinesPerThread + k);
        // Both halves: each carries its own flag, and they may arrive apart.
        if ((pending & bit) && (uint32_t)(lo[k][src] >> 32) == f && (uint32_t)(hi[k][src] >> 32) == f) pending &= ~bit;
      }
    if (!pending) break;
    // A peer that issued another collective at this seq never writes our
    // lines; the service block finds it out and gives up for the grid, which
    // ends this wait too (poll.stopped).
    const WaitEnd e = poll.aborted(turn)   ? WaitEnd::kAborted
                      : poll.stopped(turn) ? WaitEnd::kStopped
                      : poll.expired()     ? WaitEnd::kTimeout
                                           : WaitEnd::kArrived;
    if (e != WaitEnd::kArrived) {
      const uint64_t none[kDescriptorWords] = {};
      for (int src = 0; src < world; ++src)
        if (pending >> (src * kLLLinesPerThread) & ((1u << kLLLinesPerThread) - 1)) give_up(g.words, e, 0, src, none);
      return false;
    }
  }
  return true;
}

template <typename Ch, DType D>
__global__ void __launch_bounds__(kThreads, 1)
    ll_kernel(Grid g, LLChannel<Ch> ch, const uint8_t* in, uint8_t* out, uint64_t count, uint64_t tag, Prefetch pf,
              AddNorm nm, uint64_t block_rows) {
  using E = Elem<D>;
  const uint64_t bytes = count * E::kSize;
  const SeqStart s = begin(g, Family::kPsum, descriptor(OpCode::kPsum, (uint64_t)D, count, ll_tag(tag)));
  const int rank = ch.psum.rank, world = ch.psum.world, blocks = (int)gridDim.x - 1;
  const uint64_t lines = (bytes + kLLLinePayload - 1) / kLLLinePayload;
  const auto announce = ch.psum.open(s.send(), Fan::kEveryPeer);
  // Piece 1: the announcement is the collective's piece 0 (trigger_index).
  const auto put = ch.lines.open(s.send(), Fan::kEveryPeer);
  const uint64_t entries = announce.entries(1) + put.entries(1);
  const uint64_t rows = nm.on() ? count / nm.width : 0;
  auto nan = [&](int t, int n) {
    fill_nan_range<D>(out, 0, bytes, t, n);
    if (nm.on()) fill_nan_rows<D>(nm, 0, rows, t, n);
  };
  if ((int)blockIdx.x == blocks) {
    // The announcement: release, so that it orders everything this rank did
    // before it, its earlier kernels' zeroing of their lines included (the
    // kernel boundary orders those before this thread). It goes out as the
    // kernel begins, ahead of the lines, so the peers' waits for it are over
    // before the lines come: carried in the lines' own put instead, it was
    // slower (docs/performance.md, "One put per peer").
    if (threadIdx.x == 0 && !s.prior) {
      announce.signal(kEveryPeer, 0, 0, 0);
      note_published(g, Family::kPsum, s);
    }
    note_begun(g, Family::kPsum, s);
    prefetch(pf, threadIdx.x, blockDim.x);
    // Every peer's announcement: thread t waits for peer t's.
    const int t = (int)threadIdx.x;
    const bool ok = s.prior || t >= world || t == rank || wait_for(g, ch.psum, s, t, 0);
    settle(g, ch.psum, Family::kPsum, s, !ok, entries, nan);
    return;
  }
  // This thread's lines: first, first + stride, ... below end (see the top).
  uint64_t first = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (uint64_t)blocks * blockDim.x, end = lines,
           r0 = 0, r1 = 0;
  if (nm.on()) {
    const uint64_t row_bytes = nm.width * E::kSize;
    r0 = min(rows, blockIdx.x * block_rows);
    r1 = min(rows, r0 + block_rows);
    first = blocks == 1 ? threadIdx.x : r0 * row_bytes / kLLLinePayload + threadIdx.x;
    end = blocks == 1 ? lines : r1 * row_bytes / kLLLinePayload;
    stride = blockDim.x;
  }
  const bool aligned = aligned8(in) && aligned8(out);
  uint2 mine[kLLLinesPerThread];
#pragma unroll
  for (int k = 0; k < kLLLinesPerThread; ++k)
    mine[k] = first + k * stride < end ? ll_payload(in, first + k * stride, bytes, aligned) : make_uint2(0, 0);
  const uint32_t f = ll_flag(s.seq, s.desc);
  if (!s.prior) {
    for (int i = 0; i < put.fanout(kEveryPeer); ++i) {  // send order: rank + 1, rank + 2, ...
      uint8_t* slot = put.put_dst(kEveryPeer, i);
#pragma unroll
      for (int k = 0; k < kLLLinesPerThread; ++k)
        if (first + k * stride < end)
          st_line(slot + kLLLineBytes * (first + k * stride), (uint64_t)f << 32 | mine[k].x,
                  (uint64_t)f << 32 | mine[k].y);
    }
    // Staged lines reach system scope before the put that reads them: the
    // last block to arrive publishes them all (last_to_arrive).
    if constexpr (Ch::kStaged) {
      if (last_to_arrive(&g.words->family[(int)Family::kPsum].arrived, s.seq, blocks)) {
        put.publish(kEveryPeer, 1, 0, kLLLineBytes * lines);
        note_published(g, Family::kPsum, s);
      }
    }
  }
  uint64_t lo[kLLLinesPerThread][kMaxWorld] = {}, hi[kLLLinesPerThread][kMaxWorld] = {};
  const bool ok = !s.prior && ll_wait(g, s, rank, world, f, ch.lines.in, first, stride, end, lo, hi);
  if (ok && threadIdx.x == 0) ARX_STAMP(g.trace, Family::kPsum, s.seq, kArrived, globaltimer());
  if (ok) {
    // Zero the lines consumed (see "Stale lines"). After a give-up the
    // endpoint is failed for good and no line is polled again.
    for (int src = 0; src < world; ++src) {
      if (src == rank) continue;
#pragma unroll
      for (int k = 0; k < kLLLinesPerThread; ++k)
        if (first + k * stride < end) st_line(ch.lines.in.lane(s.par, src) + kLLLineBytes * (first + k * stride), 0, 0);
    }
  }
  // A thread that gave up writes NaN over its lines: the last block out
  // fills the whole output with NaN anyway; this keeps them from a wrong sum
  // meanwhile.
  const uint2 nan2 =
      E::kSize == 4 ? make_uint2(E::kNan, E::kNan) : make_uint2(E::kNan | E::kNan << 16, E::kNan | E::kNan << 16);
#pragma unroll
  for (int k = 0; k < kLLLinesPerThread; ++k)
    if (first + k * stride < end)
      ll_put(out, first + k * stride, bytes, aligned, ok ? ll_sum<D>(rank, world, mine[k], lo[k], hi[k]) : nan2);
  if (nm.on()) {
    __shared__ float s_lanes[kNormLanes];
    if (__syncthreads_and(ok)) {
      for (uint64_t row = r0; row < r1; ++row)
        add_norm_row<D>(nm, out, row, (int)threadIdx.x, (int)blockDim.x, s_lanes, [] { __syncthreads(); });
    } else {
      fill_nan_rows<D>(nm, r0, r1, (int)threadIdx.x, (int)blockDim.x);
    }
  }
  settle(g, ch.psum, Family::kPsum, s, !ok && !s.prior, entries, nan);
}

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

// A fused call's grid: whole rows per block, `block_rows` of them (see the
// top), each block's lines owned by kLLLinesPerThread or fewer per thread.
void ll_norm_grid(uint64_t bytes, uint64_t row_bytes, int& blocks, int& threads, uint64_t& block_rows) {
  const uint64_t rows = bytes / row_bytes;
  block_rows = std::max<uint64_t>(1, bytes <= kLLBlockPayload ? rows : kLLBlockPayload / row_bytes);
  blocks = (int)std::max<uint64_t>(1, (rows + block_rows - 1) / block_rows);
  const uint64_t per_block = blocks == 1 ? bytes : block_rows * row_bytes;
  const uint64_t need = std::max<uint64_t>(
      1, (per_block + kLLLinePayload * kLLLinesPerThread - 1) / (kLLLinePayload * kLLLinesPerThread));
  threads = (int)std::min<uint64_t>((need + 31) / 32 * 32, kThreads);
}

template <typename Ch, DType D>
cudaError_t launch_typed(const Grid& g, const LLChannel<Ch>& ch, const void* in, void* out, uint64_t count,
                         uint64_t tag, const Prefetch& pf, const AddNorm& nm, cudaStream_t stream) {
  int blocks = 0, threads = 0;
  uint64_t block_rows = 0;
  if (nm.on())
    ll_norm_grid(count * Elem<D>::kSize, nm.width * Elem<D>::kSize, blocks, threads, block_rows);
  else
    ll_grid(count * Elem<D>::kSize, blocks, threads);
  ll_kernel<Ch, D><<<blocks + 1, threads, 0, stream>>>(g, ch, static_cast<const uint8_t*>(in),
                                                       static_cast<uint8_t*>(out), count, tag, pf, nm, block_rows);
  return cudaGetLastError();  // may be an earlier kernel's error
}

}  // namespace

template <typename Ch>
cudaError_t launch_ll(const Grid& g, const LLChannel<Ch>& ch, DType dtype, const void* in, void* out, uint64_t count,
                      uint64_t tag, const Prefetch& pf, const AddNorm& nm, cudaStream_t stream) {
  switch (dtype) {
    case DType::kF32:
      return launch_typed<Ch, DType::kF32>(g, ch, in, out, count, tag, pf, nm, stream);
    case DType::kBF16:
      return launch_typed<Ch, DType::kBF16>(g, ch, in, out, count, tag, pf, nm, stream);
    case DType::kF16:
      return launch_typed<Ch, DType::kF16>(g, ch, in, out, count, tag, pf, nm, stream);
  }
  return cudaErrorInvalidValue;
}

template cudaError_t launch_ll<DirectChannel>(const Grid&, const LLChannel<DirectChannel>&, DType, const void*, void*,
                                              uint64_t, uint64_t, const Prefetch&, const AddNorm&, cudaStream_t);
template cudaError_t launch_ll<ProxyChannel>(const Grid&, const LLChannel<ProxyChannel>&, DType, const void*, void*,
                                             uint64_t, uint64_t, const Prefetch&, const AddNorm&, cudaStream_t);

}  // namespace arx::cuda

// The prefill ops' host device side. Each op is one prefill seq s: the
// device side copies (or, for the fused MoE combine, computes) piece by
// piece into prefill_send[s & 1] and publishes each piece into the work
// ring at once, so the proxy sends piece 0 while this thread still copies
// piece 1; then it waits piece by piece for every peer's flag to reach
// prefill_progress(s, piece) and moves that piece into XLA's output. Why
// the buffers and the ring may be reused: layout.h, "Reuse".
//
// The combine's arithmetic is written out as it is meant: each product
// added with one rounding, std::fmaf, as the reference CUDA kernel computes
// acc += w * y (nvcc contracts it) and as XLA computes it when it fuses the
// multiply and the add. The rest of the core is built with -ffp-contract=off,
// so nothing else is contracted differently on x86 and ARM.
#include "host/prefill.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "comm/atomics.h"
#include "host/common.h"
#include "host/convert.h"

namespace arx::host {
namespace {

// The prefill sequence state lives with the endpoint (PrefillControl::done),
// apart from psum's: the next op is the one after the last finished.
uint64_t next_seq(Endpoint& ep) { return load_relaxed(&ep.prefill_control()->done) + 1; }

void finish(Endpoint& ep, uint64_t seq) { store_release(&ep.prefill_control()->done, seq); }

// One ring entry: the fields first, the tag (index + 1) last with release;
// the proxy acquires the tag. The ring never holds more than kWorkRing
// entries the proxy has not taken (layout.h, "The ring"); a producer that
// found otherwise would overwrite one, so it stops with an error instead.
Status publish(Endpoint& ep, WorkOp op, uint64_t seq, uint64_t piece, uint64_t slice, uint64_t lo, uint64_t hi,
               uint64_t desc) {
  PrefillControl* pc = ep.prefill_control();
  const uint64_t idx = load_relaxed(&pc->published);
  const uint64_t consumed = load_acquire(&pc->consumed);
  if (idx - consumed >= (uint64_t)kWorkRing)
    return Status::Error(strf("jax_arx: %s: the work ring is full (%llu entries published, %llu taken by the proxy); "
                              "this is a bug in jax_arx",
                              ep.label().c_str(), (unsigned long long)idx, (unsigned long long)consumed));
  WorkItem& it = pc->ring[idx % kWorkRing];
  store_relaxed(&it.op, (uint64_t)op);
  store_relaxed(&it.seq, seq);
  store_relaxed(&it.piece, piece);
  store_relaxed(&it.slice, slice);
  store_relaxed(&it.lo, lo);
  store_relaxed(&it.hi, hi);
  store_relaxed(&it.desc, desc);
  store_release(&it.tag, idx + 1);
  store_relaxed(&pc->published, idx + 1);
  return Status::Ok();
}

// Waits until every peer's piece c of op seq has arrived (its flag covers
// every earlier piece too). A flag of the same op must carry desc.
Status wait_piece(Endpoint& ep, WorkOp op, uint64_t seq, int c, uint64_t desc) {
  FlagWait w;
  w.first = prefill_flag_index(0, 0);
  w.want = prefill_progress(seq, c);
  w.op_lo = prefill_progress(seq, 0);
  w.op_hi = prefill_progress(seq, 15);
  w.desc = desc;
  w.seq = seq;
  w.op = (uint64_t)op;
  return wait_flags(ep, w);
}

// The reduce-scatter's last step, for psum_scatter and the fused MoE
// combine alike: out = the fp32 rank-order sum of every rank's slice for
// this rank (its own from send[rank], the peers' from prefill_recv[par]),
// piece by piece as the pieces of `op` arrive; piece k is bytes
// piece_bytes(k, lo, hi) of the slice. false: a wait gave up (recorded).
template <typename PieceBytes>
bool sum_pieces_as_they_arrive(Endpoint& ep, WorkOp op, uint64_t seq, uint64_t desc, DType dtype,
                               const uint8_t* send, int par, uint64_t slice, uint8_t* out, PieceBytes piece_bytes) {
  const int rank = ep.spec().rank, world = ep.spec().world;
  const uint8_t* parts[kMaxWorld];
  for (int j = 0; j < world; ++j)
    parts[j] = j == rank ? send + rank * slice : ep.base() + ep.layout().prefill_recv_offset(par, j, slice);
  for (int k = 0; k < kChunks; ++k) {
    uint64_t lo, hi;
    piece_bytes(k, lo, hi);
    if (!wait_piece(ep, op, seq, k, desc).ok()) return false;
    const uint8_t* at[kMaxWorld];
    for (int j = 0; j < world; ++j) at[j] = parts[j] + lo;
    sum_rank_order(dtype, at, world, (hi - lo) / dtype_size(dtype), out + lo);
  }
  return true;
}

// What every failed op does: NaN out, the op finished (the sequence state
// stays consistent), and the endpoint's sticky failure returned.
template <typename Fill>
Status failed(Endpoint& ep, uint64_t seq, Fill fill, const Status& why) {
  fill();
  if (seq) finish(ep, seq);
  if (!why.ok() && !ep.failed()) ep.fail(why.message());  // a publish error: nothing recorded it
  ep.failed();  // turns a recorded wait failure into the endpoint's sticky message
  return Status::Error(ep.failure());
}

Status too_big(Endpoint& ep, const char* op, uint64_t bytes) {
  return Status::Error(strf("jax_arx: %s of %llu bytes on %s exceeds the prefill slot of %llu bytes; raise "
                            "JAX_ARX_PREFILL_SLOT_BYTES (the Python side should have fallen back to jax.lax)",
                            op, (unsigned long long)bytes, ep.label().c_str(),
                            (unsigned long long)ep.layout().prefill_slot_bytes));
}

// Bytes [lo, hi) of a part laid out as rows of `block` bytes, `stride`
// bytes apart in `strided` (row o at o * stride), to the same bytes of the
// contiguous `contig`; and back.
void gather_rows(uint8_t* contig, const uint8_t* strided, uint64_t lo, uint64_t hi, uint64_t block,
                 uint64_t stride) {
  for (uint64_t p = lo; p < hi;) {
    const uint64_t o = p / block, b = p % block, n = std::min(hi - p, block - b);
    std::memcpy(contig + p, strided + o * stride + b, n);
    p += n;
  }
}

void scatter_rows(uint8_t* strided, const uint8_t* contig, uint64_t lo, uint64_t hi, uint64_t block,
                  uint64_t stride) {
  for (uint64_t p = lo; p < hi;) {
    const uint64_t o = p / block, b = p % block, n = std::min(hi - p, block - b);
    std::memcpy(strided + o * stride + b, contig + p, n);
    p += n;
  }
}

// e4m3 -> fp32 for all 256 codes, once.
const float* e4m3_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int v = 0; v < 256; ++v) t[v] = e4m3_to_f32((uint8_t)v);
    return t;
  }();
  return table.data();
}

// Row t of the combined output into dst (bf16), using acc as scratch.
void combine_row(const MoeCombine& a, uint64_t t, float* acc, uint16_t* dst) {
  const uint64_t H = a.hidden;
  if (t >= a.tokens) {  // padding rows are zero
    std::memset(dst, 0, H * 2);
    return;
  }
  const uint16_t* sh = a.shared + t * H;
  for (uint64_t h = 0; h < H; ++h) acc[h] = bf16_to_f32(sh[h]);
  for (uint64_t q = 0; q < a.topk; ++q) {
    int64_t p = a.pos[t * a.topk + q];
    p = p < 0 ? 0 : (p >= (int64_t)a.rows ? (int64_t)a.rows - 1 : p);  // clamped, as jnp.take(mode="clip")
    const float wq = a.w[t * a.topk + q];
    if (a.y_scale) {
      const uint8_t* y8 = static_cast<const uint8_t*>(a.y) + (uint64_t)p * H;
      const float* scale = a.y_scale + (uint64_t)p * (H / 128);
      const float* lut = e4m3_table();
      for (uint64_t c0 = 0; c0 < H; c0 += 128) {
        const float f = wq * scale[c0 / 128];  // the weight times the block's scale, rounded, then per element
        for (uint64_t h = c0; h < c0 + 128; ++h) acc[h] = std::fmaf(f, lut[y8[h]], acc[h]);
      }
    } else {
      const uint16_t* y = static_cast<const uint16_t*>(a.y) + (uint64_t)p * H;
      for (uint64_t h = 0; h < H; ++h) acc[h] = std::fmaf(wq, bf16_to_f32(y[h]), acc[h]);
    }
  }
  for (uint64_t h = 0; h < H; ++h) dst[h] = f32_to_bf16(acc[h]);
}

}  // namespace

Status all_gather(Endpoint& ep, const void* in, void* out, uint64_t bytes, uint64_t outer, uint64_t type_code,
                  std::optional<DType> nan_type, uint64_t tag) {
  const Layout& L = ep.layout();
  const int rank = ep.spec().rank, world = ep.spec().world;
  const uint64_t total = bytes * world;
  auto fill = [&] {
    if (nan_type) fill_nan(*nan_type, out, total / dtype_size(*nan_type));
    else std::memset(out, 0xFF, total);
  };
  if (ep.failed()) return failed(ep, 0, fill, Status::Ok());
  if (total > L.prefill_slot_bytes) return too_big(ep, "all_gather", total);
  if (outer == 0 || bytes % outer)
    return Status::Error(strf("jax_arx: all_gather on %s: %llu bytes do not make %llu rows", ep.label().c_str(),
                              (unsigned long long)bytes, (unsigned long long)outer));
  const uint64_t seq = next_seq(ep);
  const int par = (int)(seq & 1);
  const uint64_t block = bytes / outer, stride = block * world;
  const uint64_t desc = describe_prefill(WorkOp::kAllGather, type_code | outer << 8, bytes, tag);
  // This rank's part goes to rank * bytes of prefill_send[par], from where
  // the proxy writes it into the same place of every peer's prefill_recv.
  uint8_t* mine = ep.base() + L.prefill_send_offset(par, rank, bytes);
  const uint8_t* src = static_cast<const uint8_t*>(in);
  uint8_t* dst = static_cast<uint8_t*>(out);
  for (int c = 0; c < kChunks; ++c) {
    uint64_t lo, hi;
    piece_range(bytes, c, lo, hi);
    if (hi > lo) std::memcpy(mine + lo, src + lo, hi - lo);
    const Status s = publish(ep, WorkOp::kAllGather, seq, (uint64_t)c, bytes, lo, hi, desc);
    if (!s.ok()) return failed(ep, seq, fill, s);
  }
  scatter_rows(dst + rank * block, src, 0, bytes, block, stride);
  for (int c = 0; c < kChunks; ++c) {
    uint64_t lo, hi;
    piece_range(bytes, c, lo, hi);
    if (!wait_piece(ep, WorkOp::kAllGather, seq, c, desc).ok()) return failed(ep, seq, fill, Status::Ok());
    for (int j = 0; j < world; ++j)
      if (j != rank)
        scatter_rows(dst + j * block, ep.base() + L.prefill_recv_offset(par, j, bytes), lo, hi, block, stride);
  }
  finish(ep, seq);
  return Status::Ok();
}

Status reduce_scatter(Endpoint& ep, DType dtype, const void* in, void* out, uint64_t count, uint64_t outer,
                      uint64_t tag) {
  const Layout& L = ep.layout();
  const int rank = ep.spec().rank, world = ep.spec().world, es = dtype_size(dtype);
  const uint64_t slice = count * es;
  auto fill = [&] { fill_nan(dtype, out, count); };
  if (ep.failed()) return failed(ep, 0, fill, Status::Ok());
  if (slice * world > L.prefill_slot_bytes) return too_big(ep, "psum_scatter", slice * world);
  if (outer == 0 || count % outer)
    return Status::Error(strf("jax_arx: psum_scatter on %s: %llu elements do not make %llu rows",
                              ep.label().c_str(), (unsigned long long)count, (unsigned long long)outer));
  const uint64_t seq = next_seq(ep);
  const int par = (int)(seq & 1);
  const uint64_t block = slice / outer, stride = block * world;
  const uint64_t desc = describe_prefill(WorkOp::kReduceScatter, (uint64_t)dtype | outer << 8, count * world, tag);
  // Chunk j of the input (its rows j of every outer row) goes, contiguous,
  // to j * slice of prefill_send[par], from where the proxy writes it into
  // peer j's prefill_recv at rank * slice. This rank's own chunk is copied
  // there too, last: it never leaves, but the sum reads it contiguous.
  uint8_t* send = ep.base() + L.prefill_send_offset(par, 0, slice);
  const uint8_t* src = static_cast<const uint8_t*>(in);
  for (int c = 0; c < kChunks; ++c) {
    uint64_t lo, hi;
    piece_range(slice, c, lo, hi);
    for (int step = 1; step < world; ++step) {
      const int j = (rank + step) % world;  // in the order the proxy sends them
      gather_rows(send + j * slice, src + j * block, lo, hi, block, stride);
    }
    const Status s = publish(ep, WorkOp::kReduceScatter, seq, (uint64_t)c, slice, lo, hi, desc);
    if (!s.ok()) return failed(ep, seq, fill, s);
  }
  gather_rows(send + rank * slice, src + rank * block, 0, slice, block, stride);
  if (!sum_pieces_as_they_arrive(ep, WorkOp::kReduceScatter, seq, desc, dtype, send, par, slice,
                                 static_cast<uint8_t*>(out),
                                 [&](int c, uint64_t& lo, uint64_t& hi) { piece_range(slice, c, lo, hi); }))
    return failed(ep, seq, fill, Status::Ok());
  finish(ep, seq);
  return Status::Ok();
}

Status moe_combine_reduce_scatter(Endpoint& ep, const MoeCombine& a, uint16_t* out, uint64_t tag) {
  const Layout& L = ep.layout();
  const int rank = ep.spec().rank, world = ep.spec().world;
  const uint64_t H = a.hidden, rows_per_rank = a.padded / world, row = H * 2, slice = rows_per_rank * row;
  auto fill = [&] { fill_nan(DType::kBF16, out, rows_per_rank * H); };
  if (ep.failed()) return failed(ep, 0, fill, Status::Ok());
  if (a.padded % world || a.tokens > a.padded || (a.y_scale && H % 128) || (a.rows == 0 && a.tokens && a.topk))
    return Status::Error(strf("jax_arx: moe_combine_psum_scatter on %s: %llu padded rows over %d ranks, %llu tokens, "
                              "hidden %llu, %llu expert rows: padded rows must be a multiple of the ranks and at "
                              "least the tokens; e4m3 y needs hidden %% 128 == 0; pos needs rows to point at",
                              ep.label().c_str(), (unsigned long long)a.padded, world, (unsigned long long)a.tokens,
                              (unsigned long long)H, (unsigned long long)a.rows));
  if (a.padded * row > L.prefill_slot_bytes) return too_big(ep, "moe_combine_psum_scatter", a.padded * row);
  const uint64_t seq = next_seq(ep);
  const int par = (int)(seq & 1);
  const uint64_t desc = describe_prefill(WorkOp::kRsPiece, (uint64_t)DType::kBF16, a.padded * H, tag);
  uint8_t* send = ep.base() + L.prefill_send_offset(par, 0, slice);
  std::vector<float> acc(H);
  auto combine = [&](uint64_t t0, uint64_t t1) {
    for (uint64_t t = t0; t < t1; ++t) combine_row(a, t, acc.data(), reinterpret_cast<uint16_t*>(send + t * row));
  };
  // Piece-major, destinations in the order the proxy sends to them, so the
  // wire starts on piece 0 of rank + 1 while later rows are computed. The
  // rows for this rank never leave; they are computed last.
  for (int k = 0; k < kChunks; ++k) {
    uint64_t lo, hi;
    row_piece(rows_per_rank, k, lo, hi);
    for (int step = 1; step < world; ++step) {
      const int j = (rank + step) % world;
      combine(j * rows_per_rank + lo, j * rows_per_rank + hi);
      const Status s = publish(ep, WorkOp::kRsPiece, seq, (uint64_t)j * kChunks + k, slice, lo * row, hi * row, desc);
      if (!s.ok()) return failed(ep, seq, fill, s);
    }
  }
  combine(rank * rows_per_rank, (rank + 1) * rows_per_rank);
  // rs_finish: this rank's rows summed over the ranks, piece by piece as
  // they arrive.
  auto piece_bytes = [&](int k, uint64_t& lo, uint64_t& hi) {
    row_piece(rows_per_rank, k, lo, hi);
    lo *= row;
    hi *= row;
  };
  if (!sum_pieces_as_they_arrive(ep, WorkOp::kRsPiece, seq, desc, DType::kBF16, send, par, slice,
                                 reinterpret_cast<uint8_t*>(out), piece_bytes))
    return failed(ep, seq, fill, Status::Ok());
  finish(ep, seq);
  return Status::Ok();
}

}  // namespace arx::host

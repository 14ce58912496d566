// The bulk collectives on the host, over a channel (comm/channel.h): each
// goes in the plan's pieces (comm/plan.cc, bulk_pieces), every piece
// signalled as soon as it is copied (or, for the MoE rows, computed), so the
// proxy sends piece 0 while this thread still copies piece 1; then the pieces
// are waited for and moved into XLA's output one after another.
//
// The combine's arithmetic is base/combine.h's: each weight split in two,
// so that every product is exact and std::fmaf gives the bits of a
// multiply and an add, as the CUDA kernel and jax_arx.moe_combine compute
// them. The rest of the core is built with -ffp-contract=off, so nothing
// else is contracted differently on x86 and ARM.
#include <cmath>
#include <cstring>
#include <vector>

#include "base/combine.h"
#include "comm/plan.h"
#include "host/convert.h"
#include "host/device_side.h"
#include "host/steps.h"

namespace arx::host {
namespace {

// How many pieces the plan cuts each lane into, or 0 (and `why`) if
// jax_arx does not take the collective.
int pieces_of(const Plan& plan, const char* op, Status& why) {
  if (plan.algorithm == Algorithm::kBulk) return plan.pieces;
  why = Status::Error(strf("jax_arx.%s: %s", op, plan.why_not.c_str()));
  return 0;
}

// out[p] for the bytes [lo, hi) of this rank's part = the rank-order sum of
// every rank's part: this rank's own from `own` (rows of `block` bytes,
// `stride` apart; may be `out` when stride == block), each peer's from its
// lane of the inbox.
template <typename Ch>
void sum_piece(const Ch& ch, int par, int rank, int world, DType dtype, const uint8_t* own, uint64_t block,
               uint64_t stride, uint8_t* out, uint64_t lo, uint64_t hi) {
  const uint64_t es = (uint64_t)dtype_size(dtype);
  for (uint64_t p = lo; p < hi;) {  // runs that stay inside one row of `own`
    const uint64_t o = p / block, b = p % block, n = std::min(hi - p, block - b);
    const uint8_t* parts[kMaxWorld];
    for (int j = 0; j < world; ++j) parts[j] = j == rank ? own + o * stride + b : ch.in.lane(par, j) + p;
    sum_rank_order(dtype, parts, world, n / es, out + p);
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
        // The weight times the block's scale, rounded, then per element.
        const WeightSplit f = split_weight(wq * scale[c0 / 128]);
        for (uint64_t h = c0; h < c0 + 128; ++h) acc[h] = std::fmaf(f.hi, lut[y8[h]], acc[h]);
        if (f.lo != 0.f)
          for (uint64_t h = c0; h < c0 + 128; ++h) acc[h] = std::fmaf(f.lo, lut[y8[h]], acc[h]);
      }
    } else {
      const uint16_t* y = static_cast<const uint16_t*>(a.y) + (uint64_t)p * H;
      const WeightSplit f = split_weight(wq);
      for (uint64_t h = 0; h < H; ++h) acc[h] = std::fmaf(f.hi, bf16_to_f32(y[h]), acc[h]);
      if (f.lo != 0.f)
        for (uint64_t h = 0; h < H; ++h) acc[h] = std::fmaf(f.lo, bf16_to_f32(y[h]), acc[h]);
    }
  }
  for (uint64_t h = 0; h < H; ++h) dst[h] = f32_to_bf16(acc[h]);
}

}  // namespace

Status all_gather(Endpoint& ep, const Plan& plan, const void* in, void* out, uint64_t bytes, uint64_t outer,
                  uint64_t type_code, std::optional<DType> nan_type, uint64_t tag) {
  const int rank = ep.spec().rank, world = ep.spec().world;
  const uint64_t total = bytes * world;
  auto nan = [&] {
    if (nan_type)
      fill_nan(*nan_type, out, total / dtype_size(*nan_type));
    else
      std::memset(out, 0xFF, total);
  };
  if (ep.failed()) {
    nan();
    return Status::Error(ep.failure());
  }
  Status why;
  const int pieces = pieces_of(plan, "all_gather", why);
  if (!pieces) return why;
  if (outer == 0 || bytes % outer)
    return Status::Error(strf("jax_arx: all_gather on %s: %llu bytes do not make %llu rows", ep.label().c_str(),
                              (unsigned long long)bytes, (unsigned long long)outer));
  const uint64_t block = bytes / outer, stride = block * world;
  Collective c(ep, Family::kBulk, descriptor(OpCode::kAllGather, type_code | outer << 8, bytes, tag));
  const uint8_t* src = static_cast<const uint8_t*>(in);
  uint8_t* dst = static_cast<uint8_t*>(out);
  return with_channel(ep, Family::kBulk, [&](const auto& ch) {
    const int par = c.parity();
    const auto send = ch.open(c.send(), Fan::kEveryPeer, ch.in.lane_bytes);
    const Status s = c.reserve(send.entries(pieces));
    if (!s.ok()) return c.fail(nan, s);
    for (int k = 0; k < pieces; ++k) {
      uint64_t lo, hi;
      piece_range(bytes, pieces, k, lo, hi);
      for (int i = 0; i < send.fanout(kEveryPeer); ++i)
        std::memcpy(send.put_dst(kEveryPeer, i) + lo, src + lo, hi - lo);
      send.signal(kEveryPeer, k, lo, hi);
    }
    c.published();
    scatter_rows(dst + rank * block, src, 0, bytes, block, stride);
    for (int k = 0; k < pieces; ++k) {
      uint64_t lo, hi;
      piece_range(bytes, pieces, k, lo, hi);
      if (!c.wait_peers(ch.in, k)) return c.fail(nan);
      for (int j = 0; j < world; ++j)
        if (j != rank) scatter_rows(dst + j * block, ch.in.lane(par, j), lo, hi, block, stride);
    }
    return c.finish();
  });
}

Status reduce_scatter(Endpoint& ep, const Plan& plan, DType dtype, const void* in, void* out, uint64_t count,
                      uint64_t outer, uint64_t tag) {
  const int rank = ep.spec().rank, world = ep.spec().world;
  const uint64_t slice = count * dtype_size(dtype);
  auto nan = [&] { fill_nan(dtype, out, count); };
  if (ep.failed()) {
    nan();
    return Status::Error(ep.failure());
  }
  Status why;
  const int pieces = pieces_of(plan, "psum_scatter", why);
  if (!pieces) return why;
  if (outer == 0 || count % outer)
    return Status::Error(strf("jax_arx: psum_scatter on %s: %llu elements do not make %llu rows", ep.label().c_str(),
                              (unsigned long long)count, (unsigned long long)outer));
  const uint64_t block = slice / outer, stride = block * world;
  Collective c(ep, Family::kBulk, descriptor(OpCode::kReduceScatter, (uint64_t)dtype | outer << 8, count * world, tag));
  const uint8_t* src = static_cast<const uint8_t*>(in);
  return with_channel(ep, Family::kBulk, [&](const auto& ch) {
    const int par = c.parity();
    const auto send = ch.open(c.send(), Fan::kEachPeer, ch.in.lane_bytes);
    const Status s = c.reserve(send.entries(pieces));
    if (!s.ok()) return c.fail(nan, s);
    // Piece-major, destinations in send order, so that the wire starts on
    // piece 0 of rank + 1 while the rest is copied. Destination j's part is
    // its rows j of every outer row.
    for (int k = 0; k < pieces; ++k) {
      uint64_t lo, hi;
      piece_range(slice, pieces, k, lo, hi);
      for (int step = 1; step < world; ++step) {
        const int j = (rank + step) % world;
        gather_rows(send.put_dst((uint64_t)j), src + j * block, lo, hi, block, stride);
        send.signal((uint64_t)j, k, lo, hi);
      }
    }
    c.published();
    for (int k = 0; k < pieces; ++k) {
      uint64_t lo, hi;
      piece_range(slice, pieces, k, lo, hi);
      if (!c.wait_peers(ch.in, k)) return c.fail(nan);
      sum_piece(ch, par, rank, world, dtype, src + rank * block, block, stride, static_cast<uint8_t*>(out), lo, hi);
    }
    return c.finish();
  });
}

Status moe_combine_reduce_scatter(Endpoint& ep, const Plan& plan, const MoeCombine& a, uint16_t* out, uint64_t tag) {
  const int rank = ep.spec().rank, world = ep.spec().world;
  const uint64_t H = a.hidden, rows_per_rank = a.padded / world, row = H * 2, slice = rows_per_rank * row;
  auto nan = [&] { fill_nan(DType::kBF16, out, rows_per_rank * H); };
  if (ep.failed()) {
    nan();
    return Status::Error(ep.failure());
  }
  if (a.padded % world || a.tokens > a.padded || (a.y_scale && H % 128) || (a.rows == 0 && a.tokens && a.topk))
    return Status::Error(
        strf("jax_arx: moe_combine_psum_scatter on %s: %llu padded rows over %d ranks, %llu tokens, "
             "hidden %llu, %llu expert rows: padded rows must be a multiple of the ranks and at "
             "least the tokens; e4m3 y needs hidden %% 128 == 0; pos needs rows to point at",
             ep.label().c_str(), (unsigned long long)a.padded, world, (unsigned long long)a.tokens,
             (unsigned long long)H, (unsigned long long)a.rows));
  Status why;
  const int pieces = pieces_of(plan, "moe_combine_psum_scatter", why);
  if (!pieces) return why;
  Collective c(ep, Family::kBulk, descriptor(OpCode::kMoeCombine, (uint64_t)DType::kBF16, a.padded * H, tag));
  std::vector<float> acc(H);
  auto combine = [&](int j, uint64_t r0, uint64_t r1, uint8_t* dst) {
    for (uint64_t r = r0; r < r1; ++r)
      combine_row(a, (uint64_t)j * rows_per_rank + r, acc.data(), reinterpret_cast<uint16_t*>(dst + r * row));
  };
  uint8_t* own = reinterpret_cast<uint8_t*>(out);
  return with_channel(ep, Family::kBulk, [&](const auto& ch) {
    const int par = c.parity();
    const auto send = ch.open(c.send(), Fan::kEachPeer, ch.in.lane_bytes);
    const Status s = c.reserve(send.entries(pieces));
    if (!s.ok()) return c.fail(nan, s);
    // Piece-major, destinations in send order; each destination's rows go
    // straight to where the channel sends them from.
    for (int k = 0; k < pieces; ++k) {
      uint64_t r0, r1;
      row_piece(rows_per_rank, pieces, k, r0, r1);
      for (int step = 1; step < world; ++step) {
        const int j = (rank + step) % world;
        combine(j, r0, r1, send.put_dst((uint64_t)j));
        send.signal((uint64_t)j, k, r0 * row, r1 * row);
      }
    }
    c.published();
    // This rank's own rows into out, where the sum below takes them, in place.
    combine(rank, 0, rows_per_rank, own);
    for (int k = 0; k < pieces; ++k) {
      uint64_t r0, r1;
      row_piece(rows_per_rank, pieces, k, r0, r1);
      if (!c.wait_peers(ch.in, k)) return c.fail(nan);
      sum_piece(ch, par, rank, world, DType::kBF16, own, slice, slice, own, r0 * row, r1 * row);
    }
    return c.finish();
  });
}

}  // namespace arx::host

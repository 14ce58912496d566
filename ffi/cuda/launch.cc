// The launch functions of device_side.h: the plan's algorithm, over the
// endpoint's channel. The one place where the route (direct or proxy) picks
// a kernel's channel type; the kernels themselves never branch on it.
#include <algorithm>

#include "cuda/device_side.h"
#include "cuda/kernels.h"

namespace arx::cuda {
namespace {

// Runs fn(channel) over the family's channel of the endpoint's route.
template <typename Fn>
cudaError_t over(const Channels& c, Family f, Fn fn) {
  if (c.direct) return fn(f == Family::kPsum ? c.psum_direct : c.bulk_direct);
  return fn(f == Family::kPsum ? c.psum_proxy : c.bulk_proxy);
}

// The channels of a collective that begins now: its proxy, if it has one,
// is awake for it (Endpoint::wake_proxy).
const Channels& begin(const Endpoint& ep) {
  ep.wake_proxy();
  return channels_of(ep);
}

}  // namespace

cudaError_t launch_psum(const Endpoint& ep, const Plan& plan, DType dtype, const void* in, void* out, uint64_t count,
                        uint64_t tag, const Prefetch& pf, cudaStream_t stream, const AddNorm& nm) {
  const Channels& c = begin(ep);
  tag = add_norm_tag(tag, nm);
  switch (plan.algorithm) {
    case Algorithm::kLL:
      if (c.direct) return launch_ll(c.grid, c.ll_direct, dtype, in, out, count, tag, pf, nm, stream);
      return launch_ll(c.grid, c.ll_proxy, dtype, in, out, count, tag, pf, nm, stream);
    case Algorithm::kOneShot:
      return over(c, Family::kPsum, [&](const auto& ch) {
        return launch_oneshot(c.grid, ch, dtype, in, out, count, tag, pf, plan.pieces, nm, stream);
      });
    case Algorithm::kTwoShot: {
      const cudaError_t e = over(c, Family::kPsum, [&](const auto& ch) {
        return launch_twoshot(c.grid, ch, dtype, in, out, count, tag, pf, stream);
      });
      // A failed two-shot leaves NaN in out, which the norm turns into NaN.
      if (e != cudaSuccess || !nm.on()) return e;
      return launch_add_norm(dtype, out, count, nm, stream);
    }
    case Algorithm::kNone:
    case Algorithm::kBulk:
    case Algorithm::kUnfused:
      break;
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_all_gather(const Endpoint& ep, const void* in, void* out, uint64_t bytes, uint64_t outer,
                              uint64_t type_code, int nan_type, uint64_t tag, cudaStream_t stream) {
  const int world = ep.spec().world;
  BulkOp op{};
  op.kind = BulkKind::kGather;
  op.in = static_cast<const uint8_t*>(in);
  op.out = static_cast<uint8_t*>(out);
  op.slice = bytes;
  op.block = outer ? bytes / outer : bytes;
  op.stride = op.block * world;
  op.d = descriptor(OpCode::kAllGather, type_code | outer << 8, bytes, tag);
  op.nan_type = nan_type;
  // The element type only matters for the NaN fill.
  op.dtype = nan_type == (int)DType::kF32 ? DType::kF32 : nan_type == (int)DType::kF16 ? DType::kF16 : DType::kBF16;
  op.out_bytes = bytes * world;
  op.piece_bytes = bytes / kMaxPieces + 16;
  const Channels& c = begin(ep);
  op.gpu_inboxes = c.direct && c.gpu_inboxes;
  return over(c, Family::kBulk, [&](const auto& ch) { return launch_bulk(c.grid, ch, op, stream); });
}

cudaError_t launch_reduce_scatter(const Endpoint& ep, DType dtype, const void* in, void* out, uint64_t count,
                                  uint64_t outer, uint64_t tag, cudaStream_t stream) {
  const int world = ep.spec().world;
  BulkOp op{};
  op.kind = BulkKind::kScatter;
  op.in = static_cast<const uint8_t*>(in);
  op.out = static_cast<uint8_t*>(out);
  op.slice = count * dtype_size(dtype);
  op.block = outer ? op.slice / outer : op.slice;
  op.stride = op.block * world;
  op.d = descriptor(OpCode::kReduceScatter, (uint64_t)dtype | outer << 8, count * world, tag);
  op.nan_type = (int)dtype;
  op.dtype = dtype;
  op.out_bytes = op.slice;
  // Each share goes to world - 1 peers and is summed from world sources.
  op.piece_bytes = op.slice / kMaxPieces * world + 16;
  const Channels& c = begin(ep);
  op.gpu_inboxes = c.direct && c.gpu_inboxes;
  return over(c, Family::kBulk, [&](const auto& ch) { return launch_bulk(c.grid, ch, op, stream); });
}

cudaError_t launch_moe_combine(const Endpoint& ep, const MoeCombine& a, uint16_t* out, uint64_t tag,
                               cudaStream_t stream) {
  const int world = ep.spec().world;
  BulkOp op{};
  op.kind = BulkKind::kMoe;
  op.out = reinterpret_cast<uint8_t*>(out);
  op.moe = a;
  op.rows_per_rank = a.padded / world;
  op.row_bytes = a.hidden * 2;
  op.slice = op.rows_per_rank * op.row_bytes;
  op.block = op.stride = op.slice;
  op.d = descriptor(OpCode::kMoeCombine, (uint64_t)DType::kBF16, a.padded * a.hidden, tag);
  op.nan_type = (int)DType::kBF16;
  op.dtype = DType::kBF16;
  op.out_bytes = op.slice;
  // Computing a row reads topk rows of y: a share is worth more blocks.
  op.piece_bytes = op.slice / kMaxPieces * world * std::max<uint64_t>(a.topk, 1) + 16;
  const Channels& c = begin(ep);
  op.gpu_inboxes = c.direct && c.gpu_inboxes;
  return over(c, Family::kBulk, [&](const auto& ch) { return launch_bulk(c.grid, ch, op, stream); });
}

}  // namespace arx::cuda

// Host-platform handlers: the CPU backend runs the device side in the
// handler's own thread (ffi/host).
#include <cstring>
#include <mutex>
#include <vector>

#include "host/convert.h"
#include "host/device_side.h"
#include "xla/handlers.h"

namespace arx::xla {
namespace {

// Fills every result from index `from` on with what a failed call leaves:
// NaN of a reducing type, every byte 0xFF otherwise (a NaN in every
// floating type). Never stale memory.
void fill_failed_results(ffi::RemainingRets& rets, size_t from) {
  for (size_t j = from; j < rets.size(); ++j)
    if (auto yj = rets.get<ffi::AnyBuffer>(j); yj.has_value()) {
      if (auto dj = dtype_of((*yj)->element_type()))
        host::fill_nan(*dj, (*yj)->untyped_data(), (*yj)->element_count());
      else
        std::memset((*yj)->untyped_data(), 0xFF, (*yj)->size_bytes());
    }
}

// Every rank must issue its collectives in one order, and a handler holds
// its endpoint (Endpoint::host_call_mu) for a whole collective. Two
// collectives on one endpoint at once have no such order: they come from
// several threads, or from programs the runtime runs concurrently
// (jax_arx/_ordering.py orders the calls within one program), and a peer
// may take them the other way round, summing one's data into the other's
// result when their shapes agree. So the second does not wait its turn: it
// fails, and fails the endpoint, whose proxy tells the peers (comm/proxy.cc,
// notices), so that the collective in flight fails on every rank too. Runs
// that only follow each other in different orders on different ranks, never
// overlapping, are not seen here (docs/failures.md).
class CallGuard {
 public:
  explicit CallGuard(Endpoint& ep) : lock_(ep.host_call_mu, std::try_to_lock) {}
  bool busy() const { return !lock_.owns_lock(); }

 private:
  std::unique_lock<std::mutex> lock_;
};

ffi::Error overlapping(Endpoint& ep, Stats::Kind kind, const char* op) {
  const std::string m = strf(
      "jax_arx: %s: a %s began while another collective of this endpoint was still running. Collectives issued "
      "from several threads at once (or by programs run concurrently) have no order every rank agrees on, and "
      "could be summed into each other's results: issue jax_arx's collectives from one thread. This endpoint has "
      "failed, and its peers are told; call jax_arx.shutdown() and jax_arx.initialize() on every process to go on",
      ep.label().c_str(), op);
  ep.fail(m);
  return failed_call(ep, kind, ffi::Error::Internal(m));
}

// x[0..n) -> y[0..n), each summed over the communicator, one collective per
// pair in operand order. Operands past the n-th are dependency operands
// (never read: they only make XLA run this call after their producers, see
// jax_arx/_ordering.py: the CPU runtime executes independent calls
// concurrently, and every rank must issue collectives in the same order),
// then prefetch operands, which the CPU side ignores. Attributes as the CUDA
// handler's (psum_attributes), so one lowering serves both platforms.
ffi::Error psum_host(int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
  PsumAttributes at;
  if (ffi::Error e = psum_attributes(attrs, args.size(), rets.size(), at); e.failure()) return e;
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = endpoint_for(at.comm_id, device_ordinal, ep); e.failure()) return e;
  const CallGuard guard(*ep);
  if (guard.busy()) {
    fill_failed_results(rets, 0);
    return overlapping(*ep, Stats::kPsum, "psum");
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    PsumPair p;
    if (ffi::Error e = psum_pair(args, rets, i, p); e.failure()) return e;
    const Plan plan = plan_psum(*ep, p.bytes);
    if (!at.notice) count_call(*ep, Stats::kPsum, p.bytes, plan);
    // Leaves of one call are told apart by their position.
    const Status s = host::psum(*ep, plan, p.dtype, p.in, p.out, p.count, (uint64_t)at.site * 64 + i);
    if (!s.ok()) {
      fill_failed_results(rets, i + 1);  // the rest of the call too, never stale memory
      return failed_call(*ep, Stats::kPsum, ffi::Error::Internal(s.message()));
    }
  }
  return ffi::Error::Success();
}

// (normed, hidden) = the fused psum + residual + norm of x (add_norm_call),
// one psum collective. Attributes and dependency operands as psum's.
ffi::Error psum_add_norm_host(int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets,
                              ffi::Dictionary attrs) {
  AddNormCall c;
  if (ffi::Error e = add_norm_call(args, rets, attrs, c); e.failure()) return e;
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = endpoint_for(c.at.comm_id, device_ordinal, ep); e.failure()) return e;
  const CallGuard guard(*ep);
  if (guard.busy()) {
    fill_failed_results(rets, 0);
    return overlapping(*ep, Stats::kPsum, "psum_add_norm");
  }
  const Plan plan = plan_psum(*ep, c.p.bytes, row_bytes(c));
  count_call(*ep, Stats::kPsum, c.p.bytes, plan);
  const Status s = host::psum(*ep, plan, c.p.dtype, c.p.in, c.p.out, c.p.count, (uint64_t)c.at.site * 64, c.norm);
  if (!s.ok()) return failed_call(*ep, Stats::kPsum, ffi::Error::Internal(s.message()));
  return ffi::Error::Success();
}

// x[0..n) -> y[0..n), one bulk collective per pair in operand order;
// operands past the n-th are dependency operands, as for psum. all_gather
// (kGather): y_i = every rank's x_i, gathered along `dimension` (bytes, any
// element type); psum_scatter: y_i = the sum over ranks of block `rank` of
// x_i along `dimension` (fp32 in rank order, rounded once).
template <bool kGather>
ffi::Error bulk_host(int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t comm_id,
                     int64_t site, int64_t dimension) {
  const char* op = kGather ? "all_gather" : "psum_scatter";
  const Stats::Kind kind = kGather ? Stats::kAllGather : Stats::kPsumScatter;
  if (args.size() < rets.size())
    return ffi::Error::InvalidArgument(strf("jax_arx.%s: fewer operands than results", op));
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = endpoint_for(comm_id, device_ordinal, ep, Family::kBulk); e.failure()) return e;
  const uint64_t world = (uint64_t)ep->spec().world;
  const CallGuard guard(*ep);
  if (guard.busy()) {
    fill_failed_results(rets, 0);
    return overlapping(*ep, kind, op);
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    BulkPair p;
    if (ffi::Error e = bulk_pair(kGather, args, rets, i, world, dimension, p); e.failure()) return e;
    // The plan's lane: a rank's slice of the gather, a destination's part of the scatter.
    const uint64_t lane = kGather ? p.in_bytes : p.in_bytes / world;
    const Plan plan = plan_bulk(*ep, op, lane);
    count_call(*ep, kind, lane, plan);
    const uint64_t tag = (uint64_t)site * 64 + i;
    const Status s = kGather
                         ? host::all_gather(*ep, plan, p.in, p.out, p.in_bytes, p.outer, (uint64_t)p.type, p.dtype, tag)
                         : host::reduce_scatter(*ep, plan, *p.dtype, p.in, p.out, p.out_count, p.outer, tag);
    if (!s.ok()) {
      fill_failed_results(rets, i + 1);
      return failed_call(*ep, kind, ffi::Error::Internal(s.message()));
    }
  }
  return ffi::Error::Success();
}

// The fused MoE combine + reduce-scatter (host/device_side.h); operands and
// result as moe_operands (handlers.h) reads them.
ffi::Error moe_combine_psum_scatter_host(int32_t device_ordinal, ffi::RemainingArgs args,
                                         ffi::Result<ffi::AnyBuffer> out, int64_t comm_id, int64_t site,
                                         int64_t scaled) {
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = endpoint_for(comm_id, device_ordinal, ep, Family::kBulk); e.failure()) return e;
  MoeCombine m;
  if (ffi::Error e = moe_operands(args, *out, scaled != 0, (uint64_t)ep->spec().world, m); e.failure()) return e;
  const uint64_t lane = m.padded / ep->spec().world * m.hidden * 2;
  const CallGuard guard(*ep);
  if (guard.busy()) {
    host::fill_nan(DType::kBF16, out->untyped_data(), out->element_count());
    return overlapping(*ep, Stats::kMoeCombine, "moe_combine_psum_scatter");
  }
  // plan_bulk, not plan_moe_combine: the call exists only where the plan
  // chose the fused op (Python lowers the unfused pair otherwise).
  const Plan plan = plan_bulk(*ep, "moe_combine_psum_scatter", lane);
  count_call(*ep, Stats::kMoeCombine, lane, plan);
  const Status s =
      host::moe_combine_reduce_scatter(*ep, plan, m, static_cast<uint16_t*>(out->untyped_data()), (uint64_t)site * 64);
  if (!s.ok()) return failed_call(*ep, Stats::kMoeCombine, ffi::Error::Internal(s.message()));
  return ffi::Error::Success();
}

// y = x, after the dependency operands that follow x: a fallback's notice
// (jax_arx/_notice.py) orders the jax.lax collective that reads y after the
// jax_arx call that announced it. The CPU runtime orders calls by the buffers
// they read and write, so a data path is what makes the order; y aliases x
// (output_operand_aliases), so there is nothing to move unless XLA chose
// otherwise.
ffi::Error after_host(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  auto x = args.get<ffi::AnyBuffer>(0);
  auto y = rets.get<ffi::AnyBuffer>(0);
  if (x.has_error() || y.has_error() || rets.size() != 1 || x->size_bytes() != (*y)->size_bytes())
    return ffi::Error::InvalidArgument("jax_arx: arx_after takes x and dependency operands, and returns x");
  if (x->untyped_data() != (*y)->untyped_data()) std::memcpy((*y)->untyped_data(), x->untyped_data(), x->size_bytes());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace arx::xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_psum_host, arx::xla::psum_host,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()   // device_ordinal
                                  .RemainingArgs()                  // x[0..n), dependency operands, prefetch operands
                                  .RemainingRets()                  // y[0..n)
                                  .Attrs<xla::ffi::Dictionary>());  // comm_id, site, prefetch

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_psum_add_norm_host, arx::xla::psum_add_norm_host,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()   // device_ordinal
                                  .RemainingArgs()                  // x, residual, weight, [bias], dependencies
                                  .RemainingRets()                  // normed, hidden
                                  .Attrs<xla::ffi::Dictionary>());  // comm_id, site, kind, eps, bias

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_all_gather_host, arx::xla::bulk_host</*kGather=*/true>,
                              arx::xla::bulk_collective_binding(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_psum_scatter_host, arx::xla::bulk_host</*kGather=*/false>,
                              arx::xla::bulk_collective_binding(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_moe_combine_psum_scatter_host, arx::xla::moe_combine_psum_scatter_host,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device_ordinal
                                  .RemainingArgs()                 // y, [y_scale], pos, w, shared, then dependencies
                                  .Ret<xla::ffi::AnyBuffer>()      // out [Tpad / world, H] bf16
                                  .Attr<int64_t>("comm_id")        // comm_id
                                  .Attr<int64_t>("site")           // site: the call site's tag
                                  .Attr<int64_t>("scaled"));       // scaled: 1 if y is e4m3 with y_scale

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_after_host, arx::xla::after_host,
                              xla::ffi::Ffi::Bind()
                                  .RemainingArgs()    // x, dependency operands
                                  .RemainingRets());  // y, x's buffer

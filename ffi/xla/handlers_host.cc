// Host-platform handlers: the CPU backend runs the device side in the
// handler's own thread (ffi/host).
#include <cstring>
#include <mutex>
#include <vector>

#include "host/collectives.h"
#include "host/convert.h"
#include "host/prefill.h"
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
      else std::memset((*yj)->untyped_data(), 0xFF, (*yj)->size_bytes());
    }
}

// x[0..n) -> y[0..n), each summed over the communicator, one collective per
// pair in operand order. Operands past the n-th are dependency operands:
// never read, they only make XLA run this call after their producers (see
// jax_arx/_psum.py: the CPU runtime executes independent calls concurrently,
// and every rank must issue collectives in the same order).
ffi::Error psum_host(int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t comm_id,
                     int64_t algorithm, int64_t site) {
  if (algorithm != 1)
    return ffi::Error::InvalidArgument(strf("jax_arx.psum: algorithm %lld is not available on the CPU backend "
                                            "(only one-shot, 1)", (long long)algorithm));
  if (args.size() < rets.size())
    return ffi::Error::InvalidArgument("jax_arx.psum: fewer operands than results");
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = endpoint_for(comm_id, device_ordinal, ep); e.failure()) return e;
  std::lock_guard<std::mutex> lock(ep->host_call_mu);
  for (size_t i = 0; i < rets.size(); ++i) {
    auto x = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (x.has_error()) return x.error();
    if (y.has_error()) return y.error();
    const std::optional<DType> dtype = dtype_of(x->element_type());
    if (!dtype)
      return ffi::Error::InvalidArgument("jax_arx.psum: the CPU handler takes float32, bfloat16 or float16");
    if ((*y)->element_type() != x->element_type() || (*y)->element_count() != x->element_count())
      return ffi::Error::InvalidArgument("jax_arx.psum: each result must have its operand's shape and dtype");
    // Leaves of one call are told apart by their position.
    const Status s = host::allreduce(*ep, *dtype, x->untyped_data(), (*y)->untyped_data(), x->element_count(),
                                     (uint64_t)site * 64 + i);
    if (!s.ok()) {
      fill_failed_results(rets, i + 1);  // the rest of the call too, never stale memory
      return ffi::Error::Internal(s.message());
    }
  }
  return ffi::Error::Success();
}

// x[0..n) -> y[0..n): y_i = every rank's x_i, gathered along `dimension`
// (bytes, any element type). One prefill op per pair, in operand order;
// operands past the n-th are dependency operands, as for psum.
ffi::Error all_gather_host(int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t comm_id,
                           int64_t site, int64_t dimension) {
  if (args.size() < rets.size())
    return ffi::Error::InvalidArgument("jax_arx.all_gather: fewer operands than results");
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = endpoint_for(comm_id, device_ordinal, ep); e.failure()) return e;
  const uint64_t world = (uint64_t)ep->spec().world;
  std::lock_guard<std::mutex> lock(ep->host_call_mu);
  for (size_t i = 0; i < rets.size(); ++i) {
    PrefillPair p;
    if (ffi::Error e = prefill_pair(true, args, rets, i, world, dimension, p); e.failure()) return e;
    const Status s = host::all_gather(*ep, p.in, p.out, p.in_bytes, p.outer, (uint64_t)p.type, p.dtype,
                                      (uint64_t)site * 64 + i);
    if (!s.ok()) {
      fill_failed_results(rets, i + 1);
      return ffi::Error::Internal(s.message());
    }
  }
  return ffi::Error::Success();
}

// x[0..n) -> y[0..n): y_i = the sum over ranks of block `rank` of x_i along
// `dimension` (fp32 in rank order, rounded once). As all_gather_host
// otherwise.
ffi::Error psum_scatter_host(int32_t device_ordinal, ffi::RemainingArgs args, ffi::RemainingRets rets,
                             int64_t comm_id, int64_t site, int64_t dimension) {
  if (args.size() < rets.size())
    return ffi::Error::InvalidArgument("jax_arx.psum_scatter: fewer operands than results");
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = endpoint_for(comm_id, device_ordinal, ep); e.failure()) return e;
  const uint64_t world = (uint64_t)ep->spec().world;
  std::lock_guard<std::mutex> lock(ep->host_call_mu);
  for (size_t i = 0; i < rets.size(); ++i) {
    PrefillPair p;
    if (ffi::Error e = prefill_pair(false, args, rets, i, world, dimension, p); e.failure()) return e;
    const Status s = host::reduce_scatter(*ep, *p.dtype, p.in, p.out, p.out_count, p.outer, (uint64_t)site * 64 + i);
    if (!s.ok()) {
      fill_failed_results(rets, i + 1);
      return ffi::Error::Internal(s.message());
    }
  }
  return ffi::Error::Success();
}

// The fused MoE combine + reduce-scatter (host/prefill.h); operands and
// result as moe_operands (handlers.h) reads them.
ffi::Error moe_combine_psum_scatter_host(int32_t device_ordinal, ffi::RemainingArgs args,
                                         ffi::Result<ffi::AnyBuffer> out, int64_t comm_id, int64_t site,
                                         int64_t scaled) {
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = endpoint_for(comm_id, device_ordinal, ep); e.failure()) return e;
  MoeOperands m;
  if (ffi::Error e = moe_operands(args, *out, scaled != 0, (uint64_t)ep->spec().world, m); e.failure()) return e;
  host::MoeCombine a;
  a.y = m.y;
  a.y_scale = m.y_scale;
  a.pos = m.pos;
  a.w = m.w;
  a.shared = m.shared;
  a.rows = m.rows;
  a.tokens = m.tokens;
  a.padded = m.padded;
  a.hidden = m.hidden;
  a.topk = m.topk;
  std::lock_guard<std::mutex> lock(ep->host_call_mu);
  const Status s = host::moe_combine_reduce_scatter(*ep, a, static_cast<uint16_t*>(out->untyped_data()),
                                                    (uint64_t)site * 64);
  if (!s.ok()) return ffi::Error::Internal(s.message());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace arx::xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_psum_host, arx::xla::psum_host,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device_ordinal
                                  .RemainingArgs()                 // x[0..n), then dependency operands
                                  .RemainingRets()                 // y[0..n)
                                  .Attr<int64_t>("comm_id")        // comm_id
                                  .Attr<int64_t>("algorithm")      // algorithm: 1 one-shot
                                  .Attr<int64_t>("site"));         // site: the call site's tag

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_all_gather_host, arx::xla::all_gather_host,
                              arx::xla::prefill_collective_binding(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_psum_scatter_host, arx::xla::psum_scatter_host,
                              arx::xla::prefill_collective_binding(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_moe_combine_psum_scatter_host, arx::xla::moe_combine_psum_scatter_host,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device_ordinal
                                  .RemainingArgs()                 // y, [y_scale], pos, w, shared, then dependencies
                                  .Ret<xla::ffi::AnyBuffer>()      // out [Tpad / world, H] bf16
                                  .Attr<int64_t>("comm_id")        // comm_id
                                  .Attr<int64_t>("site")           // site: the call site's tag
                                  .Attr<int64_t>("scaled"));       // scaled: 1 if y is e4m3 with y_scale

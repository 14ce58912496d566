// Host-platform handlers: the CPU backend runs the device side in the
// handler's own thread (ffi/host).
#include <mutex>

#include "host/collectives.h"
#include "xla/handlers.h"

namespace arx::xla {
namespace {

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
      for (size_t j = i + 1; j < rets.size(); ++j)  // the rest of the call gives NaN too, never stale memory
        if (auto yj = rets.get<ffi::AnyBuffer>(j); yj.has_value())
          if (auto dj = dtype_of((*yj)->element_type())) host::fill_nan_buffer(*dj, (*yj)->untyped_data(), (*yj)->element_count());
      return ffi::Error::Internal(s.message());
    }
  }
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

// Host-platform handlers: the CPU backend runs the device side in the
// handler's own thread (ffi/host).
#include "host/collectives.h"
#include "xla/handlers.h"

namespace arx::xla {
namespace {

ffi::Error psum_host(int32_t device_ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t comm_id,
                     int64_t algorithm) {
  const std::optional<DType> dtype = dtype_of(x.element_type());
  if (!dtype)
    return ffi::Error::InvalidArgument("jax_arx.psum: the CPU handler takes float32, bfloat16 or float16");
  if (y->element_type() != x.element_type() || y->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("jax_arx.psum: the result must have the operand's shape and dtype");
  if (algorithm != 1)
    return ffi::Error::InvalidArgument(strf("jax_arx.psum: algorithm %lld is not available on the CPU backend "
                                            "(only one-shot, 1)", (long long)algorithm));
  std::shared_ptr<Endpoint> ep;
  if (ffi::Error e = endpoint_for(comm_id, device_ordinal, ep); e.failure()) return e;
  const Status s = host::allreduce(*ep, *dtype, x.untyped_data(), y->untyped_data(), x.element_count());
  return s.ok() ? ffi::Error::Success() : ffi::Error::Internal(s.message());
}

}  // namespace
}  // namespace arx::xla

XLA_FFI_DEFINE_HANDLER_SYMBOL(arx_psum_host, arx::xla::psum_host,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::DeviceOrdinal>()  // device_ordinal
                                  .Arg<xla::ffi::AnyBuffer>()      // x
                                  .Ret<xla::ffi::AnyBuffer>()      // y
                                  .Attr<int64_t>("comm_id")        // comm_id
                                  .Attr<int64_t>("algorithm"));    // algorithm

// The XLA FFI handlers of jax_arx. Each is a thin layer: decode the call,
// find the endpoint by (comm_id, device ordinal), hand the buffers to a
// device side, and turn its Status into an ffi::Error.
#pragma once

#include <optional>
#include <string>

#include "comm/endpoint.h"
#include "comm/layout.h"
#include "xla/ffi/api/ffi.h"

namespace arx::xla {

namespace ffi = ::xla::ffi;

// The reducing ops' element types; nullopt for any other.
inline std::optional<DType> dtype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F16: return DType::kF16;
    default: return std::nullopt;  // XLA's enum, not ours: every other type is unsupported
  }
}

// The endpoint a call runs on, or an error saying how to get one.
inline ffi::Error endpoint_for(int64_t comm_id, int32_t device_ordinal, std::shared_ptr<Endpoint>& ep) {
  ep = find_endpoint(comm_id, device_ordinal);
  if (!ep)
    return ffi::Error::InvalidArgument(strf(
        "jax_arx: no communicator %lld on local device %d in this process; call jax_arx.initialize(mesh) (after "
        "jax.distributed.initialize) with the mesh the collective runs over, before running it",
        (long long)comm_id, (int)device_ordinal));
  return ffi::Error::Success();
}

}  // namespace arx::xla

XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_psum_host);
XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_all_gather_host);
XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_psum_scatter_host);
XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_moe_combine_psum_scatter_host);

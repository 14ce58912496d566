// A handler symbol as the capsule jax.ffi.register_ffi_target takes, for
// every platform's registrations (module.cc, handlers_cuda.cc). The capsule
// holds a void*, so nothing downstream checks what it points at: XLA calls it
// with a call frame whatever it is. The check is here, at compile time.
#pragma once

#include <nanobind/nanobind.h>

#include <type_traits>

#include "xla/ffi/api/c_api.h"

namespace arx::xla {

template <typename T>
nanobind::capsule capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>, "an XLA FFI handler");
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace arx::xla

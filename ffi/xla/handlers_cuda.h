// CUDA-platform handlers: each only launches kernels on XLA's stream
// (ffi/cuda), so they are command-buffer compatible and XLA may capture them
// in CUDA graphs. Compiled only where CUDA is found (ffi/xla/*_cuda.cc).
#pragma once

#include <nanobind/nanobind.h>

#include "xla/ffi/api/ffi.h"

namespace arx::xla {

// Adds this platform's handler capsules to `d` (target name -> capsule), for
// jax.ffi.register_ffi_target(name, capsule, platform="CUDA").
void add_cuda_registrations(nanobind::dict& d);

}  // namespace arx::xla

XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_psum_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_psum_add_norm_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_all_gather_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_psum_scatter_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_moe_combine_psum_scatter_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(arx_after_cuda);

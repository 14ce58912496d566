// The host device side as the CPU handlers call it (xla/handlers_host.cc):
// the plan asked for first (comm/plan.h), with the lane the handler asks it
// for, then handed to the device side, which runs what it says.
#pragma once

#include <optional>

#include "comm/plan.h"
#include "host/device_side.h"

namespace arx::testing {

inline Status psum(Endpoint& ep, DType dtype, const void* in, void* out, uint64_t count, uint64_t tag) {
  return host::psum(ep, plan_psum(ep, count * dtype_size(dtype)), dtype, in, out, count, tag);
}

inline Status all_gather(Endpoint& ep, const void* in, void* out, uint64_t bytes, uint64_t outer, uint64_t type_code,
                         std::optional<DType> nan_type, uint64_t tag) {
  return host::all_gather(ep, plan_bulk(ep, "all_gather", bytes), in, out, bytes, outer, type_code, nan_type, tag);
}

inline Status reduce_scatter(Endpoint& ep, DType dtype, const void* in, void* out, uint64_t count, uint64_t outer,
                             uint64_t tag) {
  const Plan plan = plan_bulk(ep, "psum_scatter", count * dtype_size(dtype));
  return host::reduce_scatter(ep, plan, dtype, in, out, count, outer, tag);
}

inline Status moe_combine_reduce_scatter(Endpoint& ep, const MoeCombine& a, uint16_t* out, uint64_t tag) {
  const Plan plan = plan_bulk(ep, "moe_combine_psum_scatter", a.padded / ep.spec().world * a.hidden * 2);
  return host::moe_combine_reduce_scatter(ep, plan, a, out, tag);
}

}  // namespace arx::testing

// The device side on the CPU: the same steps as the CUDA kernels, on the
// same layout, run by the XLA CPU handler's thread.
#pragma once

#include <cstdint>

#include "comm/endpoint.h"
#include "comm/layout.h"
#include "comm/status.h"

namespace arx::host {

// out[count] = sum over the communicator's ranks of in[count], fp32 in rank
// order, rounded once: every rank gets the same bits. in and out may alias.
// The partial must fit a slot (count * size <= slot_bytes). On failure
// (a peer that does not arrive within the timeout, a peer that issued a
// different collective, an endpoint that had failed already) out is filled
// with NaN and the error names the peers. `tag` identifies the call site
// (every rank passes the same); it travels in the descriptor.
// Callers serialize calls on one endpoint (Endpoint::host_call_mu).
Status allreduce(Endpoint& ep, DType dtype, const void* in, void* out, uint64_t count, uint64_t tag);

}  // namespace arx::host

// The prefill-sized ops on the CPU: the same steps as the CUDA kernels, on
// the same layout (layout.h, "Prefill-sized ops"), run by the XLA CPU
// handler's thread, while the proxy sends the pieces it publishes.
//
// Each call is one prefill op with the next prefill seq. The result is
// written into `out` (XLA's buffer), never left in the pinned slot. On
// failure (a peer that does not arrive within the timeout, a peer that
// issued a different collective, an endpoint that had failed already) out
// is filled with NaN and the error names the peers. `tag` identifies the
// call site (every rank passes the same); it travels in the descriptor.
// Callers serialize calls on one endpoint (Endpoint::host_call_mu).
#pragma once

#include <cstdint>
#include <optional>

#include "comm/endpoint.h"
#include "comm/layout.h"
#include "comm/status.h"

namespace arx::host {

// Layout of the gathered / scattered dimension. A rank's part is `outer`
// rows of `block` bytes: for an axis d, outer is the product of the sizes
// before d, so that the gathered output, and the scattered input, are
// [outer][world][block] (rank j's rows interleaved with the others', block
// bytes each). The wire carries each rank's part contiguous; the device
// side does the strided copies. outer = 1 is the leading axis.

// out[outer][world][block] = every rank's in[outer][block] (this rank's at
// index rank): bytes, any element type. `type_code` tells element types
// apart in the descriptor. On failure out gets nan_type's NaN, or every byte
// 0xFF (a NaN in every floating type) when nan_type is empty. Needs
// world * bytes <= prefill_slot_bytes, bytes = outer * block.
Status all_gather(Endpoint& ep, const void* in, void* out, uint64_t bytes, uint64_t outer, uint64_t type_code,
                  std::optional<DType> nan_type, uint64_t tag);

// out[outer][count / outer] = the sum over ranks of their in[outer][rank][.]
// (in is [outer][world][count / outer]), fp32 in rank order, rounded once:
// every rank gets the same bits. Needs world * count * size <=
// prefill_slot_bytes.
Status reduce_scatter(Endpoint& ep, DType dtype, const void* in, void* out, uint64_t count, uint64_t outer,
                      uint64_t tag);

// The fused MoE combine (see jax_arx.moe_combine_psum_scatter): row t of
// the combined output, for t < tokens,
//   shared[t] + sum_k w[t, k] * y[pos[t, k]]
// in fp32: acc = shared[t], then for k in order acc = fma(w[t, k], y, acc)
// (one rounding per term; for e4m3 y, fma(w[t, k] * scale, y, acc) with the
// weight-times-scale product rounded first), rounded once to bf16; rows
// tokens <= t < padded are zero.
// The rows are written straight into prefill_send and published piece by
// piece per destination; then out[padded / world, hidden] = the rank-order
// sum of every rank's rows for this rank. pos entries outside [0, rows) are
// clamped into it. y8 scales: y is e4m3 with one fp32 scale per (row, 128
// columns), y_scale[r * hidden / 128 + c / 128]; else y is bf16.
struct MoeCombine {
  const void* y = nullptr;         // [rows, hidden] bf16 or e4m3
  const float* y_scale = nullptr;  // [rows, hidden / 128] when y is e4m3, else null
  const int32_t* pos = nullptr;    // [tokens, topk]
  const float* w = nullptr;        // [tokens, topk]
  const uint16_t* shared = nullptr;  // [tokens, hidden] bf16
  uint64_t rows = 0, tokens = 0, padded = 0, hidden = 0, topk = 0;
};
Status moe_combine_reduce_scatter(Endpoint& ep, const MoeCombine& a, uint16_t* out, uint64_t tag);

}  // namespace arx::host

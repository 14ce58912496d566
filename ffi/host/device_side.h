// The device side on the CPU: the collectives of the CUDA kernels, with the
// same steps over the same channels (comm/channel.h) and the same bits, run
// by the XLA CPU handler's thread.
//
// Each call is one collective with the next seq of its family. The result is
// written into `out` (XLA's buffer), never left in a buffer of the endpoint.
// On failure (a peer that does not arrive within the timeout, a peer that
// issued a different collective, an endpoint that had failed already) out is
// filled with NaN and the error names the peers. `tag` identifies the call
// site (every rank passes the same); it travels in the descriptor. Callers
// serialize calls on one endpoint (Endpoint::host_call_mu).
//
// `plan` is what comm/plan.h chose for the call, which the handler asked
// for once, to count the call and run it: a plan that does not run here
// (kNone, or for psum anything but kOneShot) fails the call with its
// why_not, out untouched, as long as the endpoint has not failed.
#pragma once

#include <cstdint>
#include <optional>

#include "base/combine.h"
#include "base/layout.h"
#include "base/norm.h"
#include "base/status.h"
#include "comm/endpoint.h"
#include "comm/plan.h"

namespace arx::host {

// out[count] = sum over the communicator's ranks of in[count], fp32 in rank
// order, rounded once: every rank gets the same bits. in and out may alias.
// `plan`: plan_psum's, with the row's bytes for a fused call. With `norm`
// on, the fused call (base/norm.h): out becomes the sum + norm.residual
// (hidden) and norm.normed its norm, row by row; on failure both are NaN.
Status psum(Endpoint& ep, const Plan& plan, DType dtype, const void* in, void* out, uint64_t count, uint64_t tag,
            const AddNorm& norm = {});

// The epilogue of a fused psum on `hidden`, which holds the sum (base/norm.h).
void add_norm(DType dtype, void* hidden, uint64_t count, const AddNorm& n);

// The bulk collectives. The gathered / scattered dimension: a rank's part is
// `outer` rows of `block` bytes (outer: the product of the sizes before the
// dimension), so the gathered output, and the scattered input, are
// [outer][world][block]. On the wire a rank's part is contiguous; the device
// side does the strided copies. outer = 1 is the leading axis. `plan`:
// plan_bulk's for the lane (a rank's slice of all_gather; a destination's
// part of psum_scatter and of the MoE combine's output).

// out[outer][world][block] = every rank's in[outer][block] (this rank's at
// index rank): bytes, any element type. `type_code` tells element types
// apart in the descriptor. On failure out gets nan_type's NaN, or every byte
// 0xFF (a NaN in every floating type) when nan_type is empty.
Status all_gather(Endpoint& ep, const Plan& plan, const void* in, void* out, uint64_t bytes, uint64_t outer,
                  uint64_t type_code, std::optional<DType> nan_type, uint64_t tag);

// out[outer][count / outer] = the sum over ranks of their in[outer][rank][.]
// (in is [outer][world][count / outer]), fp32 in rank order, rounded once.
Status reduce_scatter(Endpoint& ep, const Plan& plan, DType dtype, const void* in, void* out, uint64_t count,
                      uint64_t outer, uint64_t tag);

// The fused MoE combine (see jax_arx.moe_combine_psum_scatter), of the
// operands base/combine.h describes: row t of the combined output, for t <
// tokens, is shared[t] + sum_k w[t, k] * y[pos[t, k]] in fp32: acc =
// shared[t], then for k in order each term added as base/combine.h says
// (for e4m3 y, of w[t, k] * scale, that product rounded first), rounded
// once to bf16. Each destination's rows are computed straight into what the
// channel sends, piece by piece; then out[padded / world, hidden] = the
// rank-order sum of every rank's rows for this rank.
Status moe_combine_reduce_scatter(Endpoint& ep, const Plan& plan, const MoeCombine& a, uint16_t* out, uint64_t tag);

}  // namespace arx::host

// What the host device side's collectives share (psum in collectives.cc,
// the prefill ops in prefill.cc): the failure record, the bounded wait on
// the peers' flags, and the rank-order fp32 sum.
#pragma once

#include <cstdint>

#include "comm/endpoint.h"
#include "comm/layout.h"
#include "comm/status.h"

namespace arx::host {

// Records a failed wait in the Control block, where jax_arx.check() and the
// proxy read it, exactly as a kernel would: the details first, failed_seq
// last with release. The first failure is the one kept. `op`: 0 for a psum
// (seq = psum seq), else the WorkOp of a prefill op (seq = prefill seq).
void record_failure(Endpoint& ep, uint64_t seq, uint64_t op, FailureKind kind, uint64_t missing, uint64_t flag,
                    int src, uint64_t desc);

// One wait on every peer's flag word, on every root.
struct FlagWait {
  int first = 0;           // index of the flag word of (src 0, root 0): flag_index(0, 0) or prefill_flag_index(0, 0)
  uint64_t want = 0;       // the progress every flag must reach
  uint64_t op_lo = 0;      // progress values [op_lo, op_hi] belong to the awaited collective:
  uint64_t op_hi = 0;      //   a flag there must carry its descriptor
  uint64_t desc = 0;       // describe() / describe_prefill() of the awaited collective
  uint64_t seq = 0;        // for the failure record
  uint64_t op = 0;         // for the failure record: 0 psum, else WorkOp
};

// Waits until every peer's flag reaches w.want. A flag inside the awaited
// collective's progress range must carry its descriptor, or the wait
// records a mismatch. A flag past the range is from a peer that already
// finished the collective, which it could only do after agreeing with ours
// (it checked our flags), so it counts as arrived; its later data went to
// the other parity. Bounded by the endpoint's timeout; gives up at once
// when the endpoint is aborted. On failure the record is written and the
// returned Status only says which way it failed.
//
// The wait yields the core on every turn: on a machine with fewer cores than
// waiting threads, a spin that does not yield starves the very peer (or
// proxy) it waits for. After a few milliseconds it naps instead, so a long
// wait (a peer still compiling) costs no CPU.
Status wait_flags(Endpoint& ep, const FlagWait& w);

// out[count] = sum over src of parts[src][count], fp32 in rank order from
// 0.0f, rounded once to dtype: every rank gets the same bits. `out` may
// alias parts[i].
void sum_rank_order(DType dtype, const uint8_t* const* parts, int world, uint64_t count, void* out);

}  // namespace arx::host

// What the kernels of ffi/cuda share about one grid and one endpoint: the
// counters the blocks of a grid meet on, the endpoint's failure state as a
// kernel sees it, and the failure record it leaves for the host.
#pragma once

#include <cstdint>

#include "comm/layout.h"
#include "cuda/device_side.h"
#include "cuda/ptx.cuh"

namespace arx::cuda {

// A failure an earlier kernel of this endpoint recorded (DeviceWords::failed,
// in device memory: written by a kernel that completed before this one
// started, so every block sees it with a plain load).
__device__ __forceinline__ bool recorded_failure(const DeviceView& v) { return v.words->failed != 0; }

// Counters shared by the blocks of one grid carry the seq in their high bits
// (seq << 16 | count), so an arrival from an earlier seq whose grid gave up
// waiting can never be counted towards this one. acq_rel: what the arriving
// block did before it (its thread 0, after the block's barrier) is visible
// to whoever sees the count it made.
__device__ __forceinline__ unsigned long long tagged_arrive(unsigned long long* word, uint64_t seq) {
  unsigned long long old = ld_acquire_gpu(word);
  while (true) {
    const uint64_t tag = old >> 16;
    if (tag > seq) return old;  // a later seq owns the word: this arrival is stale
    const unsigned long long next = tag == seq ? old + 1 : (seq << 16 | 1);
    const unsigned long long seen = cas_acq_rel_gpu(word, old, next);
    if (seen == old) return next;
    old = seen;
  }
}

// The first failure of the endpoint is the one kept, in the Control block,
// as the host side records it: the details first, failed_seq last with
// release, so the host (jax_arx.check(), the proxy) that sees failed_seq
// sees the rest. `op`: 0 for a psum (seq = psum seq), else the WorkOp of a
// prefill op (seq = prefill seq).
__device__ __forceinline__ void record_failure(const DeviceView& v, uint64_t seq, uint64_t op, uint64_t kind,
                                               uint64_t missing, uint64_t flag, uint64_t src, uint64_t desc) {
  Control* ctl = v.ctl;
  if (ld_acquire_sys(&ctl->failed_seq) != 0) return;
  const bool mismatch = kind == (uint64_t)FailureKind::kMismatch;
  st_relaxed_sys(&ctl->failed_kind, kind);
  st_relaxed_sys(&ctl->failed_missing, mismatch ? 0 : missing);
  st_relaxed_sys(&ctl->failed_flag, mismatch ? flag : 0);
  st_relaxed_sys(&ctl->failed_src, mismatch ? src : 0);
  st_relaxed_sys(&ctl->failed_desc, desc);
  if (op) st_relaxed_sys(&ctl->failed_op, op);  // kernels that only run psums never write it
  st_release_sys(&ctl->failed_seq, seq);
}

}  // namespace arx::cuda

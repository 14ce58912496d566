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
// (seq << 16 | count), so a count an earlier seq's grid left in the word is
// never counted towards this one. An endpoint's kernels never overlap (stream
// order), so the word never holds a later seq than the arriving grid's.
//
// Tagging: raise the word to seq << 16 (a count of this seq's is kept, one of
// an earlier seq's dropped). Every block tags before it counts; a block may
// tag at its start (fire and forget), so that its arrival at the end is one
// atomic. No compare-and-swap loop: with one, every block that arrived at
// once retried, a round trip each; it cost about 1 us per block of the grid
// (the pipelined one-shot in 4 KiB chunks, 16 blocks: 19 against 9 us at
// 64 KB, 2 H200s).
__device__ __forceinline__ void tag_arrivals(unsigned long long* word, uint64_t seq) {
  red_max_relaxed_gpu(word, (unsigned long long)(seq << 16));
}

// Counts an arrival (`add`: 1, plus whatever a caller keeps above the count
// bits) on a word this block tagged for this seq; returns the word after it.
// acq_rel: what the arriving block did before it (its thread 0, after the
// block's barrier) is visible to whoever sees the count it made.
__device__ __forceinline__ unsigned long long count_arrival(unsigned long long* word, unsigned long long add) {
  return add_acq_rel_gpu(word, add) + add;
}

__device__ __forceinline__ unsigned long long tagged_arrive(unsigned long long* word, uint64_t seq) {
  tag_arrivals(word, seq);  // same thread, same word: ordered before the add
  return count_arrival(word, 1);
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

// A wait of a grid that settles its failures in its last block out (the
// pipelined and LL one-shots, the prefill ops) gives up: what it found goes
// into the grid's DeviceWords::fail_* (the first mismatch or abort kind,
// missing bits, fail_any), for the last block out to record. Here: `src` published a different collective at this seq
// (its flag word `f`).
__device__ inline void give_up_mismatch(DeviceWords* w, uint64_t f, int src) {
  if (atomicCAS(&w->fail_kind, 0ull, (unsigned long long)FailureKind::kMismatch) == 0ull) {
    w->fail_flag = f;
    w->fail_src = (unsigned long long)src;
  }
  atomicExch(&w->fail_any, 1ull);
}

// The bounds of such a wait, checked after
// each unsuccessful poll (turn: how many came before): the other waiters'
// give-ups every 16th turn (a word in device memory that other blocks
// write), Control::abort every 256th (a read of host memory, over the bus:
// the LL one-shot has thousands of threads waiting at once, and their reads
// of host memory must stay few), the timeout every turn. false: give up on
// the seq or op (recorded as give_up_mismatch says); `missing`: bit
// flag_index(src, root) per source still waited for.
__device__ inline bool keep_waiting(const DeviceView& v, uint32_t turn, uint64_t start, unsigned long long missing) {
  DeviceWords* w = v.words;
  if ((turn & 15) == 15) {
    // Control::abort: the host knows the endpoint failed; give up at once.
    if ((turn & 255) == 255 && ld_acquire_sys(&v.ctl->abort) != 0) {
      atomicOr(&w->fail_missing, missing);
      atomicCAS(&w->fail_kind, 0ull, (unsigned long long)FailureKind::kAborted);
      atomicExch(&w->fail_any, 1ull);
      return false;
    }
    // Another waiter gave up: the seq fails anyway (a mismatch is found by
    // one waiter, and the peer may never write what this one waits for).
    if (ld_acquire_gpu(&w->fail_any) != 0) return false;
  }
  if (globaltimer() - start > v.timeout_ns) {
    atomicOr(&w->fail_missing, missing);
    atomicExch(&w->fail_any, 1ull);
    return false;
  }
  return true;
}

}  // namespace arx::cuda

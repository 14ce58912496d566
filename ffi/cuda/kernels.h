// The kernels' launchers, each over the channel it is given (the channel's
// type chooses the route: cuda/launch.cc decides which, once per endpoint, so
// no kernel branches on it). Host code; each returns the launch error, which
// may belong to an earlier kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_side.h"

namespace arx::cuda {

// oneshot.cu: the one-shot psum in `pieces` pieces.
// oneshot.cu and ll.cu take a fused call's epilogue (`nm`, off for a plain psum).
template <typename Ch>
cudaError_t launch_oneshot(const Grid& g, const Ch& ch, DType dtype, const void* in, void* out, uint64_t count,
                           uint64_t tag, const Prefetch& pf, int pieces, const AddNorm& nm, cudaStream_t stream);

// twoshot.cu: the two-shot psum (a reduce-scatter kernel, then an all-gather
// kernel, a seq each).
template <typename Ch>
cudaError_t launch_twoshot(const Grid& g, const Ch& ch, DType dtype, const void* in, void* out, uint64_t count,
                           uint64_t tag, const Prefetch& pf, cudaStream_t stream);

// ll.cu: the LL one-shot.
template <typename Ch>
cudaError_t launch_ll(const Grid& g, const LLChannel<Ch>& ch, DType dtype, const void* in, void* out, uint64_t count,
                      uint64_t tag, const Prefetch& pf, const AddNorm& nm, cudaStream_t stream);

// norm.cu: a fused call's epilogue on its own, over `hidden` that holds the
// sum (after the two-shot, whose rows no one block holds).
cudaError_t launch_add_norm(DType dtype, void* hidden, uint64_t count, const AddNorm& nm, cudaStream_t stream);

// bulk.cu: one bulk collective.
enum class BulkKind { kGather, kScatter, kMoe };
struct BulkOp {
  BulkKind kind;
  const uint8_t* in;
  uint8_t* out;
  uint64_t slice, block, stride;  // a lane's bytes; the rows of the strided side (see bulk.cu)
  Descriptor d;
  int nan_type;  // DType of the NaN a failed op leaves, or -1: every byte 0xFF
  uint64_t out_bytes;
  DType dtype;  // the reducing type (kScatter, kMoe)
  MoeCombine moe;
  uint64_t rows_per_rank, row_bytes;
  uint64_t piece_bytes;  // about how much work one piece is (sizes the grid)
  bool gpu_inboxes;      // the inboxes are in GPU memory (sizes the grid too)
};
template <typename Ch>
cudaError_t launch_bulk(const Grid& g, const Ch& ch, const BulkOp& op, cudaStream_t stream);

}  // namespace arx::cuda

// A fused call's epilogue as a kernel of its own (cuda/norm.cuh): after the
// two-shot, whose all-gather leaves each row's sum spread over the blocks.
// Block b norms rows b, b + B, ... with all its threads.
#include <algorithm>

#include "cuda/kernels.h"
#include "cuda/norm.cuh"

namespace arx::cuda {
namespace {

// Blocks of the epilogue: one per row, up to the SMs of an H200.
constexpr int kNormBlocks = 132;

template <DType D>
__global__ void __launch_bounds__(kThreads, 1) add_norm_kernel(uint8_t* hidden, uint64_t rows, AddNorm nm) {
  __shared__ float s_lanes[kNormLanes];
  for (uint64_t row = blockIdx.x; row < rows; row += gridDim.x)
    add_norm_row<D>(nm, hidden, row, (int)threadIdx.x, (int)blockDim.x, s_lanes, [] { __syncthreads(); });
}

template <DType D>
cudaError_t launch_typed(void* hidden, uint64_t rows, const AddNorm& nm, cudaStream_t stream) {
  const int blocks = (int)std::min<uint64_t>(rows, kNormBlocks);
  add_norm_kernel<D><<<blocks, kThreads, 0, stream>>>(static_cast<uint8_t*>(hidden), rows, nm);
  return cudaGetLastError();  // may be an earlier kernel's error
}

}  // namespace

cudaError_t launch_add_norm(DType dtype, void* hidden, uint64_t count, const AddNorm& nm, cudaStream_t stream) {
  const uint64_t rows = nm.width ? count / nm.width : 0;
  if (rows == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kF32:
      return launch_typed<DType::kF32>(hidden, rows, nm, stream);
    case DType::kBF16:
      return launch_typed<DType::kBF16>(hidden, rows, nm, stream);
    case DType::kF16:
      return launch_typed<DType::kF16>(hidden, rows, nm, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace arx::cuda

// The host object behind an attached endpoint's device_state: what attach()
// made (cuda/attach.cc) and what goes with the endpoint. Internal to the
// CUDA device side (and its test build's hooks, tests/gpu/hooks_cuda.cc).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <vector>

#include "cuda/device_side.h"

namespace arx::cuda {

// Makes `device` current for the scope and restores the caller's device: the
// handler threads belong to XLA, which keeps its own device current.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    ok_ = cudaSetDevice(device) == cudaSuccess;
  }
  ~DeviceScope() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  bool ok() const { return ok_; }

 private:
  int prev_ = -1;
  bool ok_ = false;
};

struct DeviceState {
  int device = 0;
  std::vector<void*> registered;  // host addresses pinned for the device: the region, then mapped peers'
  DeviceWords* words = nullptr;
  std::shared_ptr<void> peer_memory;  // the GPU inboxes' mappings (peer_memory.cc), if any
  Channels channels;

  ~DeviceState() {
    // Kernels of this endpoint may still be queued: let them finish (every
    // wait in them is bounded) before their memory goes. Errors are ignored:
    // at process exit the CUDA runtime may already be gone.
    DeviceScope scope(device);
    cudaDeviceSynchronize();
    // A CUDA graph captured earlier (XLA's command buffers) may still launch
    // this endpoint's kernels, with these very arguments, after it is gone:
    // the handler does not run on a replay. So the words stay, marked
    // failed, for the life of the process (256 bytes per closed endpoint);
    // a kernel that finds `failed` touches nothing but its words and its
    // output (grid.cuh, begin), so the region and the mappings may go.
    if (words) {
      const unsigned long long one = 1;
      cudaMemcpy(&words->failed, &one, sizeof one, cudaMemcpyHostToDevice);
    }
    peer_memory.reset();
    for (void* p : registered) cudaHostUnregister(p);
  }
};

}  // namespace arx::cuda

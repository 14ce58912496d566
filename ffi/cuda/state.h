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
    peer_memory.reset();
    if (words) cudaFree(words);
    for (void* p : registered) cudaHostUnregister(p);
  }
};

}  // namespace arx::cuda

// A trace build's clock (base/trace.h): the offset between the GPU's
// %globaltimer, which the kernels' stamps read, and the host's steady clock,
// which the proxy's read. The host and a one-thread kernel play ping-pong
// through mapped host memory; the round trip that took least bounds the
// offset best (its half is the error). Only in a trace build.
#if defined(ARX_TRACE)
#include <cstring>
#include <limits>

#include "base/atomics.h"
#include "base/trace.h"
#include "cuda/device_side.h"
#include "cuda/ptx.cuh"
#include "cuda/state.h"

namespace arx::cuda {
namespace {

// words[0]: the host's request i; words[1]: the reply i; words[2]: the
// GPU's clock when it replied. Gives up after `timeout_ns`.
__global__ void echo_kernel(uint64_t* words, int rounds, uint64_t timeout_ns) {
  const uint64_t start = globaltimer();
  for (int i = 1; i <= rounds; ++i) {
    while (load_acquire(&words[0]) < (uint64_t)i)
      if (globaltimer() - start > timeout_ns) return;
    store_relaxed(&words[2], globaltimer());
    store_release(&words[1], (uint64_t)i);
  }
}

}  // namespace

Status trace_clock(int device, int64_t& offset_ns, int64_t& error_ns) {
  DeviceScope scope(device);
  constexpr int kRounds = 2000;
  uint64_t* words = nullptr;
  if (cudaHostAlloc(reinterpret_cast<void**>(&words), 64, cudaHostAllocMapped) != cudaSuccess)
    return Status::Error("jax_arx: trace_clock: cudaHostAlloc failed");
  std::memset(words, 0, 64);
  uint64_t* dev = nullptr;
  cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), words, 0);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  echo_kernel<<<1, 1, 0, stream>>>(dev, kRounds, 10'000'000'000ull);
  uint64_t best = std::numeric_limits<uint64_t>::max();
  const uint64_t give_up = trace_now() + 10'000'000'000ull;
  for (int i = 1; i <= kRounds; ++i) {
    const uint64_t h0 = trace_now();
    store_release(&words[0], (uint64_t)i);
    while (load_acquire(&words[1]) < (uint64_t)i)
      if (trace_now() > give_up) break;
    const uint64_t h1 = trace_now();
    if (load_acquire(&words[1]) < (uint64_t)i) break;
    if (h1 - h0 < best) {
      best = h1 - h0;
      offset_ns = (int64_t)((h0 + h1) / 2) - (int64_t)load_relaxed(&words[2]);
    }
  }
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  cudaFreeHost(words);
  if (best == std::numeric_limits<uint64_t>::max())
    return Status::Error("jax_arx: trace_clock: the GPU did not answer within 10 s");
  error_ns = (int64_t)(best / 2);
  return Status::Ok();
}

}  // namespace arx::cuda
#endif

// The pinned round trip: a kernel's thread and a host thread pass a word
// back and forth through mapped host memory, as a kernel and the proxy do on
// every collective of the proxy route. Its time is that route's floor
// (examples/bench_psum.py measures it in the same run as the collectives),
// and the round trip that took least bounds the offset between the GPU's
// %globaltimer and the host's steady clock (its half is the error), which a
// trace build's stamps need (base/trace.h).
#include <algorithm>
#include <cstring>
#include <vector>

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

Status pinned_ping_pong(int device, int rounds, PingPong& out) {
  DeviceScope scope(device);
  if (!scope.ok() || rounds < 1) return Status::Error("jax_arx: pinned_round_trip: no such device, or no rounds");
  constexpr uint64_t kGiveUpNs = 10'000'000'000ull;
  uint64_t* words = nullptr;
  if (cudaHostAlloc(reinterpret_cast<void**>(&words), 64, cudaHostAllocMapped) != cudaSuccess) {
    cudaGetLastError();
    return Status::Error("jax_arx: pinned_round_trip: cudaHostAlloc failed");
  }
  std::memset(words, 0, 64);
  uint64_t* dev = nullptr;
  cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), words, 0);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  echo_kernel<<<1, 1, 0, stream>>>(dev, rounds, kGiveUpNs);
  std::vector<uint64_t> rtt;
  rtt.reserve(rounds);
  const uint64_t give_up = trace_now() + kGiveUpNs;
  uint64_t best = ~0ull;
  for (int i = 1; i <= rounds; ++i) {
    const uint64_t h0 = trace_now();
    store_release(&words[0], (uint64_t)i);
    while (load_acquire(&words[1]) < (uint64_t)i && trace_now() < give_up) {
    }
    const uint64_t h1 = trace_now();
    if (load_acquire(&words[1]) < (uint64_t)i) break;
    rtt.push_back(h1 - h0);
    if (h1 - h0 < best) {
      best = h1 - h0;
      out.offset_ns = (int64_t)((h0 + h1) / 2) - (int64_t)load_relaxed(&words[2]);
    }
  }
  cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  cudaFreeHost(words);
  if (rtt.empty()) return Status::Error("jax_arx: pinned_round_trip: the GPU did not answer within 10 s");
  // The first rounds include the kernel's launch.
  std::vector<uint64_t> steady(rtt.begin() + std::min<size_t>(rtt.size() - 1, rtt.size() / 10), rtt.end());
  std::nth_element(steady.begin(), steady.begin() + steady.size() / 2, steady.end());
  out.min_ns = best;
  out.median_ns = steady[steady.size() / 2];
  out.error_ns = (int64_t)(best / 2);
  return Status::Ok();
}

}  // namespace arx::cuda

// attach(): the CUDA device side's resources for one endpoint. The host
// object (DeviceState) owns them; the kernels get a DeviceView, plain data.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/device_side.h"

namespace arx::cuda {
namespace {

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
  DeviceView view{};

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

// Pins [p, p + bytes) for the current device and returns its device address.
cudaError_t map_host(DeviceState& st, void* p, uint64_t bytes, uint8_t*& dev) {
  // Mapped: kernels reach it over the bus (on GB10, it is device memory at
  // full speed). Portable: every context of this process sees it pinned, as
  // one process may drive several GPUs.
  cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e != cudaSuccess) return e;
  st.registered.push_back(p);
  void* d = nullptr;
  e = cudaHostGetDevicePointer(&d, p, 0);
  dev = static_cast<uint8_t*>(d);
  return e;
}

// Direct mode: on the shm carrier the peers' regions are mapped in this
// process, so the kernels can write the peers' inboxes themselves, one copy
// over the bus instead of a copy to send[] and the proxy's copy after it,
// and no proxy hop on the way. Measured on 2 H200s (examples/bench_psum.py,
// bf16 one-shot, us): 13 / 21 / 42 / 72 / 135 / 215 at 8 KB / 64 KB /
// 256 KB / 512 KB / 2 MB / 4 MB, against 12 / 29 / 74 / 132 / 343 / 616
// through the proxy (those direct figures are the one-shot in one piece;
// chunk by chunk, a flag per chunk, the default now: 13 / 16 / 30 / 46 / 97 /
// 167, see kPipeChunkBytes in allreduce.cu). JAX_ARX_CUDA_DIRECT=0 turns it
// off. The psum inboxes then move into GPU memory where the GPUs can map
// each other's (peer_memory.cc); those figures are for host inboxes.
bool want_direct(const Endpoint& ep) {
  return ep.spec().config.cuda_direct && ep.transport()->kind() == TransportKind::kShm;
}

Status cuda_error(const Endpoint& ep, const char* what, cudaError_t e) {
  cudaGetLastError();  // clear it: it belongs to this call, not to a later kernel
  return Status::Error(strf("jax_arx: %s: %s on device %d failed: %s (%s)", ep.label().c_str(), what,
                            ep.spec().device_ordinal, cudaGetErrorName(e), cudaGetErrorString(e)));
}

}  // namespace

Status attach(Endpoint& ep) {
  if (ep.device_state) return Status::Ok();
  const int device = ep.spec().device_ordinal;
  const Layout& L = ep.layout();
  if (L.slot_bytes % 16 || L.send_bytes % 16)
    return Status::Error(strf("jax_arx: %s: slot_bytes and send_bytes must be multiples of 16", ep.label().c_str()));
  DeviceScope scope(device);
  if (!scope.ok()) return cuda_error(ep, "cudaSetDevice", cudaGetLastError());
  auto st = std::make_shared<DeviceState>();
  st->device = device;
  uint8_t* base = nullptr;
  cudaError_t e = map_host(*st, ep.base(), ep.region()->size(), base);
  if (e != cudaSuccess) return cuda_error(ep, "pinning the endpoint's region (cudaHostRegister)", e);
  e = cudaMalloc(&st->words, sizeof(DeviceWords));
  if (e != cudaSuccess) return cuda_error(ep, "cudaMalloc of the device words", e);
  e = cudaMemset(st->words, 0, sizeof(DeviceWords));
  if (e == cudaSuccess) e = cudaDeviceSynchronize();  // zeroed before any stream of XLA's uses them
  if (e != cudaSuccess) return cuda_error(ep, "zeroing the device words", e);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);

  DeviceView& v = st->view;
  v.ctl = reinterpret_cast<Control*>(base + L.control);
  v.flags = reinterpret_cast<const uint64_t*>(base + L.flags);
  v.recv = base + L.recv;
  v.send = base + L.send;
  v.words = st->words;
  v.slot_bytes = L.slot_bytes;
  v.send_bytes = L.send_bytes;
  v.timeout_ns = (uint64_t)(ep.spec().config.timeout_s * 1e9);
  v.rank = ep.spec().rank;
  v.world = ep.spec().world;
  v.roots = ep.roots();
  // The blocks of a grid wait for each other, so they must all be resident:
  // a quarter of the multiprocessors at most, one block each (more blocks
  // measured slower, see kUnroll in allreduce.cu).
  v.max_blocks = std::clamp(sms / 4, 1, 32);
  v.direct = false;
  v.pipeline = (int)ep.spec().config.cuda_pipeline;
  v.chunk_bytes = ep.spec().config.cuda_chunk_bytes;
  v.ll_max_bytes = ep.spec().config.cuda_ll_max_bytes;
  v.ll_recv = base + L.ll_recv;
  v.chunk_flags = v.flags;
  v.peer_memory = false;
  v.pctl = reinterpret_cast<PrefillControl*>(base + L.prefill_ctl);
  v.prefill_send = base + L.prefill_send;
  v.prefill_recv = base + L.prefill_recv;
  v.prefill_slot_bytes = L.prefill_slot_bytes;
  bool mapped = want_direct(ep);
  for (int p = 0; p < v.world && mapped; ++p)  // every peer, or none (a carrier that is not connected)
    mapped = p == v.rank || ep.transport()->peer_base(p) != nullptr;
  if (mapped) {
    for (int p = 0; p < v.world; ++p) {
      if (p == v.rank) continue;
      uint8_t* dev = nullptr;
      e = map_host(*st, ep.transport()->peer_base(p), L.total, dev);
      if (e != cudaSuccess) return cuda_error(ep, "pinning a peer's region (cudaHostRegister)", e);
      v.peer_recv[p] = dev + L.recv;
      v.peer_flags[p] = reinterpret_cast<uint64_t*>(dev + L.flags);
      v.peer_chunk_flags[p] = v.peer_flags[p];
      v.peer_prefill_recv[p] = dev + L.prefill_recv;
      v.peer_ll_recv[p] = dev + L.ll_recv;
    }
    // The psum inboxes in GPU memory where every rank can map every peer's:
    // a flag page, recv[2][world] and ll_recv[2][world], laid out as in the
    // host region. The prefill inboxes stay in the host region.
    const uint64_t recv_at = kFlagWords * 8, ll_at = recv_at + 2 * (uint64_t)v.world * L.slot_bytes;
    PeerInboxes inboxes;
    const Status s = map_peer_memory(ep, device, ll_at + 2 * (uint64_t)v.world * kLLSlotBytes, inboxes);
    if (!s.ok()) return s;
    if (inboxes.mine) {
      v.chunk_flags = reinterpret_cast<const uint64_t*>(inboxes.mine);
      v.recv = inboxes.mine + recv_at;
      v.ll_recv = inboxes.mine + ll_at;
      for (int p = 0; p < v.world; ++p) {
        if (p == v.rank) continue;
        v.peer_chunk_flags[p] = reinterpret_cast<uint64_t*>(inboxes.peer[p]);
        v.peer_recv[p] = inboxes.peer[p] + recv_at;
        v.peer_ll_recv[p] = inboxes.peer[p] + ll_at;
      }
      v.peer_memory = true;
      st->peer_memory = std::move(inboxes.holder);
    }
    v.direct = true;
    ep.set_device_sends();  // the proxy sends no psum seq from now on
  }
  ep.device_state = std::move(st);
  return Status::Ok();
}

const DeviceView* view_of(const Endpoint& ep) {
  return ep.device_state ? &static_cast<const DeviceState*>(ep.device_state.get())->view : nullptr;
}

uint64_t oneshot_max_bytes(const Endpoint& ep) { return ep.layout().slot_bytes; }

// The two-shot partial goes whole into send[par], and each rank's chunk
// (chunk_range: a 16-byte multiple of at most ceil(bytes / world)) into a slot.
uint64_t twoshot_max_bytes(const Endpoint& ep) {
  const Layout& L = ep.layout();
  return std::min<uint64_t>(L.send_bytes, L.slot_bytes * (uint64_t)L.world);
}

}  // namespace arx::cuda

// attach(): the CUDA device side's resources for one endpoint. The host
// object (DeviceState) owns them; the kernels get a Grid and a channel,
// plain data, built here from the endpoint's region and, on one host, the
// peers' (comm/channel.h).
//
// Routes. On one host (the peers' regions mapped here, Endpoint::windows)
// the kernels write the peers' inboxes themselves: the direct channel, one
// copy over the bus instead of a copy to the staging buffer and the proxy's
// copy after it, and no proxy hop on the way; with the inboxes in GPU memory
// where every rank can map every peer's (peer_memory.cc). Elsewhere, or with
// JAX_ARX_CUDA_DIRECT=0, the proxy channel over the carrier. Every rank of a
// communicator takes the same route: it depends only on the carrier, the
// config (checked at rendezvous) and the GPU inbox agreement.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "cuda/device_side.h"
#include "cuda/state.h"

namespace arx::cuda {

namespace {

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

Status cuda_error(const Endpoint& ep, const char* what, cudaError_t e) {
  cudaGetLastError();  // clear it: it belongs to this call, not to a later kernel
  return Status::Error(strf("jax_arx: %s: %s on device %d failed: %s (%s)", ep.label().c_str(), what,
                            ep.spec().device_ordinal, cudaGetErrorName(e), cudaGetErrorString(e)));
}

// The inboxes in GPU memory, laid out as in the host region: a flag page,
// psum recv[2][world], ll_recv[2][world], bulk_recv[2][world]. Moves the
// direct channels' receiving halves (and the peers' they write) there.
void use_gpu_inboxes(Channels& c, const Layout& L, const PeerInboxes& in) {
  const int world = L.world, rank = c.psum_direct.rank;
  const uint64_t recv = kFlagWords * 8, ll = recv + 2 * (uint64_t)world * L.slot_bytes;
  const uint64_t bulk = ll + 2 * (uint64_t)world * kLLSlotBytes;
  auto move = [&](DirectChannel& ch, uint64_t at) {
    ch.in.flags = reinterpret_cast<uint64_t*>(in.mine);
    ch.in.data = in.mine + at;
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      ch.peer_flags[p] = reinterpret_cast<uint64_t*>(in.peer[p]);
      ch.peer_data[p] = in.peer[p] + at;
    }
  };
  move(c.psum_direct, recv);
  move(c.bulk_direct, bulk);
  move(c.ll_direct.lines, ll);
}

uint64_t gpu_inbox_bytes(const Layout& L) {
  return kFlagWords * 8 + 2 * (uint64_t)L.world * (L.slot_bytes + kLLSlotBytes + L.bulk_lane);
}

}  // namespace

Status attach(Endpoint& ep) {
  if (ep.device_state) return Status::Ok();
  const int device = ep.spec().device_ordinal, rank = ep.spec().rank, world = ep.spec().world;
  const Layout& L = ep.layout();
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

  Channels& c = st->channels;
  // The blocks of a two-shot grid wait for each other, so they must all be
  // resident: a quarter of the multiprocessors at most, one block each.
  c.grid = Grid{st->words,
                reinterpret_cast<Control*>(base + L.control),
                (uint64_t)(ep.spec().config.timeout_s * 1e9),
                std::clamp(sms / 4, 1, 32),
                std::max(sms, 1),
                nullptr};
  if (ep.trace()) {
    uint8_t* trace = nullptr;
    e = map_host(*st, reinterpret_cast<uint8_t*>(ep.trace()), sizeof(TraceBuffer), trace);
    if (e != cudaSuccess) return cuda_error(ep, "pinning the trace buffer (cudaHostRegister)", e);
    c.grid.trace = reinterpret_cast<TraceBuffer*>(trace);
  }
  c.psum_proxy = make_proxy_channel(L, Family::kPsum, rank, ep.roots(), base);
  c.bulk_proxy = make_proxy_channel(L, Family::kBulk, rank, ep.roots(), base);
  c.ll_proxy =
      LLChannel<ProxyChannel>{c.psum_proxy, make_proxy_channel(L, Family::kPsum, rank, ep.roots(), base, true)};
  Endpoint::Route route;
  route.direct = ep.route().direct && ep.spec().config.cuda_direct;  // the host's choice: mapped peers, no ring
  if (route.direct) {
    uint8_t* peers[kMaxWorld] = {};
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      e = map_host(*st, ep.windows().base(p), L.total, peers[p]);
      if (e != cudaSuccess) return cuda_error(ep, "pinning a peer's region (cudaHostRegister)", e);
    }
    c.psum_direct = make_direct_channel(L, Family::kPsum, rank, base, peers);
    c.bulk_direct = make_direct_channel(L, Family::kBulk, rank, base, peers);
    c.ll_direct.lines = make_direct_channel(L, Family::kPsum, rank, base, peers, true);
    PeerInboxes inboxes;
    ARX_RETURN_IF_ERROR(map_peer_memory(ep, device, gpu_inbox_bytes(L), inboxes));
    if (inboxes.mine) {
      use_gpu_inboxes(c, L, inboxes);
      st->peer_memory = std::move(inboxes.holder);
      route.gpu_inboxes = c.gpu_inboxes = true;
    }
    c.ll_direct.psum = c.psum_direct;
  }
  c.direct = route.direct;
  ep.set_route(route);
  ep.device_state = std::move(st);
  return Status::Ok();
}

bool attached(const Endpoint& ep) { return ep.device_state != nullptr; }

const Channels& channels_of(const Endpoint& ep) {
  return static_cast<const DeviceState*>(ep.device_state.get())->channels;
}

}  // namespace arx::cuda

// Test-only hooks for the CUDA device side's waits, on one GPU with no peer
// at all (tests/test_gpu_psum.py): an endpoint that is created, pinned and
// registered for the handlers but never connected, so no proxy runs and the
// test itself plays the peers: it writes (or withholds) their slots and
// flags in the pinned region, stale, late or never, and reads the Control
// block's failure record.
//
// A plain C ABI reached through ctypes on the extension module's own file,
// so the tests need nothing from the nanobind module. Nothing in jax_arx
// calls these.
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "base/atomics.h"
#include "comm/endpoint.h"
#include "cuda/device_side.h"

#define ARX_TESTING_API extern "C" __attribute__((visibility("default")))

namespace arx::xla {
extern std::atomic<uint64_t> g_psum_cuda_handler_calls;     // handlers_cuda.cc
extern std::atomic<uint64_t> g_prefill_cuda_handler_calls;  // handlers_cuda.cc
}

namespace {

std::mutex g_mu;
std::map<std::pair<int64_t, int>, std::shared_ptr<arx::Endpoint>> g_endpoints;

std::shared_ptr<arx::Endpoint> find(int64_t comm_id, int device_ordinal) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_endpoints.find({comm_id, device_ordinal});
  return it == g_endpoints.end() ? nullptr : it->second;
}

void set_error(char* err, int errlen, const std::string& msg) {
  if (err && errlen > 0) {
    std::strncpy(err, msg.c_str(), (size_t)errlen - 1);
    err[errlen - 1] = 0;
  }
}

}  // namespace

// Creates rank `rank` of a `world`-rank communicator on `device_ordinal`
// (shm carrier, so two roots), attaches the CUDA device side and registers
// it for the handlers under comm_id. 0 on success, else -1 and `err`.
ARX_TESTING_API int arx_testing_open(int64_t comm_id, int device_ordinal, int rank, int world, double timeout_s,
                                     uint64_t slot_bytes, uint64_t send_bytes, char* err, int errlen) {
  arx::EndpointSpec spec;
  spec.comm_id = comm_id;
  spec.device_ordinal = device_ordinal;
  spec.rank = rank;
  spec.world = world;
  spec.transport = arx::TransportKind::kShm;
  spec.platform = arx::Platform::kCuda;
  spec.name = "testing";
  spec.config.timeout_s = timeout_s;
  if (slot_bytes) spec.config.slot_bytes = slot_bytes;
  if (send_bytes) spec.config.send_bytes = send_bytes;
  std::shared_ptr<arx::Endpoint> ep;
  arx::Status s = arx::Endpoint::create(spec, ep);
  if (s.ok()) s = arx::cuda::attach(*ep);
  if (!s.ok()) {
    set_error(err, errlen, s.message());
    return -1;
  }
  arx::register_endpoint(ep);
  std::lock_guard<std::mutex> lock(g_mu);
  g_endpoints[{comm_id, device_ordinal}] = ep;
  return 0;
}

// out[0..7] = host address of the region, offsets of flags, recv and send,
// slot_bytes, send_bytes, total bytes, roots.
ARX_TESTING_API int arx_testing_layout(int64_t comm_id, int device_ordinal, uint64_t* out) {
  auto ep = find(comm_id, device_ordinal);
  if (!ep) return -1;
  const arx::Layout& L = ep->layout();
  const uint64_t v[8] = {(uint64_t)(uintptr_t)ep->base(), L.flags, L.recv, L.send, L.slot_bytes, L.send_bytes,
                         L.total, (uint64_t)ep->roots()};
  std::memcpy(out, v, sizeof v);
  return 0;
}

// A peer's data: len bytes into the region at offset (inside the inbox).
ARX_TESTING_API int arx_testing_write(int64_t comm_id, int device_ordinal, uint64_t offset, const void* src,
                                      uint64_t len) {
  auto ep = find(comm_id, device_ordinal);
  if (!ep || !ep->layout().inbox_contains(offset, len)) return -1;
  std::memcpy(ep->base() + offset, src, len);
  return 0;
}

// A peer's flag: stored with release after the data, as a carrier does.
ARX_TESTING_API int arx_testing_store_flag(int64_t comm_id, int device_ordinal, int index, uint64_t value) {
  auto ep = find(comm_id, device_ordinal);
  if (!ep || index < 0 || index >= (int)arx::kFlagWords) return -1;
  arx::store_release(reinterpret_cast<uint64_t*>(ep->base() + ep->layout().flag_offset(index)), value);
  return 0;
}

// out[0..31] = the Control block's 32 words, each loaded with acquire.
ARX_TESTING_API int arx_testing_control(int64_t comm_id, int device_ordinal, uint64_t* out) {
  auto ep = find(comm_id, device_ordinal);
  if (!ep) return -1;
  const uint64_t* w = reinterpret_cast<const uint64_t*>(ep->control());
  for (int i = 0; i < (int)(sizeof(arx::Control) / 8); ++i) out[i] = arx::load_acquire(&w[i]);
  return 0;
}

// What a carrier does when it loses a peer: the endpoint fails, and
// Control::abort makes every wait give up at once.
ARX_TESTING_API int arx_testing_fail(int64_t comm_id, int device_ordinal, const char* message) {
  auto ep = find(comm_id, device_ordinal);
  if (!ep) return -1;
  ep->fail(message);
  return 0;
}

// The endpoint's failure message (empty while healthy); its length.
ARX_TESTING_API int arx_testing_failure(int64_t comm_id, int device_ordinal, char* buf, int len) {
  auto ep = find(comm_id, device_ordinal);
  if (!ep) return -1;
  const std::string f = ep->failure();
  set_error(buf, len, f);
  return (int)f.size();
}

// describe(mode, dtype, count, tag): the descriptor a flag must carry.
ARX_TESTING_API uint64_t arx_testing_describe(int mode, int dtype, uint64_t count, uint64_t tag) {
  return arx::describe((arx::Mode)mode, (arx::DType)dtype, count, tag);
}

ARX_TESTING_API void arx_testing_close(int64_t comm_id, int device_ordinal) {
  std::shared_ptr<arx::Endpoint> ep;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_endpoints.find({comm_id, device_ordinal});
    if (it == g_endpoints.end()) return;
    ep = it->second;
    g_endpoints.erase(it);
  }
  arx::unregister_endpoint(comm_id, device_ordinal);
  ep->close();
  ep->device_state.reset();  // unpin before the region goes
}

// How many times XLA ran the CUDA psum handler in this process (replays of a
// captured CUDA graph run none).
ARX_TESTING_API uint64_t arx_testing_handler_calls() {
  return arx::xla::g_psum_cuda_handler_calls.load(std::memory_order_relaxed);
}

// The same for the prefill ops' CUDA handlers (all_gather, psum_scatter, the
// fused MoE combine together).
ARX_TESTING_API uint64_t arx_testing_prefill_handler_calls() {
  return arx::xla::g_prefill_cuda_handler_calls.load(std::memory_order_relaxed);
}

// Direct mode with this endpoint's own region standing in for every peer's
// (tests/test_gpu_psum.py, the LL one-shot): the kernels then write what they
// send into this region at this rank's own places -- recv[par][rank], the
// flag words flag_index(rank, root), ll_recv[par][rank], prefill_recv --
// which its waits never read, so the test can check what was sent while it
// plays the peers as before. One-shots up to ll_max_bytes go LL (as
// Config::cuda_ll_max_bytes: -1 built in, 0 never). Call it after
// arx_testing_open, before the endpoint's first call. 0 on success, else -1.
ARX_TESTING_API int arx_testing_loopback(int64_t comm_id, int device_ordinal, int64_t ll_max_bytes) {
  auto ep = find(comm_id, device_ordinal);
  if (!ep) return -1;
  // attach()'s view, a non-const object: each launch copies it, and none
  // has been launched yet.
  auto* v = const_cast<arx::cuda::DeviceView*>(arx::cuda::view_of(*ep));
  if (!v) return -1;
  for (int p = 0; p < v->world; ++p) {
    if (p == v->rank) continue;
    v->peer_recv[p] = const_cast<uint8_t*>(v->recv);
    v->peer_flags[p] = const_cast<uint64_t*>(v->flags);
    v->peer_chunk_flags[p] = const_cast<uint64_t*>(v->chunk_flags);
    v->peer_prefill_recv[p] = const_cast<uint8_t*>(v->prefill_recv);
    v->peer_ll_recv[p] = v->ll_recv;
  }
  v->direct = true;
  v->ll_max_bytes = ll_max_bytes;
  ep->set_device_sends();
  return 0;
}

// Test hooks for the CUDA device side's waits, on one GPU with no peer at
// all (tests/test_gpu_waits.py): an endpoint that is created, attached and
// registered for the handlers but never connected, so no proxy runs and the
// test itself plays the peers: it writes (or withholds) their slots, lines
// and flag words in the region, stale, late or never, and reads the Control
// block's failure record.
//
// Compiled into jax_arx._core only in a test build (CMake option
// JAX_ARX_TESTING=ON: `pip install -C cmake.define.JAX_ARX_TESTING=ON .`);
// the shipped module has none of it. A plain C ABI reached through ctypes on
// the extension module's own file.
#include <cuda_runtime.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "base/atomics.h"
#include "comm/endpoint.h"
#include "comm/plan.h"
#include "cuda/device_side.h"
#include "cuda/state.h"

#define ARX_TESTING_API extern "C" __attribute__((visibility("default")))

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

// The direct route with this endpoint's own region standing in for every
// peer's: what the kernels send lands at this rank's own places (its lane
// of each inbox, its own flag words), which its waits never read, so the
// test can check what was sent while it plays the peers.
void loopback(arx::Endpoint& ep) {
  auto* st = static_cast<arx::cuda::DeviceState*>(ep.device_state.get());
  void* dev = nullptr;
  cudaHostGetDevicePointer(&dev, ep.base(), 0);
  uint8_t* base = static_cast<uint8_t*>(dev);
  uint8_t* peers[arx::kMaxWorld];
  for (uint8_t*& p : peers) p = base;
  const arx::Layout& L = ep.layout();
  arx::cuda::Channels& c = st->channels;
  c.psum_direct = arx::make_direct_channel(L, arx::Family::kPsum, ep.spec().rank, base, peers);
  c.bulk_direct = arx::make_direct_channel(L, arx::Family::kBulk, ep.spec().rank, base, peers);
  c.ll_direct.psum = c.psum_direct;
  c.ll_direct.lines = arx::make_direct_channel(L, arx::Family::kPsum, ep.spec().rank, base, peers, true);
  c.direct = true;
  ep.set_route(arx::Endpoint::Route{true, false});
}

}  // namespace

// Creates rank `rank` of a `world`-rank communicator on `device_ordinal`
// (its region in shared memory; not connected), attaches the CUDA device
// side and registers it for the handlers under comm_id. direct = 0: the
// proxy channel (two roots; no proxy thread takes the triggers); 1: the
// direct channel, looped back (see loopback()). ll_max_bytes: the LL
// one-shot's limit (-1 built in, 0 never). 0 on success, else -1 and `err`.
ARX_TESTING_API int arx_testing_open(int64_t comm_id, int device_ordinal, int rank, int world, double timeout_s,
                                     int direct, int64_t ll_max_bytes, char* err, int errlen) {
  arx::EndpointSpec spec;
  spec.comm_id = comm_id;
  spec.device_ordinal = device_ordinal;
  spec.rank = rank;
  spec.world = world;
  spec.transport = arx::TransportKind::kShm;
  spec.platform = arx::Platform::kCuda;
  spec.name = "testing";
  spec.config.timeout_s = timeout_s;
  spec.config.cuda_ll_max_bytes = ll_max_bytes;
  std::shared_ptr<arx::Endpoint> ep;
  arx::Status s = arx::Endpoint::create(spec, ep);
  if (s.ok()) s = arx::cuda::attach(*ep);
  if (!s.ok()) {
    set_error(err, errlen, s.message());
    return -1;
  }
  if (direct) loopback(*ep);
  arx::register_endpoint(ep);
  std::lock_guard<std::mutex> lock(g_mu);
  g_endpoints[{comm_id, device_ordinal}] = ep;
  return 0;
}

// out[0..11] = host address of the region; offsets of flags, recv, send,
// ring, ll_recv; slot_bytes, send_bytes, total bytes; the roots the
// receiving channel waits on (2 proxy, 1 direct); the psum words' stride per
// source and pieces per source (base/words.h, FlagWords).
ARX_TESTING_API int arx_testing_layout(int64_t comm_id, int device_ordinal, uint64_t* out) {
  auto ep = find(comm_id, device_ordinal);
  if (!ep) return -1;
  const arx::Layout& L = ep->layout();
  const int roots = ep->route().direct ? 1 : ep->roots();
  const arx::FlagWords w = arx::psum_words(L.world, roots);
  const uint64_t v[12] = {(uint64_t)(uintptr_t)ep->base(),
                          L.flags,
                          L.recv,
                          L.send,
                          L.ring,
                          L.ll_recv,
                          L.slot_bytes,
                          L.send_bytes,
                          L.total,
                          (uint64_t)roots,
                          (uint64_t)w.stride,
                          (uint64_t)w.pieces};
  std::memcpy(out, v, sizeof v);
  return 0;
}

// What the psum handler runs for a `bytes`-byte partial on this endpoint
// (comm/plan.h, the handler's own call): out[0] = the Algorithm, out[1] = the
// pieces of a one-shot, which its descriptor carries (oneshot.cu, pieces_tag)
// and whose flag words the test must store.
ARX_TESTING_API int arx_testing_plan(int64_t comm_id, int device_ordinal, uint64_t bytes, int64_t* out) {
  auto ep = find(comm_id, device_ordinal);
  if (!ep) return -1;
  const arx::Plan p = arx::plan_psum(*ep, bytes);
  out[0] = (int64_t)p.algorithm;
  out[1] = p.pieces;
  return 0;
}

// A peer's bytes: len bytes into the region at offset.
ARX_TESTING_API int arx_testing_write(int64_t comm_id, int device_ordinal, uint64_t offset, const void* src,
                                      uint64_t len) {
  auto ep = find(comm_id, device_ordinal);
  if (!ep || offset > ep->layout().total || len > ep->layout().total - offset) return -1;
  std::memcpy(ep->base() + offset, src, len);
  return 0;
}

// A peer's flag word: stored with release after its bytes, as a carrier does.
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

// describe(op, type_code, count, tag): the descriptor a flag word carries.
ARX_TESTING_API uint64_t arx_testing_describe(int op, uint64_t type_code, uint64_t count, uint64_t tag) {
  return arx::describe(arx::descriptor((arx::OpCode)op, type_code, count, tag));
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
}

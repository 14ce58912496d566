// The verbs carrier's tests' rig (test_verbs_device.cc, test_verbs_transport.cc):
// an endpoint-like owner of a region and a verbs carrier for one rank, made
// with the settings the tests need, and the PASS / FAIL lines both print.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "base/config.h"
#include "base/layout.h"
#include "base/region.h"
#include "transport/transport.h"

namespace arx_test {

using namespace arx;

inline int g_rank = 0;
inline int g_failures = 0;
constexpr char kSecret[] = "test-secret";  // the communicator's secret in these tests

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline void pass(const std::string& name, const std::string& what) {
  printf("[rank %d] PASS %s %s\n", g_rank, name.c_str(), what.c_str());
  fflush(stdout);
}
inline void failed(const std::string& name, const std::string& what) {
  printf("[rank %d] FAIL %s: %s\n", g_rank, name.c_str(), what.c_str());
  fflush(stdout);
  ++g_failures;
}
inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// An endpoint-like owner of a region and a carrier, for one rank.
struct Rank {
  Config config;
  Layout layout;
  std::unique_ptr<Region> region;
  std::unique_ptr<Transport> t;
  std::atomic<int> lost_peer{-1};
  std::string lost_why;
  uint64_t* word(uint64_t off) { return reinterpret_cast<uint64_t*>(region->base() + off); }
  uint8_t* at(uint64_t off) { return region->base() + off; }
};

inline Status make_rank(Rank& r, int rank, int world, const std::string& hca, uint64_t slot_bytes,
                        int64_t gid_index = -1, bool ring = false) {
  r.config.ib_hca = hca;
  r.config.ib_gid_index = gid_index;
  r.config.timeout_s = 20;
  r.config.verbose = std::getenv("ARX_TEST_VERBOSE") != nullptr;
  // Soft-RoCE retries forever at retry_cnt 7 (see verbs.cc): 6 makes a lost
  // peer fail the writes after 7 tries. Under TCG a vCPU can stall past the
  // default 67 ms QP timeout, and the spurious resends that follow have hit
  // a 6.1 rxe bug (a NAK "remote invalid request" mid-write, about once in
  // 15 runs): 268 ms per try keeps resends rare and detection near 2 s.
  // Small WRs exercise the chunked path.
  r.config.ib_retry_cnt = 6;
  r.config.ib_timeout = 16;
  r.config.ib_chunk_bytes = 65536;
  Geometry geo;
  geo.world = world;
  geo.slot_bytes = slot_bytes;
  geo.send_bytes = slot_bytes;
  geo.topology = ring ? TopologyKind::kRing : TopologyKind::kMesh;
  r.config.topology = geo.topology;
  r.layout = Layout::of(geo);
  ARX_RETURN_IF_ERROR(Region::create(r.layout.total, false, r.region));
  TransportContext ctx;
  ctx.rank = rank;
  ctx.world = world;
  ctx.region = r.region.get();
  ctx.layout = r.layout;
  ctx.secret = kSecret;
  ctx.config = &r.config;
  ctx.label = strf("test rank %d of %d", rank, world);
  ctx.on_peer_lost = [&r](int peer, const std::string& why) {
    r.lost_why = why;
    r.lost_peer.store(peer);
  };
  return make_verbs_transport(ctx, r.t);
}

}  // namespace arx_test

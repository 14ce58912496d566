// One rank of one communicator on one local device: its region (layout.h),
// its carrier, the peers' mapped regions where they share this host, its
// proxy thread, and its failure state.
//
// Lifecycle (the reference's): create() allocates the region and opens the
// carrier; details() is what this rank tells its peers (a fingerprint of
// what must agree, the region's name where it is shared, the carrier's
// details); connect() checks every peer's fingerprint, maps the peers'
// regions (one host), wires the carrier and starts the proxy. The caller
// meets its peers at a barrier before the first collective. close() stops
// the proxy and the carrier; the memory goes with the last reference.
//
// A handler finds its endpoint by (communicator id, local device ordinal).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/layout.h"
#include "base/region.h"
#include "base/status.h"
#include "base/trace.h"
#include "base/windows.h"
#include "comm/channel.h"
#include "transport/transport.h"

namespace arx {

enum class Platform : uint32_t { kHost = 1, kCuda = 2 };

// What an endpoint has run, for jax_arx.stats(): per kind of collective the
// calls whose handler ran on the host (a replay of a captured CUDA graph runs
// no host code and is not counted), their bytes (a psum's partial, a bulk
// collective's lane), the algorithm each ran (comm/plan.h's numbers) and the
// calls whose handler failed (on the CPU; a GPU kernel's failure is the
// endpoint's failure record, which no handler sees); the stalls the
// watchdog reported; and the puts this rank relayed. Relaxed counters:
// nothing is ordered by them.
struct Stats {
  enum Kind { kPsum = 0, kAllGather, kPsumScatter, kMoeCombine, kKinds };
  static constexpr int kAlgorithms = 5;  // Algorithm's values, kNone included
  std::atomic<uint64_t> calls[kKinds] = {};
  std::atomic<uint64_t> bytes[kKinds] = {};
  std::atomic<uint64_t> failed[kKinds] = {};
  std::atomic<uint64_t> by_algorithm[kKinds][kAlgorithms] = {};
  std::atomic<uint64_t> stalls{0};
  std::atomic<uint64_t> relayed{0};  // puts this rank made for prev (a ring of 4: comm/relay.h)
  void count(Kind k, uint64_t n, int algorithm) {
    calls[k].fetch_add(1, std::memory_order_relaxed);
    bytes[k].fetch_add(n, std::memory_order_relaxed);
    if (algorithm >= 0 && algorithm < kAlgorithms) by_algorithm[k][algorithm].fetch_add(1, std::memory_order_relaxed);
  }
  void count_failure(Kind k) { failed[k].fetch_add(1, std::memory_order_relaxed); }
};

struct EndpointSpec {
  int64_t comm_id = 0;
  int device_ordinal = 0;  // local device index of this endpoint's device
  int rank = 0, world = 0;
  TransportKind transport = TransportKind::kShm;
  Platform platform = Platform::kHost;
  std::string name;    // the mesh axis, for messages
  std::string secret;  // random bytes every rank of the communicator shares
  Config config;
};

class Proxy;

class Endpoint {
 public:
  static Status create(const EndpointSpec& spec, std::shared_ptr<Endpoint>& out);
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  std::string details() const;
  Status connect(const std::vector<std::string>& all_details);
  void close();

  const EndpointSpec& spec() const { return spec_; }
  const Layout& layout() const { return layout_; }
  uint8_t* base() const { return region_->base(); }
  Region* region() const { return region_.get(); }
  Control* control() const { return reinterpret_cast<Control*>(region_->base() + layout_.control); }
  const uint64_t* flags() const { return reinterpret_cast<const uint64_t*>(region_->base() + layout_.flags); }
  Transport* transport() const { return transport_.get(); }
  int roots() const { return transport_->roots(); }
  bool connected() const { return connected_; }
  // "communicator 'tp' rank 0 of 2"
  const std::string& label() const { return label_; }

  // The peers' regions mapped here, when every rank shares this host (the
  // shm carrier); mapped() is false otherwise. The direct channels go
  // through them.
  const PeerWindows& windows() const { return windows_; }

  // How the device side reaches its peers: through the proxy, or directly
  // (the peers' memory mapped here); and, for the CUDA side, whether its
  // psum inboxes live in GPU memory. Every rank of a communicator takes the
  // same route (the choice depends only on what they all agree on). connect()
  // sets the host's (direct where the peers' regions are mapped); a device
  // side that chooses otherwise sets its own before the first collective.
  struct Route {
    bool direct = false;
    bool gpu_inboxes = false;
  };
  const Route& route() const { return route_; }
  void set_route(const Route& r) { route_ = r; }
  // A collective of this endpoint begins: where the proxy carries it (the
  // route through the proxy, which every ring takes), a napping proxy wakes now,
  // not up to a nap after the collective's first trigger (comm/proxy.h,
  // wake). Device sides call it before they publish, from the thread that
  // issues the collective (a replayed CUDA graph issues none: its first
  // collective after a pause may still wait out a nap). An atomic add.
  void wake_proxy() const;
  // The host-memory channels of family `f`, as this process sees the region.
  ProxyChannel proxy_channel(Family f) const { return make_proxy_channel(layout_, f, spec_.rank, roots(), base()); }
  DirectChannel direct_channel(Family f) const;

  // Failure state. The first failure is kept and every later call reports
  // it. Failures come from three places: a device side's wait (recorded in
  // the Control block, possibly by a kernel, and turned into a message by
  // whoever reads it first), the proxy or carrier (fail()), and peers lost
  // (peer_lost()). fail() sets Control::abort so no wait spins on.
  void fail(const std::string& message);
  void peer_lost(int peer, const std::string& why);
  // Endpoints that fail together: the psum and the bulk endpoint of one mesh
  // axis on one device (jax_arx/_bulk_endpoints.py). A failure of either,
  // whatever its cause, is the other's at once, so no rank completes a
  // collective on one communicator of an axis after the other gave up: the
  // ranks' outcomes differ by at most the one collective the notices allow,
  // per axis, not per communicator. The endpoint that failed first tells
  // its peers (the proxy's notices); one failed by its partner sends none
  // (failed_by_partner()): its peers' endpoints learn from their partners,
  // so every rank's error keeps the first cause (a mismatch, a timeout)
  // instead of a vaguer one racing it. Both ways, held weakly (either may
  // close first); an endpoint already failed fails the other now.
  static void fail_together(const std::shared_ptr<Endpoint>& a, const std::shared_ptr<Endpoint>& b);
  bool failed_by_partner() const { return failed_by_partner_.load(std::memory_order_acquire); }
  // The ranks peer_lost() named (bit j: rank j), for the notices.
  uint64_t lost_peers() const { return lost_mask_.load(std::memory_order_acquire); }
  // Reads the Control block's record; true and the message if failed.
  bool failed();
  std::string failure();
  // The message for a failure a device side recorded in the Control block.
  std::string describe_recorded_failure() const;
  // What each peer last sent, per family: " rank 1: psum #5, bulk #2; ...".
  std::string heard_from_peers() const;
  // A host-side wait of collective `seq` of family `f` left `seconds` out of
  // its timeout, in which this rank's thread was not running (host/steps.h,
  // HostPoll): a timeout recorded for that seq says so.
  void note_not_running(Family f, uint64_t seq, double seconds);
  // The watchdog's stalls: counted in stats, the last report kept.
  void note_stall(const std::string& report);
  std::string last_stall() const;

  Stats stats;

  // Held by a host-side handler for a whole collective: the sequence state
  // and the buffers belong to one collective at a time. A second collective
  // that finds it held fails (xla/handlers_host.cc, CallGuard).
  std::mutex host_call_mu;

  // The stage timestamps (base/trace.h): null but in a trace build.
  TraceBuffer* trace() const { return trace_.get(); }

  // State a device side keeps with the endpoint (the CUDA side's device
  // words, registered memory and channels); freed with it.
  std::shared_ptr<void> device_state;

 private:
  Endpoint() = default;
  // fail(), saying whether the failure came from a partner (fail_together).
  void fail_from(const std::string& message, bool partner);
  EndpointSpec spec_;
  Layout layout_;
  std::string label_;
  std::unique_ptr<Region> region_;
  PeerWindows windows_;
  Route route_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<Proxy> proxy_;
  bool connected_ = false;
  mutable std::mutex failure_mu_;  // failure_, stall_ and not_running_*
  std::string failure_, stall_;
  Family not_running_family_ = Family::kPsum;
  uint64_t not_running_seq_ = 0;
  double not_running_s_ = 0;
  std::atomic<bool> failed_{false};
  std::vector<std::weak_ptr<Endpoint>> partners_;  // fail_together(); under failure_mu_
  std::atomic<bool> failed_by_partner_{false};
  std::atomic<uint64_t> lost_mask_{0};
  struct FreeTrace {
    void operator()(TraceBuffer* t) const { std::free(t); }
  };
  std::unique_ptr<TraceBuffer, FreeTrace> trace_;
};

// The endpoints of this process, by (communicator id, device ordinal).
void register_endpoint(const std::shared_ptr<Endpoint>& ep);
void unregister_endpoint(int64_t comm_id, int device_ordinal);
std::shared_ptr<Endpoint> find_endpoint(int64_t comm_id, int device_ordinal);
std::vector<std::shared_ptr<Endpoint>> all_endpoints();

// Library version, part of the fingerprint.
const char* version();

}  // namespace arx

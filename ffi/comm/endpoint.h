// One rank of one communicator on one local device: its region (layout.h),
// its carrier, its proxy thread, and its failure state.
//
// Lifecycle (the reference's): create() allocates the region and opens the
// carrier; details() is what this rank tells its peers (a fingerprint of
// what must agree, then the carrier's details); connect() checks every
// peer's fingerprint, wires the carrier and starts the proxy. The caller
// meets its peers at a barrier before the first collective. close() stops
// the proxy and the carrier; the memory goes with the last reference.
//
// A handler finds its endpoint by (communicator id, local device ordinal).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/config.h"
#include "comm/layout.h"
#include "comm/region.h"
#include "comm/status.h"
#include "transport/transport.h"

namespace arx {

enum class Platform : uint32_t { kHost = 1, kCuda = 2 };

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
  PrefillControl* prefill_control() const {
    return reinterpret_cast<PrefillControl*>(region_->base() + layout_.prefill_ctl);
  }
  Transport* transport() const { return transport_.get(); }
  int roots() const { return transport_->roots(); }
  bool connected() const { return connected_; }
  // "communicator 'tp' rank 0 of 2"
  const std::string& label() const { return label_; }

  // Failure state. The first failure is kept and every later call reports
  // it. Failures come from three places: a device side's wait (recorded in
  // the Control block, possibly by a kernel, and turned into a message by
  // whoever reads it first), the proxy or carrier (fail()), and peers lost
  // (peer_lost()). fail() sets Control::abort so no wait spins on.
  void fail(const std::string& message);
  void peer_lost(int peer, const std::string& why);
  // Reads the Control block's record; true and the message if failed.
  bool failed();
  std::string failure();
  uint32_t lost_peers() const { return lost_peers_.load(std::memory_order_acquire); }
  // The message for a failure a device side recorded in the Control block.
  std::string describe_recorded_failure() const;

  // Held by a host-side handler for a whole collective. XLA's CPU runtime
  // may run independent custom calls concurrently; the sequence state and
  // the send buffers belong to one collective at a time.
  std::mutex host_call_mu;

  // State a device side keeps with the endpoint (the CUDA side's device
  // words and registered pointers); freed with it.
  std::shared_ptr<void> device_state;

  // Set by a device side that writes its psum partials straight into the
  // peers' inboxes (the CUDA side over the shm carrier): the proxy then
  // posts no psum seq, only follows `published` for the watchdog. Set
  // before the first collective, never cleared. The prefill ring is not
  // affected.
  void set_device_sends() { device_sends_.store(true, std::memory_order_release); }
  bool device_sends() const { return device_sends_.load(std::memory_order_acquire); }

 private:
  Endpoint() = default;
  EndpointSpec spec_;
  Layout layout_;
  std::string label_;
  std::unique_ptr<Region> region_;
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<Proxy> proxy_;
  bool connected_ = false;
  std::mutex failure_mu_;
  std::string failure_;
  std::atomic<bool> failed_{false};
  std::atomic<uint32_t> lost_peers_{0};
  std::atomic<bool> device_sends_{false};
};

// The endpoints of this process, by (communicator id, device ordinal).
void register_endpoint(const std::shared_ptr<Endpoint>& ep);
void unregister_endpoint(int64_t comm_id, int device_ordinal);
std::shared_ptr<Endpoint> find_endpoint(int64_t comm_id, int device_ordinal);
std::vector<std::shared_ptr<Endpoint>> all_endpoints();

// Library version, part of the fingerprint.
const char* version();

}  // namespace arx

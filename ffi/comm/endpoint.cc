#include "comm/endpoint.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <utility>

#include "base/atomics.h"
#include "comm/fingerprint.h"
#include "comm/proxy.h"

namespace arx {

const char* version() { return "0.1.0"; }

namespace {

// Details are three parts: the fingerprint (fixed size), then the shared
// region's part (length-prefixed; empty where the region is not shared),
// then the carrier's.
std::string frame(const std::string& part) {
  const uint32_t n = (uint32_t)part.size();
  return std::string(reinterpret_cast<const char*>(&n), sizeof n) + part;
}

bool unframe(const std::string& d, std::string& part, std::string& rest) {
  uint32_t n = 0;
  if (d.size() < sizeof n) return false;
  std::memcpy(&n, d.data(), sizeof n);
  if (d.size() - sizeof n < n) return false;
  part = d.substr(sizeof n, n);
  rest = d.substr(sizeof n + n);
  return true;
}

}  // namespace

Status Endpoint::create(const EndpointSpec& spec, std::shared_ptr<Endpoint>& out) {
  if (spec.world < 2 || spec.world > kMaxWorld)
    return Status::Error(strf("jax_arx: communicator '%s' has %d ranks; jax_arx supports 2 to %d", spec.name.c_str(),
                              spec.world, kMaxWorld));
  if (spec.rank < 0 || spec.rank >= spec.world)
    return Status::Error(
        strf("jax_arx: rank %d is outside communicator '%s' of %d ranks", spec.rank, spec.name.c_str(), spec.world));
  if (spec.config.topology == TopologyKind::kRing && spec.world > kMaxRingWorld)
    return Status::Error(
        strf("jax_arx: communicator '%s' has %d ranks; a ring (JAX_ARX_TOPOLOGY=ring) takes 2 to %d: "
             "past that, what a rank sends would go through more than one relay. Connect the "
             "boxes through a switch and use JAX_ARX_TOPOLOGY=mesh",
             spec.name.c_str(), spec.world, kMaxRingWorld));
  std::shared_ptr<Endpoint> ep(new Endpoint());
  ep->spec_ = spec;
  ep->layout_ = Layout::of(Geometry{(uint32_t)spec.world, spec.config.slot_bytes, spec.config.send_bytes,
                                    spec.config.bulk_lanes ? spec.config.bulk_bytes : 0, spec.config.topology});
  ep->label_ = strf("communicator '%s' rank %d of %d", spec.name.c_str(), spec.rank, spec.world);
  ARX_RETURN_IF_ERROR(Region::create(ep->layout_.total, spec.transport == TransportKind::kShm, ep->region_));
#if defined(ARX_TRACE)
  // Page-aligned and zeroed: the CUDA side pins it for its kernels' stamps.
  const size_t trace_bytes = (sizeof(TraceBuffer) + 4095) / 4096 * 4096;
  ep->trace_.reset(static_cast<TraceBuffer*>(std::aligned_alloc(4096, trace_bytes)));
  if (!ep->trace_) return Status::Error("jax_arx: out of memory for the trace buffer");
  std::memset(ep->trace_.get(), 0, trace_bytes);
#endif
  TransportContext ctx;
  ctx.rank = spec.rank;
  ctx.world = spec.world;
  ctx.region = ep->region_.get();
  ctx.layout = ep->layout_;
  ctx.windows = &ep->windows_;
  ctx.secret = spec.secret;
  ctx.config = &ep->spec_.config;
  ctx.label = ep->label_;
  Endpoint* raw = ep.get();  // the carrier is closed before the endpoint goes
  ctx.on_peer_lost = [raw](int peer, const std::string& why) { raw->peer_lost(peer, why); };
  ARX_RETURN_IF_ERROR(make_transport(spec.transport, ctx, ep->transport_));
  out = std::move(ep);
  return Status::Ok();
}

Endpoint::~Endpoint() { close(); }

std::string Endpoint::details() const {
  const std::string shared = region_->name().empty() ? "" : PeerWindows::details(*region_);
  return fingerprint(spec_) + frame(shared) + transport_->details();
}

Status Endpoint::connect(const std::vector<std::string>& all) {
  if (connected_) return Status::Error(strf("jax_arx: %s is already connected", label_.c_str()));
  if ((int)all.size() != spec_.world)
    return Status::Error(
        strf("jax_arx: %s got details from %zu ranks, expected %d", label_.c_str(), all.size(), spec_.world));
  std::vector<std::string> shared(all.size()), carrier(all.size());
  for (int j = 0; j < spec_.world; ++j) {
    std::string rest;
    const std::string diff = check_fingerprint(spec_, all[j], j, rest);
    if (!diff.empty()) return Status::Error(strf("jax_arx: %s: %s", label_.c_str(), diff.c_str()));
    if (!unframe(rest, shared[j], carrier[j]))
      return Status::Error(strf("jax_arx: %s: rank %d sent truncated details", label_.c_str(), j));
  }
  if (!region_->name().empty())
    ARX_RETURN_IF_ERROR(windows_.open(shared, spec_.rank, layout_, *region_, spec_.config.timeout_s, label_));
  ARX_RETURN_IF_ERROR(transport_->connect(carrier, spec_.config.timeout_s));
  // In a ring the peers' memory may be mapped (one host, in tests) but the
  // links are the carrier's: everything goes through the proxy.
  route_.direct = windows_.mapped() && !layout_.topo.ring;
  proxy_ = std::make_unique<Proxy>(*this);
  proxy_->start();
  connected_ = true;
  return Status::Ok();
}

void Endpoint::close() {
  // The device side first: its state pins this region and the peers' (shm),
  // and must be released (after the device has synchronized) while they are
  // still mapped.
  device_state.reset();
  if (proxy_) proxy_->stop();
  proxy_.reset();
  if (transport_) transport_->close();
  windows_.close();
  connected_ = false;
}

void Endpoint::wake_proxy() const {
  if (proxy_ && !route_.direct) proxy_->wake();
}

DirectChannel Endpoint::direct_channel(Family f) const {
  uint8_t* peers[kMaxWorld] = {};
  for (int j = 0; j < spec_.world; ++j) peers[j] = windows_.base(j);
  return make_direct_channel(layout_, f, spec_.rank, base(), peers);
}

namespace {

// The failure of `ep` because its partner `from` (fail_together) failed
// with `why`: it keeps why's words, which errors.classify() reads.
std::string partner_failure(const Endpoint& ep, const Endpoint& from, const std::string& why) {
  return strf("jax_arx: %s fails with %s, the other communicator of its mesh axis: %s", ep.label().c_str(),
              from.label().c_str(), why.c_str());
}

}  // namespace

void Endpoint::fail(const std::string& message) { fail_from(message, false); }

void Endpoint::fail_from(const std::string& message, bool partner) {
  std::vector<std::shared_ptr<Endpoint>> partners;
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failed_.load(std::memory_order_relaxed)) return;  // the first failure is the one reported
    if (spec_.config.abort_on_failure) {
      // Before anything a waiter reads (failed_, Control::abort): were a wait
      // released first, its caller could go on, even exit with status 0,
      // before this thread ends the process.
      fprintf(stderr, "%s\njax_arx: exiting because JAX_ARX_ON_FAILURE=abort\n", message.c_str());
      fflush(stderr);
      _exit(1);
    }
    failure_ = message;
    failed_by_partner_.store(partner, std::memory_order_release);  // before failed_: the proxy reads it after
    failed_.store(true, std::memory_order_release);
    for (const std::weak_ptr<Endpoint>& w : partners_)
      if (std::shared_ptr<Endpoint> p = w.lock()) partners.push_back(std::move(p));
  }
  // Every wait on this endpoint, host or device, gives up at once from now.
  store_release(&control()->abort, 1);
  // Outside failure_mu_: a partner's fail() comes back here and returns at
  // the check above, and two failing at once take their locks one at a time.
  for (const std::shared_ptr<Endpoint>& p : partners) p->fail_from(partner_failure(*p, *this, message), true);
}

void Endpoint::fail_together(const std::shared_ptr<Endpoint>& a, const std::shared_ptr<Endpoint>& b) {
  for (const auto& [from, to] : {std::pair{a, b}, std::pair{b, a}}) {
    std::lock_guard<std::mutex> lock(from->failure_mu_);
    from->partners_.push_back(to);
  }
  // A failure before the link: failure() reads a device side's record too.
  for (const auto& [from, to] : {std::pair{a, b}, std::pair{b, a}}) {
    const std::string why = from->failure();
    if (!why.empty()) to->fail_from(partner_failure(*to, *from, why), true);
  }
}

void Endpoint::peer_lost(int peer, const std::string& why) {
  if (peer < 0 || peer >= spec_.world) return;
  lost_mask_.fetch_or(uint64_t{1} << peer, std::memory_order_acq_rel);  // before fail(): the proxy reads it after
  fail(strf("jax_arx: %s lost rank %d: %s", label_.c_str(), peer, why.c_str()));
}

bool Endpoint::failed() {
  if (failed_.load(std::memory_order_acquire)) return true;
  if (load_acquire(&control()->failed_seq) == 0) return false;
  fail(describe_recorded_failure());
  return true;
}

std::string Endpoint::failure() {
  if (!failed()) return "";
  std::lock_guard<std::mutex> lock(failure_mu_);
  return failure_;
}

void Endpoint::note_not_running(Family f, uint64_t seq, double seconds) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  not_running_family_ = f;
  not_running_seq_ = seq;
  not_running_s_ = seconds;
}

void Endpoint::note_stall(const std::string& report) {
  stats.stalls.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(failure_mu_);
  stall_ = report;
}

std::string Endpoint::last_stall() const {
  std::lock_guard<std::mutex> lock(failure_mu_);
  return stall_;
}

namespace {
std::mutex g_registry_mu;
std::map<std::pair<int64_t, int>, std::shared_ptr<Endpoint>> g_registry;
}  // namespace

void register_endpoint(const std::shared_ptr<Endpoint>& ep) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  g_registry[{ep->spec().comm_id, ep->spec().device_ordinal}] = ep;
}

void unregister_endpoint(int64_t comm_id, int device_ordinal) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  g_registry.erase({comm_id, device_ordinal});
}

std::shared_ptr<Endpoint> find_endpoint(int64_t comm_id, int device_ordinal) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  auto it = g_registry.find({comm_id, device_ordinal});
  return it == g_registry.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<Endpoint>> all_endpoints() {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  std::vector<std::shared_ptr<Endpoint>> v;
  for (auto& [k, ep] : g_registry) v.push_back(ep);
  return v;
}

}  // namespace arx

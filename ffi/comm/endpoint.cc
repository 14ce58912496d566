#include "comm/endpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <utility>

#include "comm/atomics.h"
#include "comm/proxy.h"

namespace arx {

const char* version() { return "0.1.0"; }

const char* transport_name(TransportKind kind) {
  switch (kind) {
    case TransportKind::kShm: return "shm";
    case TransportKind::kTcp: return "tcp";
    case TransportKind::kVerbs: return "verbs";
  }
  return "unknown";
}

namespace {

const char* platform_name(Platform p) {
  switch (p) {
    case Platform::kHost: return "cpu";
    case Platform::kCuda: return "cuda";
  }
  return "unknown";
}

// What every rank of a communicator must agree on, sent ahead of the
// carrier's details. A mismatch fails connect() on every rank with a
// message saying what differs, instead of a hang or a wrong sum later.
struct Fingerprint {
  char magic[8];
  char version[16];
  char name[48];  // the mesh axis
  int64_t comm_id;
  uint32_t rank, world;
  uint64_t slot_bytes, send_bytes;
  uint64_t timeout_ms;
  uint64_t prefill_slot_bytes;
  uint64_t cuda_chunk_bytes;  // how the CUDA direct path cuts a partial (part of its descriptor)
  int64_t cuda_pipeline;
  int64_t cuda_ll_max_bytes;
  uint32_t transport, platform;
  uint32_t layout_bytes;  // the control blocks' sizes, so builds that disagree on them do not talk
  uint32_t pad;
};
constexpr char kMagic[8] = {'J', 'A', 'X', 'A', 'R', 'X', 0, 1};

Fingerprint fingerprint_of(const EndpointSpec& s) {
  Fingerprint f{};
  std::memcpy(f.magic, kMagic, sizeof kMagic);
  std::snprintf(f.version, sizeof f.version, "%s", version());
  std::snprintf(f.name, sizeof f.name, "%s", s.name.c_str());
  f.comm_id = s.comm_id;
  f.rank = (uint32_t)s.rank;
  f.world = (uint32_t)s.world;
  f.slot_bytes = s.config.slot_bytes;
  f.send_bytes = s.config.send_bytes;
  f.prefill_slot_bytes = s.config.prefill_slot_bytes;
  f.cuda_chunk_bytes = s.config.cuda_chunk_bytes;
  f.cuda_pipeline = s.config.cuda_pipeline;
  f.cuda_ll_max_bytes = s.config.cuda_ll_max_bytes;
  f.timeout_ms = (uint64_t)(s.config.timeout_s * 1000);
  f.transport = (uint32_t)s.transport;
  f.platform = (uint32_t)s.platform;
  f.layout_bytes = sizeof(Control) + sizeof(PrefillControl);
  return f;
}

// The first field in which `theirs` differs from `mine`, as a sentence.
std::string fingerprint_diff(const Fingerprint& mine, const Fingerprint& theirs, int j) {
  auto num = [&](const char* what, unsigned long long a, unsigned long long b, const char* hint) {
    return strf("rank %d has %s %llu, this rank %llu; %s", j, what, b, a, hint);
  };
  if (std::memcmp(theirs.magic, kMagic, sizeof kMagic) != 0)
    return strf("rank %d sent details that are not from jax_arx (or from an incompatible version)", j);
  if (std::strncmp(mine.version, theirs.version, sizeof mine.version) != 0)
    return strf("rank %d runs jax_arx %.16s, this rank %.16s; install the same version everywhere", j,
                theirs.version, mine.version);
  if (mine.layout_bytes != theirs.layout_bytes)
    return strf("rank %d was built with a different control block layout; rebuild jax_arx everywhere", j);
  if (std::strncmp(mine.name, theirs.name, sizeof mine.name) != 0 || mine.comm_id != theirs.comm_id)
    return strf("rank %d set up communicator '%.48s' (id %lld), this rank '%.48s' (id %lld); every process must "
                "call jax_arx.initialize with the same mesh",
                j, theirs.name, (long long)theirs.comm_id, mine.name, (long long)mine.comm_id);
  if (theirs.rank != (uint32_t)j) return strf("the details at index %d came from rank %u", j, theirs.rank);
  if (mine.world != theirs.world) return num("world size", mine.world, theirs.world, "check the mesh");
  if (mine.slot_bytes != theirs.slot_bytes)
    return num("slot_bytes", mine.slot_bytes, theirs.slot_bytes, "set JAX_ARX_SLOT_BYTES the same everywhere");
  if (mine.send_bytes != theirs.send_bytes)
    return num("send_bytes", mine.send_bytes, theirs.send_bytes, "set JAX_ARX_SEND_BYTES the same everywhere");
  if (mine.cuda_pipeline != theirs.cuda_pipeline || mine.cuda_chunk_bytes != theirs.cuda_chunk_bytes)
    return strf("rank %d has cuda_pipeline %lld / cuda_chunk_bytes %llu, this rank %lld / %llu; set "
                "JAX_ARX_CUDA_PIPELINE and JAX_ARX_CUDA_CHUNK_BYTES the same everywhere",
                j, (long long)theirs.cuda_pipeline, (unsigned long long)theirs.cuda_chunk_bytes,
                (long long)mine.cuda_pipeline, (unsigned long long)mine.cuda_chunk_bytes);
  if (mine.cuda_ll_max_bytes != theirs.cuda_ll_max_bytes)
    return strf("rank %d has cuda_ll_max_bytes %lld, this rank %lld; set JAX_ARX_CUDA_LL_MAX_BYTES the same "
                "everywhere",
                j, (long long)theirs.cuda_ll_max_bytes, (long long)mine.cuda_ll_max_bytes);
  if (mine.prefill_slot_bytes != theirs.prefill_slot_bytes)
    return num("prefill_slot_bytes", mine.prefill_slot_bytes, theirs.prefill_slot_bytes,
               "set JAX_ARX_PREFILL_SLOT_BYTES the same everywhere");
  if (mine.timeout_ms != theirs.timeout_ms)
    return num("a timeout of (ms)", mine.timeout_ms, theirs.timeout_ms, "set JAX_ARX_TIMEOUT_S the same everywhere");
  if (mine.transport != theirs.transport)
    return strf("rank %d uses the %s carrier, this rank %s; set JAX_ARX_TRANSPORT the same everywhere", j,
                transport_name((TransportKind)theirs.transport), transport_name((TransportKind)mine.transport));
  if (mine.platform != theirs.platform)
    return strf("rank %d runs on %s, this rank on %s; a communicator spans one platform", j,
                platform_name((Platform)theirs.platform), platform_name((Platform)mine.platform));
  return "";
}

Status make_transport(TransportKind kind, const TransportContext& ctx, std::unique_ptr<Transport>& out) {
  switch (kind) {
    case TransportKind::kShm: return make_shm_transport(ctx, out);
    case TransportKind::kTcp: return make_tcp_transport(ctx, out);
    case TransportKind::kVerbs: return make_verbs_transport(ctx, out);
  }
  return Status::Error("jax_arx: unknown carrier");
}

}  // namespace

Status Endpoint::create(const EndpointSpec& spec, std::shared_ptr<Endpoint>& out) {
  if (spec.world < 2 || spec.world > kMaxWorld)
    return Status::Error(strf("jax_arx: communicator '%s' has %d ranks; jax_arx supports 2 to %d", spec.name.c_str(),
                              spec.world, kMaxWorld));
  if (spec.rank < 0 || spec.rank >= spec.world)
    return Status::Error(strf("jax_arx: rank %d is outside communicator '%s' of %d ranks", spec.rank,
                              spec.name.c_str(), spec.world));
  std::shared_ptr<Endpoint> ep(new Endpoint());
  ep->spec_ = spec;
  ep->layout_ = Layout::of(Geometry{(uint32_t)spec.world, spec.config.slot_bytes, spec.config.send_bytes,
                                    spec.config.prefill_slot_bytes});
  ep->label_ = strf("communicator '%s' rank %d of %d", spec.name.c_str(), spec.rank, spec.world);
  ARX_RETURN_IF_ERROR(Region::create(ep->layout_.total, spec.transport == TransportKind::kShm, ep->region_));
  TransportContext ctx;
  ctx.rank = spec.rank;
  ctx.world = spec.world;
  ctx.region = ep->region_.get();
  ctx.layout = ep->layout_;
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
  const Fingerprint f = fingerprint_of(spec_);
  std::string d(reinterpret_cast<const char*>(&f), sizeof f);
  return d + transport_->details();
}

Status Endpoint::connect(const std::vector<std::string>& all) {
  if (connected_) return Status::Error(strf("jax_arx: %s is already connected", label_.c_str()));
  if ((int)all.size() != spec_.world)
    return Status::Error(strf("jax_arx: %s got details from %zu ranks, expected %d", label_.c_str(), all.size(),
                              spec_.world));
  const Fingerprint mine = fingerprint_of(spec_);
  std::vector<std::string> carrier(all.size());
  for (int j = 0; j < spec_.world; ++j) {
    if (all[j].size() < sizeof(Fingerprint))
      return Status::Error(strf("jax_arx: %s: rank %d sent %zu bytes of details, too few to be from jax_arx",
                                label_.c_str(), j, all[j].size()));
    Fingerprint theirs;
    std::memcpy(&theirs, all[j].data(), sizeof theirs);
    const std::string diff = fingerprint_diff(mine, theirs, j);
    if (!diff.empty()) return Status::Error(strf("jax_arx: %s: %s", label_.c_str(), diff.c_str()));
    carrier[j] = all[j].substr(sizeof(Fingerprint));
  }
  ARX_RETURN_IF_ERROR(transport_->connect(carrier, spec_.config.timeout_s));
  // The CPU device side posts its psum seqs itself (host/collectives.cc)
  // where the carrier allows puts beside the proxy's; the CUDA side does so
  // on shm (cuda/attach.cc).
  if (spec_.platform == Platform::kHost && transport_->puts_from_any_thread()) set_device_sends();
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
  connected_ = false;
}

void Endpoint::fail(const std::string& message) {
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
    failed_.store(true, std::memory_order_release);
  }
  // Every wait on this endpoint, host or device, gives up at once from now.
  store_release(&control()->abort, 1);
}

void Endpoint::peer_lost(int peer, const std::string& why) {
  if (peer < 0 || peer >= spec_.world) return;
  lost_peers_.fetch_or(1u << peer, std::memory_order_acq_rel);
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

namespace {

const char* prefill_op_name(uint64_t op) {
  switch ((WorkOp)op) {
    case WorkOp::kAllGather: return "all_gather";
    case WorkOp::kReduceScatter: return "psum_scatter";
    case WorkOp::kRsPiece: return "moe_combine_psum_scatter";
  }
  return "prefill op";
}

}  // namespace

std::string Endpoint::describe_recorded_failure() const {
  const Control* ctl = control();
  const uint64_t seq = load_acquire(&ctl->failed_seq);
  const FailureKind kind = (FailureKind)load_relaxed(&ctl->failed_kind);
  // failed_op says which flags the wait was on: psum's (progress = seq), or
  // the prefill ops' (progress = seq * 16 + piece + 1).
  const uint64_t op = load_relaxed(&ctl->failed_op);
  const bool prefill = op != 0;
  const std::string what = prefill ? strf("%s #%llu (prefill sequence)", prefill_op_name(op), (unsigned long long)seq)
                                   : strf("collective #%llu", (unsigned long long)seq);
  auto index = [&](int j, int r) { return prefill ? prefill_flag_index(j, r) : flag_index(j, r); };
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(base() + layout_.flags);
  const int roots = transport_->roots();
  std::string last;  // what each peer last sent, per root
  for (int j = 0; j < spec_.world; ++j) {
    if (j == spec_.rank) continue;
    last += strf(" r%d=", j);
    for (int r = 0; r < roots; ++r) {
      uint64_t p = flag_progress(load_relaxed(&flags[index(j, r)]));
      // CUDA direct mode: the peer's kernels write one word per piece
      // instead (layout.h, prefill_piece_flag_index); the furthest counts.
      for (int c = 0; prefill && c < kChunks; ++c)
        p = std::max(p, flag_progress(load_relaxed(&flags[prefill_piece_flag_index(j, c)])));
      if (!prefill) last += strf("%s%llu", r ? "/" : "", (unsigned long long)p);
      else if (p == 0) last += strf("%snothing", r ? "/" : "");
      else last += strf("%s#%llu piece %llu", r ? "/" : "", (unsigned long long)((p - 1) / 16),
                        (unsigned long long)((p - 1) % 16));
    }
  }
  switch (kind) {
    case FailureKind::kTimeout: {
      // failed_missing: bit src * kRoots + root per flag that had not arrived.
      const uint64_t missing = load_relaxed(&ctl->failed_missing);
      std::string who;
      for (int j = 0; j < spec_.world; ++j) {
        bool miss = false;
        for (int r = 0; r < roots; ++r) miss |= (missing >> flag_index(j, r)) & 1;
        if (miss) who += strf("%s%d", who.empty() ? "" : ", ", j);
      }
      return strf("jax_arx: %s: %s timed out after %g s waiting for rank %s. Last %s heard from each "
                  "peer:%s. The peer may have exited or crashed, or be issuing different collectives; raise "
                  "JAX_ARX_TIMEOUT_S if it is only slow",
                  label_.c_str(), what.c_str(), spec_.config.timeout_s, who.c_str(), prefill ? "piece" : "seq",
                  last.c_str());
    }
    case FailureKind::kMismatch:
      return strf("jax_arx: %s: at %s rank %llu issued a different collective (op, dtype, element "
                  "count or call site differ: descriptor %06llx, this rank %06llx). Every rank must issue the same "
                  "collectives in the same order with the same shapes",
                  label_.c_str(), what.c_str(), (unsigned long long)load_relaxed(&ctl->failed_src),
                  (unsigned long long)flag_desc(load_relaxed(&ctl->failed_flag)),
                  (unsigned long long)load_relaxed(&ctl->failed_desc));
    case FailureKind::kAborted:
      return strf("jax_arx: %s: %s was abandoned because the endpoint had already failed", label_.c_str(),
                  what.c_str());
    case FailureKind::kNone:
      break;
  }
  return strf("jax_arx: %s: %s failed (record kind %llu)", label_.c_str(), what.c_str(), (unsigned long long)kind);
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

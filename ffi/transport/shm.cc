// The shm carrier: every rank of the communicator is on this host, and each
// maps its peers' regions (POSIX shared memory). A put is a copy into the
// peer's mapped inbox and a release store of the flag word: the peer's
// acquire load of the flag then sees the copied bytes.
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "comm/atomics.h"
#include "transport/transport.h"

namespace arx {
namespace {

class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(const TransportContext& ctx) : ctx_(ctx), peers_(ctx.world) {}
  ~ShmTransport() override { close(); }

  TransportKind kind() const override { return TransportKind::kShm; }
  // Two roots, as on the NICs: the split costs one more copy and flag, and
  // keeps the protocol's two-root path exercised wherever tests run.
  int roots() const override { return kRoots; }

  std::string details() const override {
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    return ctx_.region->name() + '\n' + host;
  }

  Status connect(const std::vector<std::string>& details, double timeout_s) override {
    char host[256] = {};
    gethostname(host, sizeof host - 1);
    for (int j = 0; j < ctx_.world; ++j) {
      if (j == ctx_.rank) continue;
      const std::string& d = details[j];
      const size_t nl = d.find('\n');
      if (nl == std::string::npos)
        return Status::Error(strf("jax_arx: %s: malformed shm details from rank %d", ctx_.label.c_str(), j));
      const std::string name = d.substr(0, nl), their_host = d.substr(nl + 1);
      if (their_host != host)
        return Status::Error(strf("jax_arx: %s: the shm carrier needs every rank on one host, but rank %d is on "
                                  "'%s' and this rank on '%s'; set JAX_ARX_TRANSPORT=tcp (or verbs)",
                                  ctx_.label.c_str(), j, their_host.c_str(), host));
      ARX_RETURN_IF_ERROR(Region::open_peer(name, ctx_.layout.total, peers_[j]));
      // Tell rank j that its region is mapped here.
      store_release(reinterpret_cast<uint64_t*>(peers_[j]->base() + ctx_.layout.handshake_offset(ctx_.rank)), 1);
    }
    // Once every peer has mapped this region its name can go: a process that
    // dies later leaves nothing behind in /dev/shm.
    const auto deadline = deadline_in(timeout_s);
    for (int j = 0; j < ctx_.world; ++j) {
      if (j == ctx_.rank) continue;
      const uint64_t* word = reinterpret_cast<const uint64_t*>(ctx_.region->base() + ctx_.layout.handshake_offset(j));
      if (wait_nonzero(word, deadline) == 0)
        return Status::Error(strf("jax_arx: %s: rank %d did not map this rank's shared memory within %g s",
                                  ctx_.label.c_str(), j, timeout_s));
    }
    ctx_.region->unlink();
    return Status::Ok();
  }

  Status put(int peer, int root, const void* src, uint64_t offset, uint64_t len, uint64_t flag_offset,
             uint64_t flag_value) override {
    // The peer's inbox bounds hold for every carrier, this one included: a
    // protocol bug must not scribble over a peer's send buffer or control.
    if (peer < 0 || peer >= ctx_.world || !peers_[peer] || !ctx_.layout.inbox_contains(offset, len) ||
        !ctx_.layout.is_flag(flag_offset))
      return Status::Error(strf("jax_arx: %s: refused a put to rank %d at [%llu, +%llu) flag %llu: outside its inbox "
                                "[%llu, %llu)",
                                ctx_.label.c_str(), peer, (unsigned long long)offset, (unsigned long long)len,
                                (unsigned long long)flag_offset, (unsigned long long)ctx_.layout.inbox_lo,
                                (unsigned long long)ctx_.layout.inbox_hi));
    uint8_t* base = peers_[peer]->base();
    if (len) std::memcpy(base + offset, src, len);
    store_release(reinterpret_cast<uint64_t*>(base + flag_offset), flag_value);
    return Status::Ok();
  }

  Status poll() override { return Status::Ok(); }

  // A put is a copy and a release store into the peer's mapping: no state.
  bool puts_from_any_thread() const override { return true; }

  uint8_t* peer_base(int peer) const override {
    return peer >= 0 && peer < ctx_.world && peers_[peer] ? peers_[peer]->base() : nullptr;
  }

  void close() override {
    for (auto& p : peers_) p.reset();
  }

 private:
  TransportContext ctx_;
  std::vector<std::unique_ptr<Region>> peers_;
};

}  // namespace

Status make_shm_transport(const TransportContext& ctx, std::unique_ptr<Transport>& out) {
  if (ctx.region->name().empty())
    return Status::Error("jax_arx: the shm carrier needs the endpoint's region in shared memory");
  out = std::make_unique<ShmTransport>(ctx);
  return Status::Ok();
}

}  // namespace arx

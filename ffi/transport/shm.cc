// The shm carrier: every rank of the communicator is on this host, and the
// endpoint has mapped its peers' regions (base/windows.h). A put is a copy
// into the peer's mapped inbox and a release store of the flag word: the
// peer's acquire load of the flag then sees the copied bytes. The copy runs
// on the proxy thread and the carrier's copy helpers (transport/copy_pool.h),
// as a NIC's engines move a write, so that a route through the proxy here
// measures the protocol rather than one core's memcpy.
#include <sched.h>

#include <cstring>
#include <thread>

#include "base/atomics.h"
#include "transport/copy_pool.h"
#include "transport/transport.h"

namespace arx {
namespace {

class ShmTransport final : public Transport {
 public:
  explicit ShmTransport(const TransportContext& ctx) : ctx_(ctx) {}
  ~ShmTransport() override { close(); }

  TransportKind kind() const override { return TransportKind::kShm; }
  // Two roots, as on the NICs: the split costs one more copy and flag, and
  // keeps the protocol's two-root path exercised wherever tests run.
  int roots() const override { return kRoots; }
  bool whole_words() const override { return true; }

  // The endpoint exchanged and mapped the regions: nothing of the carrier's own.
  std::string details() const override { return ""; }

  Status connect(const std::vector<std::string>&, double) override {
    if (!ctx_.windows || !ctx_.windows->mapped())
      return Status::Error(
          strf("jax_arx: %s: the shm carrier needs the peers' regions mapped first", ctx_.label.c_str()));
    const Config defaults;
    const Config& cfg = ctx_.config ? *ctx_.config : defaults;
    // Every rank of the communicator is on this host (the shm carrier's
    // premise): they share the cores this process may run on.
    cpu_set_t set;
    const unsigned cores =
        sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : std::thread::hardware_concurrency();
    helpers_ = CopyPool::helpers_for(cfg.shm_copy_threads, ctx_.world, cores);
    idle_spin_ms_ = cfg.idle_spin_ms;
    return Status::Ok();
  }

  Status put(int peer, int root, const void* src, uint64_t offset, uint64_t len, uint64_t flag_offset,
             uint64_t flag_value) override {
    // A peer's slots hold for every carrier, this one included: a protocol
    // bug must not scribble over a peer's staging buffers or control block.
    uint8_t* base = ctx_.windows ? ctx_.windows->base(peer) : nullptr;
    if (!base || !ctx_.layout.may_write(ctx_.rank, peer, offset, len) ||
        (flag_offset != kNoFlag && !ctx_.layout.may_flag(ctx_.rank, peer, flag_offset)))
      return Status::Error(
          strf("jax_arx: %s: refused a put to rank %d at [%llu, +%llu) flag %llu: outside this "
               "rank's slots in its inbox",
               ctx_.label.c_str(), peer, (unsigned long long)offset, (unsigned long long)len,
               (unsigned long long)flag_offset));
    if (len) copy(base + offset, src, offset, len);
    if (flag_offset != kNoFlag) store_release(reinterpret_cast<uint64_t*>(base + flag_offset), flag_value);
    return Status::Ok();
  }

  Status poll() override { return Status::Ok(); }
  // An LL slot's lines are polled while they land (base/layout.h, "The LL
  // one-shot"): they go in whole 8-byte stores, which memcpy does not
  // promise. Everything else is read only after its flag.
  void copy(uint8_t* dst, const void* src, uint64_t offset, uint64_t len) {
    const Layout& L = ctx_.layout;
    if (offset < L.ll_recv || offset >= L.send || (offset | len | (uintptr_t)src) % 8) {
      // The helpers start at the first put they would share: on the direct
      // route (GPUs writing their peers' inboxes) none ever comes.
      if (!pool_ && helpers_ > 0 && len >= 2 * CopyPool::kMinPart)
        pool_ = std::make_unique<CopyPool>(helpers_, idle_spin_ms_);
      if (pool_)
        pool_->copy(dst, src, len);
      else
        std::memcpy(dst, src, len);
      return;
    }
    const uint64_t* from = static_cast<const uint64_t*>(src);
    uint64_t* to = reinterpret_cast<uint64_t*>(dst);
    for (uint64_t i = 0; i < len / 8; ++i) store_relaxed(to + i, from[i]);
  }
  // The proxy, put()'s only caller, has stopped (comm/endpoint.cc, close).
  void close() override { pool_.reset(); }

 private:
  TransportContext ctx_;
  int helpers_ = 0;  // CopyPool::helpers_for this host, from connect()
  int64_t idle_spin_ms_ = 0;
  std::unique_ptr<CopyPool> pool_;  // from the first put it would share; the proxy thread's alone
};

}  // namespace

Status make_shm_transport(const TransportContext& ctx, std::unique_ptr<Transport>& out) {
  if (ctx.region->name().empty())
    return Status::Error("jax_arx: the shm carrier needs the endpoint's region in shared memory");
  out = std::make_unique<ShmTransport>(ctx);
  return Status::Ok();
}

}  // namespace arx

#include "comm/plan.h"

#include <algorithm>

namespace arx {
namespace {

// The pieces of a one-shot psum on the CUDA side: about this many bytes
// each, by where the inboxes are (examples/bench_psum.py chose each; see
// docs/performance.md).
constexpr uint64_t kPieceBytesGpuInboxes = 32 << 10;
constexpr uint64_t kPieceBytesHostInboxes = 16 << 10;
// Through the proxy a piece is a put (an RDMA write and its flag per root):
// fewer, larger ones. Not measured yet on RoCE; on the GPU machine only
// through the tcp carrier.
constexpr uint64_t kPieceBytesProxy = 64 << 10;
// The host's bulk collectives through the proxy (tcp, verbs): each piece is
// a trigger, a put per peer and root and a wait, which over tcp cost more
// than the overlap of copying and sending buys below this size
// (docs/performance.md, "Pieces of the bulk collectives on the CPU").
constexpr uint64_t kPieceBytesBulkHostProxy = 512 << 10;

// On host inboxes the one-shot reads every peer's whole partial over the bus,
// and from 256 KiB on it loses to the two-shot, which reads a 1/world share
// of each (examples/bench_psum.py, arx-shm-host one-shot against two-shot
// under MPS: docs/performance.md): unless JAX_ARX_ONESHOT_MAX_BYTES says
// otherwise, the one-shot stops where LL does there.
constexpr uint64_t kOneShotMaxHostInboxes = kLLMaxPayload;

// Through the proxy the receiving GPU polls lines in host memory while the
// proxy writes them, and the two contend for the same lines: from 16 KiB on
// the one-shot behind a flag wins (examples/bench_psum.py, arx-shm-proxy
// against arx-shm-proxy-noll under MPS: docs/performance.md).
constexpr uint64_t kLLMaxProxy = 8 << 10;

uint64_t ll_limit(const Endpoint& ep) {
  const int64_t cfg = ep.spec().config.cuda_ll_max_bytes;
  if (cfg == 0) return 0;
  // Up to its cap by default on the direct channel, with either kind of
  // inbox (bench_psum.py); to kLLMaxProxy through the proxy.
  if (cfg < 0) return ep.route().direct ? kLLMaxPayload : kLLMaxProxy;
  return std::min<uint64_t>((uint64_t)cfg, kLLMaxPayload);
}

// Whether the LL one-shot runs a `bytes`-byte partial: on a GPU, up to its
// limit, on the direct channel, or through the proxy where the carrier's
// puts land in whole words (layout.h, "The LL one-shot"), no relay forwards
// them (comm/proxy.cc: a relay would read lines the next rank zeroes) and the
// lines fit the staging buffer.
// A fused call (`row_bytes` > 0) norms each row in the block that holds it:
// a row must fit one LL block and start on a line, unless one block holds
// the whole partial.
bool ll_runs(const Endpoint& ep, uint64_t bytes, uint64_t row_bytes) {
  if (ep.spec().platform != Platform::kCuda || bytes > ll_limit(ep)) return false;
  if (row_bytes && bytes > kLLBlockPayload && (row_bytes > kLLBlockPayload || row_bytes % kLLLinePayload)) return false;
  if (ep.route().direct) return true;
  const Layout& L = ep.layout();
  const uint64_t lines = (bytes + kLLLinePayload - 1) / kLLLinePayload * kLLLineBytes;
  return ep.transport()->whole_words() && !L.topo.relays() && lines <= L.send_bytes;
}

int psum_pieces(const Endpoint& ep, uint64_t bytes) {
  if (ep.spec().platform == Platform::kHost) return 1;  // one thread copies, then waits: pieces buy nothing
  const Endpoint::Route& r = ep.route();
  const uint64_t target = ep.spec().config.cuda_chunk_bytes ? ep.spec().config.cuda_chunk_bytes
                          : !r.direct                       ? kPieceBytesProxy
                          : r.gpu_inboxes                   ? kPieceBytesGpuInboxes
                                                            : kPieceBytesHostInboxes;
  // Each piece has a flag word per source and root (layout.h); through the
  // proxy each is a trigger too, and a collective's triggers must fit the
  // ring's bound (proxy.h).
  const int words = psum_words(ep.spec().world, r.direct ? 1 : ep.roots()).pieces;
  const int cap = r.direct ? words : std::min(words, kMaxPieces);
  return (int)std::clamp<uint64_t>((bytes + target - 1) / target, 1, (uint64_t)cap);
}

// The pieces of a bulk collective's lanes of `lane_bytes`. The CUDA kernels
// cut their grid for kMaxPieces. The host copies with one thread: on the
// direct channel (shm) a piece costs a flag store and a look, so kMaxPieces;
// through the proxy, pieces of at least kPieceBytesBulkHostProxy.
int bulk_pieces(const Endpoint& ep, uint64_t lane_bytes) {
  if (ep.spec().platform == Platform::kCuda) return kMaxPieces;
  const uint64_t cfg = ep.spec().config.bulk_piece_bytes;
  if (!cfg && ep.route().direct) return kMaxPieces;
  const uint64_t target = cfg ? cfg : kPieceBytesBulkHostProxy;
  return (int)std::clamp<uint64_t>((lane_bytes + target - 1) / target, 1, kMaxPieces);
}

// The smallest value of a size variable that holds `n` bytes, as a person
// writes it (2MiB, 196608): for messages that say what to set.
std::string size_setting(uint64_t n) {
  n = (std::max<uint64_t>(n, 1) + 15) / 16 * 16;
  for (auto [suffix, unit] : {std::pair{"GiB", 1ull << 30}, {"MiB", 1ull << 20}, {"KiB", 1ull << 10}})
    if (n % unit == 0) return strf("%llu%s", (unsigned long long)(n / unit), suffix);
  return strf("%llu", (unsigned long long)n);
}

// The route in words, for the plan's reasons.
std::string route_words(const Endpoint& ep) {
  const Endpoint::Route& r = ep.route();
  if (ep.spec().platform == Platform::kHost)
    return strf("the CPU backend %s", r.direct ? "over shared memory" : "through the proxy");
  return strf("CUDA, %s", !r.direct ? "through the proxy" : r.gpu_inboxes ? "GPU inboxes" : "host inboxes");
}

// Where the fused MoE combine's measurements are (docs/performance.md, by
// section), and the route they were taken on, for the plan's reason.
std::string moe_route(const Endpoint& ep) {
  return route_words(ep) + (ep.spec().platform == Platform::kHost
                                ? "; docs/performance.md, \"On the CPU backend\""
                                : "; docs/performance.md, \"The GB10 route on one H200 under CUDA MPS\"");
}

}  // namespace

Plan plan_psum(const Endpoint& ep, uint64_t bytes, uint64_t row_bytes) {
  const Layout& L = ep.layout();
  const Config& cfg = ep.spec().config;
  const bool cuda = ep.spec().platform == Platform::kCuda;
  Plan p;
  const bool host_inboxes = cuda && ep.route().direct && !ep.route().gpu_inboxes;
  const uint64_t oneshot_max = cfg.oneshot_max_bytes ? std::min(cfg.oneshot_max_bytes, L.slot_bytes)
                               : host_inboxes        ? std::min(kOneShotMaxHostInboxes, L.slot_bytes)
                                                     : L.slot_bytes;
  // The two-shot partial is staged whole (send_bytes), and each rank's piece
  // fills at most a slot.
  const uint64_t twoshot_max = cuda ? std::min<uint64_t>(L.send_bytes, (uint64_t)L.world * L.slot_bytes) : 0;
  if (bytes <= oneshot_max) {
    if (ll_runs(ep, bytes, row_bytes)) {
      p.algorithm = Algorithm::kLL;
      return p;
    }
    p.algorithm = Algorithm::kOneShot;
    p.pieces = psum_pieces(ep, bytes);
    // A fused call's pieces are whole rows (the block that sums a row norms
    // it), starting on a 16-byte vector.
    if (row_bytes) p.pieces = row_bytes % 16 ? 1 : (int)std::min<uint64_t>((uint64_t)p.pieces, bytes / row_bytes);
    if (p.pieces < 1) p.pieces = 1;
    return p;
  }
  if (bytes <= twoshot_max) {
    p.algorithm = Algorithm::kTwoShot;
    return p;
  }
  // The whole fix: what limited it, and every setting that lifts it (the
  // send buffer stages a partial whole, so it must hold a slot: config.load
  // refuses less).
  const std::string need = size_setting(bytes);
  if (cfg.oneshot_max_bytes && oneshot_max < L.slot_bytes && bytes <= L.slot_bytes) {
    p.why_not = strf(
        "a partial of %llu bytes exceeds JAX_ARX_ONESHOT_MAX_BYTES=%llu; set "
        "JAX_ARX_ONESHOT_MAX_BYTES=%s or unset it on every process to run it with jax_arx",
        (unsigned long long)bytes, (unsigned long long)oneshot_max, need.c_str());
    return p;
  }
  std::string fix = "JAX_ARX_SLOT_BYTES=" + need;
  if (bytes > L.send_bytes) fix += " and JAX_ARX_SEND_BYTES=" + need + " (the send buffer must hold a slot)";
  p.why_not = strf(
      "a partial of %llu bytes exceeds the %s limit of %llu bytes; set %s on every process to run it "
      "with jax_arx (each endpoint pins 2 x world x JAX_ARX_SLOT_BYTES + 2 x JAX_ARX_SEND_BYTES)",
      (unsigned long long)bytes, cuda ? "two-shot" : "one-shot", (unsigned long long)std::max(oneshot_max, twoshot_max),
      fix.c_str());
  return p;
}

Plan plan_bulk(const Endpoint& ep, const char* op, uint64_t lane_bytes) {
  const Layout& L = ep.layout();
  Plan p;
  // The envelope users set: every rank's lane together within
  // JAX_ARX_PREFILL_SLOT_BYTES (the lanes themselves hold a little more,
  // rounded up to 16 bytes). It is the communicator's, whether or not this
  // endpoint holds the lanes (Config::bulk_lanes): Python asks it of the
  // psum endpoint before the bulk endpoint exists, and the handlers of the
  // one that runs it (xla/handlers.h, endpoint_for) refuse an endpoint
  // without lanes.
  if (lane_bytes * (uint64_t)L.world <= ep.spec().config.bulk_bytes) {
    p.algorithm = Algorithm::kBulk;
    p.pieces = bulk_pieces(ep, lane_bytes);
    return p;
  }
  p.why_not = strf(
      "%s moves %llu bytes per rank, %llu for all %d ranks, more than JAX_ARX_PREFILL_SLOT_BYTES=%llu; "
      "set JAX_ARX_PREFILL_SLOT_BYTES=%s on every process to run it with jax_arx (the bulk collectives pin "
      "4 x JAX_ARX_PREFILL_SLOT_BYTES per device, from their first call on)",
      op, (unsigned long long)lane_bytes, (unsigned long long)(lane_bytes * L.world), L.world,
      (unsigned long long)ep.spec().config.bulk_bytes, size_setting(lane_bytes * L.world).c_str());
  return p;
}

Plan plan_add_norm(const Endpoint& ep, uint64_t bytes) {
  Plan p = plan_psum(ep, bytes);
  if (p.algorithm == Algorithm::kNone || ep.spec().config.norm_fused) return p;
  // The fused norm runs a row at a time: on GPUs on the blocks that summed
  // it, in the kernels' epilogue, where XLA's separate add and norm kernel
  // takes the whole GPU; on the CPU in one thread, element by element,
  // where XLA's norm is vectorized. Measured, the fused call lost to the
  // unfused three on every route, GPU and CPU (docs/performance.md, "The
  // fused norm", and its CPU figures under "On the CPU backend").
  // So it steps aside: hidden keeps its bits (psum + residual either way);
  // normed is the formula in XLA's reduction order, the same on every rank.
  // Every rank decides alike: the route and the config are the
  // communicator's.
  Plan unfused;
  unfused.algorithm = Algorithm::kUnfused;
  unfused.reason =
      "the fused norm measured slower than jax_arx.psum, then the add and the norm in jax, on this route (" +
      route_words(ep) + "; docs/performance.md, \"The fused norm\")";
  return unfused;
}

Plan plan_moe_combine(const Endpoint& ep, uint64_t lane_bytes) {
  Plan p = plan_bulk(ep, "moe_combine_psum_scatter", lane_bytes);
  if (p.algorithm != Algorithm::kBulk || ep.spec().config.moe_fused) return p;
  // The fused kernel exists only to beat the pair it is defined by (jax's
  // combine writing its rows to memory, then the bulk psum_scatter reading
  // them), and it is slower than that pair on every route and size
  // measured but one, which it won by 3-6 % (docs/performance.md, "The
  // fused MoE combine on the whole GPU" and "... stage by stage"), also
  // since its rows are computed on every multiprocessor the consumers
  // leave. So it steps aside; the pair sums in the same rank order and
  // gives the same bits. Every rank decides alike: the route and the
  // config are the communicator's.
  Plan unfused;
  unfused.algorithm = Algorithm::kUnfused;
  unfused.reason = "the fused combine measured slower than its unfused pair on this route (" + moe_route(ep) +
                   "): jax's combine, then jax_arx.psum_scatter, the same bits";
  return unfused;
}

}  // namespace arx

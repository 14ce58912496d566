// The verbs carrier: RDMA writes on RC queue pairs, libibverbs loaded at run
// time (verbs_lib.h), devices and GIDs chosen as verbs_device.h says.
//
// Per device, one per root: a PD, a CQ, and two MRs over this endpoint's
// region: the whole region for local access (every write's source lies in
// it), and the inbox alone with remote write. Peers get the inbox MR's rkey,
// so the NIC itself refuses a peer's write outside the inbox, on top of the
// check every put() makes against the bounds the peer advertised. Mesh: an
// RC QP to every peer per root.
//
// Order, the one thing the protocol asks of a carrier: put() posts the data
// write and then the flag's write on the same RC QP. The responder executes
// a QP's writes in PSN order, and a ConnectX places them in memory in that
// order as long as the MR does not ask for relaxed PCIe ordering
// (IBV_ACCESS_RELAXED_ORDERING, never requested here). So a receiver that
// load-acquires the flag sees the data before it (the reference's premise).
//
// Completions: every WR is unsignalled except one every signal_every_ WRs
// per QP. A signalled completion retires every WR posted before it on that
// QP, which is how the send queue is reclaimed; WRs that fail complete
// regardless of signalling, so errors are never missed. poll() turns the
// first failed completion into the sticky error, naming the peer, and
// reports every peer whose QP failed through ctx.on_peer_lost. A peer that
// exits or destroys its QPs stops acknowledging: the NIC retries retry_cnt
// times, timeout apart (4.096 us << timeout: 67 ms at 14), then fails the
// write, so the failure surfaces within about half a second of the first
// write the peer does not take, never as a silent stall. (Soft-RoCE, the
// rdma_rxe of Linux 6.1 at least, takes retry_cnt 7 to mean "retry forever",
// as the spec says only of rnr_retry: set JAX_ARX_IB_RETRY_CNT=6 there. A
// send queue that stays full past Config::timeout_s is reported the same way.)
#include "transport/transport.h"

#if ARX_HAVE_VERBS

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "transport/verbs_device.h"
#include "transport/verbs_lib.h"

namespace arx {
namespace {

using verbs::Api;
using verbs::Device;

// QP settings: timeout, retry count, traffic class and service level come
// from Config (the reference's 14 = 67 ms and 7 by default, see config.h).
constexpr int kRnrRetry = 7;   // 7 = retry forever; no receive WRs are ever involved
constexpr int kMinRnrTimer = 12;
constexpr uint32_t kSqDepth = 512;  // WRs per QP; a put takes 2 (1 without data)
constexpr int kChain = 16;          // WRs per ibv_post_send call
constexpr uint64_t kMaxChunk = 1ull << 30;

constexpr uint32_t kWireMagic = 0x56585241;  // "ARXV"
constexpr uint32_t kWireVersion = 2;

// What this rank tells its peers (details()). Raw bytes: every rank runs the
// same jax_arx (the endpoint's fingerprint checks the version), and the
// targets are all little-endian.
struct Wire {
  uint32_t magic, version;
  int32_t rank, world, roots, pad0;
  uint64_t secret_hash;  // details of another communicator are refused
  uint64_t region_addr, region_bytes;
  uint64_t inbox_lo, inbox_hi;  // offsets from region_addr that peers may write: flags and psum slots
  uint64_t bulk_lo, bulk_hi;    // and the bulk slots (empty when the endpoint has none)
  struct Root {
    uint8_t gid[16];
    uint32_t rkey;       // of the inbox MR
    uint32_t bulk_rkey;  // of the bulk inbox MR
    uint32_t mtu;   // the port's active MTU (enum ibv_mtu)
    uint32_t port, gid_index;
    uint16_t lid;
    uint8_t ethernet, pad[1];
    char dev[32];
  } root[kRoots];
  uint32_t qpn[kMaxWorld][kRoots];  // this rank's QP to rank j over root r
};

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// A queue-pair setting from Config, checked again here: Config::parse
// checks what Python hands over, but C++ callers fill Config in directly.
Status knob(const char* name, const char* var, int64_t v, int64_t lo, int64_t hi, int& out) {
  if (v < lo || v > hi)
    return Status::Error(strf("jax_arx: %s=%lld (%s) is not an integer in [%lld, %lld]", name, (long long)v, var,
                              (long long)lo, (long long)hi));
  out = (int)v;
  return Status::Ok();
}

const char* completion_hint(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_RETRY_EXC_ERR:
      return "the peer acknowledged nothing within the retries: it exited or closed its endpoint, or its link is "
             "down, or the path is wrong (check JAX_ARX_IB_HCA and JAX_ARX_IB_GID_INDEX on both sides)";
    case IBV_WC_REM_ACCESS_ERR:
      return "the peer refused the write: its memory is gone (it closed its endpoint) or the write fell outside "
             "its inbox (buffer sizes that differ between ranks)";
    case IBV_WC_REM_INV_REQ_ERR:
    case IBV_WC_REM_OP_ERR:
      return "the peer's queue pair cannot take writes: it was reset or destroyed (the peer closed its endpoint)";
    case IBV_WC_WR_FLUSH_ERR:
      return "flushed: the queue pair had already failed";
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_LEN_ERR:
    case IBV_WC_LOC_QP_OP_ERR:
      return "the local NIC rejected the write (a source outside the registered region, or a bad route to the "
             "peer's GID: check JAX_ARX_IB_GID_INDEX)";
    default:
      return "the link to the peer broke";
  }
}

// put() and poll() are called from one thread, the endpoint's proxy; close()
// after that thread stopped. Nothing here takes a lock.
class VerbsTransport final : public Transport {
 public:
  VerbsTransport(const TransportContext& ctx, const Api& api) : ctx_(ctx), api_(api) {}
  ~VerbsTransport() override { close(); }

  TransportKind kind() const override { return TransportKind::kVerbs; }
  int roots() const override { return (int)devices_.size(); }
  std::string details() const override { return std::string(reinterpret_cast<const char*>(&wire_), sizeof wire_); }

  Status open();
  Status connect(const std::vector<std::string>& details, double timeout_s) override;
  Status put(int peer, int root, const void* src, uint64_t offset, uint64_t len, uint64_t flag_offset,
             uint64_t flag_value) override;

  Status poll() override {
    if (error_.ok()) reap();
    return error_;
  }
  void close() override;

 private:
  // One RC QP: to one peer over one root.
  struct Link {
    ibv_qp* qp = nullptr;
    uint64_t posted = 0;       // WRs posted
    uint64_t completed = 0;    // WRs retired (by the last signalled completion)
    uint64_t unsignalled = 0;  // WRs posted since the last signalled one
    bool failed = false;
    // The peer's side, from its details.
    uint64_t remote_base = 0, inbox_lo = 0, inbox_hi = 0, bulk_lo = 0, bulk_hi = 0;
    uint32_t rkey = 0, bulk_rkey = 0, remote_qpn = 0;
    int path_mtu = 0;
    std::string remote;  // "rank 1 (rxe1 port 1, GID 198.51.100.2, QP 0x12)", for messages
  };

  // "jax_arx: <label>: <rest>" from a message that starts "jax_arx: ".
  Status labelled(const std::string& message) const {
    const std::string p = "jax_arx: ";
    const std::string rest = message.compare(0, p.size(), p) == 0 ? message.substr(p.size()) : message;
    return Status::Error(p + ctx_.label + ": " + rest);
  }
  Status fail(const std::string& message) {
    if (error_.ok()) error_ = labelled(message);
    return error_;
  }
  std::string where(int root) const { return verbs::describe(devices_[root]); }
  Status modify(int peer, int root, ibv_qp_attr& a, int mask, const char* transition, const char* hint);
  Status make_room(Link& l, int peer, int root, uint64_t need);
  void reap();
  void completion_error(int peer, int root, const ibv_wc& wc);
  void report_lost(int peer, const std::string& why);  // once per peer

  TransportContext ctx_;
  const Api& api_;
  std::vector<Device> devices_;
  std::string note_;
  ibv_pd* pd_[kRoots] = {};
  ibv_cq* cq_[kRoots] = {};
  ibv_mr* local_mr_[kRoots] = {};  // the whole region: sources
  ibv_mr* inbox_mr_[kRoots] = {};  // the inbox: what peers write into
  ibv_mr* bulk_mr_[kRoots] = {};   // the bulk inbox, likewise
  Link links_[kMaxWorld][kRoots];
  Wire wire_{};
  uint64_t sq_depth_ = kSqDepth, signal_every_ = kSqDepth / 4, chunk_ = kMaxChunk;
  int timeout_ = 14, retry_cnt_ = 7, tc_ = 0, sl_ = 0;  // from Config in open()
  bool connected_ = false, closed_ = false;
  // Set and read by the thread that calls put() and poll() (the proxy).
  Status error_;
  uint32_t lost_ = 0;  // peers already reported through on_peer_lost
};

Status VerbsTransport::open() {
  const Layout& lay = ctx_.layout;
  Region* region = ctx_.region;
  if (!region || !ctx_.config || ctx_.world < 1 || ctx_.world > kMaxWorld || ctx_.rank < 0 ||
      ctx_.rank >= ctx_.world || lay.total > region->size())
    return labelled("jax_arx: verbs carrier given an invalid context (region, config, rank/world or inbox)");
  const Config& cfg = *ctx_.config;
  Status knobs = knob("ib_timeout", "JAX_ARX_IB_TIMEOUT", cfg.ib_timeout, 1, 31, timeout_);
  if (knobs.ok()) knobs = knob("ib_retry_cnt", "JAX_ARX_IB_RETRY_CNT", cfg.ib_retry_cnt, 0, 7, retry_cnt_);
  if (knobs.ok()) knobs = knob("ib_tc", "JAX_ARX_IB_TC", cfg.ib_tc, 0, 255, tc_);
  if (knobs.ok()) knobs = knob("ib_sl", "JAX_ARX_IB_SL", cfg.ib_sl, 0, 15, sl_);
  if (!knobs.ok()) return labelled(knobs.message());
  // Test knob: split data writes into WRs of at most this many bytes, so the
  // tests exercise the chunked path that only multi-GB puts take otherwise.
  if (cfg.ib_chunk_bytes) chunk_ = std::clamp<uint64_t>(cfg.ib_chunk_bytes, 64, kMaxChunk);
  Status st = verbs::open_devices(api_, ctx_.config->ib_hca, ctx_.config->ib_gid_index, devices_, note_);
  if (!st.ok()) return labelled(st.message());

  wire_.magic = kWireMagic;
  wire_.version = kWireVersion;
  wire_.rank = ctx_.rank;
  wire_.world = ctx_.world;
  wire_.roots = roots();
  wire_.secret_hash = fnv1a(ctx_.secret);
  wire_.region_addr = (uint64_t)(uintptr_t)region->base();
  wire_.region_bytes = region->size();
  wire_.inbox_lo = lay.inbox_lo();
  wire_.inbox_hi = lay.inbox_hi();
  wire_.bulk_lo = lay.bulk_inbox_lo();
  wire_.bulk_hi = lay.bulk_inbox_hi();
  for (int r = 0; r < roots(); ++r) {
    const Device& d = devices_[r];
    sq_depth_ = std::min<uint64_t>(sq_depth_, (uint64_t)d.attr.max_qp_wr);
    chunk_ = std::min<uint64_t>(chunk_, d.port_attr.max_msg_sz ? d.port_attr.max_msg_sz : kMaxChunk);
  }
  if (sq_depth_ < 4 * kChain)
    return labelled(strf("jax_arx: %s allows only %llu WRs per queue pair; the verbs carrier needs %d",
                         where(0).c_str(), (unsigned long long)sq_depth_, 4 * kChain));
  signal_every_ = sq_depth_ / 4;

  const int local = IBV_ACCESS_LOCAL_WRITE, remote = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  const char* memlock_hint =
      "registering pins the memory: raise the locked-memory limit (ulimit -l unlimited; docker: --ulimit "
      "memlock=-1; systemd: LimitMEMLOCK=infinity)";
  for (int r = 0; r < roots(); ++r) {
    Device& d = devices_[r];
    errno = 0;
    if (!(pd_[r] = api_.alloc_pd(d.ctx)))
      return labelled(strf("jax_arx: ibv_alloc_pd on %s failed: %s", where(r).c_str(), verbs::error_text(-1).c_str()));
    errno = 0;
    if (!(local_mr_[r] = api_.reg_mr(pd_[r], region->base(), region->size(), local)))
      return labelled(strf("jax_arx: ibv_reg_mr of the endpoint's %llu bytes on %s failed: %s; %s",
                           (unsigned long long)region->size(), where(r).c_str(), verbs::error_text(-1).c_str(),
                           memlock_hint));
    errno = 0;
    // Two windows that peers may write (layout.h): the flags and psum slots,
    // and the bulk slots. Everything else is this rank's alone, and the NIC
    // itself refuses a remote write there.
    if (!(inbox_mr_[r] = api_.reg_mr(pd_[r], region->base() + lay.inbox_lo(), lay.inbox_hi() - lay.inbox_lo(), remote)))
      return labelled(strf("jax_arx: ibv_reg_mr of the inbox (%llu bytes, remote write) on %s failed: %s; %s",
                           (unsigned long long)(lay.inbox_hi() - lay.inbox_lo()), where(r).c_str(),
                           verbs::error_text(-1).c_str(), memlock_hint));
    errno = 0;
    if (lay.bulk_inbox_hi() > lay.bulk_inbox_lo() &&
        !(bulk_mr_[r] = api_.reg_mr(pd_[r], region->base() + lay.bulk_inbox_lo(),
                                    lay.bulk_inbox_hi() - lay.bulk_inbox_lo(), remote)))
      return labelled(strf("jax_arx: ibv_reg_mr of the bulk inbox (%llu bytes, remote write) on %s failed: %s; %s",
                           (unsigned long long)(lay.bulk_inbox_hi() - lay.bulk_inbox_lo()), where(r).c_str(),
                           verbs::error_text(-1).c_str(), memlock_hint));
    // Every QP's WRs fit, failed ones included (they complete signalled or not).
    const int cqe = (int)std::min<uint64_t>((uint64_t)(ctx_.world - 1) * sq_depth_ + 64, (uint64_t)d.attr.max_cqe);
    errno = 0;
    if (!(cq_[r] = api_.create_cq(d.ctx, cqe, nullptr, nullptr, 0)))
      return labelled(strf("jax_arx: ibv_create_cq(%d entries) on %s failed: %s", cqe, where(r).c_str(),
                           verbs::error_text(-1).c_str()));
    Wire::Root& w = wire_.root[r];
    memcpy(w.gid, d.gid.raw, 16);
    w.rkey = inbox_mr_[r]->rkey;
    w.bulk_rkey = bulk_mr_[r] ? bulk_mr_[r]->rkey : 0;
    w.mtu = d.port_attr.active_mtu;
    w.port = d.port;
    w.gid_index = d.gid_index;
    w.lid = d.port_attr.lid;
    w.ethernet = d.ethernet;
    snprintf(w.dev, sizeof w.dev, "%s", d.name.c_str());
    for (int j = 0; j < ctx_.world; ++j) {
      if (j == ctx_.rank) continue;
      ibv_qp_init_attr ia{};
      ia.send_cq = cq_[r];
      ia.recv_cq = cq_[r];
      ia.qp_type = IBV_QPT_RC;
      ia.sq_sig_all = 0;
      ia.cap.max_send_wr = (uint32_t)sq_depth_;
      ia.cap.max_recv_wr = 1;
      ia.cap.max_send_sge = 1;
      ia.cap.max_recv_sge = 1;
      ia.cap.max_inline_data = 64;  // the flag (8 bytes) goes inline
      errno = 0;
      Link& l = links_[j][r];
      if (!(l.qp = api_.create_qp(pd_[r], &ia)))
        return labelled(strf("jax_arx: ibv_create_qp (RC, %llu send WRs, 64 B inline) on %s for rank %d failed: %s; "
                             "the device may be out of queue pairs or locked memory (ulimit -l)",
                             (unsigned long long)sq_depth_, where(r).c_str(), j, verbs::error_text(-1).c_str()));
      if (ia.cap.max_inline_data < 8)
        return labelled(strf("jax_arx: %s gives queue pairs %u bytes of inline data; the verbs carrier needs 8 for "
                             "its flag writes. Name another device in JAX_ARX_IB_HCA",
                             where(r).c_str(), ia.cap.max_inline_data));
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_INIT;
      a.pkey_index = 0;
      a.port_num = (uint8_t)d.port;
      a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
      ARX_RETURN_IF_ERROR(modify(j, r, a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
                                 "RESET->INIT", "JAX_ARX_IB_HCA (another device or port)"));
      wire_.qpn[j][r] = l.qp->qp_num;
    }
  }
  if (ctx_.config->verbose)
    fprintf(stderr, "jax_arx verbs: %s: %d root%s: %s%s%s; QP timeout %d, retry %d%s%s\n", ctx_.label.c_str(),
            roots(), roots() == 1 ? "" : "s", where(0).c_str(), roots() > 1 ? ", " : "",
            roots() > 1 ? where(1).c_str() : "", timeout_, retry_cnt_, note_.empty() ? "" : "; ", note_.c_str());
  return Status::Ok();
}

Status VerbsTransport::modify(int peer, int root, ibv_qp_attr& a, int mask, const char* transition,
                              const char* hint) {
  Link& l = links_[peer][root];
  errno = 0;
  const int rc = api_.modify_qp(l.qp, &a, mask);
  if (rc == 0) return Status::Ok();
  return labelled(strf("jax_arx: ibv_modify_qp %s failed: %s; here %s, QP 0x%x; peer %s%s; check %s", transition,
                       verbs::error_text(rc).c_str(), where(root).c_str(), l.qp->qp_num,
                       l.remote.empty() ? strf("rank %d", peer).c_str() : l.remote.c_str(),
                       a.qp_state == IBV_QPS_RTR ? strf(", path MTU %d", verbs::mtu_bytes(a.path_mtu)).c_str() : "",
                       hint));
}

Status VerbsTransport::connect(const std::vector<std::string>& details, double timeout_s) {
  if (closed_) return labelled("jax_arx: verbs carrier connect() after close()");
  if (connected_) return labelled("jax_arx: verbs carrier connect() called twice");
  if ((int)details.size() != ctx_.world)
    return labelled(strf("jax_arx: verbs connect() got %zu ranks' details for a world of %d", details.size(),
                         ctx_.world));
  std::vector<Wire> peers(ctx_.world);
  for (int j = 0; j < ctx_.world; ++j) {
    Wire& p = peers[j];
    if (details[j].size() != sizeof(Wire))
      return labelled(strf("jax_arx: rank %d's connection details are %zu bytes, not a verbs carrier's %zu: does "
                           "every rank use the same carrier (JAX_ARX_TRANSPORT) and jax_arx version?",
                           j, details[j].size(), sizeof(Wire)));
    memcpy(&p, details[j].data(), sizeof(Wire));
    if (p.magic != kWireMagic || p.version != kWireVersion)
      return labelled(strf("jax_arx: rank %d's connection details are not a verbs carrier's (magic 0x%x, version "
                           "%u; expected 0x%x, %u)",
                           j, p.magic, p.version, kWireMagic, kWireVersion));
    if (p.rank != j || p.world != ctx_.world || p.secret_hash != wire_.secret_hash)
      return labelled(strf("jax_arx: rank %d's connection details belong to rank %d of %d of %s communicator", j,
                           p.rank, p.world, p.secret_hash == wire_.secret_hash ? "this" : "another"));
    if (p.roots != roots())
      return labelled(strf("jax_arx: rank %d has %d verbs root%s (%s%s%s) and this rank has %d (%s%s%s): every rank "
                           "must name as many devices in JAX_ARX_IB_HCA",
                           j, p.roots, p.roots == 1 ? "" : "s", p.root[0].dev, p.roots > 1 ? "," : "",
                           p.roots > 1 ? p.root[1].dev : "", roots(), devices_[0].name.c_str(),
                           roots() > 1 ? "," : "", roots() > 1 ? devices_[1].name.c_str() : ""));
  }
  int mtu_lo[kRoots] = {1 << 30, 1 << 30}, mtu_hi[kRoots] = {0, 0};
  for (int j = 0; j < ctx_.world; ++j) {
    if (j == ctx_.rank) continue;
    const Wire& p = peers[j];
    for (int r = 0; r < roots(); ++r) {
      const Device& d = devices_[r];
      const Wire::Root& pr = p.root[r];
      Link& l = links_[j][r];
      l.remote_base = p.region_addr;
      l.inbox_lo = p.inbox_lo;
      l.inbox_hi = p.inbox_hi;
      l.bulk_lo = p.bulk_lo;
      l.bulk_hi = p.bulk_hi;
      l.rkey = pr.rkey;
      l.bulk_rkey = pr.bulk_rkey;
      l.remote_qpn = p.qpn[ctx_.rank][r];
      l.remote = strf("rank %d (%s port %u, GID %s, QP 0x%x)", j, pr.dev, pr.port, verbs::gid_text(pr.gid).c_str(),
                      l.remote_qpn);
      if ((bool)pr.ethernet != d.ethernet)
        return labelled(strf("jax_arx: %s is %s but %s of %s is %s: root %d must be the same kind of link on every "
                             "rank (JAX_ARX_IB_HCA)",
                             where(r).c_str(), d.ethernet ? "RoCE" : "InfiniBand", pr.dev, l.remote.c_str(),
                             pr.ethernet ? "RoCE" : "InfiniBand", r));
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_RTR;
      a.path_mtu = (ibv_mtu)std::min<uint32_t>(d.port_attr.active_mtu, pr.mtu);
      a.dest_qp_num = l.remote_qpn;
      a.rq_psn = 0;
      a.max_dest_rd_atomic = 1;
      a.min_rnr_timer = kMinRnrTimer;
      a.ah_attr.port_num = (uint8_t)d.port;
      a.ah_attr.sl = (uint8_t)sl_;
      if (d.ethernet) {
        // RoCE addresses by GID. hop_limit 255 lets RoCE v2 cross routers.
        a.ah_attr.is_global = 1;
        memcpy(a.ah_attr.grh.dgid.raw, pr.gid, 16);
        a.ah_attr.grh.sgid_index = (uint8_t)d.gid_index;
        a.ah_attr.grh.hop_limit = 255;
        a.ah_attr.grh.traffic_class = (uint8_t)tc_;
      } else {
        a.ah_attr.dlid = pr.lid;
      }
      l.path_mtu = verbs::mtu_bytes(a.path_mtu);
      mtu_lo[r] = std::min(mtu_lo[r], l.path_mtu);
      mtu_hi[r] = std::max(mtu_hi[r], l.path_mtu);
      ARX_RETURN_IF_ERROR(modify(j, r, a,
                                 IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
                                 "INIT->RTR",
                                 d.ethernet ? "JAX_ARX_IB_GID_INDEX (a GID of the wrong type or netdev is the usual "
                                              "cause) and JAX_ARX_IB_HCA on both ranks"
                                            : "JAX_ARX_IB_HCA on both ranks (is the subnet manager running?)"));
      a = {};
      a.qp_state = IBV_QPS_RTS;
      a.timeout = (uint8_t)timeout_;
      a.retry_cnt = (uint8_t)retry_cnt_;
      a.rnr_retry = kRnrRetry;
      a.sq_psn = 0;
      a.max_rd_atomic = 1;
      ARX_RETURN_IF_ERROR(modify(j, r, a,
                                 IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                     IBV_QP_MAX_QP_RD_ATOMIC,
                                 "RTR->RTS", "JAX_ARX_IB_TIMEOUT and JAX_ARX_IB_RETRY_CNT"));
      if (ctx_.config->verbose)
        fprintf(stderr, "jax_arx verbs: %s: root %d %s QP 0x%x <-> %s: path MTU %d (ours %d, peer's %d)\n",
                ctx_.label.c_str(), r, where(r).c_str(), l.qp->qp_num, l.remote.c_str(), l.path_mtu,
                verbs::mtu_bytes(d.port_attr.active_mtu), verbs::mtu_bytes(pr.mtu));
    }
  }
  // RC needs no handshake beyond the details: a QP at RTS may send at once.
  // A peer that has not reached RTR yet drops the first packets and the NIC
  // resends them (retry_cnt x timeout); the caller's barrier after connect()
  // keeps the first put well inside that. Nothing here waits, so timeout_s
  // has nothing to bound.
  (void)timeout_s;
  connected_ = true;
  // One line per endpoint: what a user checks first when RoCE is slow.
  std::string line;
  for (int r = 0; r < roots(); ++r) {
    line += strf("%sroot %d %s", r ? "; " : "", r, where(r).c_str());
    if (ctx_.world > 1 && mtu_lo[r] == mtu_hi[r]) line += strf(", path MTU %d", mtu_lo[r]);
    else if (ctx_.world > 1) line += strf(", path MTU %d-%d", mtu_lo[r], mtu_hi[r]);
  }
  fprintf(stderr, "jax_arx verbs: %s: %s%s%s\n", ctx_.label.c_str(), line.c_str(), note_.empty() ? "" : "; ",
          note_.c_str());
  return Status::Ok();
}

Status VerbsTransport::make_room(Link& l, int peer, int root, uint64_t need) {
  if (l.posted - l.completed + need <= sq_depth_) return Status::Ok();
  // A full queue holds more than signal_every_ WRs, so one of them is
  // signalled, and its completion (or failure) ends this wait. The deadline
  // only guards against a NIC that stops completing anything at all.
  const double limit_s = std::max(ctx_.config->timeout_s, 1.0);
  const auto start = std::chrono::steady_clock::now();
  while (l.posted - l.completed + need > sq_depth_) {
    reap();
    if (!error_.ok()) return error_;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > limit_s) {
      const std::string why = strf("the send queue to %s over root %d (%s) stayed full for %.0f s: the NIC "
                                   "completed none of %llu writes",
                                   l.remote.c_str(), root, where(root).c_str(), limit_s,
                                   (unsigned long long)(l.posted - l.completed));
      report_lost(peer, why);
      return fail("jax_arx: " + why);
    }
    sched_yield();  // the peer's proxy may need this core (see DESIGN: 2-core machines)
  }
  return Status::Ok();
}

Status VerbsTransport::put(int peer, int root, const void* src, uint64_t offset, uint64_t len, uint64_t flag_offset,
                           uint64_t flag_value) {
  if (!error_.ok()) return error_;
  if (!connected_)
    return labelled(closed_ ? "jax_arx: verbs put() after close()" : "jax_arx: verbs put() before connect()");
  if (peer < 0 || peer >= ctx_.world || peer == ctx_.rank || root < 0 || root >= roots())
    return labelled(strf("jax_arx: verbs put() to rank %d over root %d: no such link (world %d, %d roots)", peer, root,
                         ctx_.world, roots()));
  Link& l = links_[peer][root];
  const uint8_t* s = static_cast<const uint8_t*>(src);
  const uint8_t* base = ctx_.region->base();
  const uint64_t size = ctx_.region->size();
  // A peer can only be written inside the inbox it advertised.
  if (len && (s < base || len > size || (uint64_t)(s - base) > size - len))
    return labelled(strf("jax_arx: verbs put() of %llu bytes from %p: the source is not inside this endpoint's "
                         "region",
                         (unsigned long long)len, src));
  // Only into this rank's own slots of the peer's inbox (every rank has the
  // same layout), and through the window (MR) that holds them.
  const bool bulk = offset >= l.bulk_lo && offset < l.bulk_hi;
  const bool with_flag = flag_offset != kNoFlag;
  if (!ctx_.layout.may_write(ctx_.rank, peer, offset, len) ||
      (with_flag && (!ctx_.layout.may_flag(ctx_.rank, peer, flag_offset) || flag_offset < l.inbox_lo ||
                     flag_offset + 8 > l.inbox_hi)) ||
      (bulk ? len > l.bulk_hi - offset : (offset < l.inbox_lo || len > l.inbox_hi - offset)))
    return labelled(strf("jax_arx: verbs put() to %s: %llu bytes at offset %llu and a flag at %llu do not lie inside "
                         "this rank's slots of its inbox",
                         l.remote.c_str(), (unsigned long long)len, (unsigned long long)offset,
                         (unsigned long long)flag_offset));
  const uint32_t data_rkey = bulk ? l.bulk_rkey : l.rkey;
  // The flag goes inline: the NIC driver copies it into the WQE inside
  // ibv_post_send, so this local only has to live until the post returns.
  uint64_t flag = flag_value;
  ibv_sge sge[kChain];
  ibv_send_wr wr[kChain];
  uint64_t sent = 0;
  for (;;) {
    int k = 0;
    while (sent < len && k < kChain - 1) {
      const uint64_t n = std::min(chunk_, len - sent);
      sge[k] = ibv_sge{(uint64_t)(uintptr_t)(s + sent), (uint32_t)n, local_mr_[root]->lkey};
      wr[k] = ibv_send_wr{};
      wr[k].opcode = IBV_WR_RDMA_WRITE;
      wr[k].wr.rdma.remote_addr = l.remote_base + offset + sent;
      wr[k].wr.rdma.rkey = data_rkey;
      sent += n;
      ++k;
    }
    const bool last = sent == len;
    if (last && with_flag) {
      sge[k] = ibv_sge{(uint64_t)(uintptr_t)&flag, 8, 0};
      wr[k] = ibv_send_wr{};
      wr[k].opcode = IBV_WR_RDMA_WRITE;
      wr[k].send_flags = IBV_SEND_INLINE;
      wr[k].wr.rdma.remote_addr = l.remote_base + flag_offset;
      wr[k].wr.rdma.rkey = l.rkey;
      ++k;
    }
    if (k == 0) return Status::Ok();  // nothing to write, and no flag
    ARX_RETURN_IF_ERROR(make_room(l, peer, root, (uint64_t)k));
    for (int i = 0; i < k; ++i) {
      wr[i].sg_list = &sge[i];
      wr[i].num_sge = 1;
      wr[i].next = i + 1 < k ? &wr[i + 1] : nullptr;
      // wr_id: the WR's number on this QP, and whether it is the flag.
      wr[i].wr_id = ++l.posted << 1 | (last && with_flag && i == k - 1);
      if (++l.unsignalled >= signal_every_) {
        wr[i].send_flags |= IBV_SEND_SIGNALED;
        l.unsignalled = 0;
      }
    }
    ibv_send_wr* bad = nullptr;
    errno = 0;
    if (const int rc = ibv_post_send(l.qp, wr, &bad))
      return fail(strf("jax_arx: ibv_post_send to %s over root %d (%s, QP 0x%x) failed: %s",
                       l.remote.c_str(), root, where(root).c_str(), l.qp->qp_num, verbs::error_text(rc).c_str()));
    if (last) return Status::Ok();
  }
}

void VerbsTransport::reap() {
  for (int r = 0; r < roots(); ++r) {
    ibv_wc wc[32];
    int n;
    do {
      n = ibv_poll_cq(cq_[r], 32, wc);
      if (n < 0) {
        fail(strf("jax_arx: ibv_poll_cq on %s failed (%d)", where(r).c_str(), n));
        return;
      }
      for (int i = 0; i < n; ++i) {
        int peer = -1;
        for (int j = 0; j < ctx_.world && peer < 0; ++j)
          if (links_[j][r].qp && links_[j][r].qp->qp_num == wc[i].qp_num) peer = j;
        if (peer < 0) continue;  // not ours: cannot happen with one CQ per carrier and device
        if (wc[i].status == IBV_WC_SUCCESS) {
          // Completions of one QP arrive in order: this retires every WR up to it.
          Link& l = links_[peer][r];
          l.completed = std::max(l.completed, wc[i].wr_id >> 1);
        } else {
          completion_error(peer, r, wc[i]);
        }
      }
    } while (n == 32);
  }
}

void VerbsTransport::completion_error(int peer, int root, const ibv_wc& wc) {
  Link& l = links_[peer][root];
  // After a QP's first failure, the rest of its queue is flushed: those say nothing new.
  if (l.failed && wc.status == IBV_WC_WR_FLUSH_ERR) return;
  l.failed = true;
  const double try_ms = 4.096e-3 * (double)(1ull << timeout_);
  const std::string why = strf(
      "the RDMA write to %s over root %d (%s, QP 0x%x) failed: %s (status %d, opcode %d, vendor_err 0x%x, the %s write "
      "of WR %llu; QP timeout %.0f ms x %d tries): %s",
      l.remote.c_str(), root, where(root).c_str(), l.qp->qp_num, api_.wc_status_str(wc.status), (int)wc.status,
      (int)wc.opcode, wc.vendor_err, (wc.wr_id & 1) ? "flag" : "data", (unsigned long long)(wc.wr_id >> 1), try_ms,
      retry_cnt_ + 1, completion_hint(wc.status));
  fail("jax_arx: " + why);
  report_lost(peer, why);
}

void VerbsTransport::report_lost(int peer, const std::string& why) {
  if (lost_ >> peer & 1) return;
  lost_ |= 1u << peer;
  if (ctx_.on_peer_lost) ctx_.on_peer_lost(peer, why);
}

void VerbsTransport::close() {
  if (closed_) return;
  closed_ = true;
  connected_ = false;
  for (auto& per_peer : links_)
    for (Link& l : per_peer)
      if (l.qp) {
        api_.destroy_qp(l.qp);
        l.qp = nullptr;
      }
  for (int r = 0; r < kRoots; ++r) {
    if (inbox_mr_[r]) api_.dereg_mr(inbox_mr_[r]);
    if (bulk_mr_[r]) api_.dereg_mr(bulk_mr_[r]);
    if (local_mr_[r]) api_.dereg_mr(local_mr_[r]);
    if (cq_[r]) api_.destroy_cq(cq_[r]);
    if (pd_[r]) api_.dealloc_pd(pd_[r]);
    inbox_mr_[r] = bulk_mr_[r] = local_mr_[r] = nullptr;
    cq_[r] = nullptr;
    pd_[r] = nullptr;
  }
  verbs::close_devices(api_, devices_);
}

}  // namespace

Status make_verbs_transport(const TransportContext& ctx, std::unique_ptr<Transport>& out) {
  const Api* api = nullptr;
  const Status loaded = verbs::load(ctx.config ? ctx.config->ibverbs_lib : std::string(), api);
  if (!loaded.ok()) return Status::Error(loaded.message() + strf(" (%s)", ctx.label.c_str()));
  auto t = std::make_unique<VerbsTransport>(ctx, *api);
  ARX_RETURN_IF_ERROR(t->open());  // on error, t's destructor releases what open() made
  out = std::move(t);
  return Status::Ok();
}

}  // namespace arx

#else  // !ARX_HAVE_VERBS

namespace arx {

Status make_verbs_transport(const TransportContext& /*ctx*/, std::unique_ptr<Transport>& /*out*/) {
  return Status::Error(
      "jax_arx: this build has no verbs carrier: it was compiled without rdma-core's headers (infiniband/verbs.h). "
      "Install libibverbs-dev (Debian/Ubuntu) or rdma-core-devel (RHEL) and rebuild, or set JAX_ARX_TRANSPORT=tcp");
}

}  // namespace arx

#endif  // ARX_HAVE_VERBS

// The verbs carrier's set-up: devices, memory windows, queue pairs, and the
// probe of every link (the design is in verbs_carrier.h).
#include "transport/verbs_carrier.h"

#if ARX_HAVE_VERBS

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace arx {
namespace {

// A queue-pair setting from Config, checked again here: Config::parse
// checks what Python hands over, but C++ callers fill Config in directly.
Status knob(const char* name, const char* var, int64_t v, int64_t lo, int64_t hi, int& out) {
  if (v < lo || v > hi)
    return Status::Error(strf("jax_arx: %s=%lld (%s) is not an integer in [%lld, %lld]", name, (long long)v, var,
                              (long long)lo, (long long)hi));
  out = (int)v;
  return Status::Ok();
}

const char* kMemlockHint =
    "registering pins the memory: raise the locked-memory limit (ulimit -l unlimited; docker: --ulimit "
    "memlock=-1; systemd: LimitMEMLOCK=infinity)";

}  // namespace

int VerbsTransport::slot_to(int peer) const {
  if (peer < 0 || peer >= ctx_.world || peer == ctx_.rank) return -1;
  if (!ring_) return peer;
  const Topology& t = ctx_.layout.topo;
  return peer == t.next(ctx_.rank) ? 1 : peer == t.prev(ctx_.rank) ? 0 : -1;
}

std::string VerbsTransport::where(int dev) const {
  const std::string d = verbs::describe(devices_[dev]);
  if (!ring_ || roots_ == 0) return d;
  const int slot = dev / roots_;
  return strf("%s, the port facing %s (rank %d)", d.c_str(), slot ? "next" : "prev", peer_of(slot));
}

// In a ring the devices say which port faces which neighbour, which no
// device can tell: they must be listed, the port facing prev first.
Status VerbsTransport::check_device_list(const std::string& hca) const {
  if (!ring_) return Status::Ok();
  std::vector<verbs::HcaSpec> specs;
  ARX_RETURN_IF_ERROR(verbs::parse_hca_list(hca, specs, kMaxDevices));
  if (specs.size() == 2 || specs.size() == (size_t)kMaxDevices) return Status::Ok();
  const Topology& t = ctx_.layout.topo;
  const int prev = t.prev(ctx_.rank), next = t.next(ctx_.rank);
  const std::string what = specs.empty() ? std::string("JAX_ARX_IB_HCA names no device")
                                         : strf("JAX_ARX_IB_HCA=%s lists %zu device%s", hca.c_str(), specs.size(),
                                                specs.size() == 1 ? "" : "s");
  return Status::Error(
      strf("jax_arx: %s; in a ring (JAX_ARX_TOPOLOGY=ring) rank %d lists the port facing the previous rank (rank %d), "
           "then the port facing the next rank (rank %d), each as its two functions (root 0, root 1): four devices, "
           "e.g. JAX_ARX_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3 where mlx5_0 and mlx5_1 are the port cabled to rank %d; "
           "or one device per port, two in all",
           what.c_str(), ctx_.rank, prev, next, prev));
}

Status VerbsTransport::open() {
  const Layout& lay = ctx_.layout;
  Region* region = ctx_.region;
  if (!region || !ctx_.config || ctx_.world < 1 || ctx_.world > kMaxWorld || ctx_.rank < 0 || ctx_.rank >= ctx_.world ||
      lay.total > region->size() || lay.world != ctx_.world)
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
  Status st = check_device_list(cfg.ib_hca);
  if (st.ok())
    st = verbs::open_devices(api_, cfg.ib_hca, cfg.ib_gid_index, ring_ ? kMaxDevices : kRoots, devices_, note_);
  if (!st.ok()) return labelled(st.message());
  roots_ = ring_ ? (int)devices_.size() / 2 : (int)devices_.size();

  wire_.magic = kWireMagic;
  wire_.version = kWireVersion;
  wire_.rank = ctx_.rank;
  wire_.world = ctx_.world;
  wire_.roots = roots_;
  wire_.ring = ring_;
  wire_.region_addr = (uint64_t)(uintptr_t)region->base();
  wire_.region_bytes = region->size();
  wire_.inbox_lo = lay.inbox_lo();
  wire_.inbox_hi = lay.inbox_hi();
  wire_.bulk_lo = lay.bulk_inbox_lo();
  wire_.bulk_hi = lay.bulk_inbox_hi();
  wire_.relay_lo = lay.relay_lo();
  wire_.relay_hi = lay.relay_hi();
  for (const verbs::Device& d : devices_) {
    sq_depth_ = std::min<uint64_t>(sq_depth_, (uint64_t)d.attr.max_qp_wr);
    chunk_ = std::min<uint64_t>(chunk_, d.port_attr.max_msg_sz ? d.port_attr.max_msg_sz : kMaxChunk);
  }
  if (sq_depth_ < 4 * kChain)
    return labelled(strf("jax_arx: %s allows only %llu WRs per queue pair; the verbs carrier needs %d",
                         where(0).c_str(), (unsigned long long)sq_depth_, 4 * kChain));
  signal_every_ = sq_depth_ / 4;
  for (int d = 0; d < (int)devices_.size(); ++d) ARX_RETURN_IF_ERROR(open_device_memory(d));
  for (int s = 0; s < slots(); ++s)
    for (int r = 0; in_use(s) && r < roots_; ++r) ARX_RETURN_IF_ERROR(create_link(s, r));
  if (cfg.verbose) {
    std::string devs;
    for (int d = 0; d < (int)devices_.size(); ++d) devs += (d ? "; " : "") + where(d);
    fprintf(stderr, "jax_arx verbs: %s: %d root%s: %s; QP timeout %d, retry %d%s%s\n", ctx_.label.c_str(), roots_,
            roots_ == 1 ? "" : "s", devs.c_str(), timeout_, retry_cnt_, note_.empty() ? "" : "; ", note_.c_str());
  }
  return Status::Ok();
}

// Device `dev`'s PD, CQ and memory windows, and its entry in the details.
Status VerbsTransport::open_device_memory(int dev) {
  const Layout& lay = ctx_.layout;
  Region* region = ctx_.region;
  verbs::Device& d = devices_[dev];
  const int local = IBV_ACCESS_LOCAL_WRITE, remote = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  errno = 0;
  if (!(pd_[dev] = api_.alloc_pd(d.ctx)))
    return labelled(strf("jax_arx: ibv_alloc_pd on %s failed: %s", where(dev).c_str(), verbs::error_text(-1).c_str()));
  errno = 0;
  if (!(local_mr_[dev] = api_.reg_mr(pd_[dev], region->base(), region->size(), local)))
    return labelled(strf("jax_arx: ibv_reg_mr of the endpoint's %llu bytes on %s failed: %s; %s",
                         (unsigned long long)region->size(), where(dev).c_str(), verbs::error_text(-1).c_str(),
                         kMemlockHint));
  // The windows that peers may write (layout.h). Everything else is this
  // rank's alone, and the NIC itself refuses a remote write there.
  struct Window {
    const char* what;
    uint64_t lo, hi;
    ibv_mr** mr;
  };
  const Window windows[] = {{"the inbox", lay.inbox_lo(), lay.inbox_hi(), &inbox_mr_[dev]},
                            {"the bulk inbox", lay.bulk_inbox_lo(), lay.bulk_inbox_hi(), &bulk_mr_[dev]},
                            {"the relay area", lay.relay_lo(), lay.relay_hi(), &relay_mr_[dev]}};
  for (const Window& w : windows) {
    if (w.hi <= w.lo) continue;  // none (no bulk buffers; no relays)
    errno = 0;
    if (!(*w.mr = api_.reg_mr(pd_[dev], region->base() + w.lo, w.hi - w.lo, remote)))
      return labelled(strf("jax_arx: ibv_reg_mr of %s (%llu bytes, remote write) on %s failed: %s; %s", w.what,
                           (unsigned long long)(w.hi - w.lo), where(dev).c_str(), verbs::error_text(-1).c_str(),
                           kMemlockHint));
  }
  // Every QP's WRs fit, failed ones included (they complete signalled or not).
  const uint64_t links = ring_ ? 1 : (uint64_t)(ctx_.world - 1);
  const int cqe = (int)std::min<uint64_t>(links * sq_depth_ + 64, (uint64_t)d.attr.max_cqe);
  errno = 0;
  if (!(cq_[dev] = api_.create_cq(d.ctx, cqe, nullptr, nullptr, 0)))
    return labelled(strf("jax_arx: ibv_create_cq(%d entries) on %s failed: %s", cqe, where(dev).c_str(),
                         verbs::error_text(-1).c_str()));
  Wire::Dev& w = wire_.dev[dev];
  memcpy(w.gid, d.gid.raw, 16);
  w.rkey = inbox_mr_[dev]->rkey;
  w.bulk_rkey = bulk_mr_[dev] ? bulk_mr_[dev]->rkey : 0;
  w.relay_rkey = relay_mr_[dev] ? relay_mr_[dev]->rkey : 0;
  w.mtu = d.port_attr.active_mtu;
  w.port = d.port;
  w.gid_index = d.gid_index;
  w.lid = d.port_attr.lid;
  w.ethernet = d.ethernet;
  snprintf(w.name, sizeof w.name, "%s", d.name.c_str());
  return Status::Ok();
}

Status VerbsTransport::create_link(int slot, int root) {
  const int dev = dev_of(slot, root);
  const verbs::Device& d = devices_[dev];
  Link& l = links_[slot][root];
  l.peer = peer_of(slot);
  l.dev = dev;
  ibv_qp_init_attr ia{};
  ia.send_cq = cq_[dev];
  ia.recv_cq = cq_[dev];
  ia.qp_type = IBV_QPT_RC;
  ia.sq_sig_all = 0;
  ia.cap.max_send_wr = (uint32_t)sq_depth_;
  ia.cap.max_recv_wr = 1;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  // The flag (8 bytes) goes inline, and so do the headers and small lines
  // where the device takes kInlineWanted; a device that refuses that many
  // gets the 64 bytes every RoCE device takes.
  ia.cap.max_inline_data = kInlineWanted;
  errno = 0;
  if (!(l.qp = api_.create_qp(pd_[dev], &ia))) {
    ia.cap.max_inline_data = 64;
    errno = 0;
    l.qp = api_.create_qp(pd_[dev], &ia);
  }
  if (!l.qp)
    return labelled(
        strf("jax_arx: ibv_create_qp (RC, %llu send WRs, 64 B inline) on %s for rank %d failed: %s; "
             "the device may be out of queue pairs or locked memory (ulimit -l)",
             (unsigned long long)sq_depth_, where(dev).c_str(), l.peer, verbs::error_text(-1).c_str()));
  l.inline_max = ia.cap.max_inline_data;
  if (ia.cap.max_inline_data < 8)
    return labelled(
        strf("jax_arx: %s gives queue pairs %u bytes of inline data; the verbs carrier needs 8 for "
             "its flag writes. Name another device in JAX_ARX_IB_HCA",
             where(dev).c_str(), ia.cap.max_inline_data));
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = (uint8_t)d.port;
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
  ARX_RETURN_IF_ERROR(modify(l, a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "RESET->INIT",
                             "JAX_ARX_IB_HCA (another device or port)"));
  wire_.qpn[slot][root] = l.qp->qp_num;
  return Status::Ok();
}

Status VerbsTransport::modify(Link& l, ibv_qp_attr& a, int mask, const char* transition, const char* hint) {
  errno = 0;
  const int rc = api_.modify_qp(l.qp, &a, mask);
  if (rc == 0) return Status::Ok();
  return labelled(strf("jax_arx: ibv_modify_qp %s failed: %s; here %s, QP 0x%x; peer %s%s; check %s", transition,
                       verbs::error_text(rc).c_str(), where(l.dev).c_str(), l.qp->qp_num,
                       l.remote.empty() ? strf("rank %d", l.peer).c_str() : l.remote.c_str(),
                       a.qp_state == IBV_QPS_RTR ? strf(", path MTU %d", verbs::mtu_bytes(a.path_mtu)).c_str() : "",
                       hint));
}

Status VerbsTransport::connect(const std::vector<std::string>& details, double timeout_s) {
  if (closed_) return labelled("jax_arx: verbs carrier connect() after close()");
  if (connected_) return labelled("jax_arx: verbs carrier connect() called twice");
  if ((int)details.size() != ctx_.world)
    return labelled(
        strf("jax_arx: verbs connect() got %zu ranks' details for a world of %d", details.size(), ctx_.world));
  std::vector<Wire> peers(ctx_.world);
  for (int j = 0; j < ctx_.world; ++j) {
    Wire& p = peers[j];
    if (details[j].size() != sizeof(Wire))
      return labelled(
          strf("jax_arx: rank %d's connection details are %zu bytes, not a verbs carrier's %zu: does "
               "every rank use the same carrier (JAX_ARX_TRANSPORT) and jax_arx version?",
               j, details[j].size(), sizeof(Wire)));
    memcpy(&p, details[j].data(), sizeof(Wire));
    if (p.magic != kWireMagic || p.version != kWireVersion)
      return labelled(
          strf("jax_arx: rank %d's connection details are not a verbs carrier's (magic 0x%x, version "
               "%u; expected 0x%x, %u)",
               j, p.magic, p.version, kWireMagic, kWireVersion));
    if (p.rank != j || p.world != ctx_.world)
      return labelled(strf("jax_arx: rank %d's connection details belong to rank %d of %d", j, p.rank, p.world));
    if (p.ring != wire_.ring)
      return labelled(
          strf("jax_arx: rank %d is cabled as a %s, this rank as a %s; set JAX_ARX_TOPOLOGY the same "
               "everywhere",
               j, p.ring ? "ring" : "mesh", ring_ ? "ring" : "mesh"));
    if (p.roots != roots_) {
      const int n = ring_ ? 2 : 1;
      std::string theirs, mine;
      for (int d = 0; d < p.roots * n && d < kMaxDevices; ++d) theirs += (d ? "," : "") + std::string(p.dev[d].name);
      for (const verbs::Device& d : devices_) mine += (mine.empty() ? "" : ",") + d.name;
      return labelled(
          strf("jax_arx: rank %d has %d verbs root%s (%s) and this rank has %d (%s): every rank must name "
               "as many devices in JAX_ARX_IB_HCA",
               j, p.roots, p.roots == 1 ? "" : "s", theirs.c_str(), roots_, mine.c_str()));
    }
  }
  for (int s = 0; s < slots(); ++s)
    for (int r = 0; in_use(s) && r < roots_; ++r) ARX_RETURN_IF_ERROR(bring_up(s, r, peers[peer_of(s)]));
  ARX_RETURN_IF_ERROR(probe(timeout_s));
  connected_ = true;
  // One line per endpoint: what a user checks first when RoCE is slow.
  std::string line;
  for (int d = 0; d < (int)devices_.size(); ++d) {
    int lo = 1 << 30, hi = 0;
    for (int s = 0; s < slots(); ++s)
      for (int r = 0; in_use(s) && r < roots_; ++r)
        if (links_[s][r].dev == d) {
          lo = std::min(lo, links_[s][r].path_mtu);
          hi = std::max(hi, links_[s][r].path_mtu);
        }
    line += strf("%sroot %d %s", d ? "; " : "", d % roots_, where(d).c_str());
    if (hi && lo == hi)
      line += strf(", path MTU %d", lo);
    else if (hi)
      line += strf(", path MTU %d-%d", lo, hi);
  }
  fprintf(stderr, "jax_arx verbs: %s: %s%s%s\n", ctx_.label.c_str(), line.c_str(), note_.empty() ? "" : "; ",
          note_.c_str());
  return Status::Ok();
}

// Link (slot, root) from INIT to RTS, aimed at the peer's end of it.
Status VerbsTransport::bring_up(int slot, int root, const Wire& p) {
  Link& l = links_[slot][root];
  const verbs::Device& d = devices_[l.dev];
  const Wire::Dev& pr = p.dev[remote_dev(slot, root)];
  l.remote_base = p.region_addr;
  l.inbox_lo = p.inbox_lo;
  l.inbox_hi = p.inbox_hi;
  l.bulk_lo = p.bulk_lo;
  l.bulk_hi = p.bulk_hi;
  l.relay_lo = p.relay_lo;
  l.relay_hi = p.relay_hi;
  l.rkey = pr.rkey;
  l.bulk_rkey = pr.bulk_rkey;
  l.relay_rkey = pr.relay_rkey;
  l.remote_qpn = p.qpn[remote_slot(slot)][root];
  l.remote = strf("rank %d (%s port %u, GID %s, QP 0x%x)", l.peer, pr.name, pr.port, verbs::gid_text(pr.gid).c_str(),
                  l.remote_qpn);
  if ((bool)pr.ethernet != d.ethernet)
    return labelled(
        strf("jax_arx: %s is %s but %s of %s is %s: root %d must be the same kind of link on every "
             "rank (JAX_ARX_IB_HCA)",
             where(l.dev).c_str(), d.ethernet ? "RoCE" : "InfiniBand", pr.name, l.remote.c_str(),
             pr.ethernet ? "RoCE" : "InfiniBand", root));
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
  ARX_RETURN_IF_ERROR(modify(l, a,
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
  ARX_RETURN_IF_ERROR(modify(
      l, a,
      IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC,
      "RTR->RTS", "JAX_ARX_IB_TIMEOUT and JAX_ARX_IB_RETRY_CNT"));
  if (ctx_.config->verbose)
    fprintf(stderr, "jax_arx verbs: %s: root %d %s QP 0x%x <-> %s: path MTU %d (ours %d, peer's %d), inline %u B\n",
            ctx_.label.c_str(), root, where(l.dev).c_str(), l.qp->qp_num, l.remote.c_str(), l.path_mtu,
            verbs::mtu_bytes(d.port_attr.active_mtu), verbs::mtu_bytes(pr.mtu), l.inline_max);
  return Status::Ok();
}

// One signalled write on every link, into the peer's handshake word for
// this rank (nothing reads it): its completion shows the peer's end of the
// link takes writes from this port. The peers reached connect() together
// (each waited for every rank's details), so a peer that has not reached
// RTR yet does within the QP's retries; one that never answers is cabled
// elsewhere, or the GID is wrong. The peer's own probe of this link's other
// direction is its business: each rank vouches for what it sends.
Status VerbsTransport::probe(double timeout_s) {
  static const uint64_t kProbe = 1;
  int pending = 0;
  for (int s = 0; s < slots(); ++s)
    for (int r = 0; in_use(s) && r < roots_; ++r) {
      Link& l = links_[s][r];
      ibv_sge sge{(uint64_t)(uintptr_t)&kProbe, 8, 0};
      ibv_send_wr wr{}, *bad = nullptr;
      wr.wr_id = ++l.posted << 1;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.opcode = IBV_WR_RDMA_WRITE;
      wr.send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED;
      wr.wr.rdma.remote_addr = l.remote_base + ctx_.layout.handshake_offset(ctx_.rank);
      wr.wr.rdma.rkey = l.rkey;
      errno = 0;
      if (const int rc = ibv_post_send(l.qp, &wr, &bad))
        return labelled(strf("jax_arx: ibv_post_send of the connection probe to %s over root %d (%s) failed: %s",
                             l.remote.c_str(), r, where(l.dev).c_str(), verbs::error_text(rc).c_str()));
      ++pending;
    }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(std::max(timeout_s, 1.0));
  while (pending > 0) {
    for (int d = 0; d < (int)devices_.size(); ++d) {
      ibv_wc wc[8];
      const int n = ibv_poll_cq(cq_[d], 8, wc);
      if (n < 0) return labelled(strf("jax_arx: ibv_poll_cq on %s failed (%d)", where(d).c_str(), n));
      for (int i = 0; i < n; ++i) {
        Link* l = link_of_qp(d, wc[i].qp_num);
        if (!l) continue;
        const int root = d % roots_;
        if (wc[i].status == IBV_WC_SUCCESS) {
          l->completed = wc[i].wr_id >> 1;
          --pending;
          continue;
        }
        const bool silent = wc[i].status == IBV_WC_RETRY_EXC_ERR;
        std::string fix = completion_hint(wc[i].status);
        if (silent && ring_)
          fix = strf(
              "check that this port is cabled to rank %d's port facing %s, and that JAX_ARX_IB_HCA on both "
              "ranks lists the port facing the previous rank first, then the port facing the next",
              l->peer, l->dev / roots_ ? "prev" : "next");
        return labelled(
            strf("jax_arx: no answer from %s over root %d from %s: the connection probe failed: %s "
                 "(status %d, vendor_err 0x%x; QP timeout %.0f ms x %d tries); %s%s",
                 l->remote.c_str(), root, where(d).c_str(), api_.wc_status_str(wc[i].status), (int)wc[i].status,
                 wc[i].vendor_err, 4.096e-3 * (double)(1ull << timeout_), retry_cnt_ + 1, fix.c_str(),
                 silent ? ". (A peer that reached jax_arx.initialize much later than this rank looks the "
                          "same: raise JAX_ARX_IB_TIMEOUT.)"
                        : ""));
      }
    }
    if (pending > 0 && std::chrono::steady_clock::now() > deadline)
      return labelled(
          strf("jax_arx: the connection probes of %d link%s completed neither way within %.0f s: the "
               "NIC reports nothing (JAX_ARX_TIMEOUT_S bounds this wait)",
               pending, pending == 1 ? "" : "s", timeout_s));
    sched_yield();  // the peer's set-up may need this core (2-core machines)
  }
  return Status::Ok();
}

}  // namespace arx

#endif  // ARX_HAVE_VERBS

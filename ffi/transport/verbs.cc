// The verbs carrier's data path: put, completions, close (the design is in
// verbs_carrier.h; set-up in verbs_connect.cc).
#include "transport/verbs_carrier.h"

#if ARX_HAVE_VERBS

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace arx {

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

Status VerbsTransport::make_room(Link& l, int root, uint64_t need) {
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
      const std::string why = strf(
          "the send queue to %s over root %d (%s) stayed full for %.0f s: the NIC "
          "completed none of %llu writes",
          l.remote.c_str(), root, where(l.dev).c_str(), limit_s, (unsigned long long)(l.posted - l.completed));
      report_lost(l.peer, why);
      return fail("jax_arx: " + why);
    }
    sched_yield();  // the peer's proxy may need this core (2-core machines)
  }
  return Status::Ok();
}

Status VerbsTransport::put(int peer, int root, const void* src, uint64_t offset, uint64_t len, uint64_t flag_offset,
                           uint64_t flag_value) {
  if (!error_.ok()) return error_;
  if (!connected_)
    return labelled(closed_ ? "jax_arx: verbs put() after close()" : "jax_arx: verbs put() before connect()");
  const int slot = slot_to(peer);
  if (slot < 0 || root < 0 || root >= roots_)
    return labelled(strf("jax_arx: verbs put() to rank %d over root %d: no such link (world %d, %d roots%s)", peer,
                         root, ctx_.world, roots_,
                         ring_ ? strf("; in a ring this rank reaches ranks %d and %d only",
                                      ctx_.layout.topo.prev(ctx_.rank), ctx_.layout.topo.next(ctx_.rank))
                                     .c_str()
                               : ""));
  Link& l = links_[slot][root];
  const uint8_t* s = static_cast<const uint8_t*>(src);
  const uint8_t* base = ctx_.region->base();
  const uint64_t size = ctx_.region->size();
  // A peer can only be written inside the inbox it advertised.
  if (len && (s < base || len > size || (uint64_t)(s - base) > size - len))
    return labelled(
        strf("jax_arx: verbs put() of %llu bytes from %p: the source is not inside this endpoint's "
             "region",
             (unsigned long long)len, src));
  // Only where this rank may write in the peer's region (its own slots, and
  // what it relays: every rank has the same layout), and through the window
  // (MR) that holds the place.
  const bool bulk = offset >= l.bulk_lo && offset < l.bulk_hi;
  const bool relay = !bulk && offset >= l.relay_lo && offset < l.relay_hi;
  const uint64_t hi = bulk ? l.bulk_hi : relay ? l.relay_hi : l.inbox_hi;
  const bool with_flag = flag_offset != kNoFlag;
  if (!ctx_.layout.may_write(ctx_.rank, peer, offset, len) ||
      (with_flag && (!ctx_.layout.may_flag(ctx_.rank, peer, flag_offset) || flag_offset < l.inbox_lo ||
                     flag_offset + 8 > l.inbox_hi)) ||
      (!bulk && !relay && offset < l.inbox_lo) || offset > hi || len > hi - offset)
    return labelled(
        strf("jax_arx: verbs put() to %s: %llu bytes at offset %llu and a flag at %llu do not lie inside "
             "this rank's slots of its inbox",
             l.remote.c_str(), (unsigned long long)len, (unsigned long long)offset, (unsigned long long)flag_offset));
  const uint32_t data_rkey = bulk ? l.bulk_rkey : relay ? l.relay_rkey : l.rkey;
  const uint32_t lkey = local_mr_[l.dev]->lkey;
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
      sge[k] = ibv_sge{(uint64_t)(uintptr_t)(s + sent), (uint32_t)n, lkey};
      wr[k] = ibv_send_wr{};
      wr[k].opcode = IBV_WR_RDMA_WRITE;
      // Small writes (headers, a line or two) inline: the bytes are read
      // now, by this thread, after the trigger that said they are in place.
      if (n <= l.inline_max) wr[k].send_flags = IBV_SEND_INLINE;
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
    ARX_RETURN_IF_ERROR(make_room(l, root, (uint64_t)k));
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
      return fail(strf("jax_arx: ibv_post_send to %s over root %d (%s, QP 0x%x) failed: %s", l.remote.c_str(), root,
                       where(l.dev).c_str(), l.qp->qp_num, verbs::error_text(rc).c_str()));
    if (last) return Status::Ok();
  }
}

VerbsTransport::Link* VerbsTransport::link_of_qp(int dev, uint32_t qp_num) {
  for (int s = 0; s < slots(); ++s)
    for (int r = 0; in_use(s) && r < roots_; ++r) {
      Link& l = links_[s][r];
      if (l.dev == dev && l.qp && l.qp->qp_num == qp_num) return &l;
    }
  return nullptr;  // not ours: cannot happen with one CQ per carrier and device
}

void VerbsTransport::reap() {
  for (int d = 0; d < (int)devices_.size(); ++d) {
    ibv_wc wc[32];
    int n;
    do {
      n = ibv_poll_cq(cq_[d], 32, wc);
      if (n < 0) {
        fail(strf("jax_arx: ibv_poll_cq on %s failed (%d)", where(d).c_str(), n));
        return;
      }
      for (int i = 0; i < n; ++i) {
        Link* l = link_of_qp(d, wc[i].qp_num);
        if (!l) continue;
        if (wc[i].status == IBV_WC_SUCCESS) {
          // Completions of one QP arrive in order: this retires every WR up to it.
          l->completed = std::max(l->completed, wc[i].wr_id >> 1);
        } else {
          completion_error(*l, d % roots_, wc[i]);
        }
      }
    } while (n == 32);
  }
}

void VerbsTransport::completion_error(Link& l, int root, const ibv_wc& wc) {
  // After a QP's first failure, the rest of its queue is flushed: those say nothing new.
  if (l.failed && wc.status == IBV_WC_WR_FLUSH_ERR) return;
  l.failed = true;
  const double try_ms = 4.096e-3 * (double)(1ull << timeout_);
  const std::string why = strf(
      "the RDMA write to %s over root %d (%s, QP 0x%x) failed: %s (status %d, opcode %d, vendor_err 0x%x, the %s write "
      "of WR %llu; QP timeout %.0f ms x %d tries): %s",
      l.remote.c_str(), root, where(l.dev).c_str(), l.qp->qp_num, api_.wc_status_str(wc.status), (int)wc.status,
      (int)wc.opcode, wc.vendor_err, (wc.wr_id & 1) ? "flag" : "data", (unsigned long long)(wc.wr_id >> 1), try_ms,
      retry_cnt_ + 1, completion_hint(wc.status));
  fail("jax_arx: " + why);
  report_lost(l.peer, why);
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
  for (auto& per_slot : links_)
    for (Link& l : per_slot)
      if (l.qp) {
        api_.destroy_qp(l.qp);
        l.qp = nullptr;
      }
  for (int d = 0; d < kMaxDevices; ++d) {
    for (ibv_mr** mr : {&inbox_mr_[d], &bulk_mr_[d], &relay_mr_[d], &local_mr_[d]})
      if (*mr) {
        api_.dereg_mr(*mr);
        *mr = nullptr;
      }
    if (cq_[d]) api_.destroy_cq(cq_[d]);
    if (pd_[d]) api_.dealloc_pd(pd_[d]);
    cq_[d] = nullptr;
    pd_[d] = nullptr;
  }
  verbs::close_devices(api_, devices_);
}

Status make_verbs_transport(const TransportContext& ctx, std::unique_ptr<Transport>& out) {
  const verbs::Api* api = nullptr;
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

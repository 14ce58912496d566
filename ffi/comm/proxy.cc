// The protocol's sending half (see DESIGN.md, "The protocol").
//
// The device side publishes seq after its partial is in send[seq & 1]. The
// proxy sees it and, per peer, writes the partial into the peer's
// recv[seq & 1][rank], then writes the flag word (seq, descriptor) into the
// peer's flag for (rank, root), on the same ordered channel, so the data is
// in place before the flag.
//
// The proxy posts every seq in order, never skipping one. The device side
// can publish seq + 1 before the proxy has seen seq (finishing seq needs
// only the peers' data), and skipping seq would let peers accept seq + 1's
// flag over stale seq data.
//
// Two buffers by parity are enough: a rank reaches seq + 2 only after every
// peer consumed seq + 1, which needed this rank's seq + 1 flag, which the
// proxy posts after this rank's seq data was read (written out). So when
// the device side overwrites send[seq & 1] for seq + 2, the proxy is done
// with seq; and when a peer writes our recv[seq & 1] for seq + 2, we have
// finished summing seq.
//
// Rank r sends to r+1, r+2, ... in turn, so no receiver takes every sender
// at once. Every write is split over the carrier's roots, each half
// followed by its own flag on that root.
//
// The prefill ops come in through a second input, the work ring (layout.h,
// "Prefill-sized ops"): the proxy takes its entries strictly in index
// order, each a piece to send, and sends each piece with the flag
// prefill_progress(seq, piece). Both inputs feed the same carriers; a
// turn of the loop takes at most one psum seq and one ring entry, so
// neither starves the other. Their flags are different words, so how the
// two interleave on a channel does not matter.
#include "comm/proxy.h"

#include <chrono>
#include <cstdio>
#include <string>

#include "comm/atomics.h"
#include "comm/endpoint.h"

namespace arx {
namespace {

using Clock = std::chrono::steady_clock;

// Idle backoff: the exact busy poll while there is work and for
// idle_spin_ms after it, then a nap of idle_nap_us per turn, so an idle
// communicator does not burn a core. idle_nap_us = 0 keeps spinning.
struct IdleNap {
  Clock::duration spin;
  std::chrono::microseconds nap;
  Clock::time_point last = Clock::now();
  IdleNap(int64_t spin_ms, int64_t nap_us) : spin(std::chrono::milliseconds(spin_ms)), nap(nap_us) {}
  void busy() { last = Clock::now(); }
  void idle() {
    if (nap.count() > 0 && Clock::now() - last > spin) {
      std::this_thread::sleep_for(nap);
      return;
    }
    // Yield even while spinning: on a machine with fewer cores than
    // spinning threads, a pure spin starves the very peer it waits for.
    std::this_thread::yield();
  }
};

}  // namespace

// One seq: what the device side published, sent to every peer in turn.
Status post_seq(Endpoint& ep, uint64_t seq) {
  const Layout& L = ep.layout();
  Control* ctl = ep.control();
  Transport* t = ep.transport();
  const int rank = ep.spec().rank, world = ep.spec().world, roots = t->roots(), par = (int)(seq & 1);
  // Acquired through `published`: the device side stored these first.
  const Mode mode = (Mode)load_relaxed(&ctl->mode[par]);
  const uint64_t bytes = load_relaxed(&ctl->bytes[par]);
  const uint64_t flag = flag_word(seq, load_relaxed(&ctl->desc[par]));
  const uint64_t capacity = mode == Mode::kScatter ? L.send_bytes : L.slot_bytes;
  if (bytes > capacity)
    return Status::Error(strf("jax_arx: %s published %llu bytes at seq %llu, more than its buffer holds (%llu)",
                              ep.label().c_str(), (unsigned long long)bytes, (unsigned long long)seq,
                              (unsigned long long)capacity));
  const uint8_t* send = ep.base() + L.send_offset(par);
  for (int step = 1; step < world; ++step) {
    const int peer = (rank + step) % world;
    // kFull and kGather send this rank's whole buffer; kScatter sends peer
    // j only its chunk j. Either way it lands in the peer's recv[par][rank].
    uint64_t lo = 0, hi = bytes;
    switch (mode) {
      case Mode::kFull:
      case Mode::kGather:
        break;
      case Mode::kScatter:
        chunk_range(bytes, world, peer, lo, hi);
        break;
    }
    for (int root = 0; root < roots; ++root) {
      uint64_t off, len;
      root_split(hi - lo, root, roots, off, len);
      ARX_RETURN_IF_ERROR(t->put(peer, root, send + lo + off, L.recv_offset(par, rank) + off, len,
                                 L.flag_offset(flag_index(rank, root)), flag));
    }
  }
  return Status::Ok();
}

namespace {

// The proxy's side of the work ring: how far it has taken entries, and the
// kRsPiece pieces that arrived ahead of an earlier piece of the same
// destination (producers publish in any order; peers read a flag as "every
// piece up to this one arrived", so pieces go out in order per destination).
struct WorkIntake {
  uint64_t consumed = 0;  // entries taken
  uint64_t last_seq = 0;  // seq of the last entry taken (watchdog)
  WorkItem pend[kMaxWorld][kChunks] = {};
  uint32_t pend_mask[kMaxWorld] = {};
  int next_k[kMaxWorld] = {};  // the next row piece to send to each destination
  uint64_t cur_seq[kMaxWorld] = {};
};

// Takes the next entry if its producer has published it (tag = index + 1,
// acquired: the other fields were stored before it).
bool take_work(PrefillControl* pc, WorkIntake& in, WorkItem& it) {
  WorkItem& slot = pc->ring[in.consumed % kWorkRing];
  if (load_acquire(&slot.tag) != in.consumed + 1) return false;
  it.op = load_relaxed(&slot.op);
  it.seq = load_relaxed(&slot.seq);
  it.piece = load_relaxed(&slot.piece);
  it.slice = load_relaxed(&slot.slice);
  it.lo = load_relaxed(&slot.lo);
  it.hi = load_relaxed(&slot.hi);
  it.desc = load_relaxed(&slot.desc);
  it.tag = in.consumed + 1;
  ++in.consumed;
  in.last_seq = it.seq;
  // Release: the reads above come before a producer may reuse the entry.
  store_release(&pc->consumed, in.consumed);
  return true;
}

// Bytes [lo, hi) of chunk `index` of prefill_send[seq & 1] to `peer`, into
// the same place of its prefill_recv[seq & 1] that this rank's chunk takes
// (rank * slice), split over the roots, each part followed by its flag.
Status send_piece(Endpoint& ep, int peer, const WorkItem& it, int index, uint64_t flag) {
  const Layout& L = ep.layout();
  Transport* t = ep.transport();
  const int rank = ep.spec().rank, roots = t->roots(), par = (int)(it.seq & 1);
  const uint8_t* src = ep.base() + L.prefill_send_offset(par, index, it.slice) + it.lo;
  const uint64_t dst = L.prefill_recv_offset(par, rank, it.slice) + it.lo;
  for (int root = 0; root < roots; ++root) {
    uint64_t off, len;
    root_split(it.hi - it.lo, root, roots, off, len);
    ARX_RETURN_IF_ERROR(t->put(peer, root, src + off, dst + off, len, L.flag_offset(prefill_flag_index(rank, root)),
                               flag));
  }
  return Status::Ok();
}

// One ring entry: what it asks for, to every peer it concerns.
Status post_work(Endpoint& ep, WorkIntake& in, const WorkItem& it) {
  const Layout& L = ep.layout();
  const int rank = ep.spec().rank, world = ep.spec().world;
  const bool rows = (WorkOp)it.op == WorkOp::kRsPiece;
  const uint64_t pieces = rows ? (uint64_t)world * kChunks : kChunks;
  // A bad entry is a bug of a device side; the carriers would refuse what
  // lands outside a peer's inbox, but not what reads past our own buffer.
  if (it.seq == 0 || it.piece >= pieces || it.lo > it.hi || it.hi > it.slice || it.slice > L.prefill_slot_bytes ||
      it.slice * (uint64_t)world > L.prefill_slot_bytes || it.op < 1 || it.op > 3)
    return Status::Error(strf("jax_arx: %s: work ring entry %llu is malformed (op %llu seq %llu piece %llu bytes "
                              "[%llu, %llu) of a %llu-byte chunk; prefill slot %llu bytes)",
                              ep.label().c_str(), (unsigned long long)it.tag - 1, (unsigned long long)it.op,
                              (unsigned long long)it.seq, (unsigned long long)it.piece, (unsigned long long)it.lo,
                              (unsigned long long)it.hi, (unsigned long long)it.slice,
                              (unsigned long long)L.prefill_slot_bytes));
  switch ((WorkOp)it.op) {
    case WorkOp::kAllGather:
    case WorkOp::kReduceScatter: {
      // One piece for every peer: all-gather sends this rank's slice,
      // reduce-scatter peer j's chunk.
      const uint64_t flag = flag_word(prefill_progress(it.seq, (int)it.piece), it.desc);
      const bool gather = (WorkOp)it.op == WorkOp::kAllGather;
      for (int step = 1; step < world; ++step) {
        const int peer = (rank + step) % world;
        ARX_RETURN_IF_ERROR(send_piece(ep, peer, it, gather ? rank : peer, flag));
      }
      return Status::Ok();
    }
    case WorkOp::kRsPiece:
      break;
  }
  // Row piece k of destination j's chunk.
  const int j = (int)(it.piece / kChunks), k = (int)(it.piece % kChunks);
  if (j == rank) return Status::Ok();  // this rank's own rows never leave
  if (in.cur_seq[j] != it.seq) {
    // Every piece of the destination's previous op went out before this
    // one: the producer published all of them before it finished that op,
    // and entries are taken in index order.
    if (in.cur_seq[j] != 0 && in.next_k[j] != kChunks)
      return Status::Error(strf("jax_arx: %s: prefill op %llu began before row piece %d of op %llu for rank %d was "
                                "published",
                                ep.label().c_str(), (unsigned long long)it.seq, in.next_k[j],
                                (unsigned long long)in.cur_seq[j], j));
    in.cur_seq[j] = it.seq;
    in.next_k[j] = 0;
    in.pend_mask[j] = 0;
  }
  in.pend[j][k] = it;
  in.pend_mask[j] |= 1u << k;
  while (in.next_k[j] < kChunks && (in.pend_mask[j] >> in.next_k[j] & 1)) {
    const int next = in.next_k[j]++;
    const WorkItem& p = in.pend[j][next];
    ARX_RETURN_IF_ERROR(send_piece(ep, j, p, j, flag_word(prefill_progress(p.seq, next), p.desc)));
  }
  return Status::Ok();
}

}  // namespace

void Proxy::start() {
  stop_ = false;
  // Where the inputs stand now, read before the thread exists: the device
  // side may publish as soon as connect() returns, before the new thread
  // first runs, and a seq read as "already posted" would never be sent.
  const uint64_t posted = load_acquire(&ep_.control()->published);
  const uint64_t consumed = load_acquire(&ep_.prefill_control()->consumed);
  thread_ = std::thread([this, posted, consumed] { loop(posted, consumed); });
}

void Proxy::stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void Proxy::loop(uint64_t posted, uint64_t consumed) {
  const Config& cfg = ep_.spec().config;
  Control* ctl = ep_.control();
  PrefillControl* pc = ep_.prefill_control();
  const Layout& L = ep_.layout();
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(ep_.base() + L.flags);
  const int rank = ep_.spec().rank, world = ep_.spec().world;
  IdleNap nap(cfg.idle_spin_ms, cfg.idle_nap_us);
  uint64_t last_done = load_relaxed(&ctl->done);
  WorkIntake intake;
  intake.consumed = consumed;
  uint64_t last_pdone = load_relaxed(&pc->done);
  Clock::time_point last_move = Clock::now();
  bool stall_reported = false, failure_seen = false;
  const auto stall_after = std::chrono::duration<double>(cfg.stall_report_s);
  while (!stop_.load(std::memory_order_relaxed)) {
    Status s = ep_.transport()->poll();
    if (!s.ok()) {
      ep_.fail(s.message());
      return;
    }
    bool moved = false;
    const uint64_t published = load_acquire(&ctl->published);
    if (published > posted && ep_.device_sends()) {
      // The device side sent these seqs itself: only follow them (watchdog),
      // and do not count it as work, so an idle proxy naps and leaves the
      // cores to the device side.
      posted = published;
    } else if (published > posted) {
      ++posted;  // every seq, in order
      s = post_seq(ep_, posted);
      if (!s.ok()) {
        ep_.fail(s.message());
        return;
      }
      moved = true;
    }
    WorkItem item;
    if (take_work(pc, intake, item)) {
      s = post_work(ep_, intake, item);
      if (!s.ok()) {
        ep_.fail(s.message());
        return;
      }
      moved = true;
    }
    if (moved) {
      nap.busy();
      continue;
    }
    // A failure the device side recorded (a kernel that gave up) becomes
    // the endpoint's sticky failure here, so JAX_ARX_ON_FAILURE=abort acts
    // even when no host code of ours runs (replayed CUDA graphs).
    if (!failure_seen && load_acquire(&ctl->failed_seq) != 0) {
      failure_seen = true;
      ep_.failed();
    }
    // Watchdog: published work that has not completed for stall_report_s is
    // a stall, and so is a peer whose flags are ahead of what this rank
    // posted. With JAX_ARX_DEBUG, print what this rank sent and what it
    // heard from each peer (a stall is no failure: a peer may be compiling;
    // the failure, if it comes, carries its own message in words).
    // Prefill ops alike: an op whose pieces were taken but that has not
    // finished, or a peer whose prefill flags are past the last op taken.
    const uint64_t done = load_relaxed(&ctl->done);
    const uint64_t pdone = load_relaxed(&pc->done);
    bool behind = false;
    for (int j = 0; j < world; ++j)
      if (j != rank) {
        behind |= flag_progress(load_relaxed(&flags[flag_index(j, 0)])) > posted;
        behind |= flag_progress(load_relaxed(&flags[prefill_flag_index(j, 0)])) >
                  prefill_progress(intake.last_seq, kChunks - 1);
      }
    const auto now = Clock::now();
    if (done != last_done || pdone != last_pdone || (done >= posted && pdone >= intake.last_seq && !behind)) {
      last_done = done;
      last_pdone = pdone;
      last_move = now;
      stall_reported = false;
    } else if (!stall_reported && cfg.verbose && now - last_move > stall_after) {
      stall_reported = true;
      std::string msg = strf("jax_arx %s (JAX_ARX_DEBUG): no progress for %g s; counters: psum calls published "
                             "%llu posted %llu done %llu; prefill ops taken up to #%llu, "
                             "done %llu; last from each peer (psum seq, prefill op#piece):",
                             ep_.label().c_str(), cfg.stall_report_s, (unsigned long long)published,
                             (unsigned long long)posted,
                             (unsigned long long)done, (unsigned long long)intake.last_seq,
                             (unsigned long long)pdone);
      for (int j = 0; j < world; ++j) {
        if (j == rank) continue;
        msg += strf(" r%d=", j);
        for (int r = 0; r < ep_.roots(); ++r)
          msg += strf("%s%llu", r ? "/" : "",
                      (unsigned long long)flag_progress(load_relaxed(&flags[flag_index(j, r)])));
        for (int r = 0; r < ep_.roots(); ++r) {
          const uint64_t p = flag_progress(load_relaxed(&flags[prefill_flag_index(j, r)]));
          msg += strf("%s%llu#%llu", r ? "/" : ",", (unsigned long long)(p ? (p - 1) / 16 : 0),
                      (unsigned long long)(p ? (p - 1) % 16 : 0));
        }
      }
      fprintf(stderr, "%s\n", msg.c_str());
    }
    nap.idle();
  }
}

}  // namespace arx

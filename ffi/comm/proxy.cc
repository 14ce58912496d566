#include "comm/proxy.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "base/atomics.h"
#include "comm/endpoint.h"
#include "comm/relay.h"

namespace arx {
namespace {

using Clock = std::chrono::steady_clock;

// Idle backoff: the exact busy poll while there is work and for
// idle_spin_ms after it, then a nap of idle_nap_us per turn, so an idle
// communicator does not burn a core. idle_nap_us = 0 keeps spinning.
//
// The bell (Proxy::wake): a device side rings it as a collective begins, so
// a napping proxy wakes then, not up to a nap later, and spins through the
// collective and idle_spin_ms after it. No wake is lost: a ring after the
// proxy's last look at the bell either changes it before the futex wait
// (which then returns at once) or finds `asleep` set (and wakes the wait);
// and were one lost, the nap still ends in idle_nap_us. The ring comes as
// the collective begins, before its first trigger (the device side copies
// first): so after a ring the proxy does not nap again until it has taken
// work, or kRungSpin has passed, whatever idle_spin_ms says (with 0 it
// would wake, find nothing yet, and nap through the collective). The bell
// is heard at the top of every turn, before the ring is looked at: a ring
// heard only after its collective's work was taken (a proxy woken from a
// nap finds the triggers already there) would keep it spinning kRungSpin
// for work that has come and gone, on every collective whose ring found it
// asleep.
struct IdleNap {
  // Far longer than a collective takes from its beginning to its first
  // trigger, on a loaded host or under ThreadSanitizer.
  static constexpr Clock::duration kRungSpin = std::chrono::milliseconds(500);
  Clock::duration spin;
  std::chrono::microseconds nap;
  std::atomic<uint32_t>& bell;
  std::atomic<bool>& asleep;
  Clock::time_point last = Clock::now();
  Clock::time_point rung{};  // the last ring not yet followed by work
  uint32_t heard;            // the bell's value at the last look
  IdleNap(int64_t spin_ms, int64_t nap_us, std::atomic<uint32_t>& b, std::atomic<bool>& a)
      : spin(std::chrono::milliseconds(spin_ms)), nap(nap_us), bell(b), asleep(a), heard(b.load()) {}
  // Each turn, before the trigger ring is looked at.
  void hear() {
    const uint32_t b = bell.load();
    if (b != heard) {
      heard = b;
      last = rung = Clock::now();
    }
  }
  void busy() {
    last = Clock::now();
    rung = {};
  }
  // Idle past idle_spin_ms, and past kRungSpin since an unanswered ring.
  bool drowsy(Clock::time_point now) const { return now - last > spin && now - rung > kRungSpin; }
  void idle() {
    if (nap.count() > 0 && drowsy(Clock::now())) {
      // Against `heard`: a ring since this turn's hear() fails the wait at
      // once, and the next turn hears it.
      asleep.store(true);
      const timespec ts{(time_t)(nap.count() / 1000000), (long)(nap.count() % 1000000) * 1000};
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&bell), FUTEX_WAIT_PRIVATE, heard, &ts, nullptr, 0);
      asleep.store(false, std::memory_order_relaxed);
      return;
    }
    // Yield even while spinning: on a machine with fewer cores than
    // spinning threads, a pure spin starves the very peer it waits for.
    std::this_thread::yield();
  }
};

// Takes entry `consumed` if its producer has published it (tag = index + 1,
// acquired: the other fields were stored before it).
bool take(Control* ctl, Trigger* ring, uint64_t& consumed, Trigger& t) {
  Trigger& slot = ring[consumed % kRing];
  if (load_acquire(&slot.tag) != consumed + 1) return false;
  t.src = load_relaxed(&slot.src);
  t.len = load_relaxed(&slot.len);
  t.dst = load_relaxed(&slot.dst);
  t.flag = load_relaxed(&slot.flag);
  t.value = load_relaxed(&slot.value);
  t.dest = load_relaxed(&slot.dest);
  t.family = load_relaxed(&slot.family);
  t.tag = consumed + 1;
  ++consumed;
  // Release: the reads above come before a producer may reuse the entry.
  store_release(&ctl->ring_consumed, consumed);
  return true;
}

// One entry: its bytes to every peer it names, in send order, each root's
// part followed by its flag word; to a peer with no link (a ring of 4),
// through the relay (comm/relay.h).
Status post(Endpoint& ep, Relay& relay, const Trigger& t) {
  const Layout& L = ep.layout();
  Transport* carrier = ep.transport();
  const int rank = ep.spec().rank, world = ep.spec().world, roots = carrier->roots();
  // A bad entry is a bug of a device side. The carriers refuse what would
  // land outside this rank's slots of a peer's inbox; the source must lie in
  // one of this rank's staging buffers.
  const bool in_send =
      t.src >= L.send && t.src <= L.send + 2 * L.send_bytes && t.len <= L.send + 2 * L.send_bytes - t.src;
  const uint64_t bulk_end = L.bulk_send + 2 * (uint64_t)world * L.bulk_lane;
  const bool in_bulk = t.src >= L.bulk_send && t.src <= bulk_end && t.len <= bulk_end - t.src;
  if (!(in_send || in_bulk) || (t.dest != kEveryPeer && (t.dest >= (uint64_t)world || t.dest == (uint64_t)rank)) ||
      (t.family & ~kTriggerHeader) >= (uint64_t)kFamilies)
    return Status::Error(strf("jax_arx: %s: trigger %llu is malformed (%llu bytes at %llu to rank %lld, family %llu)",
                              ep.label().c_str(), (unsigned long long)t.tag - 1, (unsigned long long)t.len,
                              (unsigned long long)t.src, (long long)t.dest, (unsigned long long)t.family));
  const int n = t.dest == kEveryPeer ? world - 1 : 1;
  const Family family = (Family)(t.family & 0xff);
  const int par = (int)(flag_seq(t.value) & 1);
  // The staged header, copied into the proxy's own slot (layout.h,
  // proxy_header_offset) with atomic loads and stores. Its last put is read
  // out (a NIC's read may come later) before the same slot is written for
  // seq + 2, by the staging buffer's argument (comm/channel.h).
  uint8_t* header = ep.base() + L.proxy_header_offset(family, par);
  if (t.family & kTriggerHeader) {
    const uint64_t* staged = reinterpret_cast<const uint64_t*>(ep.base() + L.staged_header_offset(family, par));
    for (int i = 0; i < kDescriptorWords; ++i)
      store_relaxed(reinterpret_cast<uint64_t*>(header) + i, load_relaxed(staged + i));
  }
  for (int i = 0; i < n; ++i) {
    const int peer = peer_in_send_order(rank, world, t.dest, i);
    if (!L.topo.linked(rank, peer)) {
      // A relay forwards out of the next rank's inbox, whose LL lines that
      // rank zeroes once it has read them: lines are never relayed (the plan
      // runs no LL through a relay).
      if (t.flag == kTriggerNoFlag)
        return Status::Error(
            strf("jax_arx: %s: trigger %llu puts LL lines to rank %d, which this rank reaches only "
                 "through a relay; a bug of jax_arx's plan, please report it",
                 ep.label().c_str(), (unsigned long long)t.tag - 1, peer));
      if (t.family & kTriggerHeader) ARX_RETURN_IF_ERROR(relay.header(t, peer, header));
      for (int root = 0; root < roots; ++root) {
        uint64_t off, len;
        root_split(t.len, root, roots, off, len);
        ARX_RETURN_IF_ERROR(relay.data(t, peer, root, off, len));
      }
      continue;
    }
    // The exact Descriptor first, on root 0: the piece's flag on that root
    // comes after it on the same ordered channel (base/words.h, "Headers").
    if (t.family & kTriggerHeader)
      ARX_RETURN_IF_ERROR(carrier->put(peer, 0, header, L.flag_offset(header_word(family, par, rank)),
                                       8 * kDescriptorWords, kNoFlag, 0));
    for (int root = 0; root < roots; ++root) {
      uint64_t off, len;
      root_split(t.len, root, roots, off, len);
      ARX_RETURN_IF_ERROR(carrier->put(peer, root, ep.base() + t.src + off, t.dst + off, len,
                                       t.flag == kTriggerNoFlag ? kNoFlag : L.flag_offset((int)t.flag + root),
                                       t.value));
    }
  }
  return Status::Ok();
}

// Watchdog: a collective under way (begun past done) that has not finished
// for stall_report_s, or a peer ahead of this rank (it sent a seq this rank
// has not begun), is a stall: say so once, in words, with what each peer
// last sent. Slow peers (one still compiling) are the usual cause; a stall
// that lasts past the timeout fails the collective.
class Watchdog {
 public:
  explicit Watchdog(Endpoint& ep)
      : ep_(ep),
        after_(std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(ep.spec().config.stall_report_s))) {
    read(begun_, done_);
  }

  // Looks at most every few milliseconds (words of peers, over the bus:
  // not every turn); true when it looked.
  bool look() {
    const auto now = Clock::now();
    if (now - last_look_ < std::chrono::milliseconds(5)) return false;
    last_look_ = now;
    uint64_t begun[kFamilies], done[kFamilies];
    read(begun, done);
    bool idle = true, moved = false;
    for (int f = 0; f < kFamilies; ++f) {
      moved |= done[f] != done_[f] || begun[f] != begun_[f];
      idle &= begun[f] <= done[f];
      begun_[f] = begun[f];
      done_[f] = done[f];
    }
    if (moved || idle) {
      last_move_ = now;
      reported_ = false;
      return true;
    }
    if (reported_ || now - last_move_ < after_) return true;
    reported_ = true;
    // A stall is no failure (a peer may still be compiling); if it becomes
    // one, the failure says so in its own message. The report is kept for
    // jax_arx.stats(), and printed with JAX_ARX_DEBUG only.
    const std::string report = strf(
        "jax_arx: %s: no progress for %.0f s: psum #%llu and bulk collective #%llu began, #%llu and #%llu "
        "finished. Last heard from each peer:%s. Waiting for the peers (one may be slow to start, stopped, "
        "or issuing other collectives); the collective fails after JAX_ARX_TIMEOUT_S=%g s",
        ep_.label().c_str(), std::chrono::duration<double>(now - last_move_).count(), (unsigned long long)begun[0],
        (unsigned long long)begun[1], (unsigned long long)done[0], (unsigned long long)done[1],
        ep_.heard_from_peers().c_str(), ep_.spec().config.timeout_s);
    ep_.note_stall(report);
    if (ep_.spec().config.verbose) fprintf(stderr, "%s\n", report.c_str());
    return true;
  }

 private:
  void read(uint64_t* begun, uint64_t* done) const {
    const Control* ctl = ep_.control();
    for (int f = 0; f < kFamilies; ++f) {
      begun[f] = load_relaxed(&ctl->begun[f]);
      done[f] = load_relaxed(&ctl->done[f]);
    }
  }
  Endpoint& ep_;
  const Clock::duration after_;
  uint64_t begun_[kFamilies] = {}, done_[kFamilies] = {};
  Clock::time_point last_move_ = Clock::now(), last_look_ = Clock::now();
  bool reported_ = false;
};

// Notices. A collective must complete everywhere or fail everywhere: a
// rank whose wait gave up (a peer stopped past the timeout, say) tells every
// peer, and a peer that has not finished that collective yet fails it too
// instead of completing it later with the data it got. The notice is a flag
// word of the failing rank's own (base/words.h, notice_word), put through the
// carrier, best effort (a broken link takes none); each proxy looks at its
// peers' notice words and turns one into its endpoint's failure, which
// aborts every wait. A peer that had finished the collective before the
// notice arrived fails at its next one: agreement on the outcome of the
// very collective would need one more round trip on every call. The
// notice's descriptor carries the family and why the wait gave up, so that
// every rank's error names the same cause (a mismatch, a timeout). A rank
// that failed because of a peer's notice passes that notice's cause on
// (`forwarded`): its own waits only saw the abort, and a third rank must not
// learn a vaguer cause from it than from the rank that found it. Likewise a
// rank that failed because it lost a peer (its link closed) says which: the
// rank that is gone, not this one, is what every rank's error must name.
void send_notices(Endpoint& ep, Relay& relay, uint64_t forwarded) {
  const Control* ctl = ep.control();
  const uint64_t seq = load_acquire(&ctl->failed_seq);
  // Bits 16-23: the ranks the cause names (a mask of kMaxWorld = 8 bits):
  // for a timeout, those the wait was still missing; for a lost peer, those
  // lost.
  static_assert(kMaxWorld <= 8, "the notice's rank mask has 8 bits");
  const uint64_t kind = seq ? load_relaxed(&ctl->failed_kind) : (uint64_t)FailureKind::kNone;
  const uint64_t lost = ep.lost_peers() & 0xff;
  const bool peer_lost = lost && (kind == (uint64_t)FailureKind::kNone || kind == (uint64_t)FailureKind::kAborted);
  const uint64_t family = seq ? load_relaxed(&ctl->failed_family) + 1 : 0;
  const uint64_t desc = peer_lost ? family | (uint64_t)FailureKind::kPeerLost << 8 | lost << 16
                        : seq     ? family | kind << 8 | (load_relaxed(&ctl->failed_missing) & 0xff) << 16
                                  : 0;
  const uint64_t value = forwarded ? forwarded : flag_word(seq ? seq : 1, desc);
  const Layout& L = ep.layout();
  const int rank = ep.spec().rank;
  for (int j = 0; j < ep.spec().world; ++j) {
    if (j == rank) continue;
    if (L.topo.linked(rank, j))
      ep.transport()->put(j, 0, ep.base() + L.recv_offset(0, rank), L.recv_offset(0, rank), 0,
                          L.flag_offset(notice_word(rank)), value);
    else
      relay.notice(j, L.flag_offset(notice_word(rank)), value);
  }
}

FailureKind notice_kind(uint64_t value) { return static_cast<FailureKind>(flag_desc(value) >> 8 & 0xff); }

// The peers' notice to act on, or 0 (`from`: its sender): one that names a
// cause (a mismatch, a timeout, a lost peer) before one that does not.
uint64_t notice_from_peers(const Endpoint& ep, int& from) {
  uint64_t best = 0;
  for (int j = 0; j < ep.spec().world; ++j) {
    if (j == ep.spec().rank) continue;
    const uint64_t v = load_acquire(ep.flags() + notice_word(j));
    if (v == 0) continue;
    const FailureKind k = notice_kind(v);
    const bool names_cause = k == FailureKind::kMismatch || k == FailureKind::kTimeout || k == FailureKind::kPeerLost;
    if (best == 0 || names_cause) {
      best = v;
      from = j;
      if (names_cause) break;
    }
  }
  return best;
}

// The ranks a notice's mask names: "rank 2", "ranks 1, 2" or "a peer" (a
// notice without the mask).
std::string waited_for(uint64_t v) {
  const uint64_t missing = flag_desc(v) >> 16 & 0xff;
  std::string who;
  for (int j = 0; j < kMaxWorld; ++j)
    if (missing >> j & 1) who += strf("%s%d", who.empty() ? "" : ", ", j);
  if (who.empty()) return "a peer";
  return strf("%s %s", who.find(',') == std::string::npos ? "rank" : "ranks", who.c_str());
}

// A peer's notice as a failure message. It keeps the words
// errors.classify() reads ("issued a different collective", "timed out
// after"), so every rank raises the same class.
std::string notice_message(const Endpoint& ep, int from, uint64_t v) {
  const uint64_t family = flag_desc(v) & 0xff;
  const FailureKind kind = notice_kind(v);
  const std::string what = strf("%s #%llu",
                                family == 2   ? "bulk collective"
                                : family == 1 ? "psum"
                                              : "a collective",
                                (unsigned long long)flag_seq(v));
  const std::string cause =
      kind == FailureKind::kMismatch  ? strf("found that the ranks issued a different collective at %s", what.c_str())
      : kind == FailureKind::kTimeout ? strf(
                                            "gave up on %s: its wait for %s timed out after its "
                                            "JAX_ARX_TIMEOUT_S",
                                            what.c_str(), waited_for(v).c_str())
      : kind == FailureKind::kPeerLost ? strf(
                                             "lost %s (its link to it closed: the process exited or crashed) and "
                                             "gave up on %s",
                                             waited_for(v).c_str(), what.c_str())
                                       : strf("gave up on %s", what.c_str());
  return strf(
      "jax_arx: %s: rank %d %s, and said so; this rank fails it too (or, if it had finished it, the "
      "collective after it), as every rank does. Rank %d's own error (or the rank it names) says more: see "
      "its log",
      ep.label().c_str(), from, cause.c_str(), from);
}

}  // namespace

void Proxy::start() {
  stop_ = false;
  // Where the ring stands now, read before the thread exists: a device side
  // may publish as soon as connect() returns, before the new thread first
  // runs, and an entry read as "already taken" would never be sent.
  const uint64_t consumed = load_acquire(&ep_.control()->ring_consumed);
  thread_ = std::thread([this, consumed] { loop(consumed); });
}

void Proxy::wake() {
  bell_.fetch_add(1);
  if (asleep_.load())
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&bell_), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
}

void Proxy::stop() {
  stop_ = true;
  wake();  // not a nap later
  if (thread_.joinable()) thread_.join();
}

void Proxy::loop(uint64_t consumed) {
  const Config& cfg = ep_.spec().config;
  Control* ctl = ep_.control();
  Trigger* ring = reinterpret_cast<Trigger*>(ep_.base() + ep_.layout().ring);
  IdleNap nap(cfg.idle_spin_ms, cfg.idle_nap_us, bell_, asleep_);
  Watchdog watchdog(ep_);
  Relay relay(ep_);
  bool failure_seen = false;
  uint64_t forwarded = 0;  // the peer's notice this endpoint failed by, passed on
  while (!stop_.load(std::memory_order_relaxed)) {
    nap.hear();
    Status s = ep_.transport()->poll();
    Trigger t{};
    if (s.ok() && take(ctl, ring, consumed, t)) {
      if (t.family & kTriggerHeader) ARX_STAMP(ep_.trace(), t.family & 0xff, flag_seq(t.value), kTaken, trace_now());
      s = post(ep_, relay, t);
      ARX_STAMP(ep_.trace(), t.family & 0xff, flag_seq(t.value), kPosted, trace_now());
      nap.busy();
    }
    // Prev's records, every turn: relays must not wait on this rank's own
    // collectives (prev's progress may be what they wait for).
    bool relayed = false;
    if (s.ok() && !failure_seen) s = relay.forward(relayed);
    if (relayed) nap.busy();
    if (!s.ok()) {
      ep_.fail(s.message());
      send_notices(ep_, relay, forwarded);
      return;
    }
    if (t.tag || relayed) continue;
    // A failure the device side recorded (a kernel that gave up) becomes
    // the endpoint's sticky failure here, so JAX_ARX_ON_FAILURE=abort acts
    // even when no host code of ours runs (replayed CUDA graphs).
    if (!failure_seen && ep_.failed()) {
      failure_seen = true;
      if (!ep_.failed_by_partner()) send_notices(ep_, relay, forwarded);  // endpoint.h, fail_together
    }
    if (!failure_seen && watchdog.look()) {
      int from = -1;
      const uint64_t notice = notice_from_peers(ep_, from);
      if (notice) {
        forwarded = notice;
        ep_.fail(notice_message(ep_, from, notice));
      }
    }
    nap.idle();
  }
}

}  // namespace arx

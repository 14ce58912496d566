// The verbs carrier against real verbs devices (soft-RoCE in CI: see
// tests/verbs/); test_verbs_device.cc has the parts that need no device.
//
//   test_verbs_transport --hca0 rxe0 --hca1 rxe1 [--roots N] [--gid0 I --gid1 I] [--ring]
//       forks rank 1; the two ranks connect over the named devices
//       (comma-separated: two roots) and run: patterned data and flags
//       through the protocol's two parities, thousands of back-to-back puts,
//       a large put, bounds checks, then a peer that closes its carrier, a
//       peer that never connects (the connection probe fails, naming it) and
//       a peer that exits mid-stream, each of which must surface as an error
//       naming the peer, within a bounded time. --ring: the two ranks are a
//       ring of 2 (JAX_ARX_TOPOLOGY=ring), each device list the port facing
//       prev, then the port facing next (one or two devices each).
// Environment instead of flags: ARX_TEST_HCA0, ARX_TEST_HCA1.
// Prints "PASS name ..." / "FAIL name: ..." lines; exits non-zero on failure.
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "base/atomics.h"
#include "base/layout.h"
#include "transport/transport.h"
#include "transport/verbs_device.h"
#include "verbs_rig.h"

using namespace arx;
using namespace arx_test;

namespace {

// The word of psum piece 0 that `src` stores over `root` (two roots).
int flag_index(const Layout& L, int src, int root) { return psum_words(L.world, kRoots).index(src, 0, root); }

// ---- two ranks ------------------------------------------------------------------

int g_sock = -1;  // to the other rank

bool send_all(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n) {
    const ssize_t k = send(g_sock, c, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    c += k;
    n -= (size_t)k;
  }
  return true;
}
bool recv_all(void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n) {
    const ssize_t k = recv(g_sock, c, n, 0);
    if (k <= 0) return false;
    c += k;
    n -= (size_t)k;
  }
  return true;
}
bool send_str(const std::string& s) {
  const uint64_t n = s.size();
  return send_all(&n, 8) && send_all(s.data(), n);
}
bool recv_str(std::string& s) {
  uint64_t n = 0;
  if (!recv_all(&n, 8) || n > (1 << 20)) return false;
  s.resize(n);
  return recv_all(s.data(), n);
}
bool barrier() {
  char c = 'b';
  return send_all(&c, 1) && recv_all(&c, 1);
}

// Deterministic bytes that differ by sender, sequence number and position.
void pattern(uint8_t* out, uint64_t n, int src, uint64_t seq) {
  uint64_t x = 0x9E3779B97F4A7C15ull * (seq + 1) ^ (uint64_t)(src + 1) << 56;
  for (uint64_t i = 0; i < n; ++i) {
    if (i % 8 == 0) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
    }
    out[i] = (uint8_t)(x >> (8 * (i % 8)));
  }
}

bool check_pattern(const uint8_t* got, uint64_t n, int src, uint64_t seq, std::string& err) {
  std::vector<uint8_t> want(n);
  pattern(want.data(), n, src, seq);
  for (uint64_t i = 0; i < n; ++i)
    if (got[i] != want[i]) {
      err = strf("byte %llu of %llu from rank %d seq %llu is 0x%02x, expected 0x%02x", (unsigned long long)i,
                 (unsigned long long)n, src, (unsigned long long)seq, got[i], want[i]);
      return false;
    }
  return true;
}

// Waits until the flag word's progress reaches `want`'s, as the device side
// does (progress only grows), calling poll() as a proxy would. At equal
// progress the whole word must match; the peer may already be further on.
Status wait_flag(Rank& r, uint64_t off, uint64_t want, double limit_s = 30) {
  const double t0 = now_s();
  uint64_t last = 0;
  for (;;) {
    const uint64_t v = load_acquire(r.word(off));
    if (flag_seq(v) < flag_seq(last))
      return Status::Error(strf("flag at %llu went backwards: 0x%llx after 0x%llx", (unsigned long long)off,
                                (unsigned long long)v, (unsigned long long)last));
    last = v;
    if (flag_seq(v) == flag_seq(want) && v != want)
      return Status::Error(strf("flag at %llu is 0x%llx, expected 0x%llx", (unsigned long long)off,
                                (unsigned long long)v, (unsigned long long)want));
    if (flag_seq(v) >= flag_seq(want)) return Status::Ok();
    ARX_RETURN_IF_ERROR(r.t->poll());
    if (now_s() - t0 > limit_s)
      return Status::Error(strf("flag at %llu stayed 0x%llx, waiting for 0x%llx for %.0f s", (unsigned long long)off,
                                (unsigned long long)v, (unsigned long long)want, limit_s));
    sched_yield();
  }
}

// The protocol's one-shot exchange for `seq` of `bytes`: copy into
// send[parity], put to the peer split over the roots, wait for the peer's
// flags, check its data. Parity reuse is safe as the protocol proves.
Status exchange(Rank& r, int rank, int peer, uint64_t seq, uint64_t bytes) {
  const int par = seq & 1, roots = r.t->roots();
  const uint64_t word = flag_word(seq, bytes * 0x9E3779B1u);  // any descriptor; flag_word masks it
  uint8_t* send = r.at(r.layout.send_offset(par));
  pattern(send, bytes, rank, seq);
  for (int root = 0; root < roots; ++root) {
    uint64_t off, len;
    root_split(bytes, root, roots, off, len);
    ARX_RETURN_IF_ERROR(r.t->put(peer, root, send + off, r.layout.recv_offset(par, rank) + off, len,
                                 r.layout.flag_offset(flag_index(r.layout, rank, root)), word));
  }
  for (int root = 0; root < roots; ++root)
    ARX_RETURN_IF_ERROR(wait_flag(r, r.layout.flag_offset(flag_index(r.layout, peer, root)), word));
  std::string err;
  if (!check_pattern(r.at(r.layout.recv_offset(par, peer)), bytes, peer, seq, err)) return Status::Error(err);
  return Status::Ok();
}

struct Args {
  std::string hca[2];
  int roots = 0;          // expected roots(); 0: do not check
  int gid[2] = {-1, -1};  // expected discovered GID index; -1: do not check
  int burst = 5000;
  uint64_t slot_bytes = 4 << 20;
  double detect_limit_s = 15;
  bool ring = false;  // a ring of 2: device lists name the port facing prev, then next
};

// The carrier's details of rank 0 and rank 1, exchanged over the socket.
Status connect_pair(Rank& r, int rank) {
  std::string mine = r.t->details(), theirs;
  if (!send_str(mine) || !recv_str(theirs)) return Status::Error("details exchange with the other rank failed");
  std::vector<std::string> all(2);
  all[rank] = mine;
  all[1 - rank] = theirs;
  ARX_RETURN_IF_ERROR(r.t->connect(all, 30));
  if (!barrier()) return Status::Error("barrier after connect failed");
  return Status::Ok();
}

// Rank 0's side of a peer that went away: puts and polls until the carrier
// reports it; the error must name rank 1, and on_peer_lost must fire.
void expect_peer_lost(Rank& r, const std::string& name, double limit_s) {
  const double t0 = now_s();
  Status st;
  uint64_t seq = 1000000;
  while (st.ok() && now_s() - t0 < limit_s) {
    uint8_t* src = r.at(r.layout.send_offset(0));
    pattern(src, 256, 0, seq);
    st = r.t->put(1, 0, src, r.layout.recv_offset(0, 0), 256, r.layout.flag_offset(flag_index(r.layout, 0, 0)),
                  flag_word(seq++, 0));
    if (st.ok()) st = r.t->poll();
    usleep(1000);
  }
  const double dt = now_s() - t0;
  if (st.ok()) {
    failed(name, strf("no error after %.1f s of puts to a peer that is gone (a silent stall)", dt));
    return;
  }
  const Status again = r.t->poll();
  const bool names_peer = contains(st.message(), "rank 1");
  const bool sticky = again.message() == st.message();
  const bool told = r.lost_peer.load() == 1 && contains(r.lost_why, "rank 1");
  if (names_peer && sticky && told)
    pass(name, strf("detected in %.2f s: %s", dt, st.message().c_str()));
  else
    failed(name, strf("after %.2f s: names rank 1 %d, sticky %d, on_peer_lost(peer %d) %d: %s", dt, names_peer, sticky,
                      r.lost_peer.load(), told, st.message().c_str()));
}

void run_rank(int rank, const Args& a) {
  const int peer = 1 - rank;
  Rank r;
  Status st = make_rank(r, rank, 2, a.hca[rank], a.slot_bytes, -1, a.ring);
  if (!st.ok()) {
    failed("construct", st.message());
    return;
  }
  if (a.roots && r.t->roots() != a.roots)
    failed("construct", strf("roots() is %d, expected %d", r.t->roots(), a.roots));
  else
    pass("construct", strf("%s: %d root%s, details %zu bytes", a.hca[rank].c_str(), r.t->roots(),
                           r.t->roots() == 1 ? "" : "s", r.t->details().size()));
#if ARX_HAVE_VERBS
  if (a.gid[rank] >= 0) {
    // The carrier's own choice, through the same function it calls.
    const verbs::Api* api = nullptr;
    std::vector<verbs::Device> devs;
    std::string note;
    st = verbs::load("", api);
    if (st.ok()) st = verbs::open_devices(*api, a.hca[rank], -1, 4, devs, note);
    if (!st.ok())
      failed("gid-discovery", st.message());
    else if (devs[0].gid_index == a.gid[rank])
      pass("gid-discovery", "found the VM's RoCE v2 IPv4 GID: " + verbs::describe(devs[0]));
    else
      failed("gid-discovery", strf("found %s, the VM set up index %d", verbs::describe(devs[0]).c_str(), a.gid[rank]));
    if (api) verbs::close_devices(*api, devs);
  }
#endif
  // The details go through the rendezvous store, which anyone who reaches
  // the coordinator reads: no trace of the secret in them, neither itself
  // nor the 64-bit FNV-1a hash that version 2 of the details carried (an
  // oracle to guess JAX_ARX_SECRET against offline).
  {
    const std::string d = r.t->details();
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char c : std::string(kSecret)) h = (h ^ c) * 0x100000001b3ull;
    const std::string hash(reinterpret_cast<const char*>(&h), sizeof h);
    if (d.find(kSecret) == std::string::npos && d.find(hash) == std::string::npos)
      pass("details-keep-the-secret", "neither the secret nor its hash is in the details");
    else
      failed("details-keep-the-secret", "the details carry the secret or its FNV-1a hash");
  }
  // Details that are not the peer's are refused before any QP changes state.
  {
    std::vector<std::string> bad(2);
    bad[rank] = r.t->details();
    bad[peer] = "short";
    const Status size = r.t->connect(bad, 1);
    bad[peer] = r.t->details();  // this rank's own details in the peer's slot
    const Status slot = r.t->connect(bad, 1);
    const std::string who = strf("rank %d's connection details", peer);
    if (contains(size.message(), who) && contains(slot.message(), who) && contains(slot.message(), "belong to"))
      pass("bad-details", slot.message());
    else
      failed("bad-details", size.message() + " | " + slot.message());
  }
  st = connect_pair(r, rank);
  if (!st.ok()) {
    failed("connect", st.message());
    return;
  }
  pass("connect", "QPs at RTS on both ranks");

  // 1. Patterned data and flags through both parities, sizes from nothing
  // to a whole slot, odd ones included.
  const uint64_t sizes[] = {0, 8, 16, 24, 1000, 4096, 65536, 65552, 300000, a.slot_bytes};
  const int nsizes = sizeof sizes / sizeof sizes[0];
  double t0 = now_s();
  uint64_t seq = 0;
  for (int i = 0; i < 3 * nsizes && st.ok(); ++i) {
    const uint64_t bytes = sizes[i % nsizes];
    st = exchange(r, rank, peer, ++seq, bytes);
  }
  if (st.ok())
    pass("pattern", strf("%llu exchanges (0 B to %llu B, both parities) checked byte for byte in %.2f s",
                         (unsigned long long)seq, (unsigned long long)a.slot_bytes, now_s() - t0));
  else
    failed("pattern", strf("at seq %llu: %s", (unsigned long long)seq, st.message().c_str()));
  if (!barrier()) return;

  // 2. Back-to-back puts, many times the send queue's depth, without
  // waiting: each writes 64 fresh bytes (sources never reused) into one of
  // 128 places, then its flag. In-order placement means that when the last
  // flag lands, every place holds the last put aimed at it.
  if (st.ok()) {
    t0 = now_s();
    const int roots = r.t->roots();
    const uint64_t src0 = r.layout.send_offset(0), dst0 = r.layout.recv_offset(0, rank);
    const int n = a.burst;
    for (int i = 0; i < n && st.ok(); ++i) {
      const int root = i % roots;
      uint8_t* src = r.at(src0 + (uint64_t)i * 64 % (2 * a.slot_bytes));
      pattern(src, 64, rank, 50000 + i);
      st = r.t->put(peer, root, src, dst0 + (uint64_t)(i % 128) * 64, 64,
                    r.layout.flag_offset(flag_index(r.layout, rank, root) + 2), flag_word(i + 1, 7));
    }
    const double post_s = now_s() - t0;
    for (int root = 0; root < roots && st.ok(); ++root) {
      int last = n - 1;
      while (last % roots != root) --last;
      st = wait_flag(r, r.layout.flag_offset(flag_index(r.layout, peer, root) + 2), flag_word(last + 1, 7));
    }
    std::string err;
    for (int k = 0; k < 128 && st.ok(); ++k) {
      int i = n - 1;
      while (i % 128 != k) --i;
      if (!check_pattern(r.at(r.layout.recv_offset(0, peer) + (uint64_t)k * 64), 64, peer, 50000 + i, err))
        st = Status::Error(err);
    }
    if (st.ok()) st = r.t->poll();
    if (st.ok())
      pass("burst", strf("%d back-to-back puts (%d per root) posted in %.2f s, all landed in order in %.2f s", n,
                         n / roots, post_s, now_s() - t0));
    else
      failed("burst", st.message());
  }
  if (!barrier()) return;

  // 3. One large put: a whole slot of fresh bytes, split over the roots.
  if (st.ok()) {
    t0 = now_s();
    const uint64_t bytes = a.slot_bytes;
    const uint64_t word = flag_word(1, 9);
    uint8_t* send = r.at(r.layout.send_offset(1));
    pattern(send, bytes, rank, 424242);
    const int roots = r.t->roots();
    for (int root = 0; root < roots && st.ok(); ++root) {
      uint64_t off, len;
      root_split(bytes, root, roots, off, len);
      st = r.t->put(peer, root, send + off, r.layout.recv_offset(1, rank) + off, len,
                    r.layout.flag_offset(flag_index(r.layout, rank, root) + 4), word);
    }
    for (int root = 0; root < roots && st.ok(); ++root)
      st = wait_flag(r, r.layout.flag_offset(flag_index(r.layout, peer, root) + 4), word);
    std::string err;
    if (st.ok() && !check_pattern(r.at(r.layout.recv_offset(1, peer)), bytes, peer, 424242, err))
      st = Status::Error(err);
    const double dt = now_s() - t0;
    if (st.ok())
      pass("large", strf("%llu B in one put per root, checked, %.2f s (%.1f MB/s each way, emulated)",
                         (unsigned long long)bytes, dt, bytes / dt / 1e6));
    else
      failed("large", st.message());
  }

  // 4. Bounds: writes outside the peer's inbox or from outside the region
  // are refused before anything is posted, and break nothing.
  {
    const uint64_t lo = r.layout.inbox_lo(), hi = r.layout.inbox_hi();
    uint8_t* src = r.at(r.layout.send_offset(0));
    const Status below = r.t->put(peer, 0, src, 0, 64, r.layout.flag_offset(0), 1);        // the control block
    const Status above = r.t->put(peer, 0, src, hi - 32, 64, r.layout.flag_offset(0), 1);  // past the inbox
    const Status flag = r.t->put(peer, 0, src, lo, 0, r.layout.send_offset(0), 1);         // a "flag" in send
    const Status unaligned = r.t->put(peer, 0, src, lo, 0, r.layout.flag_offset(0) + 4, 1);
    uint8_t outside[64] = {};
    const Status source = r.t->put(peer, 0, outside, r.layout.recv_offset(0, rank), 64, r.layout.flag_offset(0), 1);
    const Status self = r.t->put(rank, 0, src, r.layout.recv_offset(0, rank), 64, r.layout.flag_offset(0), 1);
    const Status after = r.t->poll();
    if (!below.ok() && !above.ok() && !flag.ok() && !unaligned.ok() && !source.ok() && !self.ok() && after.ok() &&
        contains(above.message(), "slots"))
      pass("bounds",
           "writes outside the peer's inbox, from outside the region, or to itself are refused: " + above.message());
    else
      failed("bounds",
             strf("accepted a bad put (below %d above %d flag %d unaligned %d source %d self %d) or "
                  "poll failed: %s",
                  below.ok(), above.ok(), flag.ok(), unaligned.ok(), source.ok(), self.ok(), after.message().c_str()));
  }
  if (!barrier()) return;

  // 5. A peer that destroys its QPs mid-stream (close()): rank 0 must get
  // an error naming rank 1 from poll() within the QP's retry budget.
  if (rank == 1) {
    r.t->close();
    const Status after =
        r.t->put(peer, 0, r.at(r.layout.send_offset(0)), r.layout.recv_offset(0, rank), 8, r.layout.flag_offset(0), 1);
    if (!after.ok())
      pass("closed-put", "put() after close(): " + after.message());
    else
      failed("closed-put", "put() after close() succeeded");
    char c = 'c';
    send_all(&c, 1);
  } else {
    char c;
    recv_all(&c, 1);
    expect_peer_lost(r, "peer-close", a.detect_limit_s);
  }
  barrier();
  r.t.reset();

  // 6. A peer that never connects: its queue pairs stay in INIT and take no
  // write, so rank 0's connection probe fails, naming rank 1 (and in a ring
  // the port), within the QP's retry budget instead of at the first put.
  {
    Rank r1;
    st = make_rank(r1, rank, 2, a.hca[rank], 1 << 16, -1, a.ring);
    std::string mine = r1.t ? r1.t->details() : "", theirs;
    if (!st.ok() || !send_str(mine) || !recv_str(theirs)) {
      failed("silent-peer", "setting up: " + st.message());
      return;
    }
    if (rank == 0) {
      std::vector<std::string> all = {mine, theirs};
      const double t0 = now_s();
      const Status c = r1.t->connect(all, 30);
      const double dt = now_s() - t0;
      if (!c.ok() && contains(c.message(), "no answer from rank 1") && contains(c.message(), "connection probe") &&
          (!a.ring || contains(c.message(), "the port facing")) && dt < a.detect_limit_s)
        pass("silent-peer", strf("connect failed in %.2f s: %s", dt, c.message().c_str()));
      else
        failed("silent-peer",
               strf("after %.2f s: %s", dt, c.ok() ? "connected to a peer that never did" : c.message().c_str()));
    }
    barrier();
  }

  // 7. A peer process that exits mid-stream: fresh carriers, one exchange to
  // show the link is up, then rank 1 exits and its kernel tears its QPs down.
  Rank r2;
  st = make_rank(r2, rank, 2, a.hca[rank], 1 << 16, -1, a.ring);
  if (st.ok()) st = connect_pair(r2, rank);
  if (st.ok()) st = exchange(r2, rank, peer, 1, 4096);
  if (!st.ok()) {
    failed("peer-exit", "setting up: " + st.message());
    return;
  }
  if (rank == 1) {
    pass("peer-exit-setup", "fresh carrier connected and exchanged; exiting now");
    fflush(stdout);
    _exit(g_failures ? 1 : 0);  // rank 1 ends here, its QPs with it
  }
  int status = 0;
  waitpid(-1, &status, 0);  // rank 1 is this process's only child
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed("rank 1", strf("exited with status 0x%x", status));
  expect_peer_lost(r2, "peer-exit", a.detect_limit_s);
}

int run_pair(const Args& a) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
    perror("socketpair");
    return 2;
  }
  fflush(stdout);
  const pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    return 2;
  }
  if (pid == 0) {
    g_rank = 1;
    g_sock = sv[1];
    close(sv[0]);
    alarm(600);  // never outlive a broken run
    run_rank(1, a);
    fflush(stdout);
    _exit(g_failures ? 1 : 0);
  }
  g_rank = 0;
  g_sock = sv[0];
  close(sv[1]);
  run_rank(0, a);
  // run_rank(0) reaped rank 1 when it got that far; otherwise reap it here.
  int status = 0;
  pid_t got = waitpid(pid, &status, WNOHANG);
  if (got == 0) {
    close(g_sock);  // a rank 1 blocked on the socket gives up
    got = waitpid(pid, &status, 0);
  }
  if (got == pid && (!WIFEXITED(status) || WEXITSTATUS(status) != 0))
    failed("rank 1", strf("exited with status 0x%x", status));
  return g_failures;
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  Args a;
  if (const char* e = std::getenv("ARX_TEST_HCA0")) a.hca[0] = e;
  if (const char* e = std::getenv("ARX_TEST_HCA1")) a.hca[1] = e;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        fprintf(stderr, "%s needs a value\n", k.c_str());
        exit(2);
      }
      return argv[++i];
    };
    if (k == "--hca0")
      a.hca[0] = val();
    else if (k == "--hca1")
      a.hca[1] = val();
    else if (k == "--roots")
      a.roots = std::stoi(val());
    else if (k == "--gid0")
      a.gid[0] = std::stoi(val());
    else if (k == "--gid1")
      a.gid[1] = std::stoi(val());
    else if (k == "--burst")
      a.burst = std::stoi(val());
    else if (k == "--slot-bytes")
      a.slot_bytes = std::stoull(val());
    else if (k == "--detect-limit")
      a.detect_limit_s = std::stod(val());
    else if (k == "--ring")
      a.ring = true;
    else {
      fprintf(stderr,
              "usage: %s --hca0 DEV[,DEV] --hca1 DEV[,DEV] [--roots N] [--gid0 I --gid1 I] "
              "[--burst N] [--slot-bytes B] [--detect-limit S] [--ring]\n",
              argv[0]);
      return 2;
    }
  }
  if (a.hca[0].empty() || a.hca[1].empty()) {
    fprintf(stderr,
            "no devices named for both ranks (--hca0 rxe0 --hca1 rxe1, or ARX_TEST_HCA0/1); "
            "test_verbs_device runs the checks that need none\n");
    return 2;
  }
#if ARX_HAVE_VERBS
  // Wrong settings fail construction with what to set.
  {
    Rank r;
    const Status st = make_rank(r, 0, 2, "nosuchdev0", 1 << 16);
    if (!st.ok() && contains(st.message(), "JAX_ARX_IB_HCA") && contains(st.message(), "rxe"))
      pass("bad-hca", st.message());
    else
      failed("bad-hca", st.ok() ? "accepted" : st.message());
    Rank r2;
    const Status st2 = make_rank(r2, 0, 2, a.hca[0], 1 << 16, 250, a.ring);
    if (!st2.ok() && contains(st2.message(), "JAX_ARX_IB_GID_INDEX"))
      pass("bad-gid-index", st2.message());
    else
      failed("bad-gid-index", st2.ok() ? "accepted" : st2.message());
  }
#endif
  run_pair(a);
  if (g_rank != 0) return g_failures ? 1 : 0;
  printf("test_verbs_transport: %s (%d failure%s)\n", g_failures ? "FAILED" : "ALL PASSED", g_failures,
         g_failures == 1 ? "" : "s");
  return g_failures ? 1 : 0;
}
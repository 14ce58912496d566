// The tcp carrier, with ranks as threads of one process, each with its own
// region: exchanges at world 2-4, ordering under thousands of back-to-back
// puts, a large put, frames outside the sender's own slots, a faulty
// authenticated peer, a peer that stops reading (every send bounded by the
// timeout, close() never held by it), connect errors and close. Returns
// non-zero on failure. Who may connect is tested in test_tcp_auth.cc, and
// adversarial bytes in test_tcp_fuzz.cc.
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tcp_rig.h"

using namespace arx;
using namespace arx::tcp_test;

namespace {

// ---- exchange: every rank to every peer, both roots, plus a flag-only put ----

void test_exchange(int world) {
  const int f0 = g_failures;
  const uint64_t slot = 65536, nbytes = slot - 40;  // not a multiple of 16: root 1 gets an odd tail
  World w;
  if (!make_world(w, world, slot, slot) || !connect_ok(w)) return;
  const uint64_t desc = describe(descriptor(OpCode::kPsum, (uint64_t)DType::kF32, nbytes / 4, /*tag=*/0));
  const auto t0 = Clock::now();
  std::vector<std::thread> senders;
  for (int r = 0; r < world; ++r) {
    senders.emplace_back([&, r] {
      Rank& me = w[r];
      uint8_t* src = me.base() + me.layout.send_offset(0);
      for (uint64_t i = 0; i < nbytes; ++i) src[i] = pattern(r, i);
      for (int k = 1; k < world; ++k) {  // send order r+1, r+2, ...
        const int p = (r + k) % world;
        for (int root = 0; root < 2; ++root) {
          uint64_t off, len;
          root_split(nbytes, root, 2, off, len);
          Status s = me.t->put(p, root, src + off, me.layout.recv_offset(0, r) + off, len,
                               me.layout.flag_offset(flag_index(r, root)), flag_word(1, desc));
          CHECK(s.ok(), "put %d->%d root %d: %s", r, p, root, s.message().c_str());
        }
        // len 0: a flag only, into its prefill flag word, over either root.
        Status s = me.t->put(p, k % 2, src, me.layout.recv_offset(0, r), 0,
                             me.layout.flag_offset(second_flag_index(r, 0)), 1000 + r);
        CHECK(s.ok(), "flag-only put %d->%d: %s", r, p, s.message().c_str());
      }
    });
  }
  for (auto& t : senders) t.join();
  for (int d = 0; d < world; ++d) {
    Rank& me = w[d];
    for (int s = 0; s < world; ++s) {
      if (s == d) continue;
      for (int root = 0; root < 2; ++root)
        CHECK(wait_flag(me.base(), me.layout.flag_offset(flag_index(s, root)), flag_word(1, desc)),
              "world %d: rank %d never saw the flag of rank %d root %d", world, d, s, root);
      CHECK(wait_flag(me.base(), me.layout.flag_offset(second_flag_index(s, 0)), 1000 + s),
            "world %d: rank %d never saw the flag-only put of rank %d", world, d, s);
      const uint8_t* got = me.base() + me.layout.recv_offset(0, s);
      uint64_t bad = 0, first = 0;
      for (uint64_t i = 0; i < nbytes; ++i)
        if (got[i] != pattern(s, i) && !bad++) first = i;
      CHECK(bad == 0, "world %d: rank %d got %llu wrong bytes from rank %d, first at %llu", world, d,
            (unsigned long long)bad, s, (unsigned long long)first);
      for (uint64_t i = nbytes; i < slot; ++i)
        if (got[i]) {
          CHECK(false, "world %d: byte %llu of rank %d's slot on rank %d was written past the payload", world,
                (unsigned long long)i, s, d);
          break;
        }
    }
    CHECK(me.lost_count() == 0, "rank %d reported a peer lost while all were up: %s", d, me.lost_text().c_str());
    CHECK(me.t->poll().ok(), "poll: %s", me.t->poll().message().c_str());
  }
  printf("%s exchange world %d: %d ranks x %d peers x 2 roots, %llu bytes each, %.1f ms\n", verdict(f0), world,
         world, world - 1, (unsigned long long)nbytes, since(t0) * 1e3);
  for (int r = 0; r < world; ++r) w[r].t->close();
}

// ---- ordering: thousands of small puts back to back on both roots ----
//
// Put i writes word i of the slot and then flag = i + 1. A reader that sees
// flag f must see words [0, f) already in place.

void test_ordering() {
  const int f0 = g_failures;
  constexpr int kN = 4000;
  const uint64_t slot = 8 * kN;
  World w;
  if (!make_world(w, 2, slot, slot) || !connect_ok(w)) return;
  auto word = [](int src, int root, int i) {
    return 0xa500000000000000ull | (uint64_t)src << 40 | (uint64_t)root << 32 | (uint64_t)(i + 1);
  };
  const auto t0 = Clock::now();
  std::vector<std::thread> th;
  for (int s = 0; s < 2; ++s) {
    for (int root = 0; root < 2; ++root) {
      uint64_t* src = reinterpret_cast<uint64_t*>(w[s].base() + w[s].layout.send_offset(root));
      for (int i = 0; i < kN; ++i) src[i] = word(s, root, i);
      // One sender thread per root: two threads putting at once on different links.
      th.emplace_back([&w, s, root, src] {
        Rank& me = w[s];
        for (int i = 0; i < kN; ++i) {
          Status st = me.t->put(1 - s, root, src + i, me.layout.recv_offset(root, s) + 8 * (uint64_t)i, 8,
                                me.layout.flag_offset(flag_index(s, root)), (uint64_t)i + 1);
          if (!st.ok()) {
            CHECK(false, "put %d of %d->%d root %d: %s", i, s, 1 - s, root, st.message().c_str());
            return;
          }
        }
      });
    }
  }
  std::atomic<int> observed{0};
  for (int d = 0; d < 2; ++d) {
    for (int root = 0; root < 2; ++root) {
      th.emplace_back([&, d, root] {
        Rank& me = w[d];
        const int s = 1 - d;
        const uint64_t* flag =
            reinterpret_cast<const uint64_t*>(me.base() + me.layout.flag_offset(flag_index(s, root)));
        const uint64_t* words = reinterpret_cast<const uint64_t*>(me.base() + me.layout.recv_offset(root, s));
        uint64_t seen = 0;
        const auto start = Clock::now();
        while (seen < (uint64_t)kN) {
          const uint64_t f = load_acquire(flag);
          CHECK(f >= seen, "flag of %d root %d went back from %llu to %llu", s, root, (unsigned long long)seen,
                (unsigned long long)f);
          if (f > seen) {
            for (uint64_t i = seen; i < f; ++i)
              if (words[i] != word(s, root, (int)i)) {
                CHECK(false, "rank %d saw flag %llu from rank %d root %d but word %llu is %016llx", d,
                      (unsigned long long)f, s, root, (unsigned long long)i, (unsigned long long)words[i]);
                return;
              }
            seen = f;
            observed.fetch_add(1);
          } else {
            if (since(start) > 30) {
              CHECK(false, "rank %d: flag of rank %d root %d stuck at %llu of %d", d, s, root,
                    (unsigned long long)seen, kN);
              return;
            }
            std::this_thread::yield();
          }
        }
      });
    }
  }
  for (auto& t : th) t.join();
  const double dt = since(t0);
  for (int r = 0; r < 2; ++r) {
    CHECK(w[r].lost_count() == 0, "rank %d lost a peer: %s", r, w[r].lost_text().c_str());
    CHECK(w[r].t->poll().ok(), "poll: %s", w[r].t->poll().message().c_str());
  }
  printf("%s ordering: %d puts x 2 roots x 2 directions in order, %d distinct flag values observed, %.2f us/put\n",
         verdict(f0), kN, observed.load(), dt * 1e6 / (4.0 * kN));
  for (int r = 0; r < 2; ++r) w[r].t->close();
}

// ---- a large put, both directions at once ----

void test_large() {
  const int f0 = g_failures;
  const uint64_t bytes = 8ull << 20;
  World w;
  if (!make_world(w, 2, bytes, bytes) || !connect_ok(w)) return;
  for (int s = 0; s < 2; ++s) {
    uint8_t* src = w[s].base() + w[s].layout.send_offset(1);
    for (uint64_t i = 0; i < bytes; ++i) src[i] = pattern(s + 5, i);
  }
  const auto t0 = Clock::now();
  std::vector<std::thread> th;
  for (int s = 0; s < 2; ++s)
    for (int root = 0; root < 2; ++root)
      th.emplace_back([&, s, root] {
        Rank& me = w[s];
        uint64_t off, len;
        root_split(bytes, root, 2, off, len);
        Status st = me.t->put(1 - s, root, me.base() + me.layout.send_offset(1) + off,
                              me.layout.recv_offset(1, s) + off, len, me.layout.flag_offset(flag_index(s, root)), 42);
        CHECK(st.ok(), "large put %d root %d: %s", s, root, st.message().c_str());
      });
  for (auto& t : th) t.join();
  for (int d = 0; d < 2; ++d) {
    const int s = 1 - d;
    for (int root = 0; root < 2; ++root)
      CHECK(wait_flag(w[d].base(), w[d].layout.flag_offset(flag_index(s, root)), 42, 30),
            "large put: rank %d never saw rank %d root %d", d, s, root);
    const uint8_t* got = w[d].base() + w[d].layout.recv_offset(1, s);
    uint64_t bad = 0;
    for (uint64_t i = 0; i < bytes; ++i) bad += got[i] != pattern(s + 5, i);
    CHECK(bad == 0, "large put: rank %d got %llu wrong bytes from rank %d", d, (unsigned long long)bad, s);
  }
  const double dt = since(t0);
  printf("%s large put: %llu MB each way over 2 roots, %.1f ms (%.2f GB/s both ways)\n", verdict(f0),
         (unsigned long long)(bytes >> 20), dt * 1e3, 2.0 * bytes / dt / 1e9);
  for (int r = 0; r < 2; ++r) w[r].t->close();
}

// ---- frames outside the sender's own slots, sent with put() by real peers ----

void test_out_of_bounds() {
  const int f0 = g_failures;
  const uint64_t slot = 4096;
  World w;
  if (!make_world(w, 4, slot, slot) || !connect_ok(w)) return;
  Rank& victim = w[1];
  const Layout& L = victim.layout;
  // Canary everywhere: no refused frame may change a byte of the region.
  memset(victim.base(), 0xcd, L.total);
  std::vector<uint8_t> before(victim.base(), victim.base() + L.total);
  for (int r : {0, 2, 3}) memset(w[r].base() + w[r].layout.send_offset(0), 0x10 + r, slot);
  auto own = [&](int src, int root) { return L.flag_offset(flag_index(src, root)); };
  // Each bad frame ends its stream, so each case uses its own (sender, root).
  struct Case {
    int from, root;
    uint64_t offset, len, flag;
    const char* expect;
  } cases[] = {
      {0, 0, L.send, 64, own(0, 0), "outside its own slots"},                            // past the inbox
      {0, 1, L.recv_offset(0, 2), 64, own(0, 1), "outside its own slots"},               // rank 2's slot
      {2, 0, L.recv_offset(1, 2) + slot - 8, 16, own(2, 0), "outside its own slots"},    // past its slot's end
      {2, 1, L.recv_offset(0, 2), 64, own(0, 0), "not one of its own words"},       // rank 0's flag
      {3, 0, L.recv_offset(0, 3), 64, L.recv, "not one of its own words"},          // not a flag
      {3, 1, L.recv_offset(0, 3), 64, L.flags + 4, "not one of its own words"},     // misaligned flag
  };
  for (const Case& c : cases) {
    Status s = w[c.from].t->put(1, c.root, w[c.from].base() + w[c.from].layout.send_offset(0), c.offset, c.len,
                                c.flag, 99);
    CHECK(s.ok(), "the bad put itself should go out (the receiver refuses it): %s", s.message().c_str());
  }
  const size_t n = sizeof cases / sizeof cases[0];
  CHECK(victim.wait_lost(n), "expected %zu on_peer_lost reports, got: %s", n, victim.lost_text().c_str());
  {
    std::lock_guard<std::mutex> lk(victim.lost_mu);
    for (const Case& c : cases) {
      bool found = false;
      for (auto& [peer, why] : victim.lost)
        found |= peer == c.from && contains(why, strf("rank %d (root %d)", c.from, c.root)) &&
                 contains(why, c.expect) &&
                 contains(why, strf("offset %llu", (unsigned long long)(contains(c.expect, "slots") ? c.offset
                                                                                                 : c.flag)));
      CHECK(found, "no report from rank %d root %d saying '%s' and naming the offset", c.from, c.root, c.expect);
    }
  }
  uint64_t changed = 0, first = 0;
  for (uint64_t i = 0; i < L.total; ++i)
    if (victim.base()[i] != before[i] && !changed++) first = i;
  CHECK(changed == 0, "refused frames changed %llu bytes of the victim's region, first at offset %llu",
        (unsigned long long)changed, (unsigned long long)first);

  // The sender learns of it: its next puts on that stream fail, and stick.
  const uint8_t* src0 = w[0].base() + w[0].layout.send_offset(0);
  Status err;
  const auto t0 = Clock::now();
  while (since(t0) < 10) {
    err = w[0].t->put(1, 0, src0, L.recv_offset(0, 0), 64, own(0, 0), 100);
    if (!err.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  CHECK(!err.ok(), "puts on a stream the receiver closed kept succeeding");
  const Status sticky = w[0].t->poll();
  CHECK(!sticky.ok() && contains(sticky.message(), "rank 1 (root 0)"),
        "poll() should report the failed send to rank 1 root 0, says: '%s'", sticky.message().c_str());
  CHECK(w[0].t->poll().message() == sticky.message(), "poll()'s error should be sticky");
  // Other links are unaffected: rank 2 -> rank 0 still works.
  const uint8_t* src2 = w[2].base() + w[2].layout.send_offset(0);
  Status ok = w[2].t->put(0, 0, src2, w[0].layout.recv_offset(0, 2), 64, w[0].layout.flag_offset(flag_index(2, 0)), 7);
  CHECK(ok.ok() && wait_flag(w[0].base(), w[0].layout.flag_offset(flag_index(2, 0)), 7),
        "an unrelated link broke: %s", ok.message().c_str());
  printf("%s own slots: %zu frames outside their sender's slots refused and reported, no byte written, sender sees "
         "'%.60s...'\n",
         verdict(f0), n, sticky.message().c_str());
  for (int r = 0; r < 4; ++r) w[r].t->close();
}

// ---- an authenticated but faulty or dying peer ----
//
// A world of 3 where only rank 0 is real and the test plays ranks 1 and 2
// (FakeRank: they hold their keys, so their streams are authenticated).

void test_faulty_peer() {
  const int f0 = g_failures;
  World w;
  if (!make_world(w, 3, 4096, 4096, /*make=*/1)) return;
  Rank& me = w[0];
  const Layout& L = me.layout;
  std::vector<std::vector<int>> in;
  const Status cs = connect_with_fakes(w, in);
  CHECK(cs.ok(), "connect with fake peers: %s", cs.message().c_str());
  if (!cs.ok()) return;
  memset(me.base() + L.inbox_hi(), 0xcd, L.total - L.inbox_hi());

  // Positive control: an authenticated stream does write.
  const int a = in[2][0];
  std::vector<uint8_t> payload(64, 0x5a);
  FrameHeader h{kFrameMagic, L.recv_offset(0, 2), 64, L.flag_offset(flag_index(2, 0)), 5};
  raw_send(a, &h, sizeof h);
  raw_send(a, payload.data(), payload.size());
  CHECK(wait_flag(me.base(), L.flag_offset(flag_index(2, 0)), 5), "an authenticated frame was not delivered");
  CHECK(memcmp(me.base() + L.recv_offset(0, 2), payload.data(), 64) == 0, "authenticated payload differs");
  // A length that wraps around 2^64 past its slot.
  FrameHeader wrap{kFrameMagic, L.recv_offset(0, 2) + 32, ~0ull - 15, L.flag_offset(flag_index(2, 0)), 6};
  raw_send(a, &wrap, sizeof wrap);
  raw_send(a, payload.data(), payload.size());
  CHECK(me.wait_lost(1), "a wrapping length was not reported");
  CHECK(read_until_closed(a) == 0, "the stream of a wrapping length should be closed");
  CHECK(flag_at(me.base(), L.flag_offset(flag_index(2, 0))) == 5, "the refused frame's flag was stored");
  for (uint64_t i = L.inbox_hi(); i < L.total; ++i)
    if (me.base()[i] != 0xcd) {
      CHECK(false, "byte %llu past the inbox was written", (unsigned long long)i);
      break;
    }

  // A peer that dies: EOF without a goodbye, in the middle of a frame.
  const int b = in[2][1];
  FrameHeader half{kFrameMagic, L.recv_offset(0, 2), 64, L.flag_offset(flag_index(2, 1)), 9};
  raw_send(b, &half, sizeof half);
  raw_send(b, payload.data(), 10);
  shutdown(b, SHUT_RDWR);
  CHECK(me.wait_lost(2), "EOF from an authenticated peer was not reported");
  // A peer that closes on purpose: goodbye, then EOF.
  const int c = in[1][0];
  FrameHeader bye{kByeMagic, 0, 0, 0, 0};
  raw_send(c, &bye, sizeof bye);
  shutdown(c, SHUT_WR);
  // An orderly close is no failure: it must not be reported as a lost peer.
  // The receiver closes the stream only after it read the goodbye and the
  // EOF and decided what they were: once its end is closed, any report is in.
  CHECK(wait_peer_closed(c), "the receiver did not close a stream that said goodbye and ended");
  {
    std::lock_guard<std::mutex> lk(me.lost_mu);
    CHECK(me.lost.size() == 2, "EOF after a goodbye was reported as a lost peer (%zu reports)", me.lost.size());
    if (me.lost.size() >= 2) {
      CHECK(me.lost[0].first == 2 && contains(me.lost[0].second, "outside its own slots"), "wrap report: %s",
            me.lost[0].second.c_str());
      CHECK(me.lost[1].first == 2 && me.lost[1].second.find("connection closed by rank 2 (root 1)") == 0 &&
                contains(me.lost[1].second, "middle of a frame"),
            "EOF report: %s", me.lost[1].second.c_str());
    }
  }
  CHECK(flag_at(me.base(), L.flag_offset(flag_index(2, 1))) == 0, "a half-received frame's flag was stored");
  printf("%s faulty peer: wrapping length refused, EOF mid-frame reported, orderly goodbye not\n", verdict(f0));
  me.t->close();
  me.t->close();  // idempotent
}

// ---- a peer that stops reading: every send bounded by the timeout ----
//
// Rank 1 is a FakeRank that authenticates and then never reads (as a
// process stopped with SIGSTOP, or hung). A put larger than what the
// kernel's buffers hold must fail within about the timeout, name the peer
// and say why, and close the stream; close() must not wait on such a send.

// Real rank 0, connected to a rank 1 that never reads; slots of `bytes`.
bool make_stopped_pair(World& w, uint64_t bytes, double timeout_s) {
  if (!make_world(w, 2, bytes, bytes, /*make=*/1, {}, "", 0, timeout_s)) return false;
  w.fake(1).drain.store(false);
  std::vector<std::vector<int>> in;
  const Status s = connect_with_fakes(w, in, 10);
  CHECK(s.ok(), "connect with a fake peer: %s", s.message().c_str());
  return s.ok();
}

void test_stopped_peer() {
  const int f0 = g_failures;
  const double timeout_s = 2;
  const uint64_t bytes = 48ull << 20;  // far more than the socket buffers of both ends hold
  {
    World w;
    if (!make_stopped_pair(w, bytes, timeout_s)) return;
    Rank& me = w[0];
    std::atomic<bool> done{false};
    Status st;
    const auto t0 = Clock::now();
    std::thread sender([&] {
      st = me.t->put(1, 0, me.base() + me.layout.send_offset(0), me.layout.recv_offset(0, 0), bytes,
                     me.layout.flag_offset(flag_index(0, 0)), 1);
      done.store(true);
    });
    // Bounded wait here too, so that a send that never gives up fails the
    // check instead of hanging the test; close() then frees it.
    while (!done.load() && since(t0) < 4 * timeout_s + 10) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const double took = since(t0);
    CHECK(done.load() && took <= 2 * timeout_s, "a put to a peer that does not read took %.1f s (timeout %g s)%s",
          took, timeout_s, done.load() ? "" : " and had not returned");
    if (!done.load()) me.t->close();
    sender.join();
    CHECK(!st.ok() && contains(st.message(), "rank 1 (root 0) took no data for 2 s") &&
              contains(st.message(), "JAX_ARX_TIMEOUT_S") && contains(st.message(), "stream is closed"),
          "put's error: '%s'", st.message().c_str());
    CHECK(me.t->poll().message() == st.message(), "poll() should report the stalled send: '%s'",
          me.t->poll().message().c_str());
    printf("%s stopped peer: a %llu MB put gave up after %.1f s (timeout %g s): '%.90s...'\n", verdict(f0),
           (unsigned long long)(bytes >> 20), took, timeout_s, st.message().c_str());
  }
  {  // close() while a put is blocked on such a peer (timeout far away).
    const int f1 = g_failures;
    World w;
    if (!make_stopped_pair(w, bytes, /*timeout_s=*/60)) return;
    Rank& me = w[0];
    std::atomic<bool> done{false};
    Status st;
    std::thread sender([&] {
      st = me.t->put(1, 1, me.base() + me.layout.send_offset(0), me.layout.recv_offset(0, 0), bytes,
                     me.layout.flag_offset(flag_index(0, 1)), 1);
      done.store(true);
    });
    // The send is under way (bytes wait in the socket for a peer that never
    // reads) and cannot finish: close() must then free it.
    const auto t1 = Clock::now();
    while (queued_to(w.fake(1).port) == 0 && !done.load() && since(t1) < 10)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    CHECK(queued_to(w.fake(1).port) > 0 && !done.load(), "the put should be blocked on the stopped peer (%lu bytes "
          "queued, %s)", queued_to(w.fake(1).port), done.load() ? "returned" : "not returned");
    const auto t0 = Clock::now();
    me.t->close();
    const double took = since(t0);
    sender.join();
    CHECK(took < 5, "close() took %.1f s with a put blocked on a stopped peer", took);
    CHECK(!st.ok(), "the blocked put should fail when the carrier closes");
    printf("%s close with a blocked put: %.2f s, the put says '%.70s...'\n", verdict(f1), took, st.message().c_str());
  }
}

// ---- connect errors ----

void test_connect_errors() {
  const int f0 = g_failures;
  {  // rank 1 exists but never calls connect(): rank 0 times out naming it.
    World w;
    if (!make_world(w, 2, 4096, 4096)) return;
    const auto t0 = Clock::now();
    Status s = w[0].t->connect(w.details, 1.0);
    CHECK(!s.ok() && contains(s.message(), "rank 1 at") && contains(s.message(), "has not reached connect()") &&
              since(t0) < 5,
          "connect without the peer: '%s' after %.1f s", s.message().c_str(), since(t0));
    printf("%s connect timeout: '%s'\n", verdict(f0), s.message().c_str());
  }
  {  // nobody listens at rank 1's address.
    World w;
    if (!make_world(w, 2, 4096, 4096, /*make=*/1)) return;
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    socklen_t al = sizeof a;
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &al);
    close(fd);  // a port that was free a moment ago and has no listener
    w.details[1] = tcp_auth::format_details("127.0.0.1", ntohs(a.sin_port), w.fake(1).keys.pub);
    Status s = w[0].t->connect(w.details, 0.5);
    CHECK(!s.ok() && s.message().find("could not connect to rank 1") != std::string::npos &&
              s.message().find("JAX_ARX_TCP_ADDR") != std::string::npos,
          "dial to nowhere: '%s'", s.message().c_str());
    printf("%s connect unreachable: '%.90s...'\n", verdict(f0), s.message().c_str());
  }
  {  // details of another carrier.
    World w;
    if (!make_world(w, 2, 4096, 4096, /*make=*/1)) return;
    w.details[1] = "shm /jax_arx-1-abc";
    Status s = w[0].t->connect(w.details, 0.5);
    CHECK(!s.ok() && s.message().find("rank 1's connection details") != std::string::npos, "bad details: '%s'",
          s.message().c_str());
  }
  {  // ranks of different communicators: secrets differ.
    World w;
    if (!make_world(w, 2, 4096, 4096, -1, {kSecret, kSecret + "x"})) return;
    std::vector<Status> st = connect_all(w, 2.0);
    // Each rank finds the other failing the acceptor's proof: the pair keys differ.
    for (int r = 0; r < 2; ++r)
      CHECK(!st[r].ok() && contains(st[r].message(), strf("answered as rank %d", 1 - r)) &&
                contains(st[r].message(), "JAX_ARX_SECRET differs"),
            "rank %d: '%s'", r, st[r].message().c_str());
    printf("%s connect with differing secrets: '%.100s...'\n", verdict(f0), st[0].message().c_str());
  }
  {  // what make_tcp_transport refuses.
    Config cfg;
    std::unique_ptr<Region> region;
    const Layout L = Layout::of(Geometry{2, 4096, 4096});
    Region::create(L.total, false, region);
    TransportContext ctx;
    ctx.world = 2;
    ctx.region = region.get();
    ctx.layout = L;
    ctx.config = &cfg;
    ctx.label = "test";
    std::unique_ptr<Transport> t;
    ctx.secret = "";
    CHECK(!make_tcp_transport(ctx, t).ok(), "an empty secret was accepted");
    ctx.secret = std::string(100, 'x');  // any length: it keys an HMAC
    for (const char* bad : {"::1", "0.0.0.0", "127.0.0.1:99999", "127.0.0.1:x"}) {
      cfg.tcp_addr = bad;
      Status s = make_tcp_transport(ctx, t);
      CHECK(!s.ok(), "tcp_addr '%s' was accepted", bad);
    }
    cfg.tcp_addr = "127.0.0.1:0";
    Status s = make_tcp_transport(ctx, t);
    CHECK(s.ok() && t->details().rfind("arx-tcp/2 127.0.0.1 ", 0) == 0, "tcp_addr 127.0.0.1:0: %s %s",
          s.message().c_str(), s.ok() ? t->details().c_str() : "");
    const int port = s.ok() ? port_of(t->details()) : 0;
    t.reset();  // the destructor closes
    cfg.tcp_addr = strf("localhost:%d", port);  // a fixed port, free again, taken with SO_REUSEADDR
    s = make_tcp_transport(ctx, t);
    CHECK(s.ok() && t && t->details().rfind(strf("arx-tcp/2 127.0.0.1 %d ", port), 0) == 0, "fixed port: %s",
          s.message().c_str());
    printf("%s construction checks: secrets, listen addresses, details '%s'\n", verdict(f0),
           t ? t->details().c_str() : "");
  }
}

// ---- close ----

void test_close() {
  const int f0 = g_failures;
  World w;
  if (!make_world(w, 2, 4096, 4096) || !connect_ok(w)) return;
  w[1].t->close();
  w[1].t->close();
  CHECK(w[1].lost_count() == 0, "rank 1 closed itself yet reported: %s", w[1].lost_text().c_str());
  Status s = w[1].t->put(0, 0, w[1].base() + w[1].layout.send_offset(0), w[1].layout.recv_offset(0, 1), 8,
                         w[1].layout.flag_offset(0), 1);
  CHECK(!s.ok() && s.message().find("after close()") != std::string::npos, "put after close: '%s'",
        s.message().c_str());
  // Rank 1 said goodbye on both roots, then closed. An orderly close is no
  // failure of rank 0, so on_peer_lost stays silent (a collective still
  // issued to rank 1 runs into the timeout naming it); but every later put
  // to rank 1, on either root, fails with an error naming the link.
  Status err[2];
  for (int root : {1, 0}) {
    const auto t0 = Clock::now();
    while (since(t0) < 10 && err[root].ok()) {
      err[root] = w[0].t->put(1, root, w[0].base() + w[0].layout.send_offset(0), w[0].layout.recv_offset(0, 0),
                              4096, w[0].layout.flag_offset(flag_index(0, root)), 1);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    CHECK(!err[root].ok() && err[root].message().find(strf("rank 1 (root %d)", root)) != std::string::npos,
          "puts to a closed peer on root %d: '%s'", root, err[root].message().c_str());
  }
  // The first failed send is the sticky one.
  CHECK(w[0].t->poll().message() == err[1].message(), "poll: '%s', first failed put: '%s'",
        w[0].t->poll().message().c_str(), err[1].message().c_str());
  // Rank 0's receiver closes each inbound stream only after it read its
  // goodbye and EOF and decided what they were: once both of rank 1's are
  // closed on rank 0's port, any report is in.
  CHECK(wait_streams_closed(port_of(w[0].t->details())), "rank 0 still has %d of rank 1's streams open",
        streams_on(port_of(w[0].t->details())));
  CHECK(w[0].lost_count() == 0, "rank 0 reported rank 1's orderly close as a lost peer: %s",
        w[0].lost_text().c_str());
  w[0].t->close();
  CHECK(w[0].t->poll().message() == err[1].message(), "close() should keep the sticky error");
  CHECK(w[0].lost_count() == 0, "rank 0 reported a peer lost while closing itself: %s", w[0].lost_text().c_str());
  printf("%s close: idempotent, orderly close not reported, later puts fail with '%.70s...'\n", verdict(f0),
         err[1].message().c_str());
}

}  // namespace

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  const auto t0 = Clock::now();
  for (int world : {2, 3, 4}) test_exchange(world);
  test_ordering();
  test_large();
  test_out_of_bounds();
  test_faulty_peer();
  test_stopped_peer();
  test_connect_errors();
  test_close();
  if (g_failures) {
    fprintf(stderr, "test_tcp_transport: %d check(s) FAILED\n", g_failures);
    return 1;
  }
  printf("test_tcp_transport: all passed in %.1f s\n", since(t0));
  return 0;
}

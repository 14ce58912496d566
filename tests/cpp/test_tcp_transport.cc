// The tcp carrier, with ranks as threads of one process, each with its own
// region: exchanges at world 2-4, ordering under thousands of back-to-back
// puts, a large put, and close. Returns non-zero on failure. Peers that
// misbehave are tested in test_tcp_faults.cc, who may connect in
// test_tcp_auth.cc, and adversarial bytes in test_tcp_fuzz.cc.
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
  printf("%s exchange world %d: %d ranks x %d peers x 2 roots, %llu bytes each, %.1f ms\n", verdict(f0), world, world,
         world - 1, (unsigned long long)nbytes, since(t0) * 1e3);
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
              CHECK(false, "rank %d: flag of rank %d root %d stuck at %llu of %d", d, s, root, (unsigned long long)seen,
                    kN);
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
      err[root] = w[0].t->put(1, root, w[0].base() + w[0].layout.send_offset(0), w[0].layout.recv_offset(0, 0), 4096,
                              w[0].layout.flag_offset(flag_index(0, root)), 1);
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
  CHECK(w[0].lost_count() == 0, "rank 0 reported rank 1's orderly close as a lost peer: %s", w[0].lost_text().c_str());
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
  test_close();
  if (g_failures) {
    fprintf(stderr, "test_tcp_transport: %d check(s) FAILED\n", g_failures);
    return 1;
  }
  printf("test_tcp_transport: all passed in %.1f s\n", since(t0));
  return 0;
}

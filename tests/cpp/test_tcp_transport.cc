// The tcp carrier, with ranks as threads of one process, each with its own
// region: exchanges at world 2-4, ordering under thousands of back-to-back
// puts, a large put, frames the receiver must refuse, strangers that must
// write nothing, connect errors and close. Returns non-zero on failure.
//
// Raw-socket cases speak the wire format by hand (transport/tcp_wire.h): they
// stand for a stranger or a faulty peer, which is exactly what the receiver's
// checks are for.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "base/atomics.h"
#include "base/config.h"
#include "base/layout.h"
#include "base/region.h"
#include "transport/tcp_wire.h"
#include "transport/transport.h"

using namespace arx;
using namespace arx::tcp_wire;
using Clock = std::chrono::steady_clock;

namespace {

// The word of psum piece 0 that `src` stores over `root` (two roots).
int flag_index(const Layout& L, int src, int root) { return psum_words(L.world, kRoots).index(src, 0, root); }


int g_failures = 0;
std::mutex g_print_mu;

#define CHECK(cond, ...)                                                         \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::lock_guard<std::mutex> lk_(g_print_mu);                               \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);            \
      fprintf(stderr, __VA_ARGS__);                                              \
      fprintf(stderr, "\n");                                                     \
      ++g_failures;                                                              \
    }                                                                            \
  } while (0)


const std::string kSecret = "test-secret-\x01\x02\x03-0123456789abcdef";

// "PASS" when no check failed since `before` (g_failures then).
const char* verdict(int before) { return g_failures == before ? "PASS" : "FAIL"; }

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Waits (bounded) for a flag to reach `want`; yields the CPU between looks
// so the receiver threads run on a 2-core machine.
bool wait_flag(const uint8_t* base, uint64_t off, uint64_t want, double timeout_s = 10) {
  const auto t0 = Clock::now();
  const uint64_t* p = reinterpret_cast<const uint64_t*>(base + off);
  while (load_acquire(p) != want) {
    if (since(t0) > timeout_s) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return true;
}

struct Rank {
  int rank = 0;
  std::unique_ptr<Region> region;
  Layout layout;
  Config config;
  std::unique_ptr<Transport> t;
  std::mutex lost_mu;
  std::vector<std::pair<int, std::string>> lost;  // on_peer_lost calls

  // The carrier's thread reports into `lost`: stop it before members go.
  ~Rank() {
    if (t) t->close();
  }
  uint8_t* base() const { return region->base(); }
  size_t lost_count() {
    std::lock_guard<std::mutex> lk(lost_mu);
    return lost.size();
  }
  bool wait_lost(size_t n, double timeout_s = 10) {
    const auto t0 = Clock::now();
    while (lost_count() < n) {
      if (since(t0) > timeout_s) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return true;
  }
  std::string lost_text() {
    std::lock_guard<std::mutex> lk(lost_mu);
    std::string s;
    for (auto& [p, why] : lost) s += strf("[peer %d: %s] ", p, why.c_str());
    return s;
  }
};

struct World {
  int world = 0;
  std::vector<std::unique_ptr<Rank>> ranks;
  std::vector<std::string> details;
  Rank& operator[](int r) { return *ranks[r]; }
};

// Creates `make` ranks of a world of `world` (the rest are left for the test
// to play by hand). secret_of(r) lets a rank belong to another communicator.
bool make_world(World& w, int world, uint64_t slot, uint64_t send, int make = -1,
                const std::vector<std::string>& secrets = {}, const std::string& tcp_addr = "") {
  w.world = world;
  if (make < 0) make = world;
  const Layout layout = Layout::of(Geometry{(uint32_t)world, slot, send});
  for (int r = 0; r < make; ++r) {
    auto rk = std::make_unique<Rank>();
    rk->rank = r;
    rk->layout = layout;
    rk->config.tcp_addr = tcp_addr;
    rk->config.timeout_s = 10;
    Status s = Region::create(layout.total, /*shared=*/false, rk->region);
    CHECK(s.ok(), "Region::create: %s", s.message().c_str());
    if (!s.ok()) return false;
    TransportContext ctx;
    ctx.rank = r;
    ctx.world = world;
    ctx.region = rk->region.get();
    ctx.layout = layout;
    ctx.secret = secrets.empty() ? kSecret : secrets[r];
    ctx.config = &rk->config;
    ctx.label = strf("test rank %d of %d", r, world);
    Rank* self = rk.get();
    ctx.on_peer_lost = [self](int peer, const std::string& why) {
      std::lock_guard<std::mutex> lk(self->lost_mu);
      self->lost.emplace_back(peer, why);
    };
    s = make_tcp_transport(ctx, rk->t);
    CHECK(s.ok(), "make_tcp_transport(rank %d): %s", r, s.message().c_str());
    if (!s.ok()) return false;
    CHECK(rk->t->roots() == 2, "roots() = %d", rk->t->roots());
    CHECK(rk->t->kind() == TransportKind::kTcp, "kind");
    w.details.push_back(rk->t->details());
    w.ranks.push_back(std::move(rk));
  }
  return true;
}

// Every made rank calls connect() at once, as on a real cluster.
std::vector<Status> connect_all(World& w, double timeout_s = 10) {
  std::vector<Status> st(w.ranks.size());
  std::vector<std::thread> th;
  for (size_t r = 0; r < w.ranks.size(); ++r)
    th.emplace_back([&, r] { st[r] = w.ranks[r]->t->connect(w.details, timeout_s); });
  for (auto& t : th) t.join();
  return st;
}

bool connect_ok(World& w) {
  bool ok = true;
  for (const Status& s : connect_all(w)) {
    CHECK(s.ok(), "connect: %s", s.message().c_str());
    ok = ok && s.ok();
  }
  return ok;
}

int port_of(const std::string& details) {
  char tag[32], host[64];
  int port = -1;
  if (sscanf(details.c_str(), "%31s %63s %d", tag, host, &port) != 3) return -1;
  return port;
}

uint8_t pattern(int src, uint64_t i) { return (uint8_t)(src * 37 + i * 7 + (i >> 9) + 1); }

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
                               me.layout.flag_offset(flag_index(me.layout, r, root)), flag_word(1, desc));
          CHECK(s.ok(), "put %d->%d root %d: %s", r, p, root, s.message().c_str());
        }
        // len 0: a flag only, in the source's word of its second piece.
        Status s = me.t->put(p, k % 2, src, me.layout.recv_offset(0, r), 0,
                             me.layout.flag_offset(flag_index(me.layout, r, 0) + 2), 1000 + r);
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
        CHECK(wait_flag(me.base(), me.layout.flag_offset(flag_index(me.layout, s, root)), flag_word(1, desc)),
              "world %d: rank %d never saw the flag of rank %d root %d", world, d, s, root);
      CHECK(wait_flag(me.base(), me.layout.flag_offset(flag_index(me.layout, s, 0) + 2), 1000 + s),
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
                                me.layout.flag_offset(flag_index(me.layout, s, root)), (uint64_t)i + 1);
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
            reinterpret_cast<const uint64_t*>(me.base() + me.layout.flag_offset(flag_index(me.layout, s, root)));
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
                              me.layout.recv_offset(1, s) + off, len, me.layout.flag_offset(flag_index(me.layout, s, root)), 42);
        CHECK(st.ok(), "large put %d root %d: %s", s, root, st.message().c_str());
      });
  for (auto& t : th) t.join();
  for (int d = 0; d < 2; ++d) {
    const int s = 1 - d;
    for (int root = 0; root < 2; ++root)
      CHECK(wait_flag(w[d].base(), w[d].layout.flag_offset(flag_index(w[d].layout, s, root)), 42, 30),
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

// ---- frames outside the inbox, sent with put() by real peers ----

void test_out_of_bounds() {
  const int f0 = g_failures;
  const uint64_t slot = 4096;
  World w;
  if (!make_world(w, 3, slot, slot) || !connect_ok(w)) return;
  Rank& victim = w[1];
  const Layout& L = victim.layout;
  // Canary everywhere a peer must not write: the control block and the send buffers.
  memset(victim.base() + L.control, 0xcd, L.inbox_lo() - L.control);
  memset(victim.base() + L.inbox_hi(), 0xcd, L.total - L.inbox_hi());
  std::vector<uint8_t> before(victim.base(), victim.base() + L.total);

  const uint8_t* src0 = w[0].base() + w[0].layout.send_offset(0);
  const uint8_t* src2 = w[2].base() + w[2].layout.send_offset(0);
  memset(w[0].base() + w[0].layout.send_offset(0), 0x11, slot);
  memset(w[2].base() + w[2].layout.send_offset(0), 0x22, slot);
  const uint64_t good_flag = L.flag_offset(flag_index(L, 0, 0));
  // Each bad frame ends its stream, so each case uses its own (sender, root).
  struct Case {
    int from, root;
    uint64_t offset, len, flag;
    const char* expect;
  } cases[] = {
      {0, 0, L.send, 64, good_flag, "outside its own slots"},               // past the inbox
      {0, 1, L.inbox_hi() - 8, 16, good_flag, "outside its own slots"},       // straddles its end
      {2, 0, L.recv_offset(0, 2), 64, L.recv, "not one of its own words"},      // flag not a flag
      {2, 1, L.recv_offset(0, 2), 64, L.flags + 4, "not one of its own words"},  // misaligned flag
  };
  for (const Case& c : cases) {
    Status s = w[c.from].t->put(1, c.root, c.from ? src2 : src0, c.offset, c.len, c.flag, 99);
    CHECK(s.ok(), "the bad put itself should go out (the receiver refuses it): %s", s.message().c_str());
  }
  CHECK(victim.wait_lost(4), "expected 4 on_peer_lost reports, got: %s", victim.lost_text().c_str());
  {
    std::lock_guard<std::mutex> lk(victim.lost_mu);
    for (const Case& c : cases) {
      bool found = false;
      for (auto& [peer, why] : victim.lost)
        found |= peer == c.from && why.find(strf("root %d", c.root)) != std::string::npos &&
                 why.find(c.expect) != std::string::npos && why.find(strf("rank %d", c.from)) != std::string::npos;
      CHECK(found, "no report from rank %d root %d saying '%s'", c.from, c.root, c.expect);
    }
    for (auto& [peer, why] : victim.lost)
      if (why.find("inbox") != std::string::npos)
        CHECK(why.find(strf("offset %llu", (unsigned long long)L.send)) != std::string::npos ||
                  why.find(strf("offset %llu", (unsigned long long)(L.inbox_hi() - 8))) != std::string::npos,
              "the report should name the offset: %s", why.c_str());
  }
  uint64_t changed = 0, first = 0;
  for (uint64_t i = 0; i < L.total; ++i)
    if (victim.base()[i] != before[i] && !changed++) first = i;
  CHECK(changed == 0, "refused frames changed %llu bytes of the victim's region, first at offset %llu",
        (unsigned long long)changed, (unsigned long long)first);

  // The sender learns of it: its next puts on that stream fail, and stick.
  Status err;
  const auto t0 = Clock::now();
  while (since(t0) < 10) {
    err = w[0].t->put(1, 0, src0, L.recv_offset(0, 0), 64, good_flag, 100);
    if (!err.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  CHECK(!err.ok(), "puts on a stream the receiver closed kept succeeding");
  const Status sticky = w[0].t->poll();
  CHECK(!sticky.ok() && sticky.message().find("rank 1 (root 0)") != std::string::npos,
        "poll() should report the failed send to rank 1 root 0, says: '%s'", sticky.message().c_str());
  CHECK(w[0].t->poll().message() == sticky.message(), "poll()'s error should be sticky");
  // Other links are unaffected: rank 2 -> rank 0 still works.
  Status ok = w[2].t->put(0, 0, src2, w[0].layout.recv_offset(0, 2), 64, w[0].layout.flag_offset(flag_index(w[0].layout, 2, 0)), 7);
  CHECK(ok.ok() && wait_flag(w[0].base(), w[0].layout.flag_offset(flag_index(w[0].layout, 2, 0)), 7),
        "an unrelated link broke: %s", ok.message().c_str());
  printf("%s out of bounds: 4 bad frames refused and reported, no byte written, sender sees '%.60s...'\n", verdict(f0),
         sticky.message().c_str());
  for (int r = 0; r < 3; ++r) w[r].t->close();
}

// ---- raw sockets: strangers, bad hellos, a faulty authenticated peer ----

int raw_connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons((uint16_t)port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

void raw_send(int fd, const void* p, size_t n) {
  // Errors are expected: the listener may have closed the stream already.
  const uint8_t* b = static_cast<const uint8_t*>(p);
  while (n) {
    const ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    if (w <= 0) return;
    b += w;
    n -= (size_t)w;
  }
}

// Reads until the other end closes; returns the bytes read, or -1 if it
// stayed open for timeout_s.
long read_until_closed(int fd, double timeout_s = 10) {
  const auto t0 = Clock::now();
  long total = 0;
  uint8_t buf[256];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const int left = (int)((timeout_s - since(t0)) * 1000);
    if (left <= 0 || poll(&p, 1, left) <= 0) return -1;
    const ssize_t r = recv(fd, buf, sizeof buf, 0);
    if (r <= 0) return total;
    total += r;
  }
}

void send_hello(int fd, const Hello& h) { raw_send(fd, &h, sizeof h); }

bool read_ack(int fd) {
  uint64_t ack = 0;
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, 10000) != 1) return false;
  return recv(fd, &ack, sizeof ack, MSG_WAITALL) == (ssize_t)sizeof ack && ack == kAckMagic;
}

Hello make_hello(const std::string& secret, int world, int rank, int root) {
  Hello h{};
  h.magic = kHelloMagic;
  h.version = kWireVersion;
  h.world = world;
  h.rank = rank;
  h.root = root;
  h.secret_len = (uint32_t)secret.size();
  memcpy(h.secret, secret.data(), std::min<size_t>(secret.size(), kMaxSecret));
  return h;
}

// Only rank 0 of a world of 3 is real. Every bad hello claims a (rank,
// root) that is still free, so the check under test is the only one that
// can refuse it.
void test_strangers() {
  const int f0 = g_failures;
  World w;
  if (!make_world(w, 3, 4096, 4096, /*make=*/1)) return;
  Rank& victim = w[0];
  const Layout& L = victim.layout;
  const int port = port_of(w.details[0]);
  // One genuine peer stream, rank 1 root 0, to claim a duplicate of below.
  const int real = raw_connect(port);
  send_hello(real, make_hello(kSecret, 3, 1, 0));
  CHECK(read_ack(real), "a correct hello got no ack");
  const std::vector<uint8_t> before(victim.base(), victim.base() + L.total);
  std::string flipped = kSecret;
  flipped.back() ^= 1;
  struct Case {
    const char* what;
    Hello hello;
    bool send_hello;
  } cases[] = {
      {"wrong secret", make_hello("not-the-secret", 3, 2, 0), true},
      {"secret that is a prefix of the real one", make_hello(kSecret.substr(0, 8), 3, 2, 1), true},
      {"secret with one bit flipped", make_hello(flipped, 3, 2, 0), true},
      {"secret with its length overstated", [&] {
         Hello h = make_hello(kSecret, 3, 2, 0);
         h.secret_len += 1;
         return h;
       }(), true},
      {"right secret, our own rank", make_hello(kSecret, 3, 0, 0), true},
      {"right secret, rank out of range", make_hello(kSecret, 3, 5, 0), true},
      {"right secret, negative root", make_hello(kSecret, 3, 2, -1), true},
      {"right secret, root out of range", make_hello(kSecret, 3, 2, 2), true},
      {"right secret, wrong world", make_hello(kSecret, 4, 2, 0), true},
      {"right secret, not a hello's magic", [] {
         Hello h = make_hello(kSecret, 3, 2, 0);
         h.magic = kFrameMagic;
         return h;
       }(), true},
      {"right secret, (rank, root) already connected", make_hello(kSecret, 3, 1, 0), true},
      {"wrong wire version", [] {
         Hello h = make_hello(kSecret, 3, 2, 0);
         h.version = 2;
         return h;
       }(), true},
      {"no hello, a data frame first", Hello{}, false},
  };
  for (const Case& c : cases) {
    const int fd = raw_connect(port);
    CHECK(fd >= 0, "%s: could not connect to the listener", c.what);
    if (fd < 0) continue;
    if (c.send_hello) send_hello(fd, c.hello);
    // Then what a writer would send: a payload into rank 2's slot and its flag.
    FrameHeader h{kFrameMagic, L.recv_offset(0, 2), 256, L.flag_offset(flag_index(L, 2, 0)), 12345};
    std::vector<uint8_t> payload(256, 0xee);
    for (int k = 0; k < 3; ++k) {
      raw_send(fd, &h, sizeof h);
      raw_send(fd, payload.data(), payload.size());
    }
    const long got = read_until_closed(fd);
    CHECK(got == 0, "%s: the listener should close without answering (read %ld bytes, -1 = still open)", c.what, got);
    close(fd);
  }
  uint64_t changed = 0;
  for (uint64_t i = 0; i < L.total; ++i) changed += victim.base()[i] != before[i];
  CHECK(changed == 0, "strangers changed %llu bytes of the region", (unsigned long long)changed);
  // The genuine stream still works after all that: the receiver stayed in step.
  std::vector<uint8_t> payload(8, 0x3c);
  FrameHeader h{kFrameMagic, L.recv_offset(1, 1), 8, L.flag_offset(flag_index(L, 1, 0)), 77};
  raw_send(real, &h, sizeof h);
  raw_send(real, payload.data(), payload.size());
  CHECK(wait_flag(victim.base(), L.flag_offset(flag_index(L, 1, 0)), 77) &&
            memcmp(victim.base() + L.recv_offset(1, 1), payload.data(), 8) == 0,
        "the genuine stream stopped working");
  CHECK(victim.lost_count() == 0, "strangers are not peers, yet on_peer_lost fired: %s", victim.lost_text().c_str());
  printf("%s strangers: %zu kinds of bad connection closed, nothing written, no peer reported lost\n", verdict(f0),
         sizeof cases / sizeof cases[0]);
  victim.t->close();
  close(real);
}

// A world of 3 where only rank 0 is real and the test plays ranks 1 and 2
// through raw sockets with the right secret: what an authenticated but
// faulty or dying peer can do.
void test_faulty_peer() {
  const int f0 = g_failures;
  World w;
  if (!make_world(w, 3, 4096, 4096, /*make=*/1)) return;
  Rank& me = w[0];
  const Layout& L = me.layout;
  const int port = port_of(w.details[0]);
  memset(me.base() + L.inbox_hi(), 0xcd, L.total - L.inbox_hi());

  // Positive control: an authenticated raw stream does write.
  const int a = raw_connect(port);
  send_hello(a, make_hello(kSecret, 3, 2, 0));
  CHECK(read_ack(a), "a correct hello got no ack");
  std::vector<uint8_t> payload(64, 0x5a);
  FrameHeader h{kFrameMagic, L.recv_offset(0, 2), 64, L.flag_offset(flag_index(L, 2, 0)), 5};
  raw_send(a, &h, sizeof h);
  raw_send(a, payload.data(), payload.size());
  CHECK(wait_flag(me.base(), L.flag_offset(flag_index(L, 2, 0)), 5), "an authenticated frame was not delivered");
  CHECK(memcmp(me.base() + L.recv_offset(0, 2), payload.data(), 64) == 0, "authenticated payload differs");
  // A length that wraps around 2^64 past the inbox.
  FrameHeader wrap{kFrameMagic, L.inbox_lo() + 32, ~0ull - 15, L.flag_offset(flag_index(L, 2, 0)), 6};
  raw_send(a, &wrap, sizeof wrap);
  raw_send(a, payload.data(), payload.size());
  CHECK(me.wait_lost(1), "a wrapping length was not reported");
  CHECK(read_until_closed(a) == 0, "the stream of a wrapping length should be closed");
  close(a);
  CHECK(load_acquire(reinterpret_cast<uint64_t*>(me.base() + L.flag_offset(flag_index(L, 2, 0)))) == 5,
        "the refused frame's flag was stored");
  for (uint64_t i = L.inbox_hi(); i < L.total; ++i)
    if (me.base()[i] != 0xcd) {
      CHECK(false, "byte %llu past the inbox was written", (unsigned long long)i);
      break;
    }

  // A peer that dies: EOF without a goodbye, in the middle of a frame.
  const int b = raw_connect(port);
  send_hello(b, make_hello(kSecret, 3, 2, 1));
  CHECK(read_ack(b), "hello for rank 2 root 1 got no ack");
  FrameHeader half{kFrameMagic, L.recv_offset(0, 2), 64, L.flag_offset(flag_index(L, 2, 1)), 9};
  raw_send(b, &half, sizeof half);
  raw_send(b, payload.data(), 10);
  close(b);
  CHECK(me.wait_lost(2), "EOF from an authenticated peer was not reported");
  // A peer that closes on purpose: goodbye, then EOF.
  const int c = raw_connect(port);
  send_hello(c, make_hello(kSecret, 3, 1, 0));
  CHECK(read_ack(c), "hello for rank 1 root 0 got no ack");
  FrameHeader bye{kByeMagic, 0, 0, 0, 0};
  raw_send(c, &bye, sizeof bye);
  close(c);
  // An orderly close is no failure: it must not be reported as a lost peer.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  {
    std::lock_guard<std::mutex> lk(me.lost_mu);
    CHECK(me.lost.size() == 2, "EOF after a goodbye was reported as a lost peer (%zu reports)", me.lost.size());
    if (me.lost.size() >= 2) {
      CHECK(me.lost[0].first == 2 && me.lost[0].second.find("outside its own slots") != std::string::npos,
            "wrap report: %s", me.lost[0].second.c_str());
      CHECK(me.lost[1].first == 2 && me.lost[1].second.find("connection closed by rank 2 (root 1)") == 0 &&
                me.lost[1].second.find("middle of a frame") != std::string::npos,
            "EOF report: %s", me.lost[1].second.c_str());
    }
  }
  CHECK(load_acquire(reinterpret_cast<uint64_t*>(me.base() + L.flag_offset(flag_index(L, 2, 1)))) == 0,
        "a half-received frame's flag was stored");
  printf("%s faulty peer: wrapping length refused, EOF mid-frame reported, orderly goodbye not\n", verdict(f0));
  me.t->close();
  me.t->close();  // idempotent
}

// ---- connect errors ----

void test_connect_errors() {
  const int f0 = g_failures;
  {  // rank 1 exists but never calls connect(): rank 0 times out naming it.
    World w;
    if (!make_world(w, 2, 4096, 4096)) return;
    const auto t0 = Clock::now();
    Status s = w[0].t->connect(w.details, 1.0);
    CHECK(!s.ok() && s.message().find("rank 1 (root 0, 1)") != std::string::npos && since(t0) < 5,
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
    w.details.push_back(strf("arx-tcp/1 127.0.0.1 %d", ntohs(a.sin_port)));
    Status s = w[0].t->connect(w.details, 0.5);
    CHECK(!s.ok() && s.message().find("could not connect to rank 1") != std::string::npos &&
              s.message().find("JAX_ARX_TCP_ADDR") != std::string::npos,
          "dial to nowhere: '%s'", s.message().c_str());
    printf("%s connect unreachable: '%.90s...'\n", verdict(f0), s.message().c_str());
  }
  {  // details of another carrier.
    World w;
    if (!make_world(w, 2, 4096, 4096, /*make=*/1)) return;
    w.details.push_back("shm /jax_arx-1-abc");
    Status s = w[0].t->connect(w.details, 0.5);
    CHECK(!s.ok() && s.message().find("rank 1's connection details") != std::string::npos, "bad details: '%s'",
          s.message().c_str());
  }
  {  // ranks of different communicators: secrets differ.
    World w;
    if (!make_world(w, 2, 4096, 4096, -1, {kSecret, kSecret + "x"})) return;
    std::vector<Status> st = connect_all(w, 2.0);
    for (int r = 0; r < 2; ++r)
      CHECK(!st[r].ok() && st[r].message().find("rejected") != std::string::npos, "rank %d: '%s'", r,
            st[r].message().c_str());
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
    ctx.secret = std::string(65, 'x');
    CHECK(!make_tcp_transport(ctx, t).ok(), "a 65-byte secret was accepted");
    ctx.secret = std::string(64, 'x');
    for (const char* bad : {"::1", "0.0.0.0", "127.0.0.1:99999", "127.0.0.1:x"}) {
      cfg.tcp_addr = bad;
      Status s = make_tcp_transport(ctx, t);
      CHECK(!s.ok(), "tcp_addr '%s' was accepted", bad);
    }
    cfg.tcp_addr = "127.0.0.1:0";
    Status s = make_tcp_transport(ctx, t);
    CHECK(s.ok() && t->details().rfind("arx-tcp/1 127.0.0.1 ", 0) == 0, "tcp_addr 127.0.0.1:0: %s %s",
          s.message().c_str(), s.ok() ? t->details().c_str() : "");
    const int port = s.ok() ? port_of(t->details()) : 0;
    t.reset();  // the destructor closes
    cfg.tcp_addr = strf("localhost:%d", port);  // a fixed port, free again, taken with SO_REUSEADDR
    s = make_tcp_transport(ctx, t);
    CHECK(s.ok() && t && t->details() == strf("arx-tcp/1 127.0.0.1 %d", port), "fixed port: %s",
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
                              4096, w[0].layout.flag_offset(flag_index(w[0].layout, 0, root)), 1);
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    CHECK(!err[root].ok() && err[root].message().find(strf("rank 1 (root %d)", root)) != std::string::npos,
          "puts to a closed peer on root %d: '%s'", root, err[root].message().c_str());
  }
  // The first failed send is the sticky one.
  CHECK(w[0].t->poll().message() == err[1].message(), "poll: '%s', first failed put: '%s'",
        w[0].t->poll().message().c_str(), err[1].message().c_str());
  // The puts failed because rank 1's sockets are gone, so its goodbyes and
  // EOFs reached rank 0 before; give rank 0's receiver a moment to read
  // them, then check that it did not report them as a lost peer.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
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
  test_strangers();
  test_faulty_peer();
  test_connect_errors();
  test_close();
  if (g_failures) {
    fprintf(stderr, "test_tcp_transport: %d check(s) FAILED\n", g_failures);
    return 1;
  }
  printf("test_tcp_transport: all passed in %.1f s\n", since(t0));
  return 0;
}

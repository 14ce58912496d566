// The tcp carrier's tests' rig: ranks as threads of one process, each with
// its own region, some real carriers (Rank) and some played by the test
// (FakeRank: its own key pair and listener, speaking the handshake with
// tcp_auth's functions, as a faulty peer or an attacker holding a key
// would), and raw sockets for strangers who hold none.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
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
#include "transport/tcp_auth.h"
#include "transport/tcp_wire.h"
#include "transport/transport.h"

namespace arx::tcp_test {

using namespace arx::tcp_wire;
using Clock = std::chrono::steady_clock;

inline int g_failures = 0;
inline std::mutex g_print_mu;

#define CHECK(cond, ...)                                              \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::lock_guard<std::mutex> lk_(::arx::tcp_test::g_print_mu);   \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                   \
      fprintf(stderr, "\n");                                          \
      ++::arx::tcp_test::g_failures;                                  \
    }                                                                 \
  } while (0)

inline const std::string kSecret = "test-secret-\x01\x02\x03-0123456789abcdef";

// "PASS" when no check failed since `before` (g_failures then).
inline const char* verdict(int before) { return g_failures == before ? "PASS" : "FAIL"; }

inline double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Waits (bounded) for a flag to reach `want`; sleeps between looks so the
// receiver threads run on a 2-core machine.
inline bool wait_flag(const uint8_t* base, uint64_t off, uint64_t want, double timeout_s = 10) {
  const auto t0 = Clock::now();
  const uint64_t* p = reinterpret_cast<const uint64_t*>(base + off);
  while (load_acquire(p) != want) {
    if (since(t0) > timeout_s) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return true;
}

// Flag words the tests signal with: source `src`'s words of the bulk family,
// which sit in the same place at every world (the psum family's depend on it).
inline int flag_index(int src, int root) { return bulk_words(kRoots).index(src, 0, root); }
inline int second_flag_index(int src, int root) { return bulk_words(kRoots).index(src, 1, root); }

inline uint64_t flag_at(const uint8_t* base, uint64_t off) {
  return load_acquire(reinterpret_cast<const uint64_t*>(base + off));
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

// ---- raw sockets ----

inline int raw_connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
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

inline void raw_send(int fd, const void* p, size_t n) {
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
// stayed open for timeout_s. `first` gets the first 8 bytes read, if any.
inline long read_until_closed(int fd, double timeout_s = 10, uint64_t* first = nullptr) {
  const auto t0 = Clock::now();
  long total = 0;
  uint8_t buf[256];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const int left = (int)((timeout_s - since(t0)) * 1000);
    if (left <= 0 || poll(&p, 1, left) <= 0) return -1;
    const ssize_t r = recv(fd, buf, sizeof buf, 0);
    if (r <= 0) return total;
    if (first && total == 0 && r >= 8) memcpy(first, buf, 8);
    total += r;
  }
}

inline int port_of(const std::string& details) {
  tcp_auth::Details d;
  std::string why;
  return tcp_auth::parse_details(details, d, why) ? d.port : -1;
}

// Waits (bounded) until the peer of `fd` has closed its end: the test's side
// shut its writes, so a receiver that read everything up to that EOF and
// then closed the stream shows as EOF here. Whether it did within timeout_s.
inline bool wait_peer_closed(int fd, double timeout_s = 10) {
  const auto t0 = Clock::now();
  while (since(t0) < timeout_s) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 50) > 0) {
      char c;
      const ssize_t r = recv(fd, &c, 1, MSG_DONTWAIT);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return true;
    }
  }
  return false;
}

// This network namespace's TCP sockets (/proc/net/tcp and tcp6): calls
// fn(local port, remote port, state, bytes queued to send) for each.
template <typename Fn>
void each_tcp_socket(Fn fn) {
  for (const char* path : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    FILE* f = fopen(path, "r");
    if (!f) continue;
    char line[512];
    if (!fgets(line, sizeof line, f)) {  // the header
      fclose(f);
      continue;
    }
    while (fgets(line, sizeof line, f)) {
      char local[64] = {}, remote[64] = {};
      unsigned state = 0;
      unsigned long tx = 0;
      if (sscanf(line, " %*d: %63s %63s %x %lx", local, remote, &state, &tx) != 4) continue;
      const char *lc = strrchr(local, ':'), *rc = strrchr(remote, ':');
      if (lc && rc) fn((int)strtol(lc + 1, nullptr, 16), (int)strtol(rc + 1, nullptr, 16), state, tx);
    }
    fclose(f);
  }
}

// The streams open on local port `port` (ESTABLISHED or CLOSE_WAIT, the
// listener aside): a receiver's inbound streams that it has not closed yet.
inline int streams_on(int port) {
  int n = 0;
  each_tcp_socket(
      [&](int local, int, unsigned state, unsigned long) { n += local == port && (state == 0x01 || state == 0x08); });
  return n;
}

// Bytes queued to send on the streams to remote port `port`.
inline unsigned long queued_to(int port) {
  unsigned long n = 0;
  each_tcp_socket([&](int, int remote, unsigned, unsigned long tx) {
    if (remote == port) n += tx;
  });
  return n;
}

// Waits (bounded) until no stream is open on `port`; whether none was left
// within timeout_s.
inline bool wait_streams_closed(int port, double timeout_s = 10) {
  const auto t0 = Clock::now();
  while (streams_on(port) > 0) {
    if (since(t0) > timeout_s) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// ---- a rank the test plays: its own key pair and listener ----
//
// start() derives its keys from everyone's details and answers dials with
// the acceptor's handshake; dial() opens an authenticated stream to a real
// rank. With drain, accepted streams are read (and dropped); without, they
// are never read: a peer that is stopped.
struct FakeRank {
  int rank = 0, world = 0;
  std::string secret = kSecret;
  tcp_auth::KeyPair keys{};
  int listen_fd = -1, port = 0;
  crypto::Digest view{};
  std::vector<crypto::Digest> key;  // [peer]
  std::atomic<bool> stop{false}, drain{true};
  std::atomic<int> handshakes{0};
  std::thread th;
  std::vector<int> fds;  // accepted and dialled streams, closed at the end

  FakeRank(int r, int w) : rank(r), world(w) {
    tcp_auth::make_key_pair(keys);
    listen_fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listen_fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    listen(listen_fd, 64);
    socklen_t al = sizeof a;
    getsockname(listen_fd, reinterpret_cast<sockaddr*>(&a), &al);
    port = ntohs(a.sin_port);
  }
  ~FakeRank() {
    stop.store(true);
    if (th.joinable()) th.join();
    for (int fd : fds) close(fd);
    close(listen_fd);
  }
  std::string details() const { return tcp_auth::format_details("127.0.0.1", port, keys.pub); }

  void start(const std::vector<std::string>& all) {
    view = tcp_auth::view_of(all);
    key.assign(world, crypto::Digest{});
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      tcp_auth::Details d;
      std::string why;
      if (tcp_auth::parse_details(all[p], d, why)) tcp_auth::pair_key(keys, rank, p, d.pub, view, secret, key[p]);
    }
    th = std::thread([this] { serve(); });
  }

  // An authenticated stream to real rank `peer` at `port_of_peer`, or -1.
  int dial(int port_of_peer, int peer, int root, tcp_auth::Result* out = nullptr) {
    const int fd = raw_connect(port_of_peer);
    if (fd < 0) return -1;
    Hello h;
    tcp_auth::make_hello(world, rank, root, view, h);
    const tcp_auth::Result r = tcp_auth::authenticate(fd, h, key[peer], tcp_io::deadline_after(10));
    if (out) *out = r;
    if (r.outcome != tcp_auth::Outcome::kOk) {
      close(fd);
      return -1;
    }
    fds.push_back(fd);
    return fd;
  }

 private:
  void serve() {
    std::vector<int> open;
    while (!stop.load()) {
      std::vector<pollfd> p{{listen_fd, POLLIN, 0}};
      if (drain.load())
        for (int fd : open) p.push_back({fd, POLLIN, 0});
      if (poll(p.data(), p.size(), 20) <= 0) continue;
      for (size_t i = 1; i < p.size(); ++i) {
        if (!p[i].revents) continue;
        uint8_t buf[1 << 16];
        if (recv(p[i].fd, buf, sizeof buf, MSG_DONTWAIT) == 0) shutdown(p[i].fd, SHUT_RDWR);
      }
      if (!(p[0].revents & POLLIN)) continue;
      const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) continue;
      const auto deadline = tcp_io::deadline_after(10);
      Hello h{};
      Challenge c{};
      Proof pr{};
      std::string why;
      const bool ok = tcp_io::recv_exact(fd, &h, sizeof h, deadline) == 0 &&
                      tcp_auth::check_hello(h, rank, world, view, why) == Reject::kNone &&
                      tcp_auth::make_challenge(h, key[h.rank], c) && send(fd, &c, sizeof c, MSG_NOSIGNAL) > 0 &&
                      tcp_io::recv_exact(fd, &pr, sizeof pr, deadline) == 0 &&
                      tcp_auth::proof_valid(h, c, key[h.rank], pr);
      const Verdict v{ok ? kAckMagic : kRejectMagic, ok ? 0u : (uint32_t)Reject::kProof, 0};
      send(fd, &v, sizeof v, MSG_NOSIGNAL);
      if (ok) {
        handshakes.fetch_add(1);
        open.push_back(fd);
      } else {
        close(fd);
      }
    }
    for (int fd : open) close(fd);
  }
};

struct World {
  int world = 0;
  std::vector<std::unique_ptr<Rank>> ranks;      // the real ones: ranks [0, ranks.size())
  std::vector<std::unique_ptr<FakeRank>> fakes;  // the test's: ranks [ranks.size(), world)
  std::vector<std::string> details;
  Rank& operator[](int r) { return *ranks[r]; }
  FakeRank& fake(int r) { return *fakes[r - ranks.size()]; }
};

// Creates `make` real ranks of a world of `world` (the rest are FakeRanks,
// started). secrets[r]: rank r's shared secret (default kSecret for all).
inline bool make_world(World& w, int world, uint64_t slot, uint64_t send, int make = -1,
                       const std::vector<std::string>& secrets = {}, const std::string& tcp_addr = "",
                       uint64_t bulk_bytes = 0, double timeout_s = 10) {
  w.world = world;
  if (make < 0) make = world;
  const Layout layout = Layout::of(Geometry{(uint32_t)world, slot, send, bulk_bytes});
  for (int r = 0; r < make; ++r) {
    auto rk = std::make_unique<Rank>();
    rk->rank = r;
    rk->layout = layout;
    rk->config.tcp_addr = tcp_addr;
    rk->config.timeout_s = timeout_s;
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
    w.details.push_back(rk->t->details());
    w.ranks.push_back(std::move(rk));
  }
  for (int r = make; r < world; ++r) {
    w.fakes.push_back(std::make_unique<FakeRank>(r, world));
    if (!secrets.empty()) w.fakes.back()->secret = secrets[r];
    w.details.push_back(w.fakes.back()->details());
  }
  for (auto& f : w.fakes) f->start(w.details);
  return true;
}

// Every real rank calls connect() at once, as on a real cluster.
inline std::vector<Status> connect_all(World& w, double timeout_s = 10) {
  std::vector<Status> st(w.ranks.size());
  std::vector<std::thread> th;
  for (size_t r = 0; r < w.ranks.size(); ++r)
    th.emplace_back([&, r] { st[r] = w.ranks[r]->t->connect(w.details, timeout_s); });
  for (auto& t : th) t.join();
  return st;
}

inline bool connect_ok(World& w) {
  bool ok = true;
  for (const Status& s : connect_all(w)) {
    CHECK(s.ok(), "connect: %s", s.message().c_str());
    ok = ok && s.ok();
  }
  return ok;
}

// Real rank 0's connect() with every other rank a FakeRank: the fakes
// accept its dials, and dial in on both roots themselves. Returns connect()'s
// status; `streams[r][root]` are the fakes' authenticated streams into rank 0.
inline Status connect_with_fakes(World& w, std::vector<std::vector<int>>& streams, double timeout_s = 10) {
  Status st;
  std::thread t([&] { st = w[0].t->connect(w.details, timeout_s); });
  const int port = port_of(w.details[0]);
  streams.assign(w.world, std::vector<int>(kRoots, -1));
  for (int r = 1; r < w.world; ++r)
    for (int root = 0; root < kRoots; ++root) {
      tcp_auth::Result res;
      streams[r][root] = w.fake(r).dial(port, 0, root, &res);
      CHECK(streams[r][root] >= 0, "fake rank %d root %d could not authenticate: outcome %d reject %d %s", r, root,
            (int)res.outcome, (int)res.reject, res.detail.c_str());
    }
  t.join();
  return st;
}

inline uint8_t pattern(int src, uint64_t i) { return (uint8_t)(src * 37 + i * 7 + (i >> 9) + 1); }

}  // namespace arx::tcp_test

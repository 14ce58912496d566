// The tcp carrier: a connection per (peer, root), so the two roots are two
// ordered streams. A put is one frame on its (peer, root) stream: a fixed
// header (where the bytes go, where the flag goes, the flag's value) and the
// payload. One receiver thread per endpoint reads every inbound stream,
// checks each frame against the inbox before writing a byte, receives the
// payload straight into the region and then stores the flag with release.
//
// Why "data before flag" holds: a stream delivers bytes in the order they
// were sent, and the receiver finishes a frame's payload before it stores
// that frame's flag (release), so a reader that acquires the flag sees the
// payload, and every earlier frame of that stream, in place.
//
// Who may write: the first frame on every inbound stream must be a HELLO
// carrying the communicator's secret. Until it is checked the receiver reads
// into its own buffer only, so a connection without the secret never
// causes a write into the region.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "base/atomics.h"
#include "transport/tcp_wire.h"
#include "transport/transport.h"

#if defined(__SANITIZE_THREAD__)
#define ARX_TCP_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ARX_TCP_TSAN 1
#endif
#endif

namespace arx {
namespace {

using namespace tcp_wire;

using Clock = std::chrono::steady_clock;


std::string errno_text(int e) { return strf("%s (errno %d)", strerror(e), e); }

double seconds_left(Clock::time_point deadline) {
  return std::chrono::duration<double>(deadline - Clock::now()).count();
}

int ms_left(Clock::time_point deadline) {
  const double s = seconds_left(deadline);
  return s <= 0 ? 0 : (int)std::min(s * 1000 + 1, 1e9);
}

std::string sockaddr_text(const sockaddr_in& a) {
  char ip[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip);
  return strf("%s:%d", ip, (int)ntohs(a.sin_port));
}

// Resolves an IPv4 host name or dotted address.
bool resolve_ipv4(const std::string& host, in_addr& out, std::string& err) {
  if (inet_pton(AF_INET, host.c_str(), &out) == 1) return true;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || !res) {
    err = rc ? gai_strerror(rc) : "no IPv4 address";
    return false;
  }
  out = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return true;
}

// Writes every byte of iov[0..n) (which it consumes), retrying partial
// writes and EINTR. Returns 0 or the errno that ended the stream.
int send_all(int fd, iovec* iov, int n) {
  while (n > 0) {
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = (size_t)n;
    // MSG_NOSIGNAL: a peer that went away is an error to report, not SIGPIPE.
    const ssize_t w = ::sendmsg(fd, &m, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    size_t done = (size_t)w;
    while (n > 0 && done >= iov->iov_len) {
      done -= iov->iov_len;
      ++iov;
      --n;
    }
    if (n > 0) {
      iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + done;
      iov->iov_len -= done;
    }
  }
  return 0;
}

void set_nodelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// One outbound stream to (peer, root). put() and close() take `mu`; the
// endpoint's proxy is the only caller of put(), but two threads putting to
// different links never share a lock, and to one link they serialize, so a
// frame is never interleaved with another.
struct OutLink {
  std::mutex mu;
  std::atomic<int> fd{-1};  // atomic: close() may shut it down while a put holds mu
  int error = 0;            // under mu: errno of the first failed send; the stream is dead after it
#ifdef ARX_TCP_TSAN
  std::vector<uint8_t> bounce;  // under mu: see put()
#endif
};

// One inbound stream, owned by the receiver thread alone.
struct InLink {
  enum class Stage { kHello, kHeader, kPayload };
  int fd = -1;
  std::string from;  // "ip:port", for messages
  Clock::time_point hello_deadline;
  Stage stage = Stage::kHello;
  int peer = -1, root = -1;  // set once the hello is accepted; peer >= 0 means authenticated
  bool said_bye = false;
  alignas(8) uint8_t buf[sizeof(Hello)];  // the hello or a frame header, as it arrives
  size_t got = 0;
  FrameHeader hdr{};
  uint64_t payload_got = 0;
};

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(const TransportContext& ctx) : ctx_(ctx) {
    if (ctx.config) cfg_ = *ctx.config;
  }
  ~TcpTransport() override {
    close();
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  Status open();

  TransportKind kind() const override { return TransportKind::kTcp; }
  int roots() const override { return kRoots; }
  std::string details() const override { return strf("%s %s %d", kDetailsTag, addr_.c_str(), port_); }
  Status connect(const std::vector<std::string>& details, double timeout_s) override;
  Status put(int peer, int root, const void* src, uint64_t offset, uint64_t len, uint64_t flag_offset,
             uint64_t flag_value) override;

  Status poll() override {
    std::lock_guard<std::mutex> lk(send_error_mu_);
    return send_error_;
  }
  void close() override;

 private:
  int link_index(int peer, int root) const { return peer * kRoots + root; }
  void log(const std::string& msg) const {
    if (cfg_.verbose) fprintf(stderr, "jax_arx: %s: tcp: %s\n", ctx_.label.c_str(), msg.c_str());
  }
  Status parse_details(int peer, const std::string& d, sockaddr_in& out) const;
  Status dial(int peer, int root, const sockaddr_in& to, Clock::time_point deadline, int& fd_out) const;
  Status await_ack(int peer, int root, int fd, const sockaddr_in& to, Clock::time_point deadline) const;

  // Receiver thread.
  void receive_loop();
  void accept_all();
  bool service(InLink& c);
  bool on_hello(InLink& c);
  bool on_header(InLink& c);
  void finish_frame(InLink& c);
  bool link_down(InLink& c, const std::string& why, bool eof = false);
  void reject(const InLink& c, const std::string& why);

  TransportContext ctx_;
  Config cfg_;
  std::string addr_;  // advertised address
  int port_ = 0;
  int listen_fd_ = -1;  // the receiver thread owns it once started
  int wake_fd_ = -1;    // eventfd: close() wakes the receiver out of poll()
  std::thread thread_;
  std::vector<std::unique_ptr<InLink>> in_;  // receiver thread only
  Clock::time_point accept_resume_{};        // receiver thread only: accept() failed, wait until then
  std::vector<std::unique_ptr<OutLink>> out_;

  // stop_: the receiver thread exits at its next wake-up. closing_: close()
  // was called here, so a stream that ends is our doing, not a lost peer.
  std::atomic<bool> stop_{false}, closing_{false};
  std::atomic<bool> connected_{false};
  bool connect_called_ = false;

  // Inbound authentication, written by the receiver thread, awaited by connect().
  std::mutex auth_mu_;
  std::condition_variable auth_cv_;
  std::vector<bool> authenticated_;   // [peer * kRoots + root]
  std::vector<std::string> rejects_;  // the last few rejected connections, for connect()'s error

  std::mutex send_error_mu_;
  Status send_error_;  // the first failed send, sticky

  std::mutex close_mu_, join_mu_;
  bool outbound_closed_ = false;  // under close_mu_
};

Status TcpTransport::open() {
  const int world = ctx_.world;
  authenticated_.assign((size_t)world * kRoots, false);
  for (int i = 0; i < world * kRoots; ++i) out_.push_back(std::make_unique<OutLink>());

  // Listen address: JAX_ARX_TCP_ADDR as "host" or "host:port"; without it,
  // every interface and 127.0.0.1 advertised, which serves one host only
  // (the Python side passes the address for multi-host runs).
  std::string host = "0.0.0.0";
  int port = 0;
  addr_ = "127.0.0.1";
  if (!cfg_.tcp_addr.empty()) {
    host = cfg_.tcp_addr;
    const size_t colon = host.rfind(':');
    if (colon != std::string::npos) {
      if (host.find(':') != colon)
        return Status::Error(strf("jax_arx: %s: JAX_ARX_TCP_ADDR=%s looks like an IPv6 address; the tcp carrier "
                                  "takes an IPv4 address or host name, optionally with :port",
                                  ctx_.label.c_str(), cfg_.tcp_addr.c_str()));
      const std::string p = host.substr(colon + 1);
      char* end = nullptr;
      const long v = strtol(p.c_str(), &end, 10);
      if (p.empty() || *end || v < 0 || v > 65535)
        return Status::Error(strf("jax_arx: %s: JAX_ARX_TCP_ADDR=%s has a bad port '%s' (want host or host:port, "
                                  "port 0-65535)",
                                  ctx_.label.c_str(), cfg_.tcp_addr.c_str(), p.c_str()));
      port = (int)v;
      host = host.substr(0, colon);
    }
  }
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons((uint16_t)port);
  std::string err;
  if (!resolve_ipv4(host, sa.sin_addr, err))
    return Status::Error(strf("jax_arx: %s: cannot resolve the tcp listen address '%s': %s; set JAX_ARX_TCP_ADDR to "
                              "this host's IPv4 address on the network that joins the ranks",
                              ctx_.label.c_str(), host.c_str(), err.c_str()));
  if (!cfg_.tcp_addr.empty()) {
    if (sa.sin_addr.s_addr == htonl(INADDR_ANY))
      return Status::Error(strf("jax_arx: %s: JAX_ARX_TCP_ADDR=%s cannot be advertised to peers; give this host's "
                                "own address on the network that joins the ranks",
                                ctx_.label.c_str(), cfg_.tcp_addr.c_str()));
    char ip[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof ip);
    addr_ = ip;  // numeric, so peers need not resolve our name
  }

  listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (listen_fd_ < 0)
    return Status::Error(strf("jax_arx: %s: socket() failed: %s", ctx_.label.c_str(), errno_text(errno).c_str()));
  const int one = 1;
  // A fixed port can be taken again while the last run's streams linger in TIME_WAIT.
  setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || ::listen(listen_fd_, 128) != 0) {
    const int e = errno;
    ::close(listen_fd_);
    listen_fd_ = -1;
    return Status::Error(strf("jax_arx: %s: cannot listen on %s: %s; set JAX_ARX_TCP_ADDR to an address of this "
                              "host (host, or host:port with a free port)",
                              ctx_.label.c_str(), sockaddr_text(sa).c_str(), errno_text(e).c_str()));
  }
  socklen_t sl = sizeof sa;
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&sa), &sl);
  port_ = ntohs(sa.sin_port);

  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) {
    const int e = errno;
    ::close(listen_fd_);
    listen_fd_ = -1;
    return Status::Error(strf("jax_arx: %s: eventfd() failed: %s", ctx_.label.c_str(), errno_text(e).c_str()));
  }
  log(strf("listening on %s, advertising %s:%d", sockaddr_text(sa).c_str(), addr_.c_str(), port_));
  // Listening and accepting start now, not in connect(): a peer may dial
  // as soon as it has our details, before this rank reaches connect().
  thread_ = std::thread([this] { receive_loop(); });
  return Status::Ok();
}

Status TcpTransport::parse_details(int peer, const std::string& d, sockaddr_in& out) const {
  char tag[16] = {}, host[256] = {};
  int port = -1, used = 0;
  if (sscanf(d.c_str(), "%15s %255s %d%n", tag, host, &port, &used) != 3 || strcmp(tag, kDetailsTag) != 0 ||
      (size_t)used != d.size() || port <= 0 || port > 65535)
    return Status::Error(strf("jax_arx: %s: rank %d's connection details '%s' are not the tcp carrier's (expected "
                              "'%s <ipv4> <port>'); do all ranks use the same transport and jax_arx version?",
                              ctx_.label.c_str(), peer, d.c_str(), kDetailsTag));
  std::string err;
  out = sockaddr_in{};
  out.sin_family = AF_INET;
  out.sin_port = htons((uint16_t)port);
  if (!resolve_ipv4(host, out.sin_addr, err))
    return Status::Error(strf("jax_arx: %s: cannot resolve rank %d's address '%s': %s", ctx_.label.c_str(), peer,
                              host, err.c_str()));
  return Status::Ok();
}

// Dials until it connects or the deadline passes: a peer's listener exists
// from its construction, but its process may not have got that far yet.
Status TcpTransport::dial(int peer, int root, const sockaddr_in& to, Clock::time_point deadline,
                          int& fd_out) const {
  int backoff_ms = 10;
  std::string last = "no attempt made";
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
      return Status::Error(strf("jax_arx: %s: socket() failed: %s", ctx_.label.c_str(), errno_text(errno).c_str()));
    int e = 0;
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) != 0) {
      e = errno;
      if (e == EINPROGRESS || e == EINTR) {
        // Non-blocking connect bounded by the deadline: an address that
        // drops SYNs must not hold us past timeout_s.
        pollfd p{fd, POLLOUT, 0};
        int n;
        while ((n = ::poll(&p, 1, ms_left(deadline))) < 0 && errno == EINTR) {}
        socklen_t el = sizeof e;
        if (n == 1) getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el);
        else e = ETIMEDOUT;
      }
    }
    if (e == 0) {
      fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // puts block until the kernel takes the bytes
      set_nodelay(fd);
      fd_out = fd;
      return Status::Ok();
    }
    ::close(fd);
    last = errno_text(e);
    if (stop_.load() || seconds_left(deadline) <= 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(backoff_ms, ms_left(deadline))));
    backoff_ms = std::min(backoff_ms * 2, 500);
  }
  return Status::Error(strf("jax_arx: %s: could not connect to rank %d at %s (root %d) before the timeout: %s; "
                            "check that the address is reachable from this host (set JAX_ARX_TCP_ADDR on every rank "
                            "to its address on the network that joins them) and that no firewall blocks the port",
                            ctx_.label.c_str(), peer, sockaddr_text(to).c_str(), root, last.c_str()));
}

// The peer's receiver answers an accepted hello with one ACK word and
// closes the stream on a rejected one.
Status TcpTransport::await_ack(int peer, int root, int fd, const sockaddr_in& to, Clock::time_point deadline) const {
  uint64_t ack = 0;
  size_t got = 0;
  while (got < sizeof ack) {
    pollfd p{fd, POLLIN, 0};
    const int n = ::poll(&p, 1, ms_left(deadline));
    if (n < 0 && errno == EINTR) continue;
    if (n == 0)
      return Status::Error(strf("jax_arx: %s: rank %d at %s (root %d) accepted the connection but did not answer "
                                "the hello within the timeout; is it a jax_arx tcp listener of this run?",
                                ctx_.label.c_str(), peer, sockaddr_text(to).c_str(), root));
    const ssize_t r = ::recv(fd, reinterpret_cast<uint8_t*>(&ack) + got, sizeof ack - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      return Status::Error(strf("jax_arx: %s: rank %d at %s (root %d) closed the connection after our hello: it "
                                "rejected it (%s). Usually the ranks come from different runs or communicators, so "
                                "their secrets differ; JAX_ARX_DEBUG=1 on that rank logs the reason",
                                ctx_.label.c_str(), peer, sockaddr_text(to).c_str(), root,
                                r == 0 ? "closed" : errno_text(errno).c_str()));
    got += (size_t)r;
  }
  if (ack != kAckMagic)
    return Status::Error(strf("jax_arx: %s: rank %d at %s (root %d) answered the hello with 0x%016llx, not an ack; "
                              "is it a jax_arx tcp listener of the same version?",
                              ctx_.label.c_str(), peer, sockaddr_text(to).c_str(), root, (unsigned long long)ack));
  return Status::Ok();
}

Status TcpTransport::connect(const std::vector<std::string>& details, double timeout_s) {
  const int world = ctx_.world, rank = ctx_.rank;
  if (connect_called_)
    return Status::Error(strf("jax_arx: %s: the tcp carrier's connect() was already called", ctx_.label.c_str()));
  connect_called_ = true;
  if ((int)details.size() != world)
    return Status::Error(strf("jax_arx: %s: got %zu connection details for a world of %d", ctx_.label.c_str(),
                              details.size(), world));
  const Clock::time_point deadline =
      Clock::now() + std::chrono::microseconds((int64_t)(std::max(timeout_s, 0.0) * 1e6));
  std::vector<sockaddr_in> to(world);
  for (int p = 0; p < world; ++p) ARX_RETURN_IF_ERROR(parse_details(p, details[p], to[p]));

  Hello hello{};
  hello.magic = kHelloMagic;
  hello.version = kWireVersion;
  hello.world = world;
  hello.rank = rank;
  hello.secret_len = (uint32_t)ctx_.secret.size();
  memcpy(hello.secret, ctx_.secret.data(), ctx_.secret.size());

  // Dial in send order (rank + 1, rank + 2, ...). Every rank dials and only
  // its receiver thread accepts, so ranks that all call connect() at once
  // never wait on each other's connect(): only on each other's listeners,
  // which exist since construction.
  for (int k = 1; k < world; ++k) {
    const int p = (rank + k) % world;
    for (int root = 0; root < kRoots; ++root) {
      int fd = -1;
      ARX_RETURN_IF_ERROR(dial(p, root, to[p], deadline, fd));
      hello.root = root;
      iovec iov{&hello, sizeof hello};
      const int e = send_all(fd, &iov, 1);
      OutLink& l = *out_[link_index(p, root)];
      {
        // Stored before closing_ is read, and close() sets closing_ before
        // it reads fd: one of the two sees the other, so the socket is
        // closed exactly once even when close() races with connect().
        std::lock_guard<std::mutex> lk(l.mu);
        l.fd.store(fd);
        if (closing_.load()) {
          l.fd.store(-1);
          ::close(fd);
          return Status::Error(strf("jax_arx: %s: tcp carrier closed while connecting", ctx_.label.c_str()));
        }
      }
      if (e)
        return Status::Error(strf("jax_arx: %s: sending the hello to rank %d at %s (root %d) failed: %s",
                                  ctx_.label.c_str(), p, sockaddr_text(to[p]).c_str(), root, errno_text(e).c_str()));
    }
  }
  for (int k = 1; k < world; ++k) {
    const int p = (rank + k) % world;
    for (int root = 0; root < kRoots; ++root)
      ARX_RETURN_IF_ERROR(await_ack(p, root, out_[link_index(p, root)]->fd.load(), to[p], deadline));
  }

  std::unique_lock<std::mutex> lk(auth_mu_);
  auto all_in = [&] {
    for (int p = 0; p < world; ++p)
      for (int root = 0; root < kRoots; ++root)
        if (p != rank && !authenticated_[link_index(p, root)]) return false;
    return true;
  };
  auth_cv_.wait_until(lk, deadline, [&] { return all_in() || stop_.load(); });
  if (!all_in()) {
    std::string missing, rejected;
    for (int p = 0; p < world; ++p) {
      std::string roots;
      for (int root = 0; root < kRoots; ++root)
        if (p != rank && !authenticated_[link_index(p, root)]) roots += strf("%s%d", roots.empty() ? "" : ", ", root);
      if (!roots.empty()) missing += strf("%srank %d (root %s)", missing.empty() ? "" : "; ", p, roots.c_str());
    }
    for (const std::string& r : rejects_) rejected += "; rejected: " + r;
    return Status::Error(strf("jax_arx: %s: %s: no authenticated tcp connection to %s:%d from %s within %.1f s. "
                              "Those ranks did not reach connect(), or cannot reach this address (set "
                              "JAX_ARX_TCP_ADDR to this host's address on the network that joins the ranks)%s",
                              ctx_.label.c_str(), stop_.load() ? "closed while connecting" : "timed out",
                              addr_.c_str(), port_, missing.c_str(), timeout_s, rejected.c_str()));
  }
  connected_.store(true, std::memory_order_release);
  log("connected to every peer on both roots");
  return Status::Ok();
}

Status TcpTransport::put(int peer, int root, const void* src, uint64_t offset, uint64_t len, uint64_t flag_offset,
                         uint64_t flag_value) {
  if (peer < 0 || peer >= ctx_.world || peer == ctx_.rank || root < 0 || root >= kRoots)
    return Status::Error(strf("jax_arx: %s: tcp put to rank %d root %d: no such link (world %d, this is rank %d, "
                              "%d roots)",
                              ctx_.label.c_str(), peer, root, ctx_.world, ctx_.rank, kRoots));
  if (!connected_.load(std::memory_order_acquire))
    return Status::Error(strf("jax_arx: %s: tcp put to rank %d before connect() succeeded", ctx_.label.c_str(), peer));
  // The receiver, not the sender, checks offset and len against its inbox:
  // it is the only side whose check a faulty or hostile sender cannot skip.
  OutLink& l = *out_[link_index(peer, root)];
  std::lock_guard<std::mutex> lk(l.mu);
  const int fd = l.fd.load();
  if (fd < 0 || closing_.load())
    return Status::Error(strf("jax_arx: %s: tcp put to rank %d (root %d) after close()", ctx_.label.c_str(), peer,
                              root));
  if (l.error == 0) {
    FrameHeader h{kFrameMagic, offset, len, flag_offset, flag_value};
#ifdef ARX_TCP_TSAN
    // ThreadSanitizer's send interceptors release the socket's sync before
    // the call and record the read of the bytes sent after it returns, so a
    // peer that acquires (by receiving them) is not ordered after that read.
    // The parity proof (comm/proxy.cc) orders the device side's next write
    // of this send buffer after the peers received these bytes, which TSan
    // then takes for a race with the recorded read. Sending a copy moves the
    // read of the region before the release, where the proof places it.
    l.bounce.assign(static_cast<const uint8_t*>(src), static_cast<const uint8_t*>(src) + len);
    src = l.bounce.data();
#endif
    iovec iov[2] = {{&h, sizeof h}, {const_cast<void*>(src), (size_t)len}};
    l.error = send_all(fd, iov, len ? 2 : 1);
    if (l.error == 0) return Status::Ok();
  }
  const Status s = Status::Error(strf("jax_arx: %s: tcp send to rank %d (root %d) failed: %s; that rank exited, "
                                      "closed its endpoint, rejected a frame (see its log), or its host is no "
                                      "longer reachable",
                                      ctx_.label.c_str(), peer, root, errno_text(l.error).c_str()));
  std::lock_guard<std::mutex> ek(send_error_mu_);
  if (send_error_.ok() && !closing_.load()) send_error_ = s;
  return s;
}

void TcpTransport::close() {
  {
    std::lock_guard<std::mutex> lk(close_mu_);
    if (!outbound_closed_) {
      outbound_closed_ = true;
      closing_.store(true);
      for (auto& lp : out_) {
        OutLink& l = *lp;
        if (l.fd.load() < 0) continue;
        // A polled try_lock rather than timed_mutex::try_lock_for, which
        // ThreadSanitizer does not model (it misses pthread_mutex_clocklock).
        std::unique_lock<std::mutex> ll(l.mu, std::defer_lock);
        for (int i = 0; i < 200 && !ll.try_lock(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (!ll.owns_lock()) {
          // A put has held the link this long: the peer stopped reading and
          // the send is blocked. Shutting the socket down fails that send.
          ::shutdown(l.fd.load(), SHUT_RDWR);
          ll.lock();
        }
        const int fd = l.fd.load();  // again under mu: connect() may have given it back
        if (fd < 0) continue;
        if (l.error == 0) {
          // BYE tells the peer this end closed on purpose, so its report
          // of us says so instead of "crashed". Best effort: never wait for room.
          FrameHeader bye{kByeMagic, 0, 0, 0, 0};
          while (::send(fd, &bye, sizeof bye, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno == EINTR) {}
        }
        l.fd.store(-1);
        ::close(fd);
      }
    }
  }
  stop_.store(true);
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    while (::write(wake_fd_, &one, sizeof one) < 0 && errno == EINTR) {}
  }
  {
    std::lock_guard<std::mutex> lk(auth_mu_);  // connect() may be waiting on auth_cv_
    auth_cv_.notify_all();
  }
  // close() called from on_peer_lost runs on the receiver thread, which
  // cannot join itself; it exits when the callback returns, and the next
  // close() (the destructor's) joins it.
  std::lock_guard<std::mutex> lk(join_mu_);
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

// ---- Receiver thread ----

void TcpTransport::receive_loop() {
  std::vector<pollfd> fds;
  while (!stop_.load()) {
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    int timeout_ms = -1;
    if (Clock::now() < accept_resume_) {
      fds[1].fd = -1;  // poll() skips it
      timeout_ms = ms_left(accept_resume_);
    }
    for (const auto& c : in_) {
      fds.push_back({c->fd, POLLIN, 0});
      if (c->peer < 0) {
        const int t = ms_left(c->hello_deadline);
        timeout_ms = timeout_ms < 0 ? t : std::min(timeout_ms, t);
      }
    }
    // Blocks until there is something to read: waiting here costs no CPU,
    // which matters where ranks outnumber cores and a spinning receiver
    // would starve the very peer it waits for.
    const int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n < 0 && errno != EINTR) {
      log(strf("poll() failed: %s; the receiver stops", errno_text(errno).c_str()));
      break;
    }
    if (stop_.load()) break;
    if (n > 0 && (fds[1].revents & POLLIN)) accept_all();
    // in_ may have grown in accept_all(): fds[2 + i] matches in_[i] for the
    // links that were polled. Dropped links are erased after the pass.
    const size_t polled = fds.size() - 2;
    std::vector<bool> drop(in_.size(), false);
    for (size_t i = 0; i < polled; ++i) {
      InLink& c = *in_[i];
      if (fds[2 + i].revents && !service(c)) drop[i] = true;
      else if (c.peer < 0 && Clock::now() >= c.hello_deadline) {
        reject(c, "no hello before the timeout");
        drop[i] = true;
      }
    }
    size_t keep = 0;
    for (size_t i = 0; i < in_.size(); ++i) {
      if (drop[i]) ::close(in_[i]->fd);
      else in_[keep++] = std::move(in_[i]);
    }
    in_.resize(keep);
  }
  for (auto& c : in_) ::close(c->fd);
  in_.clear();
  ::close(listen_fd_);
  listen_fd_ = -1;
}

void TcpTransport::accept_all() {
  for (;;) {
    sockaddr_in from{};
    socklen_t fl = sizeof from;
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &fl, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        // Out of descriptors or memory: the connection stays queued and the
        // listener stays readable, so polling it now would spin.
        log(strf("accept() failed: %s; retrying in 100 ms", errno_text(errno).c_str()));
        accept_resume_ = Clock::now() + std::chrono::milliseconds(100);
      }
      return;
    }
    size_t pending = 0;
    for (const auto& c : in_) pending += c->peer < 0;
    // Strangers get a bounded number of slots; the real peers need at most
    // (world - 1) * kRoots, all of which say hello at once.
    if (pending >= 64) {
      log(strf("refusing a connection from %s: too many connections waiting for their hello",
               sockaddr_text(from).c_str()));
      ::close(fd);
      continue;
    }
    set_nodelay(fd);
    auto c = std::make_unique<InLink>();
    c->fd = fd;
    c->from = sockaddr_text(from);
    c->hello_deadline = Clock::now() + std::chrono::microseconds((int64_t)(cfg_.timeout_s * 1e6));
    in_.push_back(std::move(c));
  }
}

// Reads what `c` has, within a budget so one busy stream cannot starve the
// others. Returns false when the link is to be dropped.
bool TcpTransport::service(InLink& c) {
  uint8_t* const base = ctx_.region->base();
  for (int turn = 0; turn < 64; ++turn) {
    uint8_t* dst = nullptr;
    size_t want = 0;
    switch (c.stage) {
      case InLink::Stage::kHello:
        dst = c.buf + c.got;
        want = sizeof(Hello) - c.got;
        break;
      case InLink::Stage::kHeader:
        dst = c.buf + c.got;
        want = sizeof(FrameHeader) - c.got;
        break;
      case InLink::Stage::kPayload:
        // Inside the inbox: on_header() checked [offset, offset + len).
        dst = base + c.hdr.offset + c.payload_got;
        want = (size_t)std::min<uint64_t>(c.hdr.len - c.payload_got, 1ull << 30);
        break;
    }
    const ssize_t r = ::recv(c.fd, dst, want, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      return link_down(c, errno_text(errno));
    }
    if (r == 0) return link_down(c, "connection closed", /*eof=*/true);
    switch (c.stage) {
      case InLink::Stage::kHello:
        c.got += (size_t)r;
        if (c.got == sizeof(Hello) && !on_hello(c)) return false;
        break;
      case InLink::Stage::kHeader:
        c.got += (size_t)r;
        if (c.got == sizeof(FrameHeader) && !on_header(c)) return false;
        break;
      case InLink::Stage::kPayload:
        c.payload_got += (uint64_t)r;
        if (c.payload_got == c.hdr.len) finish_frame(c);
        break;
    }
  }
  return true;
}

void TcpTransport::reject(const InLink& c, const std::string& why) {
  const std::string msg = strf("connection from %s: %s", c.from.c_str(), why.c_str());
  log("rejected " + msg);
  std::lock_guard<std::mutex> lk(auth_mu_);
  if (rejects_.size() >= 4) rejects_.erase(rejects_.begin());
  rejects_.push_back(msg);
}

bool TcpTransport::on_hello(InLink& c) {
  Hello h;
  memcpy(&h, c.buf, sizeof h);
  if (h.magic != kHelloMagic) {
    reject(c, "its first frame is not a jax_arx hello");
    return false;
  }
  if (h.version != kWireVersion) {
    reject(c, strf("wire version %u, this rank speaks %u (mixed jax_arx versions?)", h.version, kWireVersion));
    return false;
  }
  // Constant time: every byte of the padded secret and the length are
  // compared whatever differs first, so timing does not reveal a prefix.
  uint8_t mine[kMaxSecret] = {};
  memcpy(mine, ctx_.secret.data(), ctx_.secret.size());
  uint32_t diff = h.secret_len ^ (uint32_t)ctx_.secret.size();
  for (size_t i = 0; i < kMaxSecret; ++i) diff |= (uint32_t)(mine[i] ^ h.secret[i]);
  if (diff != 0) {
    reject(c, "wrong secret (a rank of another communicator or run?)");
    return false;
  }
  if (h.world != ctx_.world || h.rank < 0 || h.rank >= ctx_.world || h.rank == ctx_.rank || h.root < 0 ||
      h.root >= kRoots) {
    reject(c, strf("hello from rank %d root %d of world %d; this is rank %d of %d with %d roots", h.rank, h.root,
                   h.world, ctx_.rank, ctx_.world, kRoots));
    return false;
  }
  bool duplicate;
  {
    // The receiver thread is the only writer of authenticated_, so the
    // check and the set cannot race with another hello.
    std::lock_guard<std::mutex> lk(auth_mu_);
    duplicate = authenticated_[link_index(h.rank, h.root)];
    if (!duplicate) authenticated_[link_index(h.rank, h.root)] = true;
  }
  if (duplicate) {
    reject(c, strf("rank %d root %d is already connected", h.rank, h.root));
    return false;
  }
  auth_cv_.notify_all();
  c.peer = h.rank;
  c.root = h.root;
  c.stage = InLink::Stage::kHeader;
  c.got = 0;
  log(strf("accepted rank %d root %d from %s", c.peer, c.root, c.from.c_str()));
  // The ack fits an empty socket buffer: it is the first and only thing
  // this end ever sends on the stream.
  const uint64_t ack = kAckMagic;
  ssize_t w;
  while ((w = ::send(c.fd, &ack, sizeof ack, MSG_NOSIGNAL | MSG_DONTWAIT)) < 0 && errno == EINTR) {}
  if (w != (ssize_t)sizeof ack) return link_down(c, w < 0 ? errno_text(errno) : "short write of the ack");
  return true;
}

// A complete header: checks it before a byte of its payload or its flag is
// written. A frame that fails ends the stream, since what follows it on the
// stream can no longer be trusted either.
bool TcpTransport::on_header(InLink& c) {
  memcpy(&c.hdr, c.buf, sizeof c.hdr);
  c.got = 0;
  const FrameHeader& h = c.hdr;
  const Layout& L = ctx_.layout;
  std::string why;
  if (h.magic == kByeMagic) {
    c.said_bye = true;
    return true;
  }
  if (h.magic != kFrameMagic) {
    why = strf("sent a frame with a bad magic 0x%016llx: the stream is out of step (mixed jax_arx versions?)",
               (unsigned long long)h.magic);
  } else if (!L.may_write(c.peer, ctx_.rank, h.offset, h.len)) {
    why = strf("sent a write of %llu bytes at offset %llu, outside its own slots in this endpoint's inbox: the "
               "ranks disagree on the buffer geometry, or the peer is faulty",
               (unsigned long long)h.len, (unsigned long long)h.offset);
  } else if (h.flag_offset != kNoFlag && !L.may_flag(c.peer, ctx_.rank, h.flag_offset)) {
    why = strf("sent a flag for offset %llu, which is not one of its own words of this endpoint's flag page",
               (unsigned long long)h.flag_offset);
  }
  if (!why.empty()) {
    why = strf("rank %d (root %d) %s; its connection is closed", c.peer, c.root, why.c_str());
    log(why);
    if (ctx_.on_peer_lost && !closing_.load()) ctx_.on_peer_lost(c.peer, why);
    return false;
  }
  if (h.len == 0) finish_frame(c);
  else {
    c.stage = InLink::Stage::kPayload;
    c.payload_got = 0;
  }
  return true;
}

// The payload is in place (recv() wrote it on this thread): the release
// store publishes it with the flag.
void TcpTransport::finish_frame(InLink& c) {
  if (c.hdr.flag_offset != kNoFlag)
    store_release(reinterpret_cast<uint64_t*>(ctx_.region->base() + c.hdr.flag_offset), c.hdr.flag_value);
  c.stage = InLink::Stage::kHeader;
}

bool TcpTransport::link_down(InLink& c, const std::string& why, bool eof) {
  if (c.peer < 0) {
    reject(c, "closed before its hello: " + why);
    return false;
  }
  // A stream that breaks without a goodbye is a lost peer: nothing more
  // will arrive from it, and a wait on it should fail now, not time out.
  // After a goodbye the peer shut down on purpose (ranks finish at slightly
  // different times): that is no failure of this endpoint, and a collective
  // still issued on it runs into the timeout naming that rank.
  if (closing_.load() || (eof && c.said_bye)) return false;
  const char* where = c.stage == InLink::Stage::kPayload || c.got ? " in the middle of a frame" : "";
  const std::string msg =
      !eof ? strf("connection from rank %d (root %d) failed%s: %s; that rank exited or its host became unreachable",
                  c.peer, c.root, where, why.c_str())
      : c.said_bye ? strf("connection closed by rank %d (root %d): it closed its endpoint", c.peer, c.root)
                   : strf("connection closed by rank %d (root %d)%s without a goodbye: that rank exited or crashed",
                          c.peer, c.root, where);
  log(msg);
  if (ctx_.on_peer_lost) ctx_.on_peer_lost(c.peer, msg);
  return false;
}

}  // namespace

Status make_tcp_transport(const TransportContext& ctx, std::unique_ptr<Transport>& out) {
  if (!ctx.region || ctx.world < 1 || ctx.world > kMaxWorld || ctx.rank < 0 || ctx.rank >= ctx.world)
    return Status::Error(strf("jax_arx: %s: tcp carrier given rank %d of world %d%s (world must be 1-%d)",
                              ctx.label.c_str(), ctx.rank, ctx.world, ctx.region ? "" : " and no region",
                              kMaxWorld));
  if (ctx.secret.empty() || ctx.secret.size() > kMaxSecret)
    return Status::Error(strf("jax_arx: %s: the tcp carrier needs the communicator's secret of 1-%zu bytes, got %zu; "
                              "it is what keeps strangers from writing into this endpoint",
                              ctx.label.c_str(), kMaxSecret, ctx.secret.size()));
  // The receiver trusts the layout's slots as the bounds of the region.
  if (ctx.layout.total > ctx.region->size())
    return Status::Error(strf("jax_arx: %s: the layout of %llu bytes does not fit the region of %llu bytes",
                              ctx.label.c_str(), (unsigned long long)ctx.layout.total,
                              (unsigned long long)ctx.region->size()));
  auto t = std::make_unique<TcpTransport>(ctx);
  ARX_RETURN_IF_ERROR(t->open());
  out = std::move(t);
  return Status::Ok();
}

}  // namespace arx

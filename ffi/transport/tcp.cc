// The tcp carrier's set-up, put and close (the design is in tcp_carrier.h;
// the receiver thread is in tcp_receive.cc).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "transport/tcp_carrier.h"

namespace arx {

using namespace tcp_wire;
using tcp_io::errno_text;
using tcp_io::ms_left;
using tcp_io::sockaddr_text;

TcpTransport::~TcpTransport() {
  close();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

Status TcpTransport::open() {
  const int world = ctx_.world;
  authenticated_.assign((size_t)world * kRoots, false);
  from_.assign((size_t)world * kRoots, "");
  for (int i = 0; i < world * kRoots; ++i) out_.push_back(std::make_unique<OutLink>());
  if (!tcp_auth::make_key_pair(keys_))
    return Status::Error(
        strf("jax_arx: %s: the kernel gave no random bytes for the tcp carrier's key (getrandom: "
             "%s)",
             ctx_.label.c_str(), errno_text(errno).c_str()));
  ARX_RETURN_IF_ERROR(listen_on_config_addr());
  // Listening and accepting start now, not in connect(): a peer may dial
  // as soon as it has our details, before this rank reaches connect(). Its
  // hello then waits (InLink::Stage::kParked) until connect() has the keys.
  thread_ = std::thread([this] { receive_loop(); });
  return Status::Ok();
}

Status TcpTransport::listen_on_config_addr() {
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
        return Status::Error(
            strf("jax_arx: %s: JAX_ARX_TCP_ADDR=%s looks like an IPv6 address; the tcp carrier "
                 "takes an IPv4 address or host name, optionally with :port",
                 ctx_.label.c_str(), cfg_.tcp_addr.c_str()));
      const std::string p = host.substr(colon + 1);
      char* end = nullptr;
      const long v = strtol(p.c_str(), &end, 10);
      if (p.empty() || *end || v < 0 || v > 65535)
        return Status::Error(
            strf("jax_arx: %s: JAX_ARX_TCP_ADDR=%s has a bad port '%s' (want host or host:port, "
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
  if (!tcp_io::resolve_ipv4(host, sa.sin_addr, err))
    return Status::Error(
        strf("jax_arx: %s: cannot resolve the tcp listen address '%s': %s; set JAX_ARX_TCP_ADDR to "
             "this host's IPv4 address on the network that joins the ranks",
             ctx_.label.c_str(), host.c_str(), err.c_str()));
  if (!cfg_.tcp_addr.empty()) {
    if (sa.sin_addr.s_addr == htonl(INADDR_ANY))
      return Status::Error(
          strf("jax_arx: %s: JAX_ARX_TCP_ADDR=%s cannot be advertised to peers; give this host's "
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
    return Status::Error(
        strf("jax_arx: %s: cannot listen on %s: %s; set JAX_ARX_TCP_ADDR to an address of this "
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
  return Status::Ok();
}

// Parses every rank's details and derives this rank's view and pair keys.
Status TcpTransport::derive_keys(const std::vector<std::string>& details, std::vector<sockaddr_in>& to) {
  const int world = ctx_.world;
  std::vector<tcp_auth::Details> parsed(world);
  for (int p = 0; p < world; ++p) {
    std::string why, err;
    if (!tcp_auth::parse_details(details[p], parsed[p], why))
      return Status::Error(
          strf("jax_arx: %s: rank %d's connection details '%.120s' are not the tcp carrier's (%s); "
               "do all ranks use the same transport and jax_arx version?",
               ctx_.label.c_str(), p, details[p].c_str(), why.c_str()));
    to[p] = sockaddr_in{};
    to[p].sin_family = AF_INET;
    to[p].sin_port = htons((uint16_t)parsed[p].port);
    if (!tcp_io::resolve_ipv4(parsed[p].host, to[p].sin_addr, err))
      return Status::Error(strf("jax_arx: %s: cannot resolve rank %d's address '%s': %s", ctx_.label.c_str(), p,
                                parsed[p].host.c_str(), err.c_str()));
  }
  if (details[ctx_.rank] != this->details())
    return Status::Error(
        strf("jax_arx: %s: the details given for this rank (%.120s) are not its own (%s): the "
             "rendezvous handed out someone else's",
             ctx_.label.c_str(), details[ctx_.rank].c_str(), this->details().c_str()));
  view_ = tcp_auth::view_of(details);
  pair_keys_.assign(world, crypto::Digest{});
  for (int p = 0; p < world; ++p)
    if (p != ctx_.rank && !tcp_auth::pair_key(keys_, ctx_.rank, p, parsed[p].pub, view_, ctx_.secret, pair_keys_[p]))
      return Status::Error(
          strf("jax_arx: %s: rank %d's public key is not a usable X25519 key (a point of small "
               "order, which would make the pair's key public): its details were forged",
               ctx_.label.c_str(), p));
  keys_ready_.store(true, std::memory_order_release);
  // Hellos that arrived before the keys are parked: wake the receiver.
  const uint64_t one = 1;
  while (::write(wake_fd_, &one, sizeof one) < 0 && errno == EINTR) {
  }
  return Status::Ok();
}

std::string TcpTransport::rejection_text(int peer, int root, const sockaddr_in& to, const tcp_auth::Result& r) const {
  const std::string who = strf("rank %d at %s (root %d)", peer, sockaddr_text(to).c_str(), root);
  switch (r.outcome) {
    case tcp_auth::Outcome::kOk:
      return "";
    case tcp_auth::Outcome::kRejected:
      switch (r.reject) {
        case Reject::kView:
          return who +
                 " refused this rank: the two read different connection details from the rendezvous. The "
                 "ranks belong to different runs, or jax.distributed's key-value store was altered during "
                 "set-up and someone may be posing as a rank (see docs/failures.md)";
        case Reject::kProof:
          return who +
                 " refused this rank's proof of identity although both read the same connection details: "
                 "JAX_ARX_SECRET differs between the two processes (set it to one value everywhere, or nowhere)";
        case Reject::kTaken:
          return who +
                 " already has an authenticated stream from this rank: another process proved it holds this "
                 "rank's key first. Two processes run as this rank, or someone took its place by altering "
                 "the rendezvous (see docs/failures.md); stop the job";
        case Reject::kVersion:
        case Reject::kHello:
        case Reject::kNone:
          break;
      }
      return who + strf(" refused the hello (%s): mixed jax_arx versions, or the address belongs to another job",
                        reject_name(r.reject));
    case tcp_auth::Outcome::kImpostor:
      return strf(
          "the listener at %s that answered as rank %d (root %d) did not prove it holds the key rank %d "
          "shares with this one: JAX_ARX_SECRET differs between the two processes (or is set on one only), "
          "or whoever listens there is not rank %d (the rendezvous store was altered, or another program "
          "took the port); see docs/failures.md",
          sockaddr_text(to).c_str(), peer, root, peer, peer);
    case tcp_auth::Outcome::kBadReply:
      return who + " answered with something that is not jax_arx's tcp handshake (" + r.detail +
             "): is it a jax_arx tcp listener of the same version?";
    case tcp_auth::Outcome::kClosed:
      return who + " closed the connection during the handshake every time until the timeout (" + r.detail +
             "): it may be flooded with connections from elsewhere, or failing; JAX_ARX_DEBUG=1 there logs why";
    case tcp_auth::Outcome::kTimeout:
      return who + " took the connection but did not answer the hello within the timeout (" + r.detail +
             "): that rank has not reached connect() (it is slow, stuck, or failed earlier in set-up), or the "
             "address is not a jax_arx tcp listener of this run";
  }
  return who + " failed the handshake";
}

// Dials and authenticates until it succeeds, is refused, or the deadline
// passes: a peer's listener exists from its construction, but its process
// may not have got that far yet, and a listener that is flooded drops
// streams before their handshake (make_room), which a new dial gets past.
Status TcpTransport::dial_and_authenticate(int peer, int root, const sockaddr_in& to, Clock::time_point deadline,
                                           int& fd_out) {
  int backoff_ms = 10;
  std::string last = "no attempt made";
  tcp_auth::Result res;
  bool handshake_tried = false;
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
      return Status::Error(strf("jax_arx: %s: socket() failed: %s", ctx_.label.c_str(), errno_text(errno).c_str()));
    int e = 0;
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) != 0) {
      e = errno;
      if (e == EINPROGRESS || e == EINTR) {
        // Bounded by the deadline: an address that drops SYNs must not hold us past it.
        pollfd p{fd, POLLOUT, 0};
        int n;
        while ((n = ::poll(&p, 1, ms_left(deadline))) < 0 && errno == EINTR) {
        }
        socklen_t el = sizeof e;
        if (n == 1)
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el);
        else
          e = ETIMEDOUT;
      }
    }
    if (e == 0) {
      tcp_io::set_nodelay(fd);
      Hello hello;
      if (!tcp_auth::make_hello(ctx_.world, ctx_.rank, root, view_, hello)) {
        ::close(fd);
        return Status::Error(strf("jax_arx: %s: the kernel gave no random bytes for a hello", ctx_.label.c_str()));
      }
      res = tcp_auth::authenticate(fd, hello, pair_keys_[peer], deadline);
      handshake_tried = true;
      if (res.outcome == tcp_auth::Outcome::kOk) {
        fd_out = fd;  // stays non-blocking: put() bounds every send itself
        return Status::Ok();
      }
      ::close(fd);
      if (res.outcome != tcp_auth::Outcome::kClosed && res.outcome != tcp_auth::Outcome::kTimeout)
        return Status::Error(strf("jax_arx: %s: %s", ctx_.label.c_str(), rejection_text(peer, root, to, res).c_str()));
      last = res.detail;
    } else {
      ::close(fd);
      last = errno_text(e);
      handshake_tried = false;
    }
    if (stop_.load() || ms_left(deadline) <= 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(backoff_ms, ms_left(deadline))));
    backoff_ms = std::min(backoff_ms * 2, 500);
  }
  if (handshake_tried)
    return Status::Error(strf("jax_arx: %s: %s", ctx_.label.c_str(), rejection_text(peer, root, to, res).c_str()));
  return Status::Error(
      strf("jax_arx: %s: could not connect to rank %d at %s (root %d) before the timeout: %s; no "
           "path to that rank: check that the address is reachable from this host (set "
           "JAX_ARX_TCP_ADDR on every rank to its address on the network that joins them) and that "
           "no firewall blocks the port%s",
           ctx_.label.c_str(), peer, sockaddr_text(to).c_str(), root, last.c_str(),
           ctx_.layout.topo.ring ? ""
                                 : ". Boxes cabled in a ring with no switch reach only their "
                                   "neighbours: set JAX_ARX_TOPOLOGY=ring on every rank"));
}

Status TcpTransport::connect(const std::vector<std::string>& details, double timeout_s) {
  const int world = ctx_.world, rank = ctx_.rank;
  if (connect_called_)
    return Status::Error(strf("jax_arx: %s: the tcp carrier's connect() was already called", ctx_.label.c_str()));
  connect_called_ = true;
  if ((int)details.size() != world)
    return Status::Error(
        strf("jax_arx: %s: got %zu connection details for a world of %d", ctx_.label.c_str(), details.size(), world));
  const Clock::time_point deadline = tcp_io::deadline_after(timeout_s);
  std::vector<sockaddr_in> to(world);
  ARX_RETURN_IF_ERROR(derive_keys(details, to));

  // Dial in send order (rank + 1, rank + 2, ...). Every rank dials and only
  // its receiver thread accepts, so ranks that all call connect() at once
  // never wait on each other's connect(): only on each other's receivers,
  // which run since construction. In a ring, only the neighbours.
  const Topology& topo = ctx_.layout.topo;
  for (int k = 1; k < world; ++k) {
    const int p = (rank + k) % world;
    if (!topo.linked(rank, p)) continue;
    for (int root = 0; root < kRoots; ++root) {
      int fd = -1;
      ARX_RETURN_IF_ERROR(dial_and_authenticate(p, root, to[p], deadline, fd));
      OutLink& l = *out_[link_index(p, root)];
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
  }

  std::unique_lock<std::mutex> lk(auth_mu_);
  auto all_in = [&] {
    for (int p = 0; p < world; ++p)
      for (int root = 0; root < kRoots; ++root)
        if (p != rank && topo.linked(rank, p) && !authenticated_[link_index(p, root)]) return false;
    return true;
  };
  auth_cv_.wait_until(lk, deadline, [&] { return all_in() || stop_.load() || !alarm_.empty(); });
  if (!alarm_.empty()) return Status::Error(strf("jax_arx: %s: %s", ctx_.label.c_str(), alarm_.c_str()));
  if (!all_in()) {
    std::string missing, rejected;
    for (int p = 0; p < world; ++p) {
      std::string roots;
      for (int root = 0; root < kRoots; ++root)
        if (p != rank && topo.linked(rank, p) && !authenticated_[link_index(p, root)])
          roots += strf("%s%d", roots.empty() ? "" : ", ", root);
      if (!roots.empty()) missing += strf("%srank %d (root %s)", missing.empty() ? "" : "; ", p, roots.c_str());
    }
    for (const std::string& r : rejects_) rejected += "; rejected: " + r;
    return Status::Error(
        strf("jax_arx: %s: %s: no authenticated tcp connection to %s:%d from %s within %.1f s. "
             "Those ranks did not reach connect(), or cannot reach this address (set "
             "JAX_ARX_TCP_ADDR to this host's address on the network that joins the ranks)%s",
             ctx_.label.c_str(), stop_.load() ? "closed while connecting" : "timed out", addr_.c_str(), port_,
             missing.c_str(), timeout_s, rejected.c_str()));
  }
  // Under auth_mu_: a second holder of a peer's key that shows up from now
  // on is reported as a lost peer (tcp_receive.cc on_proof), before it, here.
  connected_.store(true, std::memory_order_release);
  log(topo.ring ? "connected to both neighbours on both roots" : "connected to every peer on both roots");
  return Status::Ok();
}

Status TcpTransport::put(int peer, int root, const void* src, uint64_t offset, uint64_t len, uint64_t flag_offset,
                         uint64_t flag_value) {
  if (peer < 0 || peer >= ctx_.world || peer == ctx_.rank || root < 0 || root >= kRoots ||
      !ctx_.layout.topo.linked(ctx_.rank, peer))
    return Status::Error(
        strf("jax_arx: %s: tcp put to rank %d root %d: no such link (world %d, this is rank %d, "
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
    return Status::Error(
        strf("jax_arx: %s: tcp put to rank %d (root %d) after close()", ctx_.label.c_str(), peer, root));
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
    l.error = tcp_io::send_all(fd, iov, len ? 2 : 1, cfg_.timeout_s);
    if (l.error == 0) return Status::Ok();
    // The frame may have gone out in part: nothing more can follow it on
    // this stream. Shutting it down makes the peer see a broken stream
    // (a lost peer) as soon as it reads again, instead of a frame that
    // never ends.
    ::shutdown(fd, SHUT_RDWR);
  }
  const std::string why =
      l.error == ETIMEDOUT
          ? strf(
                "rank %d (root %d) took no data for %g s (JAX_ARX_TIMEOUT_S): it is stopped, hung or overloaded, or "
                "its host became unreachable; the stream is closed",
                peer, root, cfg_.timeout_s)
          : strf(
                "tcp send to rank %d (root %d) failed: %s; that rank exited, closed its endpoint, rejected a frame "
                "(see its log), or its host is no longer reachable",
                peer, root, errno_text(l.error).c_str());
  const Status s = Status::Error(strf("jax_arx: %s: %s", ctx_.label.c_str(), why.c_str()));
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
          while (::send(fd, &bye, sizeof bye, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno == EINTR) {
          }
        }
        l.fd.store(-1);
        ::close(fd);
      }
    }
  }
  stop_.store(true);
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    while (::write(wake_fd_, &one, sizeof one) < 0 && errno == EINTR) {
    }
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

Status make_tcp_transport(const TransportContext& ctx, std::unique_ptr<Transport>& out) {
  if (!ctx.region || ctx.world < 1 || ctx.world > kMaxWorld || ctx.rank < 0 || ctx.rank >= ctx.world)
    return Status::Error(strf("jax_arx: %s: tcp carrier given rank %d of world %d%s (world must be 1-%d)",
                              ctx.label.c_str(), ctx.rank, ctx.world, ctx.region ? "" : " and no region", kMaxWorld));
  if (ctx.secret.empty())
    return Status::Error(
        strf("jax_arx: %s: the tcp carrier needs the communicator's shared secret (the rendezvous "
             "derives it); every pair key is made from it",
             ctx.label.c_str()));
  // The receiver trusts the layout's slots (tcp_wire.h check_frame) as
  // bounds inside the region.
  if (ctx.layout.world != ctx.world || ctx.layout.total > ctx.region->size())
    return Status::Error(strf("jax_arx: %s: the layout of %llu bytes does not fit the region of %llu bytes",
                              ctx.label.c_str(), (unsigned long long)ctx.layout.total,
                              (unsigned long long)ctx.region->size()));
  auto t = std::make_unique<TcpTransport>(ctx);
  ARX_RETURN_IF_ERROR(t->open());
  out = std::move(t);
  return Status::Ok();
}

}  // namespace arx

// The tcp carrier's receiver thread: accepts streams, runs the acceptor's
// side of the handshake (tcp_auth.h), and reads authenticated frames into
// the region (the design is in tcp_carrier.h).
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/atomics.h"
#include "transport/tcp_carrier.h"

namespace arx {

using namespace tcp_wire;
using tcp_io::errno_text;
using tcp_io::ms_left;

void TcpTransport::receive_loop() {
  std::vector<pollfd> fds;
  bool keys_seen = false;
  while (!stop_.load()) {
    // Hellos that came before connect() gave this rank its keys are
    // answered as soon as the keys are there.
    const bool keys = !keys_seen && keys_ready_.load(std::memory_order_acquire);
    if (keys) {
      keys_seen = true;
      for (auto& c : in_)
        if (c->stage == InLink::Stage::kParked && !on_hello(*c)) c->drop = true;
    }
    // Links dropped since the last poll go before the next, which could
    // otherwise sleep until some other event with them still open.
    size_t keep = 0;
    for (size_t i = 0; i < in_.size(); ++i) {
      if (in_[i]->drop)
        ::close(in_[i]->fd);
      else
        in_[keep++] = std::move(in_[i]);
    }
    in_.resize(keep);
    fds.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({listen_fd_, POLLIN, 0});
    int timeout_ms = -1;
    if (Clock::now() < accept_resume_) {
      fds[1].fd = -1;  // poll() skips it
      timeout_ms = ms_left(accept_resume_);
    }
    for (const auto& c : in_) {
      // A parked stream is not read (its sender waits for our challenge;
      // anything more it sends can wait): poll reports only its hang-up.
      fds.push_back({c->fd, (short)(c->stage == InLink::Stage::kParked ? 0 : POLLIN), 0});
      if (c->peer < 0) {
        const int t = ms_left(c->deadline);
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
    if (n > 0 && (fds[0].revents & POLLIN)) {
      uint64_t v;
      while (::read(wake_fd_, &v, sizeof v) < 0 && errno == EINTR) {
      }
    }
    if (n > 0 && (fds[1].revents & POLLIN)) accept_all();
    // accept_all() only appends to in_ (a link it evicts is marked, not
    // erased), so fds[2 + i] matches in_[i] for the links that were polled;
    // dropped links are erased at the top of the next turn.
    const size_t polled = fds.size() - 2;
    const auto now = Clock::now();
    for (size_t i = 0; i < polled; ++i) {
      InLink& c = *in_[i];
      if (c.drop) continue;
      if (c.stage == InLink::Stage::kParked) {
        if (fds[2 + i].revents) {
          reject(c, "closed while waiting for this rank to reach connect()");
          c.drop = true;
        }
      } else if (fds[2 + i].revents && !service(c)) {
        c.drop = true;
      }
      if (!c.drop && c.peer < 0 && now >= c.deadline) {
        reject(c, "did not authenticate within the timeout");
        c.drop = true;
      }
    }
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
    make_room();
    tcp_io::set_nodelay(fd);
    auto c = std::make_unique<InLink>();
    c->fd = fd;
    c->from = tcp_io::sockaddr_text(from);
    c->deadline = tcp_io::deadline_after(cfg_.timeout_s);
    in_.push_back(std::move(c));
  }
}

// Keeps fewer than kMaxPending streams waiting to authenticate. The one
// dropped is the oldest that has sent nothing, else the oldest: a real
// peer says hello at once after it connects and answers the challenge in
// one round trip, so silence is what a crowd of strangers shows, and a
// real peer dropped anyway dials again (tcp.cc dial_and_authenticate).
void TcpTransport::make_room() {
  size_t pending = 0;
  InLink *oldest = nullptr, *oldest_silent = nullptr;
  for (auto& c : in_) {
    if (!c->pending()) continue;
    ++pending;
    if (!oldest) oldest = c.get();
    if (!oldest_silent && c->silent()) oldest_silent = c.get();
  }
  if (pending < kMaxPending) return;
  InLink* victim = oldest_silent ? oldest_silent : oldest;
  reject(*victim, strf("dropped to make room: %zu connections were waiting to authenticate, and this was the oldest%s",
                       pending, oldest_silent ? " that had sent nothing" : ""));
  victim->drop = true;
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
        want = sizeof(Hello);
        break;
      case InLink::Stage::kProof:
        want = sizeof(Proof);
        break;
      case InLink::Stage::kHeader:
        want = sizeof(FrameHeader);
        break;
      case InLink::Stage::kParked:
        return true;  // read nothing until the keys are there
      case InLink::Stage::kPayload:
        // Inside the sender's own slots: on_header() checked [offset, offset + len).
        dst = base + c.hdr.offset + c.payload_got;
        want = (size_t)std::min<uint64_t>(c.hdr.len - c.payload_got, 1ull << 30);
        break;
    }
    if (!dst) {
      dst = c.buf + c.got;
      want -= c.got;
    }
    const ssize_t r = ::recv(c.fd, dst, want, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
      return link_down(c, errno_text(errno));
    }
    if (r == 0) return link_down(c, "connection closed", /*eof=*/true);
    if (c.stage == InLink::Stage::kPayload) {
      c.payload_got += (uint64_t)r;
      if (c.payload_got == c.hdr.len) finish_frame(c);
      continue;
    }
    c.got += (size_t)r;
    if ((size_t)r < want) continue;
    c.got = 0;  // a whole message is in buf
    bool keep = true;
    switch (c.stage) {
      case InLink::Stage::kHello:
        memcpy(&c.hello, c.buf, sizeof c.hello);
        keep = on_hello(c);
        break;
      case InLink::Stage::kProof:
        keep = on_proof(c);
        break;
      case InLink::Stage::kHeader:
        keep = on_header(c);
        break;
      case InLink::Stage::kParked:
      case InLink::Stage::kPayload:
        break;
    }
    if (!keep) return false;
    if (c.stage == InLink::Stage::kParked) return true;
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

// The acceptor sends at most a challenge and a verdict on a stream, 88
// bytes into an empty socket buffer, so they go whole without waiting.
bool TcpTransport::answer(InLink& c, const void* msg, size_t len) {
  ssize_t w;
  while ((w = ::send(c.fd, msg, len, MSG_NOSIGNAL | MSG_DONTWAIT)) < 0 && errno == EINTR) {
  }
  if (w == (ssize_t)len) return true;
  reject(c, strf("could not answer its handshake: %s", w < 0 ? errno_text(errno).c_str() : "short write"));
  return false;
}

bool TcpTransport::refuse(InLink& c, Reject code, const std::string& why) {
  reject(c, why);
  const Verdict v{kRejectMagic, (uint32_t)code, 0};
  answer(c, &v, sizeof v);  // best effort: the close follows either way
  return false;
}

bool TcpTransport::on_hello(InLink& c) {
  if (!keys_ready_.load(std::memory_order_acquire)) {
    c.stage = InLink::Stage::kParked;
    return true;
  }
  std::string why;
  Reject r = tcp_auth::check_hello(c.hello, ctx_.rank, ctx_.world, view_, why);
  if (r == Reject::kNone && !ctx_.layout.topo.linked(ctx_.rank, (int)c.hello.rank)) {
    r = Reject::kHello;  // a ring: not a neighbour (base/topology.h)
    why = strf("rank %u is no neighbour of rank %d in the ring (JAX_ARX_TOPOLOGY=ring)", c.hello.rank, ctx_.rank);
  }
  if (r != Reject::kNone) return refuse(c, r, why);
  if (!tcp_auth::make_challenge(c.hello, pair_keys_[c.hello.rank], c.challenge)) {
    reject(c, "the kernel gave no random bytes for a challenge");
    return false;
  }
  if (!answer(c, &c.challenge, sizeof c.challenge)) return false;
  c.stage = InLink::Stage::kProof;
  return true;
}

bool TcpTransport::on_proof(InLink& c) {
  Proof p;
  memcpy(&p, c.buf, sizeof p);
  const int rank = c.hello.rank, root = c.hello.root;
  if (!tcp_auth::proof_valid(c.hello, c.challenge, pair_keys_[rank], p))
    return refuse(c, Reject::kProof,
                  strf("it says it is rank %d root %d, but its proof of identity is wrong: it does not hold the key "
                       "that rank shares with this one (a stranger, or JAX_ARX_SECRET differs)",
                       rank, root));
  const int idx = link_index(rank, root);
  std::string duplicate;
  bool lost = false;
  {
    // The receiver thread is the only writer of authenticated_, so the
    // check and the set cannot race with another hello.
    std::lock_guard<std::mutex> lk(auth_mu_);
    if (authenticated_[idx]) {
      duplicate = strf(
          "a second stream from %s proved it holds rank %d's key (root %d) while the one from %s was "
          "already authenticated: two processes run as rank %d, or someone took a rank's place by "
          "altering the rendezvous (see docs/failures.md)",
          c.from.c_str(), rank, root, from_[idx].c_str(), rank);
      // Before connect() returns, it fails with this; after, the endpoint fails.
      lost = connected_.load();
      if (!lost && alarm_.empty()) alarm_ = duplicate;
    } else {
      authenticated_[idx] = true;
      from_[idx] = c.from;
    }
  }
  auth_cv_.notify_all();
  if (!duplicate.empty()) {
    refuse(c, Reject::kTaken, duplicate);
    if (lost && ctx_.on_peer_lost && !closing_.load()) ctx_.on_peer_lost(rank, duplicate);
    return false;
  }
  c.peer = rank;
  c.root = root;
  c.stage = InLink::Stage::kHeader;
  log(strf("accepted rank %d root %d from %s", c.peer, c.root, c.from.c_str()));
  const Verdict ack{kAckMagic, 0, 0};
  if (!answer(c, &ack, sizeof ack)) return link_down(c, "could not send the ack");
  return true;
}

// A complete header: checks it before a byte of its payload or its flag is
// written. A frame that fails ends the stream, since what follows it on the
// stream can no longer be trusted either.
bool TcpTransport::on_header(InLink& c) {
  memcpy(&c.hdr, c.buf, sizeof c.hdr);
  const FrameHeader& h = c.hdr;
  if (h.magic == kByeMagic) {
    c.said_bye = true;
    return true;
  }
  const std::string bad = check_frame(h, ctx_.layout, c.peer, ctx_.rank);
  if (!bad.empty()) {
    const std::string why = strf("rank %d (root %d) %s; its connection is closed", c.peer, c.root, bad.c_str());
    log(why);
    if (ctx_.on_peer_lost && !closing_.load()) ctx_.on_peer_lost(c.peer, why);
    return false;
  }
  if (h.len == 0) {
    finish_frame(c);
  } else {
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
    reject(c, "closed before it authenticated: " + why);
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
                   : strf(
                         "connection closed by rank %d (root %d)%s without a goodbye: that rank exited, crashed, or "
                         "gave up sending to this rank",
                         c.peer, c.root, where);
  log(msg);
  if (ctx_.on_peer_lost) ctx_.on_peer_lost(c.peer, msg);
  return false;
}

}  // namespace arx

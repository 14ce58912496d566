#include "transport/tcp_io.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "base/status.h"

namespace arx::tcp_io {

std::string errno_text(int e) { return strf("%s (errno %d)", strerror(e), e); }

int ms_left(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return 1 << 30;
  const double s = std::chrono::duration<double>(deadline - Clock::now()).count();
  return s <= 0 ? 0 : (int)std::min(s * 1000 + 1, 1e9);
}

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::microseconds((int64_t)(std::max(seconds, 0.0) * 1e6));
}

std::string sockaddr_text(const sockaddr_in& a) {
  char ip[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &a.sin_addr, ip, sizeof ip);
  return strf("%s:%d", ip, (int)ntohs(a.sin_port));
}

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

void set_nodelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

int send_all(int fd, iovec* iov, int n, double stall_s, Clock::time_point deadline) {
  Clock::time_point stalled_at = deadline_after(stall_s);
  while (n > 0) {
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = (size_t)n;
    // MSG_NOSIGNAL: a peer that went away is an error to report, not SIGPIPE.
    const ssize_t w = ::sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return errno;
      // The socket buffer is full: wait for room, but only as long as the
      // peer keeps taking bytes. Blocks in the kernel, costing no CPU.
      const Clock::time_point until = std::min(stalled_at, deadline);
      pollfd p{fd, POLLOUT, 0};
      const int r = ::poll(&p, 1, ms_left(until));
      if (r < 0 && errno != EINTR) return errno;
      if (r == 0) return ETIMEDOUT;
      continue;  // writable, or an error the next sendmsg reports
    }
    stalled_at = deadline_after(stall_s);  // progress
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

int recv_exact(int fd, void* buf, size_t len, Clock::time_point deadline) {
  uint8_t* p = static_cast<uint8_t*>(buf);
  while (len > 0) {
    pollfd pf{fd, POLLIN, 0};
    const int r = ::poll(&pf, 1, ms_left(deadline));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) return ETIMEDOUT;
    const ssize_t got = ::recv(fd, p, len, MSG_DONTWAIT);
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return errno;
    }
    if (got == 0) return ECONNRESET;
    p += got;
    len -= (size_t)got;
  }
  return 0;
}

}  // namespace arx::tcp_io

// Socket helpers of the tcp carrier. Every call that can wait takes a bound:
// no send, receive or connect here waits past it.
#pragma once

#include <netinet/in.h>
#include <sys/uio.h>

#include <chrono>
#include <string>

namespace arx::tcp_io {

using Clock = std::chrono::steady_clock;

std::string errno_text(int e);
int ms_left(Clock::time_point deadline);
Clock::time_point deadline_after(double seconds);
std::string sockaddr_text(const sockaddr_in& a);
// Resolves an IPv4 host name or dotted address.
bool resolve_ipv4(const std::string& host, in_addr& out, std::string& err);
void set_nodelay(int fd);

// Writes every byte of iov[0..n) (which it consumes) to a non-blocking
// socket. Gives up when the socket takes no byte for `stall_s` seconds (the
// peer stopped reading: stopped, hung, or its host unreachable), or at
// `deadline`. Returns 0, ETIMEDOUT for either bound, or the errno that ended
// the stream.
int send_all(int fd, iovec* iov, int n, double stall_s, Clock::time_point deadline = Clock::time_point::max());
// Reads exactly len bytes by `deadline`. Returns 0, ETIMEDOUT, ECONNRESET
// for an orderly close before len bytes, or the errno that ended the stream.
int recv_exact(int fd, void* buf, size_t len, Clock::time_point deadline);

}  // namespace arx::tcp_io

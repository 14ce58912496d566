#include "transport/tcp_auth.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "base/layout.h"
#include "base/status.h"

namespace arx::tcp_auth {

using namespace tcp_wire;

namespace {

// Domain labels: a MAC made for one purpose never passes for another.
constexpr const char* kViewLabel = "jax_arx tcp v2 view";
constexpr const char* kPairLabel = "jax_arx tcp v2 pair key";
constexpr const char* kAcceptorLabel = "jax_arx tcp v2 acceptor";
constexpr const char* kDialerLabel = "jax_arx tcp v2 dialer";

void put_u32(uint8_t out[4], uint32_t v) {
  for (int i = 0; i < 4; ++i) out[i] = (uint8_t)(v >> (8 * i));
}

Digest acceptor_mac(const Hello& h, const uint8_t nonce[kNonceBytes], const Digest& key) {
  return crypto::Hmac(key.b, sizeof key.b)
      .field(std::string(kAcceptorLabel))
      .field(&h, sizeof h)
      .field(nonce, kNonceBytes)
      .final();
}

}  // namespace

bool make_key_pair(KeyPair& out) {
  if (!crypto::random_bytes(out.priv, sizeof out.priv)) return false;
  crypto::x25519_base(out.pub, out.priv);
  return true;
}

std::string format_details(const std::string& addr, int port, const uint8_t pub[crypto::kKeyBytes]) {
  return strf("%s %s %d %s", kDetailsTag, addr.c_str(), port, crypto::to_hex(pub, crypto::kKeyBytes).c_str());
}

bool parse_details(const std::string& d, Details& out, std::string& why) {
  char tag[16] = {}, host[256] = {}, key[2 * crypto::kKeyBytes + 2] = {};
  int port = -1, used = 0;
  if (sscanf(d.c_str(), "%15s %255s %d %65s%n", tag, host, &port, key, &used) != 4 || strcmp(tag, kDetailsTag) != 0 ||
      (size_t)used != d.size()) {
    why = strf("expected '%s <ipv4> <port> <public key>'", kDetailsTag);
    return false;
  }
  if (port <= 0 || port > 65535) {
    why = strf("port %d is not a tcp port", port);
    return false;
  }
  if (!crypto::from_hex(key, out.pub, sizeof out.pub)) {
    why = "the public key is not 64 hex digits";
    return false;
  }
  out.host = host;
  out.port = port;
  return true;
}

Digest view_of(const std::vector<std::string>& details) {
  crypto::Sha256 h;
  h.field(std::string(kViewLabel));
  uint8_t n[4];
  put_u32(n, (uint32_t)details.size());
  h.update(n, sizeof n);
  for (const std::string& d : details) h.field(d);
  return h.final();
}

bool pair_key(const KeyPair& mine, int rank, int peer, const uint8_t peer_pub[crypto::kKeyBytes], const Digest& view,
              const std::string& shared_secret, Digest& out) {
  uint8_t dh[crypto::kKeyBytes];
  const bool ok = crypto::x25519(dh, mine.priv, peer_pub);
  uint8_t lo[4], hi[4];
  put_u32(lo, (uint32_t)std::min(rank, peer));
  put_u32(hi, (uint32_t)std::max(rank, peer));
  out = crypto::Hmac(shared_secret.data(), shared_secret.size())
            .field(std::string(kPairLabel))
            .field(dh, sizeof dh)
            .field(view.b, sizeof view.b)
            .field(lo, 4)
            .field(hi, 4)
            .final();
  memset(dh, 0, sizeof dh);
  return ok;
}

bool make_hello(int world, int rank, int root, const Digest& view, Hello& out) {
  out = Hello{};
  out.magic = kHelloMagic;
  out.version = kWireVersion;
  out.world = world;
  out.rank = rank;
  out.root = root;
  memcpy(out.view, view.b, sizeof out.view);
  return crypto::random_bytes(out.nonce, sizeof out.nonce);
}

Reject check_hello(const Hello& h, int my_rank, int world, const Digest& my_view, std::string& why) {
  if (h.magic != kHelloMagic) {
    why = strf("its first bytes (0x%016llx) are not a jax_arx hello", (unsigned long long)h.magic);
    return Reject::kHello;
  }
  if (h.version != kWireVersion) {
    why = strf("it speaks wire version %u, this rank %u (mixed jax_arx versions?)", h.version, kWireVersion);
    return Reject::kVersion;
  }
  if (h.world != world || h.rank < 0 || h.rank >= world || h.rank == my_rank || h.root < 0 || h.root >= kRoots) {
    why = strf("it says it is rank %d root %d of world %d; this is rank %d of %d with %d roots", h.rank, h.root,
               h.world, my_rank, world, kRoots);
    return Reject::kHello;
  }
  if (!crypto::equal_ct(h.view, my_view.b, sizeof h.view)) {
    why = strf(
        "it says it is rank %d, but read other connection details from the rendezvous than this rank did "
        "(another run or communicator, or the store was altered during set-up)",
        h.rank);
    return Reject::kView;
  }
  return Reject::kNone;
}

bool make_challenge(const Hello& h, const Digest& key, Challenge& out) {
  out = Challenge{};
  out.magic = kChallengeMagic;
  if (!crypto::random_bytes(out.nonce, sizeof out.nonce)) return false;
  const Digest mac = acceptor_mac(h, out.nonce, key);
  memcpy(out.mac, mac.b, sizeof out.mac);
  return true;
}

bool challenge_valid(const Hello& h, const Challenge& c, const Digest& key) {
  const Digest mac = acceptor_mac(h, c.nonce, key);
  return c.magic == kChallengeMagic && crypto::equal_ct(mac.b, c.mac, sizeof c.mac);
}

Proof make_proof(const Hello& h, const Challenge& c, const Digest& key) {
  Proof p{};
  p.magic = kProofMagic;
  const Digest mac = crypto::Hmac(key.b, sizeof key.b)
                         .field(std::string(kDialerLabel))
                         .field(&h, sizeof h)
                         .field(&c, sizeof c)
                         .final();
  memcpy(p.mac, mac.b, sizeof p.mac);
  return p;
}

bool proof_valid(const Hello& h, const Challenge& c, const Digest& key, const Proof& p) {
  const Proof want = make_proof(h, c, key);
  return p.magic == kProofMagic && crypto::equal_ct(want.mac, p.mac, sizeof p.mac);
}

Result authenticate(int fd, const Hello& hello, const Digest& key, tcp_io::Clock::time_point deadline) {
  Result res;
  auto failed = [&](int e, const char* when) {
    res.outcome = e == ETIMEDOUT ? Outcome::kTimeout : Outcome::kClosed;
    res.detail = strf("%s %s", when, tcp_io::errno_text(e).c_str());
    return res;
  };
  Hello h = hello;
  iovec iov{&h, sizeof h};
  const double left = tcp_io::ms_left(deadline) / 1000.0;
  if (const int e = tcp_io::send_all(fd, &iov, 1, left, deadline)) return failed(e, "sending the hello:");
  // The answer is a challenge, or a verdict that rejects: the magic says which.
  uint64_t magic = 0;
  if (const int e = tcp_io::recv_exact(fd, &magic, sizeof magic, deadline)) return failed(e, "awaiting the challenge:");
  auto read_verdict_rest = [&](uint64_t m) {
    tcp_wire::Verdict v{};
    v.magic = m;
    if (const int e = tcp_io::recv_exact(fd, reinterpret_cast<uint8_t*>(&v) + 8, sizeof v - 8, deadline))
      return failed(e, "reading the verdict:");
    if (v.magic == kAckMagic) {
      res.outcome = Outcome::kOk;
    } else {
      res.outcome = Outcome::kRejected;
      res.reject = (Reject)v.code;
    }
    return res;
  };
  if (magic == kRejectMagic) return read_verdict_rest(magic);
  if (magic != kChallengeMagic) {
    res.outcome = Outcome::kBadReply;
    res.detail = strf("it answered 0x%016llx", (unsigned long long)magic);
    return res;
  }
  Challenge c{};
  c.magic = magic;
  if (const int e = tcp_io::recv_exact(fd, reinterpret_cast<uint8_t*>(&c) + 8, sizeof c - 8, deadline))
    return failed(e, "reading the challenge:");
  if (!challenge_valid(h, c, key)) {
    res.outcome = Outcome::kImpostor;
    return res;
  }
  Proof p = make_proof(h, c, key);
  iovec piov{&p, sizeof p};
  if (const int e = tcp_io::send_all(fd, &piov, 1, tcp_io::ms_left(deadline) / 1000.0, deadline))
    return failed(e, "sending the proof:");
  if (const int e = tcp_io::recv_exact(fd, &magic, sizeof magic, deadline)) return failed(e, "awaiting the verdict:");
  if (magic != kAckMagic && magic != kRejectMagic) {
    res.outcome = Outcome::kBadReply;
    res.detail = strf("it answered the proof with 0x%016llx", (unsigned long long)magic);
    return res;
  }
  return read_verdict_rest(magic);
}

}  // namespace arx::tcp_auth

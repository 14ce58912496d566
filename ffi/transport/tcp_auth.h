// Who may open a tcp stream into an endpoint: the handshake's keys and
// messages (the wire layout is in tcp_wire.h).
//
// Keys. Each carrier makes an X25519 key pair when it is constructed and
// puts the public half in its connection details ("arx-tcp/2 <ip> <port>
// <public key>"), which the ranks exchange through jax.distributed's
// key-value store. The private half never leaves the process. For each
// pair of ranks (i, j):
//   view   = SHA-256 of every rank's details, in rank order, as this rank read them
//   K(i,j) = HMAC-SHA256(key = the communicator's shared secret,
//                        X25519(own private key, peer's public key), view, i, j)
// The shared secret (TransportContext::secret) is, from Python, derived from
// JAX_ARX_SECRET when the user set it and otherwise from public values of
// the rendezvous: it binds a run and a communicator, and is a secret only
// when the user gave one.
//
// Handshake (tcp_wire.h). The acceptor proves it holds K first, the dialer
// then proves it over both nonces; each side checks the other's MAC before
// it sends anything that depends on K, and the labels differ by direction,
// so neither side's answers help forge the other's.
//
// What this keeps out (docs/failures.md says it for users):
//  - Anyone who can read the store (any local user, anyone who reaches the
//    coordinator's port) learns public keys and addresses only: without a
//    rank's private key no stream of theirs is accepted, and no byte of
//    theirs reaches an endpoint's memory.
//  - An authenticated rank writes only its own slots and flag words
//    (tcp_wire.h check_frame), so one faulty rank cannot forge another's arrival.
//  - Someone who can also write the store during set-up can replace a rank's
//    details. The ranks whose views then differ cannot authenticate each
//    other, and say so (Reject::kView, a proof that fails). A replaced key
//    passes unnoticed only if the writer also stands between every pair it
//    splits, with consistent views on both sides (a full man in the middle
//    of the rendezvous); with JAX_ARX_SECRET set on every process even that
//    fails, since K needs the secret.
//  - Not covered: the bytes of an authenticated stream are neither
//    encrypted nor authenticated one by one, so an attacker on the network
//    path itself (who can forge TCP segments) can read or alter them, as
//    with NCCL's sockets and any RDMA. Run the carrier on the cluster's own
//    network.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "transport/tcp_crypto.h"
#include "transport/tcp_io.h"
#include "transport/tcp_wire.h"

namespace arx::tcp_auth {

using crypto::Digest;
using tcp_wire::Challenge;
using tcp_wire::Hello;
using tcp_wire::Proof;
using tcp_wire::Reject;

struct KeyPair {
  uint8_t priv[crypto::kKeyBytes];
  uint8_t pub[crypto::kKeyBytes];
};
// False only if the kernel gave no random bytes.
bool make_key_pair(KeyPair& out);

// One rank's connection details.
struct Details {
  std::string host;
  int port = 0;
  uint8_t pub[crypto::kKeyBytes] = {};
};
std::string format_details(const std::string& addr, int port, const uint8_t pub[crypto::kKeyBytes]);
// False, with the reason, when `d` is not this carrier's details.
bool parse_details(const std::string& d, Details& out, std::string& why);

// The hash of every rank's details (the "view").
Digest view_of(const std::vector<std::string>& details);
// K(rank, peer). False when the peer's public key is of small order (the
// Diffie-Hellman result would be zero, known to anyone).
bool pair_key(const KeyPair& mine, int rank, int peer, const uint8_t peer_pub[crypto::kKeyBytes], const Digest& view,
              const std::string& shared_secret, Digest& out);

// Messages; the make_ functions draw a fresh nonce (false if none could be drawn).
bool make_hello(int world, int rank, int root, const Digest& view, Hello& out);
// The acceptor's look at a hello, before any key is used: Reject::kNone when
// the stream may go on to the challenge, else why not (`why`: a sentence).
Reject check_hello(const Hello& h, int my_rank, int world, const Digest& my_view, std::string& why);
bool make_challenge(const Hello& h, const Digest& key, Challenge& out);
bool challenge_valid(const Hello& h, const Challenge& c, const Digest& key);
Proof make_proof(const Hello& h, const Challenge& c, const Digest& key);
bool proof_valid(const Hello& h, const Challenge& c, const Digest& key, const Proof& p);

// The dialer's side of the handshake on a connected non-blocking socket.
enum class Outcome {
  kOk,        // acked: frames may follow
  kClosed,    // the acceptor closed before its verdict (it was busy or restarting): dial again
  kRejected,  // the acceptor refused, saying why (reject)
  kImpostor,  // whoever answered did not prove it holds the pair's key
  kBadReply,  // an answer that is not this protocol's
  kTimeout,   // no answer by the deadline
};
struct Result {
  Outcome outcome = Outcome::kTimeout;
  Reject reject = Reject::kNone;
  std::string detail;  // errno text or the bytes seen, for messages
};
Result authenticate(int fd, const Hello& hello, const Digest& key, tcp_io::Clock::time_point deadline);

}  // namespace arx::tcp_auth

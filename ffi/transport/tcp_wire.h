// The tcp carrier's wire format, shared by the carrier (tcp*.cc) and the
// tests that speak it by hand as a stranger or a faulty peer would.
//
// A stream (one per (dialer, acceptor, root)) opens with a handshake, then
// carries frames from the dialer to the acceptor only:
//
//   dialer -> acceptor   Hello      who the dialer says it is, the hash of the
//                                   connection details it read (its "view"),
//                                   and a fresh nonce
//   acceptor -> dialer   Challenge  a fresh nonce and a MAC proving the
//                                   acceptor holds the pair's key
//                        or Verdict(reject, why) and a close
//   dialer -> acceptor   Proof      a MAC over the hello and the challenge
//   acceptor -> dialer   Verdict    ack, or reject (why) and a close
//   dialer -> acceptor   frames: FrameHeader + payload, ..., then a bye
//
// How the pair's key is made, and what it protects against, is in
// tcp_auth.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "base/layout.h"
#include "transport/transport.h"

namespace arx::tcp_wire {

// Words travel in host order: every supported host (x86-64, aarch64) is
// little-endian, and a byte-swapped peer fails the magic check.
constexpr uint64_t kHelloMagic = 0x4f4c4c4548585241ull;      // "ARXHELLO"
constexpr uint64_t kChallengeMagic = 0x4c4c414843585241ull;  // "ARXCHALL"
constexpr uint64_t kProofMagic = 0x464f4f5250585241ull;      // "ARXPROOF"
constexpr uint64_t kAckMagic = 0x00004b4341585241ull;        // "ARXACK": the stream is authenticated
constexpr uint64_t kRejectMagic = 0x54434a4552585241ull;     // "ARXREJCT": refused, a close follows
constexpr uint64_t kFrameMagic = 0x454d415246585241ull;      // "ARXFRAME"
constexpr uint64_t kByeMagic = 0x0000455942585241ull;        // "ARXBYE": a deliberate close follows
// Version 1 sent the communicator's secret itself in the hello.
constexpr uint32_t kWireVersion = 2;
constexpr const char* kDetailsTag = "arx-tcp/2";
constexpr size_t kNonceBytes = 32, kMacBytes = 32;

struct Hello {
  uint64_t magic;    // kHelloMagic
  uint32_t version;  // at the offset version 1 had it, so old peers are told what differs
  int32_t world, rank, root;
  uint32_t reserved;
  uint8_t view[32];  // tcp_auth: the hash of every rank's details, as the dialer read them
  uint8_t nonce[kNonceBytes];
  uint8_t pad[4];
};
static_assert(sizeof(Hello) == 96, "Hello is read by the peer as raw bytes: keep its layout fixed");

struct Challenge {
  uint64_t magic;  // kChallengeMagic
  uint8_t nonce[kNonceBytes];
  uint8_t mac[kMacBytes];
};
static_assert(sizeof(Challenge) == 72, "Challenge is read by the peer as raw bytes: keep its layout fixed");

struct Proof {
  uint64_t magic;  // kProofMagic
  uint8_t mac[kMacBytes];
};
static_assert(sizeof(Proof) == 40, "Proof is read by the peer as raw bytes: keep its layout fixed");

// Why an acceptor refused a stream (Verdict::code with kRejectMagic).
enum class Reject : uint32_t {
  kNone = 0,
  kVersion = 1,  // another wire version
  kHello = 2,    // a world, rank or root that is not a peer of this rank
  kView = 3,     // the two ranks read different connection details
  kProof = 4,    // the proof was wrong: the dialer does not hold the pair's key
  kTaken = 5,    // that (rank, root) is already authenticated
};
const char* reject_name(Reject r);

struct Verdict {
  uint64_t magic;  // kAckMagic or kRejectMagic
  uint32_t code;   // Reject
  uint32_t reserved;
};
static_assert(sizeof(Verdict) == 16, "Verdict is read by the peer as raw bytes: keep its layout fixed");

struct FrameHeader {
  uint64_t magic;  // kFrameMagic, or kByeMagic (other fields zero)
  uint64_t offset, len, flag_offset, flag_value;
};
static_assert(sizeof(FrameHeader) == 40, "FrameHeader is read by the peer as raw bytes: keep its layout fixed");

// Checks a data frame from authenticated rank `src` against what that rank
// may write in rank `at`'s region (layout L): Layout::may_write and
// may_flag, the one statement of who writes what, for every carrier.
// Returns "" when it may, else why not, as the end of a sentence. Data of
// length zero is no write and passes wherever it points; kNoFlag is no
// flag.
std::string check_frame(const FrameHeader& h, const Layout& L, int src, int at);

}  // namespace arx::tcp_wire

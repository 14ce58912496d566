// The carrier interface. A carrier knows only two things: "write these bytes
// into peer p's region at offset o over root r, then write this flag word, in
// that order", and "poll for completions and errors". The protocol (what to
// send when, and in which order) lives in comm/ (channel.h, proxy.cc),
// written once; the proxy is the only caller of put().
//
// Carriers: shm (peers on one host map each other's regions), tcp (any
// hosts; the receiver checks every frame against its inbox), verbs (RDMA
// writes on RC queue pairs; libibverbs loaded at run time).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/layout.h"
#include "base/region.h"
#include "base/status.h"
#include "base/windows.h"

namespace arx {

enum class TransportKind : uint32_t { kShm = 1, kTcp = 2, kVerbs = 3 };

// Transport::put's flag_offset for a put with no flag word after its bytes.
constexpr uint64_t kNoFlag = ~0ull;
const char* transport_name(TransportKind kind);

// What a carrier is given by its endpoint. Everything here outlives it.
struct TransportContext {
  int rank = 0, world = 0;
  Region* region = nullptr;  // this endpoint's memory
  Layout layout;             // where the inbox is; every write is checked against the sender's slots in it
  // Peers on one host: their regions mapped here (the shm carrier puts
  // through them). Mapped by the endpoint before connect(); null elsewhere.
  const PeerWindows* windows = nullptr;
  std::string secret;  // the communicator's random secret, from the rendezvous
  const Config* config = nullptr;
  std::string label;  // "communicator 'tp' rank 0 of 2", for messages
  // The receiving side of a carrier reports a peer whose link broke (the
  // peer exited, or sent what it must not): the endpoint fails the waits on
  // that peer at once instead of letting them run into the timeout.
  std::function<void(int peer, const std::string& why)> on_peer_lost;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual TransportKind kind() const = 0;
  // How many roots each write is split over: 2 (two NIC functions, or two
  // streams), or 1 (a single device; the data then goes whole).
  virtual int roots() const = 0;
  // Whether every put lands in whole aligned 8-byte words: a reader polling
  // the destination never sees an aligned word half written. The LL lines
  // (base/layout.h) need it to travel through the proxy.
  virtual bool whole_words() const = 0;
  // This rank's connection details, opaque to everyone but the same carrier
  // on the peers. Available right after construction.
  virtual std::string details() const = 0;
  // Wires every peer from everyone's details (index = rank; this rank's own
  // entry included). Returns when every link is up in both directions, or
  // an error naming the peer that did not answer within timeout_s.
  virtual Status connect(const std::vector<std::string>& details, double timeout_s) = 0;
  // Writes [src, src + len) into `peer`'s region at `offset` (len may be 0),
  // then stores `flag_value` into its word at `flag_offset` (none when
  // flag_offset is kNoFlag), over `root`. The peer observes the flag (with
  // acquire) only after the data is in place. Puts on one (peer, root) take
  // effect in the order they are made, so a later put's flag covers an
  // earlier put's data too. `src` lies inside this endpoint's region.
  virtual Status put(int peer, int root, const void* src, uint64_t offset, uint64_t len, uint64_t flag_offset,
                     uint64_t flag_value) = 0;
  // Reaps completions; returns the first error, which is sticky.
  virtual Status poll() = 0;
  // Stops the carrier's threads and closes its links. Idempotent.
  virtual void close() = 0;
};

// The carrier of `kind` (transport/factory.cc).
Status make_transport(TransportKind kind, const TransportContext& ctx, std::unique_ptr<Transport>& out);

Status make_shm_transport(const TransportContext& ctx, std::unique_ptr<Transport>& out);
Status make_tcp_transport(const TransportContext& ctx, std::unique_ptr<Transport>& out);
Status make_verbs_transport(const TransportContext& ctx, std::unique_ptr<Transport>& out);

}  // namespace arx

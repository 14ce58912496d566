// The carrier interface. A carrier knows only two things: "write these bytes
// into peer p's region at offset o over root r, then write this flag word, in
// that order", and "poll for completions and errors". The protocol (what to
// send when, and in which order) lives in comm/proxy.cc, written once.
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

#include "comm/config.h"
#include "comm/layout.h"
#include "comm/region.h"
#include "comm/status.h"

namespace arx {

enum class TransportKind : uint32_t { kShm = 1, kTcp = 2, kVerbs = 3 };
const char* transport_name(TransportKind kind);

// What a carrier is given by its endpoint. Everything here outlives it.
struct TransportContext {
  int rank = 0, world = 0;
  Region* region = nullptr;  // this endpoint's memory
  Layout layout;             // where the inbox is; every incoming write is checked against it
  std::string secret;        // the communicator's random secret, from the rendezvous
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
  // This rank's connection details, opaque to everyone but the same carrier
  // on the peers. Available right after construction.
  virtual std::string details() const = 0;
  // Wires every peer from everyone's details (index = rank; this rank's own
  // entry included). Returns when every link is up in both directions, or
  // an error naming the peer that did not answer within timeout_s.
  virtual Status connect(const std::vector<std::string>& details, double timeout_s) = 0;
  // Writes [src, src + len) into `peer`'s region at `offset` (len may be 0),
  // then stores `flag_value` into its word at `flag_offset`, over `root`.
  // The peer observes the flag (with acquire) only after the data is in
  // place. Puts on one (peer, root) take effect in the order they are made.
  // `src` lies inside this endpoint's region.
  virtual Status put(int peer, int root, const void* src, uint64_t offset, uint64_t len, uint64_t flag_offset,
                     uint64_t flag_value) = 0;
  // Whether put() may be called from a thread other than the proxy's, while
  // the proxy puts and polls (the CPU device side sends its own psum seqs
  // where it may).
  virtual bool puts_from_any_thread() const = 0;
  // Reaps completions; returns the first error, which is sticky.
  virtual Status poll() = 0;
  // This process's mapping of `peer`'s whole region, where a carrier has one
  // (shm), else nullptr. The CUDA device side writes the peers' inboxes
  // through it directly (data, then the flag with release), skipping the
  // proxy's copy; the proxy then sends no psum seq (Endpoint::device_sends).
  virtual uint8_t* peer_base(int peer) const { return nullptr; }
  // Stops the carrier's threads and closes its links. Idempotent.
  virtual void close() = 0;
};

Status make_shm_transport(const TransportContext& ctx, std::unique_ptr<Transport>& out);
Status make_tcp_transport(const TransportContext& ctx, std::unique_ptr<Transport>& out);
Status make_verbs_transport(const TransportContext& ctx, std::unique_ptr<Transport>& out);

}  // namespace arx

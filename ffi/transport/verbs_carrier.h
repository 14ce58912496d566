// The verbs carrier: RDMA writes on RC queue pairs, libibverbs loaded at run
// time (verbs_lib.h), devices and GIDs chosen as verbs_device.h says.
// verbs_connect.cc: set-up (devices, memory windows, queue pairs, the probe
// of every link); verbs.cc: the data path (put, completions) and close.
//
// Per device: a PD, a CQ, and MRs over this endpoint's region: the whole
// region for local access (every write's source lies in it), and with remote
// write only the windows peers may write (base/layout.h): the inbox (flags
// and psum slots), the bulk inbox, and in a ring of 4 the relay area. Peers
// get those MRs' rkeys, so the NIC itself refuses a peer's write anywhere
// else, on top of the check every put() makes against the bounds the peer
// advertised.
//
// Links: one RC QP each, to one peer over one root, on one device.
//  - Mesh: a link to every peer per root; root r is device r.
//  - Ring (base/topology.h): a rank reaches only prev and next, each over
//    the port that faces it, a device per root on each port. The devices are
//    listed as in the reference: the port facing prev (root 0, root 1), then
//    the port facing next. Link slot 0 goes out of the prev port, slot 1 out
//    of the next port, and meets the peer's slot on the other end of the
//    cable (prev's slot 1, next's slot 0). At world 2 prev is next, cabled
//    twice: both slots are linked, puts go out of the next port (the
//    reference's choice) and arrive on the peer's prev port. What goes to
//    the rank two away (world 4) is not the carrier's business: the proxy
//    relays it through next (comm/relay.h).
//
// Order, the one thing the protocol asks of a carrier: put() posts the data
// write and then the flag's write on the same RC QP. The responder executes
// a QP's writes in PSN order, and a ConnectX places them in memory in that
// order as long as the MR does not ask for relaxed PCIe ordering
// (IBV_ACCESS_RELAXED_ORDERING, never requested here). So a receiver that
// load-acquires the flag sees the data before it (the reference's premise).
//
// Reachability: connect() ends with one signalled write on every link (the
// probe, into the peer's handshake word). A neighbour that is not cabled
// where the device list says, or a wrong GID, fails initialize naming the
// rank and the port instead of the first collective.
//
// Completions: every WR is unsignalled except one every signal_every_ WRs
// per QP. A signalled completion retires every WR posted before it on that
// QP, which is how the send queue is reclaimed; WRs that fail complete
// regardless of signalling, so errors are never missed. poll() turns the
// first failed completion into the sticky error, naming the peer, and
// reports every peer whose QP failed through ctx.on_peer_lost. A peer that
// exits or destroys its QPs stops acknowledging: the NIC retries retry_cnt
// times, timeout apart (4.096 us << timeout: 67 ms at 14), then fails the
// write, so the failure surfaces within about half a second of the first
// write the peer does not take, never as a silent stall. (Soft-RoCE, the
// rdma_rxe of Linux 6.1 at least, takes retry_cnt 7 to mean "retry forever",
// as the spec says only of rnr_retry: set JAX_ARX_IB_RETRY_CNT=6 there. A
// send queue that stays full past Config::timeout_s is reported the same way.)
#pragma once

#include "transport/transport.h"

#include "transport/verbs_build.h"
#if ARX_HAVE_VERBS

#include <string>
#include <vector>

#include "transport/verbs_device.h"
#include "transport/verbs_lib.h"

namespace arx {

// QP settings: timeout, retry count, traffic class and service level come
// from Config (the reference's 14 = 67 ms and 7 by default, see config.h).
constexpr int kRnrRetry = 7;  // 7 = retry forever; no receive WRs are ever involved
constexpr int kMinRnrTimer = 12;
constexpr uint32_t kSqDepth = 512;  // WRs per QP; a put takes 2 (1 without data)
// Inline bytes asked of each QP: a put's header (32 bytes) and the few LL
// lines of a small psum fit; ConnectX takes more, soft-RoCE 400.
constexpr uint32_t kInlineWanted = 256;
constexpr int kChain = 16;  // WRs per ibv_post_send call
constexpr uint64_t kMaxChunk = 1ull << 30;
constexpr int kMaxDevices = 2 * kRoots;  // a ring: two ports, a device per root on each

constexpr uint32_t kWireMagic = 0x56585241;  // "ARXV"
constexpr uint32_t kWireVersion = 4;

// What this rank tells its peers (details()). Raw bytes: every rank runs the
// same jax_arx (the endpoint's fingerprint checks the version), and the
// targets are all little-endian. The details travel through the rendezvous
// store, which anyone who reaches the coordinator reads: they hold nothing
// derived from the communicator's secret (version 2 held a 64-bit hash of
// it, against which JAX_ARX_SECRET could be guessed offline). That the
// details are this communicator's is the endpoint fingerprint's check
// (communicator id and name, comm/fingerprint.cc).
struct Wire {
  uint32_t magic, version;
  int32_t rank, world, roots, ring;
  uint64_t region_addr, region_bytes;
  uint64_t inbox_lo, inbox_hi;  // offsets from region_addr that peers may write: flags and psum slots
  uint64_t bulk_lo, bulk_hi;    // and the bulk slots (empty when the endpoint has none)
  uint64_t relay_lo, relay_hi;  // and the relay area (a ring of 4; empty elsewhere)
  struct Dev {
    uint8_t gid[16];
    uint32_t rkey;        // of the inbox MR
    uint32_t bulk_rkey;   // of the bulk inbox MR
    uint32_t relay_rkey;  // of the relay area's MR
    uint32_t mtu;         // the port's active MTU (enum ibv_mtu)
    uint32_t port, gid_index;
    uint16_t lid;
    uint8_t ethernet, pad[1];
    char name[32];
  } dev[kMaxDevices];
  uint32_t qpn[kMaxWorld][kRoots];  // this rank's QP of link slot s over root r
};

// put() and poll() are called from one thread, the endpoint's proxy; close()
// after that thread stopped. Nothing here takes a lock.
class VerbsTransport final : public Transport {
 public:
  VerbsTransport(const TransportContext& ctx, const verbs::Api& api)
      : ctx_(ctx), api_(api), ring_(ctx.layout.topo.ring) {}
  ~VerbsTransport() override { close(); }

  TransportKind kind() const override { return TransportKind::kVerbs; }
  int roots() const override { return roots_; }
  // The NIC writes host memory in aligned words of 8 bytes or more, never a
  // part of one (what NCCL's LL protocol over the network relies on too).
  bool whole_words() const override { return true; }
  std::string details() const override { return std::string(reinterpret_cast<const char*>(&wire_), sizeof wire_); }

  Status open();
  Status connect(const std::vector<std::string>& details, double timeout_s) override;
  Status put(int peer, int root, const void* src, uint64_t offset, uint64_t len, uint64_t flag_offset,
             uint64_t flag_value) override;

  Status poll() override {
    if (error_.ok()) reap();
    return error_;
  }
  void close() override;

 private:
  // One RC QP: to one peer over one root, on one device.
  struct Link {
    ibv_qp* qp = nullptr;
    int peer = -1, dev = 0;
    uint64_t posted = 0;       // WRs posted
    uint64_t completed = 0;    // WRs retired (by the last signalled completion)
    uint64_t unsignalled = 0;  // WRs posted since the last signalled one
    bool failed = false;
    // The peer's side, from its details.
    uint64_t remote_base = 0, inbox_lo = 0, inbox_hi = 0, bulk_lo = 0, bulk_hi = 0, relay_lo = 0, relay_hi = 0;
    uint32_t rkey = 0, bulk_rkey = 0, relay_rkey = 0, remote_qpn = 0;
    int path_mtu = 0;
    // Writes of up to this many bytes go inline (IBV_SEND_INLINE): the
    // driver copies them into the work request as it posts, so the NIC
    // need not read them from host memory; what the QP was given.
    uint32_t inline_max = 0;
    std::string remote;  // "rank 1 (rxe1 port 1, GID 198.51.100.2, QP 0x12)", for messages
  };

  // Link slots (see the top): mesh, one per rank (this rank's unused);
  // ring, 0 (out of the prev port) and 1 (out of the next port).
  int slots() const { return ring_ ? 2 : ctx_.world; }
  bool in_use(int slot) const { return ring_ || slot != ctx_.rank; }
  int peer_of(int slot) const {
    return !ring_ ? slot : slot ? ctx_.layout.topo.next(ctx_.rank) : ctx_.layout.topo.prev(ctx_.rank);
  }
  // The slot put() takes to `peer`: next before prev (world 2); -1: no link.
  int slot_to(int peer) const;
  int dev_of(int slot, int root) const { return ring_ ? slot * roots_ + root : root; }
  // The peer's slot and device on the other end of this rank's link.
  int remote_slot(int slot) const { return ring_ ? 1 - slot : ctx_.rank; }
  int remote_dev(int slot, int root) const { return dev_of(remote_slot(slot), root); }

  // "jax_arx: <label>: <rest>" from a message that starts "jax_arx: ".
  Status labelled(const std::string& message) const {
    const std::string p = "jax_arx: ";
    const std::string rest = message.compare(0, p.size(), p) == 0 ? message.substr(p.size()) : message;
    return Status::Error(p + ctx_.label + ": " + rest);
  }
  Status fail(const std::string& message) {
    if (error_.ok()) error_ = labelled(message);
    return error_;
  }
  // "rxe0 port 1 GID[1] 198.51.100.1 on veth0", and in a ring which
  // neighbour its port faces.
  std::string where(int dev) const;
  Status check_device_list(const std::string& hca) const;
  Status open_device_memory(int dev);
  Status create_link(int slot, int root);
  Status bring_up(int slot, int root, const Wire& peer);
  Status probe(double timeout_s);
  Status modify(Link& l, ibv_qp_attr& a, int mask, const char* transition, const char* hint);
  Status make_room(Link& l, int root, uint64_t need);
  Link* link_of_qp(int dev, uint32_t qp_num);
  void reap();
  void completion_error(Link& l, int root, const ibv_wc& wc);
  void report_lost(int peer, const std::string& why);  // once per peer

  TransportContext ctx_;
  const verbs::Api& api_;
  const bool ring_;
  int roots_ = 0;
  std::vector<verbs::Device> devices_;
  std::string note_;
  ibv_pd* pd_[kMaxDevices] = {};
  ibv_cq* cq_[kMaxDevices] = {};
  ibv_mr* local_mr_[kMaxDevices] = {};  // the whole region: sources
  ibv_mr* inbox_mr_[kMaxDevices] = {};  // the inbox: what peers write into
  ibv_mr* bulk_mr_[kMaxDevices] = {};   // the bulk inbox, likewise
  ibv_mr* relay_mr_[kMaxDevices] = {};  // the relay area (a ring of 4), likewise
  Link links_[kMaxWorld][kRoots];       // by slot and root
  Wire wire_{};
  uint64_t sq_depth_ = kSqDepth, signal_every_ = kSqDepth / 4, chunk_ = kMaxChunk;
  int timeout_ = 14, retry_cnt_ = 7, tc_ = 0, sl_ = 0;  // from Config in open()
  bool connected_ = false, closed_ = false;
  // Set and read by the thread that calls put() and poll() (the proxy).
  Status error_;
  uint32_t lost_ = 0;  // peers already reported through on_peer_lost
};

// Why a completion failed, in words a user can act on.
const char* completion_hint(ibv_wc_status s);

}  // namespace arx

#endif  // ARX_HAVE_VERBS

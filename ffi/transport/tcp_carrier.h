// The tcp carrier: a connection per (peer, root), so the two roots are two
// ordered streams. A put is one frame on its (peer, root) stream: a fixed
// header (where the bytes go, where the flag goes, the flag's value) and the
// payload. One receiver thread per endpoint reads every inbound stream,
// checks each frame against what its sender may write before writing a
// byte, receives the payload straight into the region and then stores the
// flag with release. tcp.cc: set-up, put and close; tcp_receive.cc: the
// receiver thread; tcp_auth.h: who may open a stream.
//
// Why "data before flag" holds: a stream delivers bytes in the order they
// were sent, and the receiver finishes a frame's payload before it stores
// that frame's flag (release), so a reader that acquires the flag sees the
// payload, and every earlier frame of that stream, in place.
//
// Who may write: a stream is read into the region only after its handshake
// proved the dialer holds the key this rank shares with the rank it claims
// to be (tcp_auth.h); until then the receiver reads into the link's own
// buffer only. After it, every frame is checked against that rank's own
// slots and flag words (tcp_wire.h check_frame).
//
// Bounded in time: a send gives up when the peer takes no byte for the
// timeout (tcp_io::send_all), and then closes its stream, so the peer sees
// it broken; connect() and every handshake end at its deadline; a stream
// that has not authenticated is dropped at the timeout, and when more than
// kMaxPending wait, the oldest of the silent ones first.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/tcp_auth.h"
#include "transport/tcp_io.h"
#include "transport/tcp_wire.h"
#include "transport/transport.h"

#if defined(__SANITIZE_THREAD__)
#define ARX_TCP_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define ARX_TCP_TSAN 1
#endif
#endif

namespace arx {

using tcp_io::Clock;

// One outbound stream to (peer, root). put() and close() take `mu`; two
// threads putting to different links never share a lock, and to one link
// they serialize, so a frame is never interleaved with another.
struct OutLink {
  std::mutex mu;
  std::atomic<int> fd{-1};  // atomic: close() may shut it down while a put holds mu
  int error = 0;            // under mu: errno of the first failed send; the stream is dead after it
#ifdef ARX_TCP_TSAN
  std::vector<uint8_t> bounce;  // under mu: see put()
#endif
};

// One inbound stream, owned by the receiver thread alone.
struct InLink {
  enum class Stage {
    kHello,   // reading the hello
    kParked,  // a whole hello, waiting for connect() to give this rank its keys
    kProof,   // challenged, reading the proof
    kHeader,  // authenticated: reading a frame header
    kPayload  // reading a frame's payload into the region
  };
  int fd = -1;
  std::string from;            // "ip:port", for messages
  Clock::time_point deadline;  // to authenticate by
  Stage stage = Stage::kHello;
  int peer = -1, root = -1;  // set once authenticated; peer >= 0 means authenticated
  bool said_bye = false;
  bool drop = false;  // the receiver closes and forgets it at the end of its pass
  tcp_wire::Hello hello{};
  tcp_wire::Challenge challenge{};
  alignas(8) uint8_t buf[sizeof(tcp_wire::Hello)];  // the message or frame header, as it arrives
  size_t got = 0;
  tcp_wire::FrameHeader hdr{};
  uint64_t payload_got = 0;
  bool pending() const { return peer < 0 && !drop; }
  bool silent() const { return stage == Stage::kHello && got == 0; }
};

class TcpTransport final : public Transport {
 public:
  // Streams waiting to authenticate, at most: the real peers need
  // (world - 1) * kRoots, all of which dial at once.
  static constexpr size_t kMaxPending = 64;

  explicit TcpTransport(const TransportContext& ctx) : ctx_(ctx) {
    if (ctx.config) cfg_ = *ctx.config;
  }
  ~TcpTransport() override;

  Status open();

  TransportKind kind() const override { return TransportKind::kTcp; }
  int roots() const override { return kRoots; }
  // recv() may return inside a word: a reader polling the destination could
  // see half of it.
  bool whole_words() const override { return false; }
  std::string details() const override { return tcp_auth::format_details(addr_, port_, keys_.pub); }
  Status connect(const std::vector<std::string>& details, double timeout_s) override;
  Status put(int peer, int root, const void* src, uint64_t offset, uint64_t len, uint64_t flag_offset,
             uint64_t flag_value) override;
  Status poll() override {
    std::lock_guard<std::mutex> lk(send_error_mu_);
    return send_error_;
  }
  void close() override;

 private:
  int link_index(int peer, int root) const { return peer * kRoots + root; }
  void log(const std::string& msg) const {
    if (cfg_.verbose) fprintf(stderr, "jax_arx: %s: tcp: %s\n", ctx_.label.c_str(), msg.c_str());
  }
  Status listen_on_config_addr();
  Status derive_keys(const std::vector<std::string>& details, std::vector<sockaddr_in>& to);
  Status dial_and_authenticate(int peer, int root, const sockaddr_in& to, Clock::time_point deadline, int& fd_out);
  std::string rejection_text(int peer, int root, const sockaddr_in& to, const tcp_auth::Result& r) const;

  // Receiver thread (tcp_receive.cc).
  void receive_loop();
  void accept_all();
  void make_room();
  bool service(InLink& c);
  bool on_hello(InLink& c);
  bool on_proof(InLink& c);
  bool on_header(InLink& c);
  void finish_frame(InLink& c);
  bool answer(InLink& c, const void* msg, size_t len);
  bool refuse(InLink& c, tcp_wire::Reject code, const std::string& why);
  bool link_down(InLink& c, const std::string& why, bool eof = false);
  void reject(const InLink& c, const std::string& why);

  TransportContext ctx_;
  Config cfg_;
  tcp_auth::KeyPair keys_{};
  std::string addr_;  // advertised address
  int port_ = 0;
  int listen_fd_ = -1;  // the receiver thread owns it once started
  int wake_fd_ = -1;    // eventfd: close() and connect() wake the receiver out of poll()
  std::thread thread_;
  std::vector<std::unique_ptr<InLink>> in_;  // receiver thread only
  Clock::time_point accept_resume_{};        // receiver thread only: accept() failed, wait until then
  std::vector<std::unique_ptr<OutLink>> out_;

  // Written by connect() before keys_ready_ is stored (release); the
  // receiver thread reads them only after loading it (acquire).
  crypto::Digest view_{};
  std::vector<crypto::Digest> pair_keys_;  // [peer]
  std::atomic<bool> keys_ready_{false};

  // stop_: the receiver thread exits at its next wake-up. closing_: close()
  // was called here, so a stream that ends is our doing, not a lost peer.
  std::atomic<bool> stop_{false}, closing_{false};
  std::atomic<bool> connected_{false};
  bool connect_called_ = false;

  // Inbound authentication, written by the receiver thread, awaited by connect().
  std::mutex auth_mu_;
  std::condition_variable auth_cv_;
  std::vector<bool> authenticated_;   // [peer * kRoots + root]
  std::vector<std::string> from_;     // [peer * kRoots + root]: where that stream came from
  std::vector<std::string> rejects_;  // the last few rejected connections, for connect()'s error
  std::string alarm_;                 // a second holder of a peer's key showed up before connect() returned

  std::mutex send_error_mu_;
  Status send_error_;  // the first failed send, sticky

  std::mutex close_mu_, join_mu_;
  bool outbound_closed_ = false;  // under close_mu_
};

}  // namespace arx

// The proxy: one thread per endpoint that turns each published seq into
// carrier puts, in order, and watches for stalls and recorded failures.
// It knows nothing of carriers beyond the Transport interface.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

namespace arx {

class Endpoint;
class Status;

// The protocol's sending half for one psum seq: what the device side
// published for `seq` (in send[seq & 1], with bytes, mode and descriptor in
// the Control block), put to every peer in turn (r+1, r+2, ...), each write
// split over the carrier's roots and followed by its flag. Seqs must be
// posted in order, each once: by the proxy thread, or, where the device side
// sends its own seqs (Endpoint::device_sends), by that device side.
Status post_seq(Endpoint& ep, uint64_t seq);

class Proxy {
 public:
  explicit Proxy(Endpoint& ep) : ep_(ep) {}
  ~Proxy() { stop(); }
  void start();
  void stop();

 private:
  // posted, consumed: where the inputs stood when start() was called.
  void loop(uint64_t posted, uint64_t consumed);
  Endpoint& ep_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace arx

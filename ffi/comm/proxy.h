// The proxy: one thread per endpoint that turns each published seq into
// carrier puts, in order, and watches for stalls and recorded failures.
// It knows nothing of carriers beyond the Transport interface.
#pragma once

#include <atomic>
#include <thread>

namespace arx {

class Endpoint;

class Proxy {
 public:
  explicit Proxy(Endpoint& ep) : ep_(ep) {}
  ~Proxy() { stop(); }
  void start();
  void stop();

 private:
  void loop();
  Endpoint& ep_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace arx

// Ranks as threads of one process: a communicator's endpoints, created and
// connected together, for the C++ core tests.
#pragma once

#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/endpoint.h"

// A check that counts its failures (g_failures, which the test's main
// turns into its exit status) and goes on: one run reports every failure.
#define EXPECT(cond, ...)                                  \
  do {                                                     \
    if (!(cond)) {                                         \
      ++::arx::testing::g_failures;                        \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
    }                                                      \
  } while (0)

namespace arx::testing {

inline int g_failures = 0;  // EXPECT's count

// Every rank's endpoint; closed when the rig goes.
struct Rig {
  std::vector<std::shared_ptr<Endpoint>> eps;
  ~Rig() {
    for (auto& ep : eps)
      if (ep) ep->close();
  }
};

// Creates `world` endpoints over `kind` and connects them concurrently, as
// ranks do. False (with the reason on stderr) if any step fails.
inline bool make_rig(TransportKind kind, int world, Rig& rig, const Config& cfg, const std::string& name = "test",
                     int64_t comm_id = 7) {
  std::vector<std::string> details(world);
  rig.eps.resize(world);
  for (int r = 0; r < world; ++r) {
    EndpointSpec s;
    s.comm_id = comm_id;
    s.rank = r;
    s.world = world;
    s.transport = kind;
    s.name = name;
    s.secret = "secret-of-this-test";
    s.config = cfg;
    const Status st = Endpoint::create(s, rig.eps[r]);
    if (!st.ok()) {
      fprintf(stderr, "create: %s\n", st.message().c_str());
      return false;
    }
    details[r] = rig.eps[r]->details();
  }
  std::vector<std::thread> ts;
  std::vector<Status> sts(world);
  for (int r = 0; r < world; ++r) ts.emplace_back([&, r] { sts[r] = rig.eps[r]->connect(details); });
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; ++r)
    if (!sts[r].ok()) {
      fprintf(stderr, "connect: %s\n", sts[r].message().c_str());
      return false;
    }
  return true;
}

// Every rank runs `body(rank)` in its own thread.
inline void on_ranks(int world, const std::function<void(int)>& body) {
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) ts.emplace_back(body, r);
  for (auto& t : ts) t.join();
}

// The command line every core test takes: [--quick] [shm] [tcp] (no
// carrier named: both). False, with the usage on stderr, for anything else.
struct TestArgs {
  std::vector<TransportKind> kinds;
  bool quick = false;
};

inline bool parse_test_args(int argc, char** argv, TestArgs& out) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      out.quick = true;
    else if (a == "shm")
      out.kinds.push_back(TransportKind::kShm);
    else if (a == "tcp")
      out.kinds.push_back(TransportKind::kTcp);
    else {
      fprintf(stderr, "usage: %s [--quick] [shm] [tcp]\n", argv[0]);
      return false;
    }
  }
  if (out.kinds.empty()) out.kinds = {TransportKind::kShm, TransportKind::kTcp};
  return true;
}

// A test's main after its arguments: `one(k)` for each carrier of `args`,
// a line "<carrier>: ok" or "FAILED" each, then the tally. Returns main's
// exit status.
inline int run_per_carrier(const TestArgs& args, const std::function<void(TransportKind)>& one) {
  int passed = 0;
  for (TransportKind k : args.kinds) {
    const int before = g_failures;
    one(k);
    printf("%s: %s\n", transport_name(k), g_failures == before ? "ok" : "FAILED");
    passed += g_failures == before;
  }
  printf("%d passed, %d failed\n", passed, (int)args.kinds.size() - passed);
  return g_failures ? 1 : 0;
}

}  // namespace arx::testing

// jax_arx._core: the endpoint lifecycle (create: buffers and this rank's
// connection details; connect: wire the peers and start the proxy; close)
// and the handler capsules jax_arx registers with jax.ffi at import.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/stl/tuple.h>

#include "comm/endpoint.h"
#include "comm/plan.h"
#include "transport/verbs_build.h"  // has_verbs()
#include "xla/capsule.h"
#include "xla/handlers.h"

#if ARX_HAVE_CUDA
#include "cuda/device_side.h"
#include "xla/handlers_cuda.h"
#endif

#include <tuple>

namespace nb = nanobind;

namespace arx {
namespace {

void check(const Status& s) {
  if (!s.ok()) throw std::runtime_error(s.message());
}

TransportKind parse_transport(const std::string& s) {
  if (s == "shm") return TransportKind::kShm;
  if (s == "tcp") return TransportKind::kTcp;
  if (s == "verbs") return TransportKind::kVerbs;
  throw std::invalid_argument("jax_arx: unknown transport '" + s + "'; use shm, tcp or verbs");
}

Platform parse_platform(const std::string& s) {
  if (s == "cpu") return Platform::kHost;
  if (s == "cuda") return Platform::kCuda;
  throw std::invalid_argument("jax_arx: unknown platform '" + s + "'; use cpu or cuda");
}

// Python's handle on one endpoint. connect() registers it for the handlers;
// close() (or garbage collection) unregisters and stops it.
class PyEndpoint {
 public:
  PyEndpoint(int64_t comm_id, int device_ordinal, int rank, int world, const std::string& transport,
             const std::string& platform, const std::string& name, nb::bytes secret,
             const std::map<std::string, std::string>& options) {
    EndpointSpec spec;
    spec.comm_id = comm_id;
    spec.device_ordinal = device_ordinal;
    spec.rank = rank;
    spec.world = world;
    spec.transport = parse_transport(transport);
    spec.platform = parse_platform(platform);
    spec.name = name;
    spec.secret = std::string(secret.c_str(), secret.size());
    check(Config::parse(options, spec.config));
#if !ARX_HAVE_CUDA
    if (spec.platform == Platform::kCuda)
      throw std::runtime_error(
          "jax_arx was built without CUDA (no nvcc at build time); rebuild it where nvcc is "
          "installed to run on GPUs");
#endif
    nb::gil_scoped_release release;
    check(Endpoint::create(spec, ep_));
  }
  ~PyEndpoint() { close(); }

  nb::bytes details() const {
    const std::string d = ep_->details();
    return nb::bytes(d.data(), d.size());
  }

  void connect(const std::vector<nb::bytes>& all) {
    std::vector<std::string> v;
    for (const nb::bytes& b : all) v.emplace_back(b.c_str(), b.size());
    {
      nb::gil_scoped_release release;
      check(ep_->connect(v));
#if ARX_HAVE_CUDA
      if (ep_->spec().platform == Platform::kCuda) {
        const Status s = cuda::attach(*ep_);
        if (!s.ok()) {
          ep_->close();
          check(s);
        }
      }
#endif
    }
    register_endpoint(ep_);
    registered_ = true;
  }

  void close() {
    if (!ep_) return;
    if (registered_) unregister_endpoint(ep_->spec().comm_id, ep_->spec().device_ordinal);
    registered_ = false;
    nb::gil_scoped_release release;
    ep_->close();
  }

  nb::object failure() {
    const std::string f = ep_->failure();
    if (f.empty()) return nb::none();
    return nb::str(f.c_str());
  }

  // What runs a collective of `op` ("psum", "psum_add_norm", "all_gather",
  // "psum_scatter", "moe_combine_psum_scatter") on this endpoint:
  // (algorithm, pieces, why not, or for kUnfused the plan's reason),
  // comm/plan.h. `bytes`: a psum's partial; for the bulk ops one rank's lane
  // (an all_gather's input, a psum_scatter's or the combine's output).
  std::tuple<int, int, std::string> plan(const std::string& op, uint64_t bytes) const {
    Plan p;
    if (op == "psum")
      p = plan_psum(*ep_, bytes);
    else if (op == "psum_add_norm")
      p = plan_add_norm(*ep_, bytes);
    else if (op == "all_gather" || op == "psum_scatter")
      p = plan_bulk(*ep_, op.c_str(), bytes);
    else if (op == "moe_combine_psum_scatter")
      p = plan_moe_combine(*ep_, bytes);
    else
      throw std::invalid_argument("jax_arx: no plan for op '" + op + "'");
    return {(int)p.algorithm, p.pieces, p.algorithm == Algorithm::kUnfused ? p.reason : p.why_not};
  }

  // Endpoint::stats, as a dict (the keys: the "stats" docstring below).
  nb::dict stats() const {
    static const char* kinds[] = {"psum", "all_gather", "psum_scatter", "moe_combine_psum_scatter"};
    static const char* algorithms[] = {"none", "one_shot", "two_shot", "ll", "bulk"};
    static_assert(std::size(kinds) == Stats::kKinds && std::size(algorithms) == Stats::kAlgorithms);
    const Stats& st = ep_->stats;
    auto n = [](const std::atomic<uint64_t>& c) { return c.load(std::memory_order_relaxed); };
    nb::dict calls, bytes, by_algorithm, ops, d;
    uint64_t total[Stats::kAlgorithms] = {};
    for (int k = 0; k < Stats::kKinds; ++k) {
      calls[kinds[k]] = n(st.calls[k]);
      bytes[kinds[k]] = n(st.bytes[k]);
      nb::dict op, ran;
      for (int a = 1; a < Stats::kAlgorithms; ++a) {
        total[a] += n(st.by_algorithm[k][a]);
        if (n(st.by_algorithm[k][a])) ran[algorithms[a]] = n(st.by_algorithm[k][a]);
      }
      op["calls"] = n(st.calls[k]);
      op["bytes"] = n(st.bytes[k]);
      op["failed"] = n(st.failed[k]);
      op["algorithms"] = ran;
      ops[kinds[k]] = op;
    }
    for (int a = 1; a < Stats::kAlgorithms; ++a) by_algorithm[algorithms[a]] = total[a];
    d["calls"] = calls;
    d["bytes"] = bytes;
    d["algorithms"] = by_algorithm;
    d["ops"] = ops;
    d["stalls"] = n(st.stalls);
    const std::string stall = ep_->last_stall();
    d["last_stall"] = stall.empty() ? nb::none() : nb::object(nb::str(stall.c_str()));
    d["relayed_puts"] = n(st.relayed);
    const std::string failure = ep_->failure();
    d["failure"] = failure.empty() ? nb::none() : nb::object(nb::str(failure.c_str()));
    return d;
  }

  const std::shared_ptr<Endpoint>& endpoint() const { return ep_; }

 private:
  std::shared_ptr<Endpoint> ep_;
  bool registered_ = false;
};

}  // namespace
}  // namespace arx

NB_MODULE(_core, m) {
  using arx::PyEndpoint;
  m.doc() = "jax_arx's C++ core: endpoints, carriers, proxies and the XLA FFI handlers";
  m.def("version", [] { return std::string(arx::version()); });
  m.def("has_cuda", [] {
#if ARX_HAVE_CUDA
    return true;
#else
    return false;
#endif
  });
  m.def("has_verbs", [] {
#if ARX_HAVE_VERBS
    return true;
#else
    return false;
#endif
  });
  m.def(
      "registrations",
      [] {
        nb::dict platforms, cpu;
        cpu["jax_arx_psum"] = arx::xla::capsule(arx_psum_host);
        cpu["jax_arx_psum_add_norm"] = arx::xla::capsule(arx_psum_add_norm_host);
        cpu["jax_arx_all_gather"] = arx::xla::capsule(arx_all_gather_host);
        cpu["jax_arx_psum_scatter"] = arx::xla::capsule(arx_psum_scatter_host);
        cpu["jax_arx_moe_combine_psum_scatter"] = arx::xla::capsule(arx_moe_combine_psum_scatter_host);
        cpu["arx_after"] = arx::xla::capsule(arx_after_host);
        platforms["cpu"] = cpu;
#if ARX_HAVE_CUDA
        nb::dict gpu;
        arx::xla::add_cuda_registrations(gpu);
        platforms["CUDA"] = gpu;
#endif
        return platforms;
      },
      "Handler capsules by platform and target name, for jax.ffi.register_ffi_target.");
#if defined(ARX_TRACE)
  // A trace build (base/trace.h): examples/bench_stages.py reads these.
  m.def(
      "trace",
      [](int64_t comm_id, int device_ordinal) {
        auto ep = arx::find_endpoint(comm_id, device_ordinal);
        if (!ep || !ep->trace()) throw std::runtime_error("jax_arx: no connected endpoint with a trace there");
        return nb::bytes(reinterpret_cast<const char*>(ep->trace()), sizeof(arx::TraceBuffer));
      },
      nb::arg("comm_id"), nb::arg("device_ordinal"),
      "The endpoint's stage timestamps: uint64 [family][seq % 4096][stage] (base/trace.h), as bytes.");
#endif
#if ARX_HAVE_CUDA
  m.def(
      "pinned_round_trip",
      [](int device, int rounds) {
        arx::cuda::PingPong p;
        arx::check(arx::cuda::pinned_ping_pong(device, rounds, p));
        nb::dict d;
        d["min_us"] = p.min_ns / 1e3;
        d["median_us"] = p.median_ns / 1e3;
        d["offset_ns"] = p.offset_ns;
        d["error_ns"] = p.error_ns;
        return d;
      },
      nb::arg("device"), nb::arg("rounds") = 2000,
      "The proxy route's floor: `rounds` round trips of a word between a host thread and a kernel on `device` "
      "(its local ordinal) through mapped host memory: {'min_us', 'median_us', 'offset_ns', 'error_ns'}, where "
      "the host's steady clock = the GPU's %globaltimer + offset_ns within error_ns (half the shortest).");
#endif
  m.def(
      "failures",
      [] {
        std::vector<std::string> out;
        for (auto& ep : arx::all_endpoints())
          if (ep->failed()) out.push_back(ep->failure());
        return out;
      },
      "The failure message of every registered endpoint that has failed.");

  nb::class_<PyEndpoint>(m, "Endpoint")
      .def(nb::init<int64_t, int, int, int, const std::string&, const std::string&, const std::string&, nb::bytes,
                    const std::map<std::string, std::string>&>(),
           nb::arg("comm_id"), nb::arg("device_ordinal"), nb::arg("rank"), nb::arg("world"), nb::arg("transport"),
           nb::arg("platform"), nb::arg("name"), nb::arg("secret"), nb::arg("options"),
           "Allocates one rank's buffers and opens its carrier. Raises RuntimeError saying what was wrong.")
      .def("details", &PyEndpoint::details, "This rank's connection details, to send to every peer.")
      .def("connect", &PyEndpoint::connect, nb::arg("all_details"),
           "Checks every rank's details (index = rank), wires the peers, starts the proxy and registers the "
           "endpoint for the handlers. Call a barrier after it, before the first collective.")
      .def("close", &PyEndpoint::close, "Stops the proxy and the carrier and unregisters. Idempotent.")
      .def("failure", &PyEndpoint::failure, "The failure message, or None while healthy.")
      .def(
          "fail_together",
          [](PyEndpoint& self, PyEndpoint& other) { arx::Endpoint::fail_together(self.endpoint(), other.endpoint()); },
          nb::arg("other"),
          "Links this endpoint's failure with `other`'s, both ways (comm/endpoint.h): a failure of either, "
          "earlier or later, fails the other.")
      .def_prop_ro("rank", [](const PyEndpoint& p) { return p.endpoint()->spec().rank; })
      .def_prop_ro("world", [](const PyEndpoint& p) { return p.endpoint()->spec().world; })
      .def_prop_ro("comm_id", [](const PyEndpoint& p) { return p.endpoint()->spec().comm_id; })
      .def_prop_ro("device_ordinal", [](const PyEndpoint& p) { return p.endpoint()->spec().device_ordinal; })
      .def_prop_ro("roots", [](const PyEndpoint& p) { return p.endpoint()->roots(); })
      .def_prop_ro(
          "region_bytes", [](const PyEndpoint& p) { return p.endpoint()->layout().total; },
          "Bytes of this endpoint's region (pinned host memory; shared memory with the shm carrier).")
      .def_prop_ro(
          "bulk_lane_bytes", [](const PyEndpoint& p) { return p.endpoint()->layout().bulk_lane; },
          "Bytes of one bulk lane (the region holds 4 x world of them); 0 where the endpoint holds none.")
      .def("plan", &PyEndpoint::plan, nb::arg("op"), nb::arg("bytes"),
           "What runs a collective of `op` with `bytes` per rank here: (algorithm, pieces, why_not). algorithm 0: "
           "jax_arx does not take it, and why_not says why and what to set; 1 one-shot, 2 two-shot, 3 LL, 4 bulk; 5 "
           "unfused (the MoE combine: jax's combine, then the bulk psum_scatter), and why_not is the plan's reason.")
      .def("stats", &PyEndpoint::stats,
           "What this endpoint ran (jax_arx.stats() gathers them): {'ops': {kind: {'calls': n, 'bytes': n, 'failed': "
           "n, 'algorithms': {name: n}}}, 'calls': {kind: n}, 'bytes': {kind: n}, 'algorithms': {name: n} (every "
           "kind), 'stalls': n, 'last_stall': the watchdog's last report or None, 'relayed_puts': n, 'failure': the "
           "failure message or None}. Kinds: psum, all_gather, psum_scatter, moe_combine_psum_scatter; algorithms: "
           "one_shot, two_shot, ll, bulk. Calls are counted when their handler runs on the host: a replay of a "
           "captured CUDA graph runs no host code and is not counted.")
      .def_prop_ro(
          "route",
          [](const PyEndpoint& p) {
            const arx::Endpoint::Route& r = p.endpoint()->route();
            return std::string(!r.direct ? "proxy" : r.gpu_inboxes ? "direct, GPU inboxes" : "direct");
          },
          "How the device side reaches its peers: 'proxy' (through the carrier), 'direct' (stores into the peers' "
          "mapped memory; inboxes in pinned host memory) or 'direct, GPU inboxes' (inboxes in each GPU's memory, "
          "mapped into the peers' GPUs: JAX_ARX_CUDA_PEER_MEMORY).");
}

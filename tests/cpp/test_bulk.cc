// The bulk collectives end to end, ranks as threads of one process:
// all_gather, reduce_scatter and the fused MoE combine over the endpoint's
// channels (direct on shm, through the proxy and the carrier on tcp), against
// an independent reference (conversions written here, sums in rank order from
// the inputs, never from the library's buffers). Also: bulk collectives
// interleaved with psum on one endpoint, many calls back to back (parity and
// ring reuse), a producer that publishes triggers out of order (as GPU blocks
// do), timeouts and mismatches; an endpoint made without the bulk lanes. Runs under ThreadSanitizer with --quick (tcp;
// see test_core.cc for why not shm).
//
// usage: test_bulk [--quick] [carrier ...]   (default: shm tcp)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/atomics.h"
#include "comm/endpoint.h"
#include "comm/plan.h"
#include "comm/wait.h"
#include "host_calls.h"
#include "reference.h"
#include "rig.h"
#include "transport/copy_pool.h"

using namespace arx;
using namespace arx::testing;

namespace {

// ---- rigs -------------------------------------------------------------------

// The topology the rigs take: the suite runs in a mesh, then again in a
// ring (main), where at world 4 every op's pieces for the rank two away go
// through the relay: the all-gather's from the relay's inbox, the
// reduce-scatter's and the combine's (one destination each) through its
// relay lanes.
TopologyKind g_topology = TopologyKind::kMesh;
// The bulk pieces' size (Config::bulk_piece_bytes): 0, the built-in choice,
// then small (main), so that small lanes go in many pieces on every carrier.
uint64_t g_piece_bytes = 0;

Config test_config() {
  Config c;
  c.topology = g_topology;
  c.bulk_piece_bytes = g_piece_bytes;
  c.bulk_bytes = 8 << 20;
  c.slot_bytes = 64 << 10;
  c.send_bytes = 64 << 10;
  c.timeout_s = 20;
  c.idle_spin_ms = 0;  // as in test_core.cc's psum_config: spinning proxies starve the ranks
  return c;
}

bool bulk_rig(TransportKind kind, int world, Rig& rig, const Config& cfg = test_config()) {
  return testing::make_rig(kind, world, rig, cfg, "bulk", 11);
}

std::vector<uint8_t> random_bytes(uint64_t n, std::mt19937& rng) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = (uint8_t)rng();
  return v;
}

// Random finite values of t, in [-4, 4].
std::vector<uint8_t> random_values(DType t, uint64_t count, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(-4.f, 4.f);
  std::vector<uint8_t> v(count * dtype_size(t));
  for (uint64_t i = 0; i < count; ++i) ref_store(t, v.data() + i * dtype_size(t), d(rng));
  return v;
}

// ---- the ops against the reference ------------------------------------------

// sizes: (rows, block bytes) of each rank's part; the gathered output is
// [rows][world][block].
void test_all_gather(TransportKind kind, int world, const std::vector<std::pair<uint64_t, uint64_t>>& sizes) {
  Rig rig;
  if (!bulk_rig(kind, world, rig)) {
    EXPECT(false, "rig %s world %d", transport_name(kind), world);
    return;
  }
  std::mt19937 rng(world * 31 + (int)kind);
  for (int rep = 0; rep < 2; ++rep)
    for (auto [outer, block] : sizes) {
      const uint64_t bytes = outer * block;
      std::vector<std::vector<uint8_t>> in(world), out(world);
      for (int r = 0; r < world; ++r) {
        in[r] = random_bytes(bytes, rng);
        out[r].assign(bytes * world, 0xAB);
      }
      std::vector<uint8_t> ref;
      for (uint64_t o = 0; o < outer; ++o)
        for (int r = 0; r < world; ++r)
          ref.insert(ref.end(), in[r].begin() + o * block, in[r].begin() + (o + 1) * block);
      std::vector<Status> sts(world);
      on_ranks(world, [&](int r) {
        sts[r] = testing::all_gather(*rig.eps[r], in[r].data(), out[r].data(), bytes, outer, 7, std::nullopt, 1);
      });
      for (int r = 0; r < world; ++r) {
        EXPECT(sts[r].ok(), "%s all_gather world %d %llu x %llu bytes rank %d: %s", transport_name(kind), world,
               (unsigned long long)outer, (unsigned long long)block, r, sts[r].message().c_str());
        EXPECT(out[r] == ref, "%s all_gather world %d %llu x %llu bytes: rank %d differs from the reference",
               transport_name(kind), world, (unsigned long long)outer, (unsigned long long)block, r);
      }
    }
}

// shapes: (rows, elements per row of each rank's chunk); the input is
// [rows][world][elements], the result [rows][elements].
void test_reduce_scatter(TransportKind kind, int world, DType dtype,
                         const std::vector<std::pair<uint64_t, uint64_t>>& shapes) {
  Rig rig;
  if (!bulk_rig(kind, world, rig)) {
    EXPECT(false, "rig %s world %d", transport_name(kind), world);
    return;
  }
  std::mt19937 rng(world * 57 + (int)dtype);
  const int es = dtype_size(dtype);
  for (int rep = 0; rep < 2; ++rep)
    for (auto [outer, inner] : shapes) {
      const uint64_t count = outer * inner;  // per-rank result elements
      std::vector<std::vector<uint8_t>> in(world), out(world);
      for (int r = 0; r < world; ++r) {
        in[r] = random_values(dtype, count * world, rng);
        out[r].assign(count * es, 0xAB);
      }
      std::vector<Status> sts(world);
      on_ranks(world, [&](int r) {
        sts[r] = testing::reduce_scatter(*rig.eps[r], dtype, in[r].data(), out[r].data(), count, outer, 2);
      });
      for (int r = 0; r < world; ++r) {
        EXPECT(sts[r].ok(), "%s reduce_scatter world %d %llu x %llu rank %d: %s", transport_name(kind), world,
               (unsigned long long)outer, (unsigned long long)inner, r, sts[r].message().c_str());
        std::vector<uint8_t> ref(count * es);
        for (uint64_t o = 0; o < outer; ++o)
          for (uint64_t i = 0; i < inner; ++i) {
            // Rank order from rank 0's element, as every sum of jax_arx.
            float acc = ref_load(dtype, in[0].data() + ((o * world + r) * inner + i) * es);
            for (int s = 1; s < world; ++s) acc += ref_load(dtype, in[s].data() + ((o * world + r) * inner + i) * es);
            ref_store(dtype, ref.data() + (o * inner + i) * es, acc);
          }
        EXPECT(out[r] == ref, "%s reduce_scatter world %d dtype %d %llu x %llu: rank %d differs from the reference",
               transport_name(kind), world, (int)dtype, (unsigned long long)outer, (unsigned long long)inner, r);
      }
    }
}

void test_moe(TransportKind kind, int world, const std::vector<MoeCase>& cases) {
  Rig rig;
  if (!bulk_rig(kind, world, rig)) {
    EXPECT(false, "rig %s world %d", transport_name(kind), world);
    return;
  }
  std::mt19937 rng(world * 91);
  for (const MoeCase& c : cases) {
    const uint64_t padded = (c.tokens + world - 1) / world * world, per = padded / world;
    std::vector<std::vector<uint8_t>> y(world);
    std::vector<std::vector<float>> scale(world), w(world);
    std::vector<std::vector<int32_t>> pos(world);
    std::vector<std::vector<uint16_t>> shared(world), combined(world), out(world);
    std::uniform_real_distribution<float> d(-2.f, 2.f);
    for (int r = 0; r < world; ++r) {
      if (c.e4m3) {
        y[r] = random_bytes(c.rows * c.hidden, rng);
        for (auto& b : y[r])
          if ((b & 0x7f) == 0x7f) b = 0x3c;  // no NaN codes
        for (uint64_t i = 0; i < c.rows * (c.hidden / 128); ++i) scale[r].push_back(std::ldexp(1.0f + d(rng) / 4, -4));
      } else {
        y[r] = random_values(DType::kBF16, c.rows * c.hidden, rng);
      }
      for (uint64_t i = 0; i < c.tokens * c.topk; ++i) {
        // Mostly valid rows; a few out of range, which are clamped.
        const uint32_t u = rng();
        const int32_t outside = (u / 50) % 2 ? -1 - (int32_t)(u % 3) : (int32_t)(c.rows + u % 5);
        pos[r].push_back(u % 50 == 0 ? outside : (int32_t)(u % c.rows));
        w[r].push_back(d(rng) / 2);
      }
      for (uint64_t i = 0; i < c.tokens * c.hidden; ++i) shared[r].push_back(ref_to_bf16(d(rng)));
      if (!c.e4m3) tie_token(c, y[r], pos[r], w[r], shared[r]);
      combined[r] = ref_combine(c, padded, y[r], scale[r], pos[r], w[r], shared[r]);
      out[r].assign(per * c.hidden, 0xABAB);
    }
    std::vector<Status> sts(world);
    on_ranks(world, [&](int r) {
      MoeCombine a;
      a.y = y[r].data();
      a.y_scale = c.e4m3 ? scale[r].data() : nullptr;
      a.pos = pos[r].data();
      a.w = w[r].data();
      a.shared = shared[r].data();
      a.rows = c.rows;
      a.tokens = c.tokens;
      a.padded = padded;
      a.hidden = c.hidden;
      a.topk = c.topk;
      sts[r] = testing::moe_combine_reduce_scatter(*rig.eps[r], a, out[r].data(), 3);
    });
    for (int r = 0; r < world; ++r) {
      EXPECT(sts[r].ok(), "%s moe world %d tokens %llu rank %d: %s", transport_name(kind), world,
             (unsigned long long)c.tokens, r, sts[r].message().c_str());
      std::vector<uint16_t> ref(per * c.hidden);
      for (uint64_t i = 0; i < per * c.hidden; ++i) {
        float acc = ref_bf16(combined[0][r * per * c.hidden + i]);
        for (int s = 1; s < world; ++s) acc += ref_bf16(combined[s][r * per * c.hidden + i]);
        ref[i] = ref_to_bf16(acc);
      }
      EXPECT(out[r] == ref, "%s moe world %d tokens %llu hidden %llu topk %llu %s: rank %d differs from the reference",
             transport_name(kind), world, (unsigned long long)c.tokens, (unsigned long long)c.hidden,
             (unsigned long long)c.topk, c.e4m3 ? "e4m3" : "bf16", r);
    }
  }
}

// ---- sequence state and reuse -----------------------------------------------

// Hundreds of calls back to back, all-gathers, reduce-scatters, fused
// combines and psums interleaved on one endpoint: two separate sequences,
// parity reuse of every buffer, and the trigger ring (kRing entries, up to
// kMaxPieces x (world - 1) a call) wrapping many times.
// `big_every`: one round of four calls in this many is large.
void test_back_to_back(TransportKind kind, int world, int calls, int big_every = 2) {
  Rig rig;
  if (!bulk_rig(kind, world, rig)) {
    EXPECT(false, "rig");
    return;
  }
  std::vector<int> bad(world, 0);
  std::vector<std::string> why(world);
  on_ranks(world, [&](int r) {
    Endpoint& ep = *rig.eps[r];
    // Per-rank elements: pieces of uneven sizes; one round of the four
    // calls in big_every larger (600 KB lanes), cut in another number of
    // pieces where the plan cuts by size (comm/plan.cc, bulk_pieces).
    std::vector<float> in(150038 * world), out(150038 * world);
    for (int c = 1; c <= calls && !bad[r]; ++c) {
      const uint64_t n = (c / 4) % big_every == 1 ? 150038 : 37;
      auto value = [&](int rank, uint64_t i) { return (float)((c * 7 + rank * 3 + (int)i) % 1000); };
      switch (c % 4) {
        case 0: {  // all_gather
          for (uint64_t i = 0; i < n; ++i) in[i] = value(r, i);
          const Status s = testing::all_gather(ep, in.data(), out.data(), n * 4, 1, 11, DType::kF32, 5);
          if (!s.ok()) {
            bad[r] = c;
            why[r] = s.message();
            break;
          }
          for (int j = 0; j < world; ++j)
            for (uint64_t i = 0; i < n; ++i)
              if (out[j * n + i] != value(j, i)) {
                bad[r] = c;
                why[r] = "all_gather value";
              }
          break;
        }
        case 1:
        case 3: {  // reduce_scatter (exact: small integers)
          for (uint64_t i = 0; i < n * world; ++i) in[i] = value(r, i);
          const Status s = testing::reduce_scatter(ep, DType::kF32, in.data(), out.data(), n, 1, 6);
          if (!s.ok()) {
            bad[r] = c;
            why[r] = s.message();
            break;
          }
          for (uint64_t i = 0; i < n; ++i) {
            float want = 0;
            for (int j = 0; j < world; ++j) want += value(j, r * n + i);
            if (out[i] != want) {
              bad[r] = c;
              why[r] = "reduce_scatter value";
            }
          }
          break;
        }
        case 2: {  // psum, in between (within its slot)
          const uint64_t m = 37;
          for (uint64_t i = 0; i < m; ++i) in[i] = value(r, i);
          const Status s = testing::psum(ep, DType::kF32, in.data(), out.data(), m, 4);
          if (!s.ok()) {
            bad[r] = c;
            why[r] = s.message();
            break;
          }
          for (uint64_t i = 0; i < m; ++i) {
            float want = 0;
            for (int j = 0; j < world; ++j) want += value(j, i);
            if (out[i] != want) {
              bad[r] = c;
              why[r] = "psum value";
            }
          }
          break;
        }
      }
    }
  });
  for (int r = 0; r < world; ++r)
    EXPECT(bad[r] == 0, "%s back-to-back world %d: rank %d wrong at call %d: %s", transport_name(kind), world, r,
           bad[r], why[r].c_str());
  const Control* ctl = rig.eps[0]->control();
  EXPECT(load_acquire(&ctl->done[(int)Family::kBulk]) == (uint64_t)(calls - calls / 4),
         "bulk seq %llu after %d bulk calls", (unsigned long long)load_acquire(&ctl->done[(int)Family::kBulk]),
         calls - calls / 4);
  EXPECT(load_acquire(&ctl->done[(int)Family::kPsum]) == (uint64_t)(calls / 4), "psum seq after %d psums", calls / 4);
  // Every call of a ring of 4 relays; the rings wrapped several times.
  if (rig.eps[0]->layout().topo.relays())
    for (int r = 0; r < world; ++r)
      EXPECT(rig.eps[r]->stats.relayed.load() > (uint64_t)kRing * 2, "%s ring of 4: rank %d relayed %llu puts",
             transport_name(kind), r, (unsigned long long)rig.eps[r]->stats.relayed.load());
}

// A producer that publishes its triggers in any order of time, at fixed
// ring indices, as the blocks of a GPU kernel do: the proxy takes them in
// index order, and a piece's word always finds the piece's bytes in place.
// With rows of `H` bf16 values and `cfg`: wide rows over shm with copy
// helpers put each piece in parts on several threads
// (transport/copy_pool.h), and the word still covers every part.
struct NeverStop {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  bool expired() const { return std::chrono::steady_clock::now() - start > std::chrono::seconds(20); }
  bool aborted(uint32_t) const { return false; }
  bool stopped(uint32_t) const { return false; }
  void pause(uint32_t) const { std::this_thread::yield(); }
};

void test_out_of_order_producer(TransportKind kind, int world, uint64_t H = 24, const Config& cfg = test_config()) {
  Rig rig;
  if (!bulk_rig(kind, world, rig, cfg)) {
    EXPECT(false, "rig");
    return;
  }
  const uint64_t per = 29, row = H * 2;  // uneven row pieces
  const uint64_t seq = 1;
  const Descriptor d = descriptor(OpCode::kMoeCombine, 2, per * H, 7);
  std::vector<int> bad(world, 0);
  on_ranks(world, [&](int r) {
    Endpoint& ep = *rig.eps[r];
    const ProxyChannel ch = ep.proxy_channel(Family::kBulk);
    const int par = (int)(seq & 1);
    // A fresh rig: the seq's triggers start at ring index 0.
    const auto send = ch.open(SeqSend{par, flag_word(seq, describe(d)), d, 0}, Fan::kEachPeer, ch.in.lane_bytes);
    // Row t of destination j holds bytes (r, j, t).
    for (int j = 0; j < world; ++j)
      for (uint64_t t = 0; t < per; ++t)
        std::memset(send.put_dst((uint64_t)j) + t * row, (int)(1 + r * 64 + j * 8 + t % 8), row);
    std::vector<std::pair<int, int>> order;
    for (int j = 0; j < world; ++j)
      for (int k = 0; k < kMaxPieces && j != r; ++k) order.push_back({j, k});
    std::shuffle(order.begin(), order.end(), std::mt19937(r * 5 + 1));
    for (auto [j, k] : order) {
      uint64_t lo, hi;
      row_piece(per, k, lo, hi);
      send.signal((uint64_t)j, k, lo * row, hi * row);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    // Receive: once a peer's word for piece k holds the seq, its rows of
    // piece k are in place.
    for (int s = 0; s < world; ++s) {
      if (s == r) continue;
      const uint8_t* recv = ch.in.lane(par, s);
      for (int k = 0; k < kMaxPieces && !bad[r]; ++k) {
        NeverStop poll;
        uint64_t seen = 0, theirs[kDescriptorWords];
        if (wait_piece(ch.in, s, k, seq, d, poll, seen, theirs) != WaitEnd::kArrived) {
          bad[r] = 100 + s;
          break;
        }
        uint64_t lo, hi;
        row_piece(per, k, lo, hi);
        for (uint64_t t = lo; t < hi; ++t)
          for (uint64_t b = 0; b < row; ++b)
            if (recv[t * row + b] != (uint8_t)(1 + s * 64 + r * 8 + t % 8)) bad[r] = 1 + s;
      }
    }
  });
  for (int r = 0; r < world; ++r)
    EXPECT(bad[r] == 0, "%s out-of-order producer world %d: rank %d saw a piece's word before its bytes (code %d)",
           transport_name(kind), world, r, bad[r]);
}

// ---- failures ---------------------------------------------------------------

// A peer that never arrives: the op fails within the timeout, names it,
// fills NaN, and later calls (bulk or psum) fail at once.
void test_timeout(TransportKind kind) {
  Config cfg = test_config();
  cfg.timeout_s = 0.5;
  Rig rig;
  if (!bulk_rig(kind, 3, rig, cfg)) {
    EXPECT(false, "rig");
    return;
  }
  std::vector<std::vector<uint16_t>> in(2, std::vector<uint16_t>(30, 0x3f80)), out(2, std::vector<uint16_t>(10, 0));
  std::vector<Status> sts(2);
  const auto t0 = std::chrono::steady_clock::now();
  on_ranks(2, [&](int r) {  // rank 2 never calls
    sts[r] = testing::reduce_scatter(*rig.eps[r], DType::kBF16, in[r].data(), out[r].data(), 10, 1, 0);
  });
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // The rank that timed out first names the op and the missing rank; the
  // other may learn of it by that rank's notice first, which says it timed out.
  auto names = [](const Status& s) {
    return s.message().find("rank 2") != std::string::npos && s.message().find("psum_scatter #1") != std::string::npos;
  };
  for (int r = 0; r < 2; ++r)
    EXPECT(!sts[r].ok() && (names(sts[r]) || sts[r].message().find("timed out after") != std::string::npos),
           "rank %d: a timeout, or a peer's notice of one: %s", r, sts[r].message().c_str());
  EXPECT(names(sts[0]) || names(sts[1]), "no rank named the op and the missing rank: '%s' / '%s'",
         sts[0].message().c_str(), sts[1].message().c_str());
  EXPECT(took < 5, "timeout took %.2f s", took);
  EXPECT(out[0][0] == 0x7fc0 && out[1][9] == 0x7fc0, "output is NaN after a failed call");
  std::vector<uint8_t> x(16, 1), y(48, 0);
  const auto t1 = std::chrono::steady_clock::now();
  const Status again = testing::all_gather(*rig.eps[0], x.data(), y.data(), 16, 1, 1, std::nullopt, 0);
  EXPECT(!again.ok() && again.message() == sts[0].message(), "a later call reports the same failure: %s",
         again.message().c_str());
  EXPECT(y[0] == 0xFF && y[47] == 0xFF, "a failed all_gather of a non-float type leaves 0xFF bytes");
  std::vector<float> p(4, 1.0f);
  const Status psum = testing::psum(*rig.eps[0], DType::kF32, p.data(), p.data(), 4, 0);
  EXPECT(!psum.ok() && std::isnan(p[0]), "a later psum fails too");
  EXPECT(std::chrono::steady_clock::now() - t1 < std::chrono::milliseconds(100), "later calls fail at once");
}

// Ranks that issue different bulk collectives at the same seq get an error.
void test_mismatch(TransportKind kind) {
  Config cfg = test_config();
  cfg.timeout_s = 5;
  Rig rig;
  if (!bulk_rig(kind, 2, rig, cfg)) {
    EXPECT(false, "rig");
    return;
  }
  std::vector<float> a(64, 1.0f), o0(128), o1(32);
  Status s0, s1;
  on_ranks(2, [&](int r) {
    if (r == 0)
      s0 = testing::all_gather(*rig.eps[0], a.data(), o0.data(), 256, 1, 11, DType::kF32, 0);
    else
      s1 = testing::reduce_scatter(*rig.eps[1], DType::kF32, a.data(), o1.data(), 32, 1, 0);
  });
  EXPECT(!s0.ok() && s0.message().find("different collective") != std::string::npos, "rank 0 mismatch: %s",
         s0.message().c_str());
  EXPECT(!s1.ok() && s1.message().find("different collective") != std::string::npos, "rank 1 mismatch: %s",
         s1.message().c_str());
  EXPECT(std::isnan(o0[0]) && std::isnan(o1[0]), "mismatched calls give NaN");
}

// Sizes beyond the bulk lanes are refused before anything is sent.
void test_too_big(TransportKind kind) {
  Rig rig;
  if (!bulk_rig(kind, 2, rig)) {
    EXPECT(false, "rig");
    return;
  }
  const uint64_t bytes = (8 << 20) / 2 + 16;
  std::vector<uint8_t> x(bytes), y(2 * bytes);
  const Status s = testing::all_gather(*rig.eps[0], x.data(), y.data(), bytes, 1, 1, std::nullopt, 0);
  EXPECT(!s.ok() && s.message().find("JAX_ARX_PREFILL_SLOT_BYTES") != std::string::npos, "too big: %s",
         s.message().c_str());
  EXPECT(!rig.eps[0]->failed(), "refusing a size does not fail the endpoint");
}

// The plan's pieces: kMaxPieces on the direct channel (shm); through the proxy
// (tcp), one per 512 KiB of lane, at least 1 and at most kMaxPieces; and what
// Config::bulk_piece_bytes asks for.
void test_pieces(TransportKind kind) {
  Rig rig;
  if (!bulk_rig(kind, 2, rig)) {
    EXPECT(false, "rig");
    return;
  }
  const bool proxy = !rig.eps[0]->route().direct;
  const std::vector<std::pair<uint64_t, int>> want = {
      {0, 1}, {16 << 10, 1}, {512 << 10, 1}, {(512 << 10) + 16, 2}, {1 << 20, 2}, {2 << 20, 4}, {4 << 20, 8}};
  for (auto [lane, pieces] : want) {
    const Plan p = plan_bulk(*rig.eps[0], "all_gather", lane);
    EXPECT(p.algorithm == Algorithm::kBulk && p.pieces == (proxy ? pieces : kMaxPieces),
           "%s: a lane of %llu bytes goes in %d pieces", transport_name(kind), (unsigned long long)lane, p.pieces);
  }
  Config small = test_config();
  small.bulk_piece_bytes = 4096;
  Rig tuned;
  if (!bulk_rig(kind, 2, tuned, small)) {
    EXPECT(false, "rig");
    return;
  }
  EXPECT(plan_bulk(*tuned.eps[0], "psum_scatter", 16 << 10).pieces == 4 &&
             plan_bulk(*tuned.eps[0], "psum_scatter", 1 << 20).pieces == kMaxPieces,
         "%s: bulk_piece_bytes 4096 cuts 16 KiB in 4 pieces, 1 MiB in kMaxPieces", transport_name(kind));
}

// An endpoint made without the bulk lanes (Config::bulk_lanes = false, what
// jax_arx makes for psum): its region has none, so it is smaller by the 4 x
// bulk_bytes they take; psum runs on it; its plan still says what the
// communicator takes (the envelope). (An endpoint laid out with them does not
// pair with it: test_core.cc, test_fingerprint.)
void test_psum_only_endpoint(TransportKind kind) {
  Config with = test_config(), without = test_config();
  without.bulk_lanes = false;
  Rig rig;
  if (!bulk_rig(kind, 2, rig, without)) {
    EXPECT(false, "rig");
    return;
  }
  const Layout full = Layout::of(Geometry{2, with.slot_bytes, with.send_bytes, with.bulk_bytes, with.topology});
  const Layout& none = rig.eps[0]->layout();
  EXPECT(none.bulk_lane == 0 && none.total + 4 * with.bulk_bytes <= full.total,
         "an endpoint without lanes holds none: lane %llu, %llu bytes against %llu", (unsigned long long)none.bulk_lane,
         (unsigned long long)none.total, (unsigned long long)full.total);
  EXPECT(plan_bulk(*rig.eps[0], "all_gather", with.bulk_bytes / 2).algorithm == Algorithm::kBulk &&
             plan_bulk(*rig.eps[0], "all_gather", with.bulk_bytes / 2 + 16).algorithm == Algorithm::kNone,
         "the plan is the communicator's envelope, lanes or not");
  std::vector<std::vector<float>> x(2, std::vector<float>(1000));
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 1000; ++i) x[r][i] = (float)(i * (r + 1));
  std::vector<Status> sts(2);
  on_ranks(2, [&](int r) { sts[r] = testing::psum(*rig.eps[r], DType::kF32, x[r].data(), x[r].data(), 1000, 0); });
  EXPECT(sts[0].ok() && sts[1].ok() && x[0][999] == 999.f * 3 && x[1][1] == 3.f, "psum without lanes: %s",
         sts[0].message().c_str());
}

}  // namespace

int main(int argc, char** argv) {
  testing::TestArgs args;
  if (!testing::parse_test_args(argc, argv, args)) return 2;
  const bool quick = args.quick;
  using Shapes = std::vector<std::pair<uint64_t, uint64_t>>;
  const Shapes ag_sizes = quick ? Shapes{{1, 0}, {1, 1}, {1, 100}, {3, 7}, {1, 4097}}
                                : Shapes{{1, 0},    {1, 1}, {1, 7},   {1, 16},   {1, 100},   {1, 129},
                                         {1, 1000}, {5, 3}, {4, 256}, {7, 1171}, {1, 65539}, {3, 349525}};
  const Shapes rs_counts = quick ? Shapes{{1, 1}, {1, 9}, {3, 5}, {1, 1001}}
                                 : Shapes{{1, 1}, {1, 7}, {1, 9}, {1, 255}, {1, 4097}, {1, 65537}, {4, 3}, {9, 130}};
  const std::vector<MoeCase> moe =
      quick ? std::vector<MoeCase>{{16, 5, 128, 2, false}, {16, 9, 128, 3, true}}
            : std::vector<MoeCase>{{16, 5, 128, 1, false}, {40, 37, 64, 4, false}, {64, 100, 256, 16, false},
                                   {16, 9, 128, 3, true},  {50, 77, 256, 8, true}, {8, 3, 128, 16, true}};
  return testing::run_per_carrier(args, [&](TransportKind k) {
    for (int world : {2, 3, 4}) {
      test_all_gather(k, world, ag_sizes);
      test_reduce_scatter(k, world, DType::kF32, rs_counts);
      test_reduce_scatter(k, world, DType::kBF16, rs_counts);
      test_reduce_scatter(k, world, DType::kF16, quick ? Shapes{{1, 3}} : Shapes{{1, 1}, {1, 9}, {2, 150}});
      test_moe(k, world, moe);
      test_back_to_back(k, world, quick ? 100 : 600);
      test_out_of_order_producer(k, world);
    }
    if (k == TransportKind::kShm) {
      Config helped = test_config();
      helped.shm_copy_threads = CopyPool::kMaxHelpers;
      test_out_of_order_producer(k, 2, 64 << 10, helped);  // puts of 192-256 KiB: 4 parts
    }
    test_timeout(k);
    test_mismatch(k);
    test_too_big(k);
    test_pieces(k);
    test_psum_only_endpoint(k);
    g_topology = TopologyKind::kRing;
    for (int world : {2, 3, 4}) {
      test_all_gather(k, world, ag_sizes);
      test_reduce_scatter(k, world, DType::kBF16, rs_counts);
      test_moe(k, world, moe);
      // A ring of 4 must wrap the trigger ring twice: many calls, few of
      // them large in --quick (ThreadSanitizer's run, where every byte
      // copied costs).
      test_back_to_back(k, world, quick ? 200 : 400, quick ? 5 : 2);
    }
    g_topology = TopologyKind::kMesh;
    g_piece_bytes = 4096;  // small lanes in many pieces, on every carrier
    for (int world : {2, 3}) {
      test_all_gather(k, world, ag_sizes);
      test_reduce_scatter(k, world, DType::kBF16, rs_counts);
      test_moe(k, world, moe);
      test_back_to_back(k, world, quick ? 60 : 200);
    }
    g_piece_bytes = 0;
  });
}

// What runs a collective of each size (comm/plan.h), on endpoints that are
// created but never connected: the host and the CUDA device sides, every
// route, the settings that move the limits. The expectations are the rules
// as the configuration table (jax_arx/config.py) and the README state them,
// written out here on their own:
//   psum: LL up to its limit (CUDA: cuda_ll_max_bytes, at most 128 KiB;
//   unset, 128 KiB direct and 8 KiB through the proxy; on the
//   direct route, or through the proxy over a carrier that puts whole words
//   -- shm, verbs, not tcp -- with no relay and the lines, twice the bytes,
//   within the send buffer), the one-shot up to the slot (or
//   JAX_ARX_ONESHOT_MAX_BYTES, at most the slot; unset, on CUDA host
//   inboxes -- direct, not in GPU memory -- up to 128 KiB), the two-shot (CUDA only)
//   up to min(send, world x slot); past that nothing, with a message that
//   names the setting to raise;
//   bulk: every rank's lane together within JAX_ARX_PREFILL_SLOT_BYTES;
//   the MoE combine: within that envelope its unfused pair on every route,
//   with a reason that names the route, where it was measured and that the
//   bits are the same; fused (bulk) with the moe_fused tuning; past the
//   envelope nothing, as the other bulk ops.
// No CUDA is needed: an endpoint of the CUDA platform is plain memory until
// its device side attaches, and the plan reads only its config and route.
#include <cstdio>
#include <string>

#include "base/layout.h"
#include "comm/plan.h"
#include "rig.h"

using namespace arx;
using arx::testing::g_failures;

namespace {

constexpr uint64_t kKiB = 1024;

struct Case {
  Platform platform;
  bool direct, gpu_inboxes;
  Config cfg;
  int world = 2;
  TransportKind transport = TransportKind::kTcp;
};

std::shared_ptr<Endpoint> open_endpoint(const Case& c) {
  EndpointSpec s;
  s.comm_id = 11;
  s.rank = 0;
  s.world = c.world;
  s.transport = c.transport;
  s.platform = c.platform;
  s.name = "plan";
  s.secret = "secret-of-this-test";
  s.config = c.cfg;
  std::shared_ptr<Endpoint> ep;
  const Status st = Endpoint::create(s, ep);
  EXPECT(st.ok(), "create: %s", st.message().c_str());
  if (ep) ep->set_route(Endpoint::Route{c.direct, c.gpu_inboxes});
  return ep;
}

const char* name(Algorithm a) {
  switch (a) {
    case Algorithm::kNone:
      return "none";
    case Algorithm::kOneShot:
      return "one_shot";
    case Algorithm::kTwoShot:
      return "two_shot";
    case Algorithm::kLL:
      return "ll";
    case Algorithm::kBulk:
      return "bulk";
    case Algorithm::kUnfused:
      return "unfused";
  }
  return "?";
}

// The psum rules above, for `bytes` on case `c`.
Algorithm expected_psum(const Case& c, uint64_t bytes) {
  const bool cuda = c.platform == Platform::kCuda;
  const uint64_t slot = c.cfg.slot_bytes;
  const bool host_inboxes = cuda && c.direct && !c.gpu_inboxes;
  const uint64_t oneshot = c.cfg.oneshot_max_bytes ? std::min(c.cfg.oneshot_max_bytes, slot)
                           : host_inboxes          ? std::min<uint64_t>(128 * kKiB, slot)
                                                   : slot;
  const int64_t ll_cfg = c.cfg.cuda_ll_max_bytes;
  const bool relays = c.cfg.topology == TopologyKind::kRing && c.world == 4;
  const bool ll_route = c.direct || (c.transport != TransportKind::kTcp && !relays);
  const uint64_t ll_default = c.direct ? 128 * kKiB : 8 * kKiB;
  const uint64_t ll = !cuda || !ll_route ? 0 : ll_cfg < 0 ? ll_default : std::min<uint64_t>(ll_cfg, 128 * kKiB);
  const bool lines_fit = c.direct || 2 * ((bytes + 7) / 8 * 8) <= c.cfg.send_bytes;
  if (bytes <= oneshot) return bytes <= ll && lines_fit ? Algorithm::kLL : Algorithm::kOneShot;
  if (cuda && bytes <= std::min<uint64_t>(c.cfg.send_bytes, (uint64_t)c.world * slot)) return Algorithm::kTwoShot;
  return Algorithm::kNone;
}

void check_psum(const char* what, const Case& c, std::initializer_list<uint64_t> sizes) {
  auto ep = open_endpoint(c);
  if (!ep) return;
  int seen[5] = {};
  for (uint64_t bytes : sizes) {
    const Plan p = plan_psum(*ep, bytes);
    const Algorithm want = expected_psum(c, bytes);
    ++seen[(int)want];
    EXPECT(p.algorithm == want, "%s: a psum of %llu bytes ran %s, want %s", what, (unsigned long long)bytes,
           name(p.algorithm), name(want));
    if (want == Algorithm::kNone) {
      const bool oneshot_limited =
          c.cfg.oneshot_max_bytes && c.cfg.oneshot_max_bytes < c.cfg.slot_bytes && bytes <= c.cfg.slot_bytes;
      const char* setting = oneshot_limited ? "JAX_ARX_ONESHOT_MAX_BYTES=" : "JAX_ARX_SLOT_BYTES=";
      EXPECT(p.why_not.find(setting) != std::string::npos, "%s: %llu bytes refused without naming %s: '%s'", what,
             (unsigned long long)bytes, setting, p.why_not.c_str());
    } else {
      EXPECT(p.why_not.empty(), "%s: a plan that runs says why not: '%s'", what, p.why_not.c_str());
    }
    if (p.algorithm == Algorithm::kOneShot) EXPECT(p.pieces >= 1, "%s: %d pieces", what, p.pieces);
  }
  ep->close();
}

// The pieces of a one-shot with cuda_chunk_bytes set: that many bytes each,
// up to the flag words there are.
void check_pieces() {
  for (bool direct : {true, false}) {
    Case c{Platform::kCuda, direct, false, Config{}};
    c.cfg.cuda_ll_max_bytes = 0;
    c.cfg.cuda_chunk_bytes = 4096;
    c.cfg.oneshot_max_bytes = 1 << 20;  // host inboxes would stop the one-shot at 128 KiB
    auto ep = open_endpoint(c);
    if (!ep) return;
    const FlagWords w = psum_words(c.world, direct ? 1 : ep->roots());
    const int cap = direct ? w.pieces : std::min(w.pieces, kMaxPieces);
    for (uint64_t bytes : std::initializer_list<uint64_t>{16, 4096, 4097, 40000, 1 << 20}) {
      const Plan p = plan_psum(*ep, bytes);
      const int want = (int)std::min<uint64_t>((bytes + 4095) / 4096, (uint64_t)cap);
      EXPECT(p.algorithm == Algorithm::kOneShot && p.pieces == want, "%s route: %llu bytes in %d pieces, want %d",
             direct ? "direct" : "proxy", (unsigned long long)bytes, p.pieces, want);
    }
    ep->close();
  }
  // The host device side copies, then waits: always one piece.
  Case h{Platform::kHost, true, false, Config{}};
  h.cfg.cuda_chunk_bytes = 4096;
  if (auto ep = open_endpoint(h)) {
    EXPECT(plan_psum(*ep, 40000).pieces == 1, "host: %d pieces", plan_psum(*ep, 40000).pieces);
    ep->close();
  }
}

// A fused psum_add_norm (row_bytes > 0): the envelope and algorithm of a
// psum, except that its rows are never cut (the block that sums a row
// norms it): an LL block holds whole rows that start on a line, or one
// block the whole partial; one-shot pieces are whole rows starting on a
// 16-byte vector, so never more pieces than rows, and one piece for rows
// of another width.
void check_fused() {
  Case c{Platform::kCuda, true, true, Config{}};
  c.cfg.cuda_chunk_bytes = 4096;
  auto ep = open_endpoint(c);
  if (!ep) return;
  struct Want {
    uint64_t bytes, row_bytes;
    Algorithm algorithm;
  };
  for (const Want& w : {Want{8 * kKiB, 8 * kKiB, Algorithm::kLL}, Want{64 * kKiB, 8 * kKiB, Algorithm::kLL},
                        Want{6, 6, Algorithm::kLL},  // one block holds it all
                        Want{8 * kKiB - 6, 8 * kKiB - 6, Algorithm::kLL},
                        Want{64 * kKiB, 16 * kKiB, Algorithm::kOneShot},  // a row past an LL block
                        Want{3 * 4100, 4100, Algorithm::kOneShot},        // rows that start mid-line
                        Want{2 * c.cfg.slot_bytes, c.cfg.slot_bytes / 2, Algorithm::kTwoShot}}) {
    const Plan plain = plan_psum(*ep, w.bytes), p = plan_psum(*ep, w.bytes, w.row_bytes);
    EXPECT(p.algorithm == w.algorithm, "fused, %llu bytes in rows of %llu: %s, want %s", (unsigned long long)w.bytes,
           (unsigned long long)w.row_bytes, name(p.algorithm), name(w.algorithm));
    EXPECT((plain.algorithm == Algorithm::kNone) == (p.algorithm == Algorithm::kNone),
           "fused, %llu bytes: not psum's envelope", (unsigned long long)w.bytes);
  }
  c.cfg.cuda_ll_max_bytes = 0;
  auto one = open_endpoint(c);
  if (!one) return;
  struct Pieces {
    uint64_t bytes, row_bytes;
    int pieces;
  };
  for (const Pieces& w : {Pieces{40 * 1024, 1024, 10}, Pieces{3 * 8192, 8192, 3}, Pieces{40 * 1000, 1000, 1},
                          Pieces{5 * 4096, 5 * 4096, 1}}) {
    const Plan p = plan_psum(*one, w.bytes, w.row_bytes);
    EXPECT(p.algorithm == Algorithm::kOneShot && p.pieces == w.pieces,
           "fused one-shot, %llu bytes in rows of %llu: %s in %d pieces, want %d", (unsigned long long)w.bytes,
           (unsigned long long)w.row_bytes, name(p.algorithm), p.pieces, w.pieces);
  }
  one->close();
  ep->close();
}

void check_bulk() {
  for (uint64_t bulk : std::initializer_list<uint64_t>{256 * kKiB, 32 << 20, 0}) {
    for (int world : {2, 3, 8}) {
      Case c{Platform::kHost, true, false, Config{}, world};
      c.cfg.bulk_bytes = bulk;
      auto ep = open_endpoint(c);
      if (!ep) return;
      const uint64_t at = bulk / world;
      for (const char* op : {"all_gather", "psum_scatter", "moe_combine_psum_scatter"}) {
        for (uint64_t lane : {(uint64_t)16, at, at + 16}) {
          if (lane == 0) continue;
          const Plan p = plan_bulk(*ep, op, lane);
          const bool fits = lane * world <= bulk;
          EXPECT(p.algorithm == (fits ? Algorithm::kBulk : Algorithm::kNone),
                 "%s, world %d, bulk %llu: a lane of %llu bytes ran %s", op, world, (unsigned long long)bulk,
                 (unsigned long long)lane, name(p.algorithm));
          if (!fits)
            EXPECT(p.why_not.find("JAX_ARX_PREFILL_SLOT_BYTES=") != std::string::npos &&
                       p.why_not.find(op) != std::string::npos,
                   "%s refused without the op and the setting: '%s'", op, p.why_not.c_str());
          else
            EXPECT(p.pieces == kMaxPieces, "%s: %d pieces", op, p.pieces);
        }
      }
      ep->close();
    }
  }
}

// plan_moe_combine on every route, by default and with moe_fused, inside
// and past the envelope.
void check_moe() {
  struct Route {
    Platform platform;
    bool direct, gpu_inboxes;
    TransportKind transport;
    const char* says;      // what the reason names the route by
    const char* measured;  // the docs/performance.md section it cites
  };
  const Route routes[] = {
      {Platform::kHost, true, false, TransportKind::kShm, "over shared memory", "On the CPU backend"},
      {Platform::kHost, false, false, TransportKind::kTcp, "through the proxy", "On the CPU backend"},
      {Platform::kCuda, true, true, TransportKind::kShm, "GPU inboxes", "under CUDA MPS"},
      {Platform::kCuda, true, false, TransportKind::kShm, "host inboxes", "under CUDA MPS"},
      {Platform::kCuda, false, false, TransportKind::kTcp, "through the proxy", "under CUDA MPS"},
  };
  const char* op = "moe_combine_psum_scatter";
  for (const Route& r : routes) {
    for (int64_t fused : {0, 1}) {
      for (int world : {2, 3}) {
        Case c{r.platform, r.direct, r.gpu_inboxes, Config{}, world, r.transport};
        c.cfg.bulk_bytes = 256 * kKiB;
        c.cfg.moe_fused = fused;
        auto ep = open_endpoint(c);
        if (!ep) return;
        const uint64_t at = c.cfg.bulk_bytes / world / 16 * 16;
        for (uint64_t lane : {(uint64_t)16, at, at + 16, (uint64_t)c.cfg.bulk_bytes}) {
          const Plan p = plan_moe_combine(*ep, lane);
          const bool fits = lane * world <= c.cfg.bulk_bytes;
          const Algorithm want = !fits ? Algorithm::kNone : fused ? Algorithm::kBulk : Algorithm::kUnfused;
          EXPECT(p.algorithm == want, "%s, %s, moe_fused %lld, world %d: a lane of %llu bytes ran %s, want %s",
                 r.platform == Platform::kHost ? "host" : "cuda", r.says, (long long)fused, world,
                 (unsigned long long)lane, name(p.algorithm), name(want));
          if (want == Algorithm::kNone)
            EXPECT(p.why_not.find("JAX_ARX_PREFILL_SLOT_BYTES=") != std::string::npos &&
                       p.why_not.find(op) != std::string::npos && p.reason.empty(),
                   "%s past the envelope without the op and the setting: '%s'", op, p.why_not.c_str());
          if (want == Algorithm::kUnfused)
            EXPECT(p.why_not.empty() && p.reason.find(r.says) != std::string::npos &&
                       p.reason.find("docs/performance.md") != std::string::npos &&
                       p.reason.find(r.measured) != std::string::npos &&
                       p.reason.find("the same bits") != std::string::npos,
                   "%s: the reason for the unfused pair does not name %s, %s and the same bits: '%s'", r.says, r.says,
                   r.measured, p.reason.c_str());
          if (want == Algorithm::kBulk) {
            const int pieces = plan_bulk(*ep, op, lane).pieces;
            EXPECT(p.pieces == pieces && p.reason.empty() && p.why_not.empty(),
                   "%s fused: %d pieces (the bulk plan's %d), reason '%s'", r.says, p.pieces, pieces, p.reason.c_str());
          }
          // The handlers of the fused op, which run only where it was
          // chosen, still find it inside the envelope.
          EXPECT(plan_bulk(*ep, op, lane).algorithm == (fits ? Algorithm::kBulk : Algorithm::kNone),
                 "%s: the handlers' plan_bulk for a lane of %llu bytes ran %s", r.says, (unsigned long long)lane,
                 name(plan_bulk(*ep, op, lane).algorithm));
        }
        ep->close();
      }
    }
  }
}

// plan_add_norm on every route, by default and with norm_fused, inside and
// past psum's envelope: the fused kernels and host side step aside unless
// asked for, on GPUs and on the CPU backend alike.
void check_add_norm() {
  struct Route {
    Platform platform;
    bool direct, gpu_inboxes;
    TransportKind transport;
    const char* says;
  };
  const Route routes[] = {
      {Platform::kHost, true, false, TransportKind::kShm, "over shared memory"},
      {Platform::kHost, false, false, TransportKind::kTcp, "through the proxy"},
      {Platform::kCuda, true, true, TransportKind::kShm, "GPU inboxes"},
      {Platform::kCuda, true, false, TransportKind::kShm, "host inboxes"},
      {Platform::kCuda, false, false, TransportKind::kTcp, "through the proxy"},
  };
  for (const Route& r : routes) {
    for (int64_t fused : {0, 1}) {
      Case c{r.platform, r.direct, r.gpu_inboxes, Config{}, 2, r.transport};
      c.cfg.norm_fused = fused;
      auto ep = open_endpoint(c);
      if (!ep) return;
      for (uint64_t bytes : {(uint64_t)16, (uint64_t)8 * kKiB, (uint64_t)c.cfg.slot_bytes, 64 * c.cfg.send_bytes}) {
        const Plan psum = plan_psum(*ep, bytes), p = plan_add_norm(*ep, bytes);
        const bool steps_aside = psum.algorithm != Algorithm::kNone && !fused;
        const Algorithm want = steps_aside ? Algorithm::kUnfused : psum.algorithm;
        EXPECT(p.algorithm == want, "%s, %s, norm_fused %lld: %llu bytes ran %s, want %s",
               r.platform == Platform::kHost ? "host" : "cuda", r.says, (long long)fused, (unsigned long long)bytes,
               name(p.algorithm), name(want));
        if (steps_aside)
          EXPECT(p.reason.find(r.says) != std::string::npos &&
                     p.reason.find("docs/performance.md, \"The fused norm\"") != std::string::npos,
                 "%s: the reason does not name the route and the measurement: '%s'", r.says, p.reason.c_str());
        else
          EXPECT(p.why_not == psum.why_not && p.pieces == psum.pieces, "%s: not psum's plan", r.says);
      }
      ep->close();
    }
  }
}

}  // namespace

int main() {
  const uint64_t slot = 1 << 20;
  // Sizes on both sides of every limit the cases below have.
  const std::initializer_list<uint64_t> sizes = {
      2,         16,   16 * kKiB, 16 * kKiB + 16, 64 * kKiB,     64 * kKiB + 16, 128 * kKiB,    128 * kKiB + 16,
      slot - 16, slot, slot + 16, 2 * slot,       2 * slot + 16, 4 * slot,       4 * slot + 16, 16 * slot};
  Config dflt;
  check_psum("host, defaults", {Platform::kHost, true, false, dflt}, sizes);
  check_psum("host over the proxy", {Platform::kHost, false, false, dflt}, sizes);
  check_psum("cuda, GPU inboxes", {Platform::kCuda, true, true, dflt}, sizes);
  check_psum("cuda, host inboxes", {Platform::kCuda, true, false, dflt}, sizes);
  check_psum("cuda over the proxy", {Platform::kCuda, false, false, dflt}, sizes);
  check_psum("cuda over the proxy, shm", {Platform::kCuda, false, false, dflt, 2, TransportKind::kShm}, sizes);
  Config ring = dflt, tiny_send = dflt;
  ring.topology = TopologyKind::kRing;
  check_psum("cuda over the proxy, shm, a ring of 4", {Platform::kCuda, false, false, ring, 4, TransportKind::kShm},
             sizes);
  check_psum("cuda over the proxy, shm, a ring of 3", {Platform::kCuda, false, false, ring, 3, TransportKind::kShm},
             sizes);
  tiny_send.slot_bytes = tiny_send.send_bytes = 64 * kKiB;
  check_psum("cuda over the proxy, shm, a send buffer of 64K",
             {Platform::kCuda, false, false, tiny_send, 2, TransportKind::kShm}, sizes);
  check_psum("cuda, world 4 (send-bound two-shot)", {Platform::kCuda, true, true, dflt, 4}, sizes);
  Config small_send = dflt;
  small_send.send_bytes = 3 * slot / 2;
  check_psum("cuda, a send buffer of 1.5 slots", {Platform::kCuda, true, true, small_send}, sizes);
  Config oneshot = dflt;
  oneshot.oneshot_max_bytes = 64 * kKiB;
  check_psum("host, JAX_ARX_ONESHOT_MAX_BYTES=64K", {Platform::kHost, true, false, oneshot}, sizes);
  check_psum("cuda, JAX_ARX_ONESHOT_MAX_BYTES=64K", {Platform::kCuda, false, false, oneshot}, sizes);
  Config no_ll = dflt, ll16 = dflt;
  no_ll.cuda_ll_max_bytes = 0;
  ll16.cuda_ll_max_bytes = 16 * kKiB;
  check_psum("cuda, no LL", {Platform::kCuda, true, true, no_ll}, sizes);
  check_psum("cuda, LL to 16K", {Platform::kCuda, true, false, ll16}, sizes);
  check_pieces();
  check_fused();
  check_bulk();
  check_moe();
  check_add_norm();
  printf("plan: %s\n", g_failures ? "FAILED" : "ok");
  return g_failures ? 1 : 0;
}

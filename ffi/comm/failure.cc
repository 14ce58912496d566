// The messages of an endpoint's failures and stalls: what failed, and what
// each peer last sent.
#include <algorithm>

#include "base/atomics.h"
#include "comm/endpoint.h"

namespace arx {
namespace {

const char* op_name(uint64_t op) {
  switch ((OpCode)op) {
    case OpCode::kPsum:
      return "psum";
    case OpCode::kPsumScatter:
      return "psum (two-shot, reduce-scatter half)";
    case OpCode::kPsumGather:
      return "psum (two-shot, all-gather half)";
    case OpCode::kAllGather:
      return "all_gather";
    case OpCode::kReduceScatter:
      return "psum_scatter";
    case OpCode::kMoeCombine:
      return "moe_combine_psum_scatter";
  }
  return "collective";
}

// "psum of 5881 bf16 elements at call site 0x1f2e" for a Descriptor.
std::string describe_exactly(uint64_t op, uint64_t type, uint64_t count, uint64_t tag) {
  const char* dtypes[] = {"?", "f32", "bf16", "f16"};
  const uint64_t t = type & 0xff, rows = type >> 8;
  const bool reducing = (OpCode)op != OpCode::kAllGather;
  std::string what = strf("%s of %llu %s%s", op_name(op), (unsigned long long)count,
                          reducing && t <= 3 ? dtypes[t] : strf("type-%llu", (unsigned long long)t).c_str(),
                          reducing ? " elements" : " bytes");
  if (rows > 1) what += strf(" in %llu rows", (unsigned long long)rows);
  return what + strf(" at call site %llx (leaf %llu)", (unsigned long long)(tag >> 6), (unsigned long long)(tag & 63));
}

const char* family_name(Family f) {
  switch (f) {
    case Family::kPsum:
      return "psum";
    case Family::kBulk:
      return "bulk";
  }
  return "?";
}

// The furthest seq source j's words of family f in the host region show
// (its flag words; the heard word the kernels keep where those words live in
// GPU memory).
uint64_t heard(const Endpoint& ep, Family f, int j) {
  const uint64_t* flags = ep.flags();
  const int world = ep.spec().world;
  int lo = 0, n = 0;
  switch (f) {
    case Family::kPsum:
      n = psum_stride(world);
      lo = kPsumWordBase + j * n;
      break;
    case Family::kBulk:
      n = kMaxPieces * kRoots;
      lo = kBulkWordBase + j * n;
      break;
  }
  uint64_t s = flag_seq(load_relaxed(&flags[heard_word(f, j)]));
  for (int i = lo; i < lo + n; ++i) s = std::max(s, flag_seq(load_relaxed(&flags[i])));
  return s;
}

}  // namespace

std::string Endpoint::heard_from_peers() const {
  std::string out;
  for (int j = 0; j < spec_.world; ++j) {
    if (j == spec_.rank) continue;
    out += strf("%s rank %d: psum #%llu, bulk #%llu", out.empty() ? "" : ";", j,
                (unsigned long long)heard(*this, Family::kPsum, j), (unsigned long long)heard(*this, Family::kBulk, j));
  }
  return out;
}

std::string Endpoint::describe_recorded_failure() const {
  const Control* ctl = control();
  const uint64_t seq = load_acquire(&ctl->failed_seq);
  const FailureKind kind = (FailureKind)load_relaxed(&ctl->failed_kind);
  const Family family = (Family)load_relaxed(&ctl->failed_family);
  const std::string what = strf("%s #%llu (%s sequence)", op_name(load_relaxed(&ctl->failed_op)),
                                (unsigned long long)seq, family_name(family));
  switch (kind) {
    case FailureKind::kTimeout: {
      const uint64_t missing = load_relaxed(&ctl->failed_missing);
      std::string who;
      for (int j = 0; j < spec_.world; ++j)
        if (missing >> j & 1) who += strf("%s%d", who.empty() ? "" : ", ", j);
      if (who.empty()) who = "(a block of this rank's own kernel that never ran)";
      double not_running = 0;
      {
        std::lock_guard<std::mutex> lock(failure_mu_);
        if (not_running_seq_ == seq && not_running_family_ == family) not_running = not_running_s_;
      }
      // A rank that was stopped itself (host/steps.h, HostPoll) says so
      // first: its peers have most likely given up on it meanwhile.
      const std::string itself =
          not_running > 0 ? strf(
                                " This rank itself was not running for %.1f s during that wait (the process was "
                                "stopped, or starved of the CPU), which is not counted in the timeout; its peers "
                                "have likely given up on it meanwhile.",
                                not_running)
                          : std::string();
      return strf(
          "jax_arx: %s: %s timed out after %g s waiting for rank %s.%s Last heard from each peer:%s. The "
          "peer may have exited or crashed, be stopped, or be issuing different collectives; raise "
          "JAX_ARX_TIMEOUT_S if it is only slow",
          label_.c_str(), what.c_str(), spec_.config.timeout_s, who.c_str(), itself.c_str(),
          heard_from_peers().c_str());
    }
    case FailureKind::kMismatch: {
      uint64_t theirs[kDescriptorWords];
      for (int i = 0; i < kDescriptorWords; ++i) theirs[i] = load_relaxed(&ctl->failed_theirs[i]);
      const std::string mine = describe_exactly(load_relaxed(&ctl->failed_op), load_relaxed(&ctl->failed_type),
                                                load_relaxed(&ctl->failed_count), load_relaxed(&ctl->failed_tag));
      const std::string peer = theirs[0] ? describe_exactly(theirs[0], theirs[1], theirs[2], theirs[3])
                                         : strf("another collective (descriptor %06llx, this rank's %06llx)",
                                                (unsigned long long)flag_desc(load_relaxed(&ctl->failed_flag)),
                                                (unsigned long long)(load_relaxed(&ctl->failed_desc) & kDescMask));
      return strf(
          "jax_arx: %s: at %s rank %llu issued a different collective: %s, where this rank issued %s. "
          "Every rank must issue the same collectives in the same order with the same shapes (a rank whose "
          "operand is outside jax_arx's size envelope falls back to jax.lax and issues a psum of 1 f32 "
          "element there to say so: jax_arx.stats()[\"fallbacks\"] on it tells why)",
          label_.c_str(), what.c_str(), (unsigned long long)load_relaxed(&ctl->failed_src), peer.c_str(), mine.c_str());
    }
    case FailureKind::kAborted:
      return strf("jax_arx: %s: %s was abandoned because the endpoint had already failed", label_.c_str(),
                  what.c_str());
    case FailureKind::kNone:
    case FailureKind::kPeerLost:  // in notices only, never recorded
      break;
  }
  return strf("jax_arx: %s: %s failed (record kind %llu)", label_.c_str(), what.c_str(), (unsigned long long)kind);
}

}  // namespace arx

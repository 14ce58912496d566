// The one place that decides what runs a collective of a given size on an
// endpoint: the size envelope (what jax_arx takes at all; Python asks it at
// trace time to fall back to jax.lax, through jax_arx._core.plan) and the
// algorithm and its pieces (the handlers ask it at each call). Every rank
// decides the same from the same size and what the ranks agreed on at set-up
// (config, world, route); the choice also goes into the descriptors, so a
// rank that chose otherwise is a mismatch, never a wrong sum.
#pragma once

#include <cstdint>
#include <string>

#include "comm/endpoint.h"

namespace arx {

enum class Algorithm : int64_t {
  kNone = 0,     // jax_arx does not take it (why_not says why)
  kOneShot = 1,  // every rank puts its partial to every peer, in `pieces` pieces, then sums
  kTwoShot = 2,  // a reduce-scatter then an all-gather, a seq each
  kLL = 3,       // the one-shot with its flags inside the data (CUDA)
  kBulk = 4,     // a bulk collective, in `pieces` pieces (at most kMaxPieces)
  // The fused MoE combine left to its unfused pair: Python traces jax's
  // combine (jax_arx.moe_combine) then the bulk psum_scatter instead, so it
  // never reaches a handler, and Stats does not count it.
  kUnfused = 5,
};
static_assert((int)Algorithm::kBulk + 1 == Stats::kAlgorithms, "Stats counts every algorithm a handler runs");

struct Plan {
  Algorithm algorithm = Algorithm::kNone;
  int pieces = 1;       // kOneShot: pieces of the partial; kBulk: of each lane
  std::string why_not;  // kNone: the reason and the fix, for the fallback message
  std::string reason;   // kUnfused: why the plan chose it, for stats()["plans"]
};

// A psum of a `bytes`-byte partial; `row_bytes` > 0: the fused
// psum_add_norm (base/norm.h) with rows of that many bytes, which the norm
// needs whole in one piece or LL block.
Plan plan_psum(const Endpoint& ep, uint64_t bytes, uint64_t row_bytes = 0);

// A bulk collective whose lane (one rank's slice of an all_gather, one
// destination's part of a psum_scatter or of the MoE combine's output) is
// `lane_bytes`; `total_bytes` is world times that, for the message.
Plan plan_bulk(const Endpoint& ep, const char* op, uint64_t lane_bytes);

// The fused MoE combine + psum_scatter whose output lane is `lane_bytes`:
// plan_bulk's envelope first (kNone past it); within it kUnfused, the pair
// its result is defined by (the same bits), wherever the fused kernel is
// not known to win; kBulk where it runs fused (Config::moe_fused). The
// handlers of the fused op run only where this chose kBulk, and ask
// plan_bulk for its pieces.
Plan plan_moe_combine(const Endpoint& ep, uint64_t lane_bytes);

// jax_arx.psum_add_norm of a `bytes`-byte partial: plan_psum's envelope
// first (kNone past it); within it kUnfused, jax_arx.psum then the add and
// the norm in jax, wherever the fused kernels are not known to win (on
// GPUs); else what plan_psum gives the fused call (Config::norm_fused
// forces that). The handlers of the fused op run only where this did not
// choose kUnfused, and ask plan_psum with the row's bytes.
Plan plan_add_norm(const Endpoint& ep, uint64_t bytes);

}  // namespace arx

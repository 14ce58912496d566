// Settings of one endpoint. Python reads the JAX_ARX_* environment (one
// place, jax_arx/config.py) and hands the values over as strings; the
// defaults below are the reference's. The "tuning" ones are no user
// settings: benchmarks chose their defaults, and only tests and benchmarks
// set them (jax_arx.initialize's private `_tuning` argument), to reach a
// path that the defaults take only at other sizes.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "base/status.h"
#include "base/topology.h"

namespace arx {

struct Config {
  uint64_t slot_bytes = 1 << 20;   // per peer per parity: one-shot partial or two-shot piece
  uint64_t send_bytes = 4 << 20;   // per parity: a two-shot partial
  uint64_t oneshot_max_bytes = 0;  // JAX_ARX_ONESHOT_MAX_BYTES: one-shot psum up to here (0: slot_bytes), then two-shot
  uint64_t bulk_bytes =
      32 << 20;  // JAX_ARX_PREFILL_SLOT_BYTES: per parity, a bulk op's gathered output / input (0: none)
  // Whether this endpoint's region holds the bulk lanes (bulk_bytes of
  // them, 4 x in all). jax_arx makes its psum endpoints without (false) and
  // gives the bulk collectives an endpoint of their own at their first call
  // (jax_arx/_bulk_endpoints.py), so a psum-only program pins nothing for
  // them. bulk_bytes stays the envelope either way (comm/plan.h).
  bool bulk_lanes = true;
  double timeout_s = 30;          // JAX_ARX_TIMEOUT_S: bound of every wait on peers
  int64_t idle_spin_ms = 200;     // JAX_ARX_IDLE_SPIN_MS: proxy spins this long after work
  int64_t idle_nap_us = 200;      // JAX_ARX_IDLE_NAP_US: then naps this long per turn (0: spin)
  double stall_report_s = 2;      // the proxy reports a stall after this long without progress
  bool abort_on_failure = false;  // JAX_ARX_ON_FAILURE=abort
  std::string tcp_addr;           // address the tcp carrier listens on and advertises
  std::string ib_hca;             // verbs: device names (JAX_ARX_IB_HCA)
  int64_t ib_gid_index = -1;      // verbs: forced GID index, -1 = find it
  // verbs: queue-pair settings (NCCL_IB_* style). A write not acknowledged
  // within 4.096 us << ib_timeout is resent, ib_retry_cnt times, then fails.
  int64_t ib_timeout = 14;      // JAX_ARX_IB_TIMEOUT, 1..31 (14: 67 ms)
  int64_t ib_retry_cnt = 7;     // JAX_ARX_IB_RETRY_CNT, 0..7 (soft-RoCE: 6, see verbs.cc)
  int64_t ib_tc = 0;            // JAX_ARX_IB_TC: traffic class of RoCE packets, 0..255
  int64_t ib_sl = 0;            // JAX_ARX_IB_SL: service level, 0..15
  uint64_t ib_chunk_bytes = 0;  // tuning: split verbs data writes into pieces of at most this; 0 = whole
  std::string ibverbs_lib;      // JAX_ARX_IBVERBS_LIB: the libibverbs to load; empty = the usual names
  // JAX_ARX_TOPOLOGY: mesh (every rank reaches every other), or ring (prev
  // and next only; base/topology.h).
  TopologyKind topology = TopologyKind::kMesh;
  bool cuda_direct = true;  // JAX_ARX_CUDA_DIRECT: GPUs of one host write the peers' inboxes themselves
  // tuning: the pieces of a one-shot psum (comm/plan.cc); 0: built in.
  uint64_t cuda_chunk_bytes = 0;
  // tuning: the host device side cuts a bulk collective's lane into pieces
  // of at least this many bytes, at most kMaxPieces (comm/plan.cc, bulk_pieces);
  // 0: built in.
  uint64_t bulk_piece_bytes = 0;
  // tuning: 1 runs the fused MoE combine within the bulk envelope on every
  // route; 0: the plan decides, and steps aside for the unfused pair where
  // the fused kernel loses (comm/plan.cc, plan_moe_combine).
  int64_t moe_fused = 0;
  // tuning: 1: jax_arx.psum_add_norm runs its fused kernels wherever its
  // psum runs; 0: the plan decides, and steps aside for psum then the add
  // and the norm in jax, where the fused kernels or host side lose
  // (comm/plan.cc, plan_add_norm).
  int64_t norm_fused = 0;
  // tuning: the shm carrier's copy helpers per rank (transport/copy_pool.h);
  // -1: as many as the host's cores allow (CopyPool::helpers_for); 0: the
  // proxy thread copies alone.
  int64_t shm_copy_threads = -1;
  // tuning: on the direct channel, a one-shot psum up to this size goes LL,
  // its flags inside the data (cuda/ll.cu). -1: built in; 0: never.
  int64_t cuda_ll_max_bytes = -1;
  // JAX_ARX_CUDA_PEER_MEMORY: in direct mode, the psum inboxes (recv slots,
  // chunk flags, LL lines) live in each GPU's own memory, mapped into the
  // peers' GPUs (NVLink or PCIe peer access), instead of in the pinned host
  // region (ffi/cuda/peer_memory.cc). -1: where every rank can map every
  // peer's (else the host region, with one log line); 0: never; 1: required
  // (set-up fails if it cannot be had).
  int64_t cuda_peer_memory = -1;
  bool verbose = false;  // JAX_ARX_DEBUG: log set-up steps

  // Parses {"slot_bytes": "1048576", ...}; unknown keys are an error, so a
  // typo in Python does not silently fall back to a default.
  static Status parse(const std::map<std::string, std::string>& kv, Config& out);
};

}  // namespace arx

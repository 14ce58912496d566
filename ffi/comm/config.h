// Settings of one endpoint. Python reads the JAX_ARX_* environment (one
// place, jax_arx/config.py) and hands the values over as strings; the
// defaults below are the reference's.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "comm/status.h"

namespace arx {

struct Config {
  uint64_t slot_bytes = 1 << 20;  // per peer per parity: one-shot partial or two-shot chunk
  uint64_t send_bytes = 4 << 20;  // per parity: a two-shot partial
  double timeout_s = 30;          // JAX_ARX_TIMEOUT_S: bound of every wait on peers
  int64_t idle_spin_ms = 200;     // JAX_ARX_IDLE_SPIN_MS: proxy spins this long after work
  int64_t idle_nap_us = 200;      // JAX_ARX_IDLE_NAP_US: then naps this long per turn (0: spin)
  double stall_report_s = 2;      // the proxy reports a stall after this long without progress
  bool abort_on_failure = false;  // JAX_ARX_ON_FAILURE=abort
  std::string tcp_addr;           // address the tcp carrier listens on and advertises
  std::string ib_hca;             // verbs: device names (JAX_ARX_IB_HCA)
  int64_t ib_gid_index = -1;      // verbs: forced GID index, -1 = find it
  bool verbose = false;           // JAX_ARX_DEBUG: log set-up steps

  // Parses {"slot_bytes": "1048576", ...}; unknown keys are an error, so a
  // typo in Python does not silently fall back to a default.
  static Status parse(const std::map<std::string, std::string>& kv, Config& out);
};

}  // namespace arx

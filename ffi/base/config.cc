#include "base/config.h"

#include <cerrno>
#include <cstdlib>

namespace arx {
namespace {

Status parse_u64(const std::string& key, const std::string& v, uint64_t& out) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long x = std::strtoull(v.c_str(), &end, 10);
  if (errno || end == v.c_str() || *end || v[0] == '-')
    return Status::Error(strf("jax_arx: option %s=%s is not a non-negative integer", key.c_str(), v.c_str()));
  out = x;
  return Status::Ok();
}

Status parse_i64(const std::string& key, const std::string& v, int64_t& out) {
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (errno || end == v.c_str() || *end)
    return Status::Error(strf("jax_arx: option %s=%s is not an integer", key.c_str(), v.c_str()));
  out = x;
  return Status::Ok();
}

Status parse_f64(const std::string& key, const std::string& v, double& out) {
  char* end = nullptr;
  errno = 0;
  const double x = std::strtod(v.c_str(), &end);
  if (errno || end == v.c_str() || *end || !(x > 0))
    return Status::Error(strf("jax_arx: option %s=%s is not a positive number", key.c_str(), v.c_str()));
  out = x;
  return Status::Ok();
}

// An integer option with a closed range (the verbs queue-pair settings).
Status parse_range(const std::string& key, const std::string& v, int64_t lo, int64_t hi, int64_t& out) {
  int64_t x = 0;
  ARX_RETURN_IF_ERROR(parse_i64(key, v, x));
  if (x < lo || x > hi)
    return Status::Error(
        strf("jax_arx: option %s=%s is outside [%lld, %lld]", key.c_str(), v.c_str(), (long long)lo, (long long)hi));
  out = x;
  return Status::Ok();
}

}  // namespace

Status Config::parse(const std::map<std::string, std::string>& kv, Config& out) {
  Config c;
  for (const auto& [k, v] : kv) {
    if (k == "slot_bytes")
      ARX_RETURN_IF_ERROR(parse_u64(k, v, c.slot_bytes));
    else if (k == "send_bytes")
      ARX_RETURN_IF_ERROR(parse_u64(k, v, c.send_bytes));
    else if (k == "oneshot_max_bytes")
      ARX_RETURN_IF_ERROR(parse_u64(k, v, c.oneshot_max_bytes));
    else if (k == "bulk_bytes")
      ARX_RETURN_IF_ERROR(parse_u64(k, v, c.bulk_bytes));
    else if (k == "bulk_lanes")
      c.bulk_lanes = v == "1" || v == "true";
    else if (k == "timeout_s")
      ARX_RETURN_IF_ERROR(parse_f64(k, v, c.timeout_s));
    else if (k == "idle_spin_ms")
      ARX_RETURN_IF_ERROR(parse_i64(k, v, c.idle_spin_ms));
    else if (k == "idle_nap_us")
      ARX_RETURN_IF_ERROR(parse_i64(k, v, c.idle_nap_us));
    else if (k == "stall_report_s")
      ARX_RETURN_IF_ERROR(parse_f64(k, v, c.stall_report_s));
    else if (k == "abort_on_failure")
      c.abort_on_failure = v == "1" || v == "true";
    else if (k == "tcp_addr")
      c.tcp_addr = v;
    else if (k == "ib_hca")
      c.ib_hca = v;
    else if (k == "ib_gid_index")
      ARX_RETURN_IF_ERROR(parse_i64(k, v, c.ib_gid_index));
    else if (k == "ib_timeout")
      ARX_RETURN_IF_ERROR(parse_range(k, v, 1, 31, c.ib_timeout));
    else if (k == "ib_retry_cnt")
      ARX_RETURN_IF_ERROR(parse_range(k, v, 0, 7, c.ib_retry_cnt));
    else if (k == "ib_tc")
      ARX_RETURN_IF_ERROR(parse_range(k, v, 0, 255, c.ib_tc));
    else if (k == "ib_sl")
      ARX_RETURN_IF_ERROR(parse_range(k, v, 0, 15, c.ib_sl));
    else if (k == "ib_chunk_bytes")
      ARX_RETURN_IF_ERROR(parse_u64(k, v, c.ib_chunk_bytes));
    else if (k == "ibverbs_lib")
      c.ibverbs_lib = v;
    else if (k == "topology") {
      if (v != "mesh" && v != "ring")
        return Status::Error(strf("jax_arx: topology '%s' (JAX_ARX_TOPOLOGY) is neither 'mesh' nor 'ring'", v.c_str()));
      c.topology = v == "ring" ? TopologyKind::kRing : TopologyKind::kMesh;
    } else if (k == "cuda_direct")
      c.cuda_direct = v == "1" || v == "true";
    else if (k == "cuda_chunk_bytes")
      ARX_RETURN_IF_ERROR(parse_u64(k, v, c.cuda_chunk_bytes));
    else if (k == "bulk_piece_bytes")
      ARX_RETURN_IF_ERROR(parse_u64(k, v, c.bulk_piece_bytes));
    else if (k == "moe_fused")
      ARX_RETURN_IF_ERROR(parse_range(k, v, 0, 1, c.moe_fused));
    else if (k == "norm_fused")
      ARX_RETURN_IF_ERROR(parse_range(k, v, 0, 1, c.norm_fused));
    else if (k == "shm_copy_threads")
      ARX_RETURN_IF_ERROR(parse_range(k, v, -1, 64, c.shm_copy_threads));
    else if (k == "cuda_ll_max_bytes")
      ARX_RETURN_IF_ERROR(parse_i64(k, v, c.cuda_ll_max_bytes));
    else if (k == "cuda_peer_memory")
      ARX_RETURN_IF_ERROR(parse_range(k, v, -1, 1, c.cuda_peer_memory));
    else if (k == "verbose")
      c.verbose = v == "1" || v == "true";
    else
      return Status::Error(strf("jax_arx: unknown endpoint option '%s'", k.c_str()));
  }
  if (c.slot_bytes == 0 || c.slot_bytes % 16 || c.send_bytes % 16)
    return Status::Error(strf("jax_arx: slot_bytes (%llu) and send_bytes (%llu) must be positive multiples of 16",
                              (unsigned long long)c.slot_bytes, (unsigned long long)c.send_bytes));
  // A one-shot partial is staged in send[parity] before it goes out whole.
  if (c.send_bytes < c.slot_bytes)
    return Status::Error(
        strf("jax_arx: send_bytes (%llu) must be at least slot_bytes (%llu): a one-shot partial is "
             "staged in a send buffer; raise JAX_ARX_SEND_BYTES or lower JAX_ARX_SLOT_BYTES",
             (unsigned long long)c.send_bytes, (unsigned long long)c.slot_bytes));
  if (c.cuda_chunk_bytes % 16)
    return Status::Error(
        strf("jax_arx: cuda_chunk_bytes (%llu) must be a multiple of 16", (unsigned long long)c.cuda_chunk_bytes));
  if (c.cuda_ll_max_bytes < -1)
    return Status::Error(strf("jax_arx: cuda_ll_max_bytes (%lld) must be -1 (built in), 0 (off) or a size",
                              (long long)c.cuda_ll_max_bytes));
  if (c.bulk_bytes % 16)
    return Status::Error(strf("jax_arx: bulk_bytes (%llu, JAX_ARX_PREFILL_SLOT_BYTES) must be a multiple of 16",
                              (unsigned long long)c.bulk_bytes));
  out = c;
  return Status::Ok();
}

}  // namespace arx

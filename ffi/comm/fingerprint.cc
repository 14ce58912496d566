#include "comm/fingerprint.h"

#include <cstdio>
#include <cstring>

namespace arx {
namespace {

const char* platform_name(Platform p) {
  switch (p) {
    case Platform::kHost:
      return "cpu";
    case Platform::kCuda:
      return "cuda";
  }
  return "unknown";
}

struct Fingerprint {
  char magic[8];
  char version[16];
  char name[48];  // the mesh axis
  int64_t comm_id;
  uint32_t rank, world;
  uint64_t slot_bytes, send_bytes, bulk_bytes, oneshot_max_bytes;
  uint64_t timeout_ms;
  // How the kernels cut a psum and which medium they take (both are in the
  // descriptors, but a difference found here is a clearer message).
  uint64_t cuda_chunk_bytes, bulk_piece_bytes;
  int64_t cuda_ll_max_bytes;
  uint32_t moe_fused;   // whether the MoE combine runs fused: a rank that differs would issue other collectives
  uint32_t norm_fused;  // the same for psum_add_norm
  uint32_t cuda_direct;
  uint32_t bulk_lanes;  // whether the region holds the bulk lanes (base/config.h)
  uint32_t transport, platform, topology;
  uint32_t layout_bytes;  // the shared blocks' sizes, so builds that disagree on them do not talk
};
constexpr char kMagic[8] = {'J', 'A', 'X', 'A', 'R', 'X', 0, 4};

Fingerprint fingerprint_of(const EndpointSpec& s) {
  Fingerprint f{};
  std::memcpy(f.magic, kMagic, sizeof kMagic);
  std::snprintf(f.version, sizeof f.version, "%s", version());
  std::snprintf(f.name, sizeof f.name, "%s", s.name.c_str());
  f.comm_id = s.comm_id;
  f.rank = (uint32_t)s.rank;
  f.world = (uint32_t)s.world;
  f.slot_bytes = s.config.slot_bytes;
  f.send_bytes = s.config.send_bytes;
  f.bulk_bytes = s.config.bulk_bytes;
  f.oneshot_max_bytes = s.config.oneshot_max_bytes;
  f.timeout_ms = (uint64_t)(s.config.timeout_s * 1000);
  f.cuda_chunk_bytes = s.config.cuda_chunk_bytes;
  f.bulk_piece_bytes = s.config.bulk_piece_bytes;
  f.cuda_ll_max_bytes = s.config.cuda_ll_max_bytes;
  f.moe_fused = (uint32_t)s.config.moe_fused;
  f.norm_fused = (uint32_t)s.config.norm_fused;
  f.cuda_direct = s.config.cuda_direct;
  f.bulk_lanes = s.config.bulk_lanes;
  f.transport = (uint32_t)s.transport;
  f.platform = (uint32_t)s.platform;
  f.topology = (uint32_t)s.config.topology;
  f.layout_bytes = sizeof(Control) + sizeof(Trigger) * kRing + (uint32_t)kFlagWords;
  return f;
}

}  // namespace

std::string fingerprint(const EndpointSpec& spec) {
  const Fingerprint f = fingerprint_of(spec);
  return std::string(reinterpret_cast<const char*>(&f), sizeof f);
}

std::string check_fingerprint(const EndpointSpec& spec, const std::string& details, int j, std::string& rest) {
  if (details.size() < sizeof(Fingerprint))
    return strf("rank %d sent %zu bytes of details, too few to be from jax_arx", j, details.size());
  const Fingerprint mine = fingerprint_of(spec);
  Fingerprint theirs;
  std::memcpy(&theirs, details.data(), sizeof theirs);
  rest = details.substr(sizeof theirs);
  auto num = [&](const char* what, unsigned long long a, unsigned long long b, const char* hint) {
    return strf("rank %d has %s %llu, this rank %llu; %s", j, what, b, a, hint);
  };
  if (std::memcmp(theirs.magic, kMagic, sizeof kMagic) != 0)
    return strf("rank %d sent details that are not from jax_arx (or from an incompatible version)", j);
  if (std::strncmp(mine.version, theirs.version, sizeof mine.version) != 0)
    return strf("rank %d runs jax_arx %.16s, this rank %.16s; install the same version everywhere", j, theirs.version,
                mine.version);
  if (mine.layout_bytes != theirs.layout_bytes)
    return strf("rank %d was built with a different control block layout; rebuild jax_arx everywhere", j);
  if (std::strncmp(mine.name, theirs.name, sizeof mine.name) != 0 || mine.comm_id != theirs.comm_id)
    return strf(
        "rank %d set up communicator '%.48s' (id %lld), this rank '%.48s' (id %lld); every process must "
        "call jax_arx.initialize with the same mesh",
        j, theirs.name, (long long)theirs.comm_id, mine.name, (long long)mine.comm_id);
  if (theirs.rank != (uint32_t)j) return strf("the details at index %d came from rank %u", j, theirs.rank);
  if (mine.world != theirs.world) return num("world size", mine.world, theirs.world, "check the mesh");
  if (mine.slot_bytes != theirs.slot_bytes)
    return num("slot_bytes", mine.slot_bytes, theirs.slot_bytes, "set JAX_ARX_SLOT_BYTES the same everywhere");
  if (mine.send_bytes != theirs.send_bytes)
    return num("send_bytes", mine.send_bytes, theirs.send_bytes, "set JAX_ARX_SEND_BYTES the same everywhere");
  if (mine.bulk_bytes != theirs.bulk_bytes)
    return num("bulk bytes", mine.bulk_bytes, theirs.bulk_bytes, "set JAX_ARX_PREFILL_SLOT_BYTES the same everywhere");
  if (mine.bulk_lanes != theirs.bulk_lanes)
    return strf(
        "rank %d %s the bulk lanes, this rank %s; every rank of a communicator must lay its region out "
        "alike (a bug of the caller: jax_arx sets this, not the user)",
        j, theirs.bulk_lanes ? "holds" : "does not hold", mine.bulk_lanes ? "does" : "does not");
  if (mine.oneshot_max_bytes != theirs.oneshot_max_bytes)
    return num("oneshot_max_bytes", mine.oneshot_max_bytes, theirs.oneshot_max_bytes,
               "set JAX_ARX_ONESHOT_MAX_BYTES the same everywhere");
  if (mine.timeout_ms != theirs.timeout_ms)
    return num("a timeout of (ms)", mine.timeout_ms, theirs.timeout_ms, "set JAX_ARX_TIMEOUT_S the same everywhere");
  if (mine.cuda_direct != theirs.cuda_direct)
    return num("cuda_direct", mine.cuda_direct, theirs.cuda_direct, "set JAX_ARX_CUDA_DIRECT the same everywhere");
  if (mine.cuda_chunk_bytes != theirs.cuda_chunk_bytes || mine.cuda_ll_max_bytes != theirs.cuda_ll_max_bytes ||
      mine.bulk_piece_bytes != theirs.bulk_piece_bytes || mine.moe_fused != theirs.moe_fused ||
      mine.norm_fused != theirs.norm_fused)
    return strf(
        "rank %d was set up with other tuning (chunk %llu, LL up to %lld bytes, bulk pieces of %llu, MoE "
        "fused %u, norm fused %u; this rank %llu, %lld, %llu, %u, %u): pass the same _tuning to "
        "jax_arx.initialize everywhere",
        j, (unsigned long long)theirs.cuda_chunk_bytes, (long long)theirs.cuda_ll_max_bytes,
        (unsigned long long)theirs.bulk_piece_bytes, theirs.moe_fused, theirs.norm_fused,
        (unsigned long long)mine.cuda_chunk_bytes, (long long)mine.cuda_ll_max_bytes,
        (unsigned long long)mine.bulk_piece_bytes, mine.moe_fused, mine.norm_fused);
  if (mine.transport != theirs.transport)
    return strf("rank %d uses the %s carrier, this rank %s; set JAX_ARX_TRANSPORT the same everywhere", j,
                transport_name((TransportKind)theirs.transport), transport_name((TransportKind)mine.transport));
  if (mine.topology != theirs.topology)
    return strf("rank %d is cabled as a %s, this rank as a %s; set JAX_ARX_TOPOLOGY the same everywhere", j,
                theirs.topology ? "ring" : "mesh", mine.topology ? "ring" : "mesh");
  if (mine.platform != theirs.platform)
    return strf("rank %d runs on %s, this rank on %s; a communicator spans one platform", j,
                platform_name((Platform)theirs.platform), platform_name((Platform)mine.platform));
  return "";
}

}  // namespace arx

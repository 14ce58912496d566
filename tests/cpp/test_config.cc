// What the core makes of the endpoint options jax_arx/config.py hands it
// (Config::parse, base/config.h): the CUDA settings, which the host device
// side never reads, so no CPU test would see them misread, and the values
// it refuses. tests/test_config_unit.py checks the strings Python sends.
#include <cstdio>
#include <map>
#include <string>

#include "base/config.h"
#include "rig.h"

using namespace arx;
using arx::testing::g_failures;

namespace {

Config parsed(const std::map<std::string, std::string>& kv) {
  Config c;
  const Status s = Config::parse(kv, c);
  EXPECT(s.ok(), "parse refused what it should take: %s", s.message().c_str());
  return c;
}

void refused(const std::map<std::string, std::string>& kv, const char* says) {
  Config c;
  const Status s = Config::parse(kv, c);
  EXPECT(!s.ok() && s.message().find(says) != std::string::npos, "'%s' expected, got '%s'", says,
         s.ok() ? "ok" : s.message().c_str());
}

}  // namespace

int main() {
  const Config d = parsed({});
  EXPECT(d.cuda_direct && d.cuda_peer_memory == -1 && d.cuda_chunk_bytes == 0 && d.cuda_ll_max_bytes == -1,
         "defaults: direct %d, peer memory %lld, chunk %llu, LL %lld", d.cuda_direct, (long long)d.cuda_peer_memory,
         (unsigned long long)d.cuda_chunk_bytes, (long long)d.cuda_ll_max_bytes);
  EXPECT(!parsed({{"cuda_direct", "0"}}).cuda_direct, "cuda_direct=0 (JAX_ARX_CUDA_DIRECT=0)");
  EXPECT(parsed({{"cuda_direct", "1"}}).cuda_direct, "cuda_direct=1");
  EXPECT(parsed({{"cuda_peer_memory", "1"}}).cuda_peer_memory == 1, "cuda_peer_memory=1");
  EXPECT(parsed({{"cuda_peer_memory", "0"}}).cuda_peer_memory == 0, "cuda_peer_memory=0");
  EXPECT(parsed({{"cuda_peer_memory", "-1"}}).cuda_peer_memory == -1, "cuda_peer_memory=-1");
  refused({{"cuda_peer_memory", "2"}}, "cuda_peer_memory");
  EXPECT(parsed({{"cuda_chunk_bytes", "4096"}}).cuda_chunk_bytes == 4096, "cuda_chunk_bytes=4096");
  refused({{"cuda_chunk_bytes", "100"}}, "cuda_chunk_bytes (100) must be a multiple of 16");
  EXPECT(parsed({{"cuda_ll_max_bytes", "0"}}).cuda_ll_max_bytes == 0, "cuda_ll_max_bytes=0");
  EXPECT(parsed({{"cuda_ll_max_bytes", "16384"}}).cuda_ll_max_bytes == 16384, "cuda_ll_max_bytes=16384");
  refused({{"cuda_ll_max_bytes", "-2"}}, "cuda_ll_max_bytes (-2)");
  EXPECT(parsed({{"oneshot_max_bytes", "65536"}}).oneshot_max_bytes == 65536, "oneshot_max_bytes");
  EXPECT(parsed({{"bulk_bytes", "0"}}).bulk_bytes == 0, "bulk_bytes=0 (JAX_ARX_PREFILL_SLOT_BYTES=0)");
  EXPECT(parsed({{"abort_on_failure", "1"}}).abort_on_failure, "abort_on_failure=1 (JAX_ARX_ON_FAILURE=abort)");
  EXPECT(!parsed({{"abort_on_failure", "0"}}).abort_on_failure, "abort_on_failure=0");
  EXPECT(d.moe_fused == 0, "default: moe_fused %lld (the plan decides)", (long long)d.moe_fused);
  EXPECT(parsed({{"moe_fused", "1"}}).moe_fused == 1, "moe_fused=1");
  EXPECT(parsed({{"moe_fused", "0"}}).moe_fused == 0, "moe_fused=0");
  refused({{"moe_fused", "2"}}, "moe_fused");
  EXPECT(d.norm_fused == 0, "default: norm_fused %lld (the plan decides)", (long long)d.norm_fused);
  EXPECT(parsed({{"norm_fused", "1"}}).norm_fused == 1, "norm_fused=1");
  refused({{"norm_fused", "2"}}, "norm_fused");
  refused({{"cuda_pipeline", "1"}}, "unknown endpoint option 'cuda_pipeline'");
  printf("config: %s\n", g_failures ? "FAILED" : "ok");
  return g_failures ? 1 : 0;
}

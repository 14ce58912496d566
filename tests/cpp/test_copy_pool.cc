// The shm carrier's copy helpers (transport/copy_pool.h): every byte of
// every copy in place when copy() returns, with 0 to kMaxHelpers helpers,
// for lengths below, at and across the part size, odd lengths and odd
// addresses; copies back to back with the helpers spinning and with them
// asleep between parts (idle_spin_ms 0); and the policy that picks their
// number. The copies are checked against the source, byte for byte, by a
// pattern that differs per copy, so a part left from the copy before (a
// helper that had not finished) shows. Runs under ThreadSanitizer
// (tests/test_cpp_core.py, TSAN_TESTS).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "rig.h"
#include "transport/copy_pool.h"

using namespace arx;

namespace {

bool copies_exactly(CopyPool& pool, std::vector<uint8_t>& dst, std::vector<uint8_t>& src, uint64_t off, uint64_t len,
                    uint32_t tag) {
  for (uint64_t i = 0; i < len; ++i) src[off + i] = (uint8_t)((i * 131 + tag * 7 + (i >> 12)) ^ tag);
  const uint64_t end = off + len + 64;  // what a copy could overrun into is checked too
  std::memset(dst.data(), 0xA5, end);
  pool.copy(dst.data() + off, src.data() + off, len);
  if (std::memcmp(dst.data() + off, src.data() + off, len) != 0) return false;
  for (uint64_t i = 0; i < end; ++i)
    if ((i < off || i >= off + len) && dst[i] != 0xA5) return false;
  return true;
}

void test_copies(int helpers, int64_t spin_ms, bool quick) {
  CopyPool pool(helpers, spin_ms);
  EXPECT(pool.helpers() == helpers, "asked for %d helpers, started %d", helpers, pool.helpers());
  const uint64_t P = CopyPool::kMinPart;
  const std::vector<uint64_t> lens = {0,         1,         63,         P - 1,         P, 2 * P - 1, 2 * P,
                                      2 * P + 1, 4 * P + 7, 5 * P + 64, (1 << 20) + 13};
  std::vector<uint8_t> src((1 << 20) + 128), dst(src.size());
  uint32_t tag = 0;
  for (int round = 0; round < (quick ? 1 : 3); ++round)
    for (uint64_t len : lens)
      for (uint64_t off : {0, 1, 24}) {
        ++tag;
        EXPECT(copies_exactly(pool, dst, src, off, len, tag),
               "helpers %d, idle spin %lld ms: a copy of %llu bytes at offset %llu is not the source", helpers,
               (long long)spin_ms, (unsigned long long)len, (unsigned long long)off);
      }
}

void test_policy() {
  // -1: a core for each rank's own thread and one for its proxy, the rest
  // of its share to helpers, at most kMaxHelpers.
  EXPECT(CopyPool::helpers_for(-1, 2, 2) == 0, "2 ranks on 2 cores: no helper");
  EXPECT(CopyPool::helpers_for(-1, 4, 16) == 2, "4 ranks on 16 cores: 2 helpers each");
  EXPECT(CopyPool::helpers_for(-1, 2, 16) == CopyPool::kMaxHelpers, "2 ranks on 16 cores: the most");
  EXPECT(CopyPool::helpers_for(-1, 8, 16) == 0, "8 ranks on 16 cores: none");
  EXPECT(CopyPool::helpers_for(-1, 0, 16) == 0, "no ranks known: none");
  // Asked for: taken, up to kMaxHelpers.
  EXPECT(CopyPool::helpers_for(0, 2, 64) == 0, "0 asked for");
  EXPECT(CopyPool::helpers_for(2, 2, 2) == 2, "2 asked for on 2 cores");
  EXPECT(CopyPool::helpers_for(64, 2, 64) == CopyPool::kMaxHelpers, "64 asked for");
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  test_policy();
  for (int helpers = 0; helpers <= CopyPool::kMaxHelpers; ++helpers) {
    test_copies(helpers, 0, quick);   // the helpers block between parts
    test_copies(helpers, 50, quick);  // they spin between parts
  }
  printf("%s\n", testing::g_failures ? "FAILED" : "test_copy_pool: all passed");
  return testing::g_failures ? 1 : 0;
}

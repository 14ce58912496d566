// Who talks to whom. In a mesh every rank reaches every other one. In a
// ring (boxes cabled in a ring, no switch: a NIC cannot forward RoCE for
// other boxes) a rank reaches only prev = rank - 1 and next = rank + 1, and
// what it sends to a rank two away is relayed: at world 4, the bytes for
// rank + 2 go to next, whose proxy puts them on to rank + 2 (comm/proxy.cc,
// "Relays"). At world 2 and 3 every rank is a neighbour, so a ring is a mesh
// with fewer cables; past 4 a ring would need relays of relays, and is
// refused (Endpoint::create).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ARX_HD __host__ __device__ __forceinline__
#else
#define ARX_HD inline
#endif

namespace arx {

enum class TopologyKind : uint32_t { kMesh = 0, kRing = 1 };
constexpr int kMaxRingWorld = 4;

struct Topology {
  int world = 0;
  bool ring = false;

  ARX_HD int prev(int r) const { return (r + world - 1) % world; }
  ARX_HD int next(int r) const { return (r + 1) % world; }
  // Whether a and b (a != b) are linked.
  ARX_HD bool linked(int a, int b) const { return !ring || b == prev(a) || b == next(a); }
  // The rank that relays what `src` sends to `dest`, or -1 where they are
  // linked. One relay per pair, always the sender's next: the relayed flag
  // words of a source then have one writer, as direct ones do.
  ARX_HD int relay(int src, int dest) const { return linked(src, dest) ? -1 : next(src); }
  // Whether `carrier` may store what `src` sends to `dest`: its own, over a
  // link, or what it relays.
  ARX_HD bool carries(int carrier, int src, int dest) const {
    return carrier == src ? linked(src, dest) : relay(src, dest) == carrier;
  }
  // The source whose puts `m` relays (its prev), or -1 where nothing is relayed.
  ARX_HD int relayed_source(int m) const { return ring && world > 3 ? prev(m) : -1; }
  bool relays() const { return ring && world > 3; }
};

}  // namespace arx

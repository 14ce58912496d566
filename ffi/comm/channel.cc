#include "comm/channel.h"

namespace arx {
namespace {

// Where a family's inbox and staging buffer are in a region.
struct FamilyPlace {
  uint64_t inbox, inbox_parity, lane, stage, stage_parity;
};

FamilyPlace place_of(const Layout& L, Family f, bool ll_lines) {
  if (ll_lines) return {L.ll_recv, (uint64_t)L.world * kLLSlotBytes, kLLSlotBytes, L.send, L.send_bytes};
  switch (f) {
    case Family::kPsum:
      return {L.recv, (uint64_t)L.world * L.slot_bytes, L.slot_bytes, L.send, L.send_bytes};
    case Family::kBulk:
      return {L.bulk_recv, (uint64_t)L.world * L.bulk_lane, L.bulk_lane, L.bulk_send, (uint64_t)L.world * L.bulk_lane};
  }
  return {};
}

FlagWords words_of(const Layout& L, Family f, int roots) {
  switch (f) {
    case Family::kPsum:
      return psum_words(L.world, roots);
    case Family::kBulk:
      return bulk_words(roots);
  }
  return {};
}

Inbox inbox_of(const Layout& L, Family f, int roots, uint8_t* base, bool ll_lines) {
  const FamilyPlace p = place_of(L, f, ll_lines);
  Inbox in;
  in.data = base + p.inbox;
  in.parity_bytes = p.inbox_parity;
  in.lane_bytes = p.lane;
  in.flags = reinterpret_cast<uint64_t*>(base + L.flags);
  in.words = words_of(L, f, roots);
  in.family = f;
  return in;
}

}  // namespace

ProxyChannel make_proxy_channel(const Layout& L, Family f, int rank, int roots, uint8_t* base, bool ll_lines) {
  const FamilyPlace p = place_of(L, f, ll_lines);
  ProxyChannel c;
  c.in = inbox_of(L, f, roots, base, ll_lines);
  c.rank = rank;
  c.world = L.world;
  c.family = f;
  c.stage = base + p.stage;
  c.stage_parity_bytes = p.stage_parity;
  c.stage_offset = p.stage;
  c.inbox_offset = p.inbox;
  c.ring = reinterpret_cast<Trigger*>(base + L.ring);
  c.staged = reinterpret_cast<uint64_t*>(base + L.staged_header_offset(f, 0));
  return c;
}

DirectChannel make_direct_channel(const Layout& L, Family f, int rank, uint8_t* base, uint8_t* const* peers,
                                  bool ll_lines) {
  const FamilyPlace p = place_of(L, f, ll_lines);
  DirectChannel c;
  c.in = inbox_of(L, f, 1, base, ll_lines);
  c.rank = rank;
  c.world = L.world;
  for (int j = 0; j < L.world; ++j) {
    if (j == rank || !peers[j]) continue;
    c.peer_data[j] = peers[j] + p.inbox;
    c.peer_flags[j] = reinterpret_cast<uint64_t*>(peers[j] + L.flags);
    c.peer_heard[j] = reinterpret_cast<uint64_t*>(peers[j] + L.flag_offset(heard_word(f, rank)));
  }
  return c;
}

}  // namespace arx

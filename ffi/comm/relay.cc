#include "comm/relay.h"

#include <cstring>

#include "base/atomics.h"
#include "comm/endpoint.h"
#include "transport/transport.h"

namespace arx {

Status Relay::record(int root, uint64_t from, uint64_t len, uint64_t dst, uint64_t flag_offset, uint64_t value) {
  const Layout& L = ep_.layout();
  const int next = L.topo.next(ep_.spec().rank);
  // Staged in this rank's region (a carrier reads only from there), in the
  // entry the ring argument (relay.h) says is free.
  const uint64_t at = L.relay_out_offset(root, sent_[root]);
  RelayRecord r{};
  r.from = from;
  r.len = len;
  r.dst = dst;
  r.flag_offset = flag_offset;
  r.value = value;
  std::memcpy(ep_.base() + at, &r, sizeof r);
  ++sent_[root];
  return ep_.transport()->put(next, root, ep_.base() + at, L.relay_record_offset(root, sent_[root] - 1), sizeof r,
                              L.flag_offset(relay_word(root)), sent_[root]);
}

Status Relay::header(const Trigger& t, int dest, const uint8_t* header) {
  const Layout& L = ep_.layout();
  const int rank = ep_.spec().rank, next = L.topo.next(rank);
  const Family family = (Family)(t.family & 0xff);
  const int par = (int)(flag_seq(t.value) & 1);
  const uint64_t slot = L.flag_offset(header_word(family, par, rank)), bytes = 8 * kDescriptorWords;
  (void)dest;
  // A put to every peer put the header into next's slot already. For dest
  // alone it goes into next's relay area: next's own slot for this rank gets
  // its header once per seq, before the flag word it may be reading it
  // after.
  if (t.dest == kEveryPeer) return record(0, slot, bytes, slot, kNoFlag, 0);
  const uint64_t staged = L.relay_header_offset(family, par);
  ARX_RETURN_IF_ERROR(ep_.transport()->put(next, 0, header, staged, bytes, kNoFlag, 0));
  return record(0, staged, bytes, slot, kNoFlag, 0);
}

Status Relay::data(const Trigger& t, int dest, int root, uint64_t off, uint64_t len) {
  const Layout& L = ep_.layout();
  const int rank = ep_.spec().rank, next = L.topo.next(rank);
  (void)dest;
  const uint64_t flag = L.flag_offset((int)t.flag + root);
  if (t.dest == kEveryPeer) return record(root, t.dst + off, len, t.dst + off, flag, t.value);
  Family f;
  int par;
  uint64_t lane_start;
  if (!L.lane_of(rank, t.dst, f, par, lane_start) || t.dst - lane_start + off + len > L.relay_lane_bytes(f))
    return Status::Error(
        strf("jax_arx: %s: a put to rank %d at %llu is in no inbox lane of this rank's; nothing "
             "to relay it through",
             ep_.label().c_str(), dest, (unsigned long long)t.dst));
  const uint64_t staged = L.relay_offset(f, par) + (t.dst - lane_start) + off;
  ARX_RETURN_IF_ERROR(ep_.transport()->put(next, root, ep_.base() + t.src + off, staged, len, kNoFlag, 0));
  return record(root, staged, len, t.dst + off, flag, t.value);
}

Status Relay::notice(int dest, uint64_t flag_offset, uint64_t value) {
  (void)dest;
  // No bytes; the place is this rank's own slot, as for a direct notice.
  return record(0, 0, 0, ep_.layout().recv_offset(0, ep_.spec().rank), flag_offset, value);
}

Status Relay::forward(bool& moved) {
  const Layout& L = ep_.layout();
  const int rank = ep_.spec().rank, prev = L.topo.relayed_source(rank), dest = L.topo.next(rank);
  if (prev < 0) return Status::Ok();
  for (int root = 0; root < ep_.roots(); ++root) {
    const uint64_t count = load_acquire(ep_.flags() + relay_word(root));
    // prev's count only grows and never runs more than a ring ahead of
    // what was taken (relay.h); anything else is not from jax_arx.
    if (count < taken_[root] || count - taken_[root] > (uint64_t)kRing)
      return Status::Error(
          strf("jax_arx: %s: rank %d announced relay record %llu on root %d, where %llu were "
               "taken; it is not a jax_arx peer, or a broken one",
               ep_.label().c_str(), prev, (unsigned long long)count, root, (unsigned long long)taken_[root]));
    for (; taken_[root] < count; ++taken_[root]) {
      RelayRecord r;
      std::memcpy(&r, ep_.base() + L.relay_record_offset(root, taken_[root]), sizeof r);
      // The bytes must be prev's to send on: its slots here, or the relay
      // area it fills. Where they land and the flag word the carrier checks
      // (Layout::may_write, may_flag: prev's slots at dest).
      const bool from_ok = r.len == 0 || L.src_may_write(prev, r.from, r.len) ||
                           (r.from >= L.relay_lo() && r.from <= L.relay_ring && r.len <= L.relay_ring - r.from);
      if (!from_ok)
        return Status::Error(
            strf("jax_arx: %s: rank %d asked to relay %llu bytes at %llu, which are not its "
                 "own; it is not a jax_arx peer, or a broken one",
                 ep_.label().c_str(), prev, (unsigned long long)r.len, (unsigned long long)r.from));
      ARX_RETURN_IF_ERROR(ep_.transport()->put(dest, root, ep_.base() + r.from, r.dst, r.len, r.flag_offset, r.value));
      ep_.stats.relayed.fetch_add(1, std::memory_order_relaxed);
      moved = true;
    }
  }
  return Status::Ok();
}

}  // namespace arx

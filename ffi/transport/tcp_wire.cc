#include "transport/tcp_wire.h"

#include <algorithm>

#include "comm/status.h"

namespace arx::tcp_wire {

const char* reject_name(Reject r) {
  switch (r) {
    case Reject::kNone: return "none";
    case Reject::kVersion: return "another wire version";
    case Reject::kHello: return "not a peer of this rank";
    case Reject::kView: return "different connection details";
    case Reject::kProof: return "wrong proof of identity";
    case Reject::kTaken: return "rank already connected";
  }
  return "unknown";
}

namespace {

// [offset, offset + len) inside [lo, lo + size), without overflow.
bool inside(uint64_t offset, uint64_t len, uint64_t lo, uint64_t size) {
  return offset >= lo && offset - lo <= size && len <= size - (offset - lo);
}

// Whether src's chunk of some op can hold [o, o + len) of a prefill_recv
// parity of S bytes: a chunk size c with src * c <= o, o + len <= (src + 1) * c
// and world * c <= S (the proxy refuses larger ops). Exact in integers.
bool in_prefill_chunk(uint64_t o, uint64_t len, int src, int world, uint64_t S) {
  const uint64_t c_max = std::min<uint64_t>(src ? o / (uint64_t)src : UINT64_MAX, S / (uint64_t)world);
  const uint64_t end = o + len;  // <= S: checked by the caller
  const uint64_t c_min = end / (uint64_t)(src + 1) + (end % (uint64_t)(src + 1) != 0);
  return c_min <= c_max;
}

}  // namespace

std::string check_frame(const FrameHeader& h, const Layout& L, int src) {
  if (h.magic != kFrameMagic)
    return strf("sent a frame with a bad magic 0x%016llx: the stream is out of step (mixed jax_arx versions?)",
                (unsigned long long)h.magic);
  bool own_flag = false;
  for (int root = 0; root < kRoots; ++root)
    own_flag |= h.flag_offset == L.flag_offset(flag_index(src, root)) ||
                h.flag_offset == L.flag_offset(prefill_flag_index(src, root));
  if (!own_flag)
    return strf("sent a flag for offset %llu, which is not one of its own flag words (%llu-%llu, %llu-%llu): a "
                "rank may signal only its own arrivals",
                (unsigned long long)h.flag_offset, (unsigned long long)L.flag_offset(flag_index(src, 0)),
                (unsigned long long)L.flag_offset(flag_index(src, kRoots - 1)),
                (unsigned long long)L.flag_offset(prefill_flag_index(src, 0)),
                (unsigned long long)L.flag_offset(prefill_flag_index(src, kRoots - 1)));
  if (h.len == 0) return "";
  for (int par = 0; par < 2; ++par) {
    if (inside(h.offset, h.len, L.recv_offset(par, src), L.slot_bytes)) return "";
    const uint64_t base = L.prefill_recv + (uint64_t)par * L.prefill_slot_bytes;
    if (L.prefill_slot_bytes && inside(h.offset, h.len, base, L.prefill_slot_bytes) &&
        in_prefill_chunk(h.offset - base, h.len, src, L.world, L.prefill_slot_bytes))
      return "";
  }
  return strf("sent a write of %llu bytes at offset %llu, outside its own slots in this endpoint's inbox (its "
              "one-shot slots [%llu, +%llu) and [%llu, +%llu), its chunks of the prefill buffers at [%llu, +%llu)): "
              "the ranks disagree on the buffer geometry, or the peer is faulty",
              (unsigned long long)h.len, (unsigned long long)h.offset,
              (unsigned long long)L.recv_offset(0, src), (unsigned long long)L.slot_bytes,
              (unsigned long long)L.recv_offset(1, src), (unsigned long long)L.slot_bytes,
              (unsigned long long)L.prefill_recv, (unsigned long long)(2 * L.prefill_slot_bytes));
}

}  // namespace arx::tcp_wire

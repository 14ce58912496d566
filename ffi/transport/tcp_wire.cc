#include "transport/tcp_wire.h"

#include "base/status.h"

namespace arx::tcp_wire {

const char* reject_name(Reject r) {
  switch (r) {
    case Reject::kNone:
      return "none";
    case Reject::kVersion:
      return "another wire version";
    case Reject::kHello:
      return "not a peer of this rank";
    case Reject::kView:
      return "different connection details";
    case Reject::kProof:
      return "wrong proof of identity";
    case Reject::kTaken:
      return "rank already connected";
  }
  return "unknown";
}

std::string check_frame(const FrameHeader& h, const Layout& L, int src, int at) {
  if (h.magic != kFrameMagic)
    return strf("sent a frame with a bad magic 0x%016llx: the stream is out of step (mixed jax_arx versions?)",
                (unsigned long long)h.magic);
  if (h.flag_offset != kNoFlag && !L.may_flag(src, at, h.flag_offset))
    return strf(
        "sent a flag for offset %llu, which is not one of its own words of this endpoint's flag page (nor "
        "one it relays): a rank may signal only its own arrivals",
        (unsigned long long)h.flag_offset);
  if (h.len != 0 && !L.may_write(src, at, h.offset, h.len))
    return strf(
        "sent a write of %llu bytes at offset %llu, outside its own slots in this endpoint's inbox (nor "
        "in slots it relays): the ranks disagree on the buffer geometry, or the peer is faulty",
        (unsigned long long)h.len, (unsigned long long)h.offset);
  return "";
}

}  // namespace arx::tcp_wire

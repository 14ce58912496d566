// psum on the host: the one-shot over a channel (comm/channel.h). One piece:
// a single thread copies and then waits, so cutting the partial would only
// add flags (comm/plan.cc). A fused call (AddNorm) runs its epilogue on the
// sum (host/norm.cc) before the collective finishes.
#include <cstring>

#include "comm/plan.h"
#include "host/convert.h"
#include "host/device_side.h"
#include "host/steps.h"

namespace arx::host {

Status psum(Endpoint& ep, const Plan& plan, DType dtype, const void* in, void* out, uint64_t count, uint64_t tag,
            const AddNorm& norm) {
  const uint64_t bytes = count * dtype_size(dtype);
  auto nan = [&] {
    fill_nan(dtype, out, count);
    if (norm.on()) fill_nan(dtype, norm.normed, count);
  };
  if (ep.failed()) {
    nan();
    return Status::Error(ep.failure());
  }
  if (plan.algorithm != Algorithm::kOneShot)
    return Status::Error(strf("jax_arx.psum on %s: %s", ep.label().c_str(),
                              plan.why_not.empty() ? "the host runs the one-shot only" : plan.why_not.c_str()));
  const int rank = ep.spec().rank, world = ep.spec().world;
  Collective c(ep, Family::kPsum, descriptor(OpCode::kPsum, (uint64_t)dtype, count, add_norm_tag(tag, norm)));
  return with_channel(ep, Family::kPsum, [&](const auto& ch) {
    const int par = c.parity();
    const auto send = ch.open(c.send(), Fan::kEveryPeer);
    const Status s = c.reserve(send.entries(1));
    if (!s.ok()) return c.fail(nan, s);
    // The whole partial to every peer; `in` may be `out`, which is written
    // only after every copy of it.
    for (int i = 0; i < send.fanout(kEveryPeer); ++i) std::memcpy(send.put_dst(kEveryPeer, i), in, bytes);
    // The copies happen-before the signal's release store (one thread).
    send.signal(kEveryPeer, 0, 0, bytes);
    c.published();
    if (!c.wait_peers(ch.in, 0)) return c.fail(nan);
    const uint8_t* parts[kMaxWorld];
    for (int src = 0; src < world; ++src)
      parts[src] = src == rank ? static_cast<const uint8_t*>(in) : ch.in.lane(par, src);
    sum_rank_order(dtype, parts, world, count, out);
    if (norm.on()) add_norm(dtype, out, count, norm);
    return c.finish();
  });
}

}  // namespace arx::host

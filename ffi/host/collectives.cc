#include "host/collectives.h"

#include <cstring>

#include "comm/atomics.h"
#include "comm/proxy.h"
#include "host/common.h"
#include "host/convert.h"

namespace arx::host {
namespace {

// Sequence state lives with the endpoint (Control::done), not in the
// handler: the next collective is the one after the last finished.
uint64_t next_seq(Endpoint& ep) { return load_relaxed(&ep.control()->done) + 1; }

// Publish order: the partial (already in send[par]) and its bytes, mode and
// descriptor first, then `published` with release. The proxy acquires
// `published` and so sees all of it.
void publish(Endpoint& ep, uint64_t seq, Mode mode, DType dtype, uint64_t bytes, uint64_t desc) {
  Control* ctl = ep.control();
  const int par = (int)(seq & 1);
  store_relaxed(&ctl->bytes[par], bytes);
  store_relaxed(&ctl->mode[par], (uint64_t)mode);
  store_relaxed(&ctl->desc[par], desc);
  store_relaxed(&ctl->dtype[par], (uint64_t)dtype);
  store_release(&ctl->published, seq);
}

void finish(Endpoint& ep, uint64_t seq) { store_release(&ep.control()->done, seq); }

// Waits until every peer's flag, on every root, reaches seq; a flag at
// exactly seq must carry our descriptor (see wait_flags).
Status wait_peers(Endpoint& ep, uint64_t seq, uint64_t desc) {
  FlagWait w;
  w.first = flag_index(0, 0);
  w.want = w.op_lo = w.op_hi = w.seq = seq;
  w.desc = desc;
  w.op = 0;
  return wait_flags(ep, w);
}

}  // namespace

Status allreduce(Endpoint& ep, DType dtype, const void* in, void* out, uint64_t count, uint64_t tag) {
  const uint64_t bytes = count * dtype_size(dtype);
  if (ep.failed()) {
    fill_nan(dtype, out, count);
    return Status::Error(ep.failure());
  }
  const Layout& L = ep.layout();
  if (bytes > L.slot_bytes)
    return Status::Error(strf("jax_arx: psum of %llu bytes on %s exceeds the one-shot slot of %llu bytes; raise "
                              "JAX_ARX_SLOT_BYTES (the Python side should have fallen back to jax.lax.psum)",
                              (unsigned long long)bytes, ep.label().c_str(), (unsigned long long)L.slot_bytes));
  const uint64_t seq = next_seq(ep);
  const int par = (int)(seq & 1), rank = ep.spec().rank, world = ep.spec().world;
  uint8_t* mine = ep.base() + L.send_offset(par);
  if (bytes) std::memcpy(mine, in, bytes);
  const uint64_t desc = describe(Mode::kFull, dtype, count, tag);
  publish(ep, seq, Mode::kFull, dtype, bytes, desc);
  // The CPU device side sends its own seq (Endpoint::device_sends), with the
  // proxy's protocol function: no hop through the proxy thread, which on a
  // machine with few cores costs more than the copy.
  if (ep.device_sends()) {
    const Status s = post_seq(ep, seq);
    if (!s.ok()) ep.fail(s.message());  // the wait below then gives up at once
  }
  if (!wait_peers(ep, seq, desc).ok()) {
    fill_nan(dtype, out, count);
    finish(ep, seq);
    ep.failed();  // turns the record into the endpoint's sticky message
    return Status::Error(ep.failure());
  }
  const uint8_t* parts[kMaxWorld];
  for (int src = 0; src < world; ++src) parts[src] = src == rank ? mine : ep.base() + L.recv_offset(par, src);
  sum_rank_order(dtype, parts, world, count, out);
  finish(ep, seq);
  return Status::Ok();
}

}  // namespace arx::host

#include "host/collectives.h"

#include <sched.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "comm/atomics.h"
#include "host/convert.h"

namespace arx::host {
namespace {

using Clock = std::chrono::steady_clock;

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

// Records a failed wait in the Control block, where jax_arx.check() and the
// proxy read it, exactly as a kernel would: the details first, failed_seq
// last with release.
void record_failure(Endpoint& ep, uint64_t seq, FailureKind kind, uint64_t missing, uint64_t flag, int src,
                    uint64_t desc) {
  Control* ctl = ep.control();
  if (load_acquire(&ctl->failed_seq) != 0) return;  // the first failure is the one kept
  store_relaxed(&ctl->failed_kind, (uint64_t)kind);
  store_relaxed(&ctl->failed_missing, missing);
  store_relaxed(&ctl->failed_flag, flag);
  store_relaxed(&ctl->failed_src, (uint64_t)src);
  store_relaxed(&ctl->failed_desc, desc);
  store_release(&ctl->failed_seq, seq);
}

// Waits until every peer's flag, on every root, reaches seq. A flag at
// exactly seq must carry our descriptor. A flag past seq is from a peer
// that already finished seq, which it could only do after agreeing with
// ours (it checked our seq flag), so it counts as arrived: its seq + 1 data
// went to the other parity and recv[seq & 1] still holds seq's.
//
// The wait yields the core on every turn: on a machine with fewer cores than
// waiting threads, a spin that does not yield starves the very peer (or
// proxy) it waits for. After a few milliseconds it naps instead, so a long
// wait (a peer still compiling) costs no CPU. It is bounded by the timeout.
Status wait_peers(Endpoint& ep, uint64_t seq, uint64_t desc) {
  const Layout& L = ep.layout();
  Control* ctl = ep.control();
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(ep.base() + L.flags);
  const int rank = ep.spec().rank, world = ep.spec().world, roots = ep.roots();
  uint64_t pending = 0;
  for (int j = 0; j < world; ++j)
    for (int r = 0; r < roots && j != rank; ++r) pending |= 1ull << flag_index(j, r);
  const auto start = Clock::now();
  const auto timeout = std::chrono::duration<double>(ep.spec().config.timeout_s);
  for (uint64_t turn = 0;; ++turn) {
    for (uint64_t m = pending; m; m &= m - 1) {
      const int i = __builtin_ctzll(m);
      const uint64_t f = load_acquire(&flags[i]);
      if (flag_progress(f) < seq) continue;
      if (flag_progress(f) == seq && flag_desc(f) != flag_desc(flag_word(seq, desc))) {
        record_failure(ep, seq, FailureKind::kMismatch, 0, f, i / kRoots, desc);
        return Status::Error("mismatch");
      }
      pending &= ~(1ull << i);
    }
    if (!pending) return Status::Ok();
    if (load_acquire(&ctl->abort)) {
      record_failure(ep, seq, FailureKind::kAborted, pending, 0, 0, desc);
      return Status::Error("aborted");
    }
    if ((turn & 15) == 15) {
      const auto waited = Clock::now() - start;
      if (waited > timeout) {
        record_failure(ep, seq, FailureKind::kTimeout, pending, 0, 0, desc);
        return Status::Error("timeout");
      }
      if (waited > std::chrono::milliseconds(5)) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        continue;
      }
    }
    sched_yield();
  }
}

template <typename Load, typename Store>
void sum_rank_order(const uint8_t* const* parts, int world, uint64_t count, int esize, void* out, Load load,
                    Store store) {
  constexpr uint64_t kBlock = 512;
  float acc[kBlock];
  for (uint64_t base = 0; base < count; base += kBlock) {
    const uint64_t n = count - base < kBlock ? count - base : kBlock;
    for (uint64_t k = 0; k < n; ++k) acc[k] = 0.0f;
    for (int src = 0; src < world; ++src) {  // rank order: every rank rounds the same way
      const uint8_t* p = parts[src] + base * esize;
      for (uint64_t k = 0; k < n; ++k) acc[k] += load(p + k * esize);
    }
    for (uint64_t k = 0; k < n; ++k) store((uint8_t*)out + (base + k) * esize, acc[k]);
  }
}

void sum(DType dtype, const uint8_t* const* parts, int world, uint64_t count, void* out) {
  switch (dtype) {
    case DType::kF32:
      sum_rank_order(
          parts, world, count, 4, out, [](const uint8_t* p) { float f; std::memcpy(&f, p, 4); return f; },
          [](uint8_t* p, float f) { std::memcpy(p, &f, 4); });
      return;
    case DType::kBF16:
      sum_rank_order(
          parts, world, count, 2, out, [](const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return bf16_to_f32(h); },
          [](uint8_t* p, float f) { const uint16_t h = f32_to_bf16(f); std::memcpy(p, &h, 2); });
      return;
    case DType::kF16:
      sum_rank_order(
          parts, world, count, 2, out, [](const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return f16_to_f32(h); },
          [](uint8_t* p, float f) { const uint16_t h = f32_to_f16(f); std::memcpy(p, &h, 2); });
      return;
  }
}

}  // namespace

void fill_nan_buffer(DType dtype, void* out, uint64_t count) { fill_nan(dtype, out, count); }

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
  if (!wait_peers(ep, seq, desc).ok()) {
    fill_nan(dtype, out, count);
    finish(ep, seq);
    ep.failed();  // turns the record into the endpoint's sticky message
    return Status::Error(ep.failure());
  }
  const uint8_t* parts[kMaxWorld];
  for (int src = 0; src < world; ++src) parts[src] = src == rank ? mine : ep.base() + L.recv_offset(par, src);
  sum(dtype, parts, world, count, out);
  finish(ep, seq);
  return Status::Ok();
}

}  // namespace arx::host

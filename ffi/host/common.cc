#include "host/common.h"

#include <sched.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "comm/atomics.h"
#include "host/convert.h"

namespace arx::host {
namespace {

using Clock = std::chrono::steady_clock;

template <typename Load, typename Store>
void sum_blocks(const uint8_t* const* parts, int world, uint64_t count, int esize, void* out, Load load,
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

}  // namespace

void record_failure(Endpoint& ep, uint64_t seq, uint64_t op, FailureKind kind, uint64_t missing, uint64_t flag,
                    int src, uint64_t desc) {
  Control* ctl = ep.control();
  if (load_acquire(&ctl->failed_seq) != 0) return;  // the first failure is the one kept
  store_relaxed(&ctl->failed_kind, (uint64_t)kind);
  store_relaxed(&ctl->failed_missing, missing);
  store_relaxed(&ctl->failed_flag, flag);
  store_relaxed(&ctl->failed_src, (uint64_t)src);
  store_relaxed(&ctl->failed_desc, desc);
  store_relaxed(&ctl->failed_op, op);
  store_release(&ctl->failed_seq, seq);
}

Status wait_flags(Endpoint& ep, const FlagWait& w) {
  const Layout& L = ep.layout();
  Control* ctl = ep.control();
  const uint64_t* flags = reinterpret_cast<const uint64_t*>(ep.base() + L.flags) + w.first;
  const int rank = ep.spec().rank, world = ep.spec().world, roots = ep.roots();
  // Bit src * kRoots + root per flag still awaited (the failure record's
  // `missing` uses the same numbering for every kind of collective).
  uint64_t pending = 0;
  for (int j = 0; j < world; ++j)
    for (int r = 0; r < roots && j != rank; ++r) pending |= 1ull << (j * kRoots + r);
  const uint64_t want_desc = flag_desc(flag_word(0, w.desc));
  const auto start = Clock::now();
  const auto timeout = std::chrono::duration<double>(ep.spec().config.timeout_s);
  for (uint64_t turn = 0;; ++turn) {
    for (uint64_t m = pending; m; m &= m - 1) {
      const int i = __builtin_ctzll(m);
      const uint64_t f = load_acquire(&flags[i]);
      const uint64_t progress = flag_progress(f);
      if (progress >= w.op_lo && progress <= w.op_hi && flag_desc(f) != want_desc) {
        record_failure(ep, w.seq, w.op, FailureKind::kMismatch, 0, f, i / kRoots, w.desc);
        return Status::Error("mismatch");
      }
      if (progress < w.want) continue;
      pending &= ~(1ull << i);
    }
    if (!pending) return Status::Ok();
    if (load_acquire(&ctl->abort)) {
      record_failure(ep, w.seq, w.op, FailureKind::kAborted, pending, 0, 0, w.desc);
      return Status::Error("aborted");
    }
    if ((turn & 15) == 15) {
      const auto waited = Clock::now() - start;
      if (waited > timeout) {
        record_failure(ep, w.seq, w.op, FailureKind::kTimeout, pending, 0, 0, w.desc);
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

void sum_rank_order(DType dtype, const uint8_t* const* parts, int world, uint64_t count, void* out) {
  switch (dtype) {
    case DType::kF32:
      sum_blocks(
          parts, world, count, 4, out, [](const uint8_t* p) { float f; std::memcpy(&f, p, 4); return f; },
          [](uint8_t* p, float f) { std::memcpy(p, &f, 4); });
      return;
    case DType::kBF16:
      sum_blocks(
          parts, world, count, 2, out, [](const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return bf16_to_f32(h); },
          [](uint8_t* p, float f) { const uint16_t h = f32_to_bf16(f); std::memcpy(p, &h, 2); });
      return;
    case DType::kF16:
      sum_blocks(
          parts, world, count, 2, out, [](const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return f16_to_f32(h); },
          [](uint8_t* p, float f) { const uint16_t h = f32_to_f16(f); std::memcpy(p, &h, 2); });
      return;
  }
}

}  // namespace arx::host

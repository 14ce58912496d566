#include "host/steps.h"

#include <algorithm>
#include <cstring>

#include "host/convert.h"

namespace arx::host {

Collective::Collective(Endpoint& ep, Family f, const Descriptor& d) : ep_(ep), ctl_(ep.control()), family_(f), d_(d) {
  // The sequence state lives with the endpoint (Control::done), not in the
  // handler: the next collective is the one after the last finished.
  seq_ = load_relaxed(&ctl_->done[(int)f]) + 1;
  ring_ = load_relaxed(&ctl_->ring_published);
  store_relaxed(&ctl_->begun[(int)f], seq_);
  ep.wake_proxy();
  ARX_STAMP(ep.trace(), f, seq_, kBegin, trace_now());
  ARX_STAMP(ep.trace(), f, seq_, kSeq, seq_);
  poll_ = HostPoll{
      ctl_, HostPoll::Clock::now(),
      std::chrono::duration_cast<HostPoll::Clock::duration>(std::chrono::duration<double>(ep.spec().config.timeout_s))};
}

bool Collective::wait_peers(const Inbox& in, int piece) {
  const int rank = ep_.spec().rank, world = ep_.spec().world;
  for (int src = 0; src < world; ++src) {
    if (src == rank) continue;
    uint64_t seen = 0;
    FailureRecord r;
    poll_.begin();
    const WaitEnd e = wait_piece(in, src, piece, seq_, d_, poll_, seen, r.theirs);
    if (e == WaitEnd::kArrived) {
      poll_.end();
      ARX_STAMP(ep_.trace(), family_, seq_, kArrived, trace_now());
      continue;
    }
    r.seq = seq_;
    r.kind = failure_kind(e);
    r.flag = seen;
    r.src = (uint64_t)src;
    r.mine = d_;
    r.family = family_;
    // Which peers had not sent this piece: this one, and any other whose
    // words are short of the seq right now.
    for (int j = 0; j < world; ++j)
      for (int root = 0; root < in.words.roots && j != rank; ++root)
        if (j == src || flag_seq(load_relaxed(in.word(j, piece, root))) < seq_) r.missing |= 1ull << j;
    if (poll_.not_running.count() > 0)
      ep_.note_not_running(family_, seq_, std::chrono::duration<double>(poll_.not_running).count());
    record_failure(ctl_, r);
    return false;
  }
  return true;
}

Status Collective::finish() {
  ARX_STAMP(ep_.trace(), family_, seq_, kEnd, trace_now());
  store_release(&ctl_->done[(int)family_], seq_);
  return Status::Ok();
}

void gather_rows(uint8_t* contig, const uint8_t* strided, uint64_t lo, uint64_t hi, uint64_t block, uint64_t stride) {
  for (uint64_t p = lo; p < hi;) {
    const uint64_t o = p / block, b = p % block, n = std::min(hi - p, block - b);
    std::memcpy(contig + p, strided + o * stride + b, n);
    p += n;
  }
}

void scatter_rows(uint8_t* strided, const uint8_t* contig, uint64_t lo, uint64_t hi, uint64_t block, uint64_t stride) {
  for (uint64_t p = lo; p < hi;) {
    const uint64_t o = p / block, b = p % block, n = std::min(hi - p, block - b);
    std::memcpy(strided + o * stride + b, contig + p, n);
    p += n;
  }
}

namespace {

template <typename E>
void sum_blocks(const uint8_t* const* parts, int world, uint64_t count, void* out) {
  constexpr uint64_t esize = E::kSize;
  constexpr auto load = E::load;
  constexpr auto store = E::store;
  constexpr uint64_t kBlock = 512;
  float acc[kBlock];
  for (uint64_t base = 0; base < count; base += kBlock) {
    const uint64_t n = count - base < kBlock ? count - base : kBlock;
    // Rank order, from rank 0's element (not from +0.0, which would turn a
    // sum of negative zeros positive): every rank rounds the same way.
    for (uint64_t k = 0; k < n; ++k) acc[k] = load(parts[0] + (base + k) * esize);
    for (int src = 1; src < world; ++src) {
      const uint8_t* p = parts[src] + base * esize;
      for (uint64_t k = 0; k < n; ++k) acc[k] += load(p + k * esize);
    }
    for (uint64_t k = 0; k < n; ++k) store((uint8_t*)out + (base + k) * esize, acc[k]);
  }
}

}  // namespace

void sum_rank_order(DType dtype, const uint8_t* const* parts, int world, uint64_t count, void* out) {
  with_element(dtype, [&](auto e) { sum_blocks<decltype(e)>(parts, world, count, out); });
}

}  // namespace arx::host

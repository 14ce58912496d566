// Adversarial bytes against the tcp carrier's receiving side, seeded and
// bounded in time (a few seconds; more with --iterations):
//  1. frames: check_frame, the receiver's decision on every frame header,
//     against a brute-force reference of what a rank may write; every write
//     the protocol makes (comm/proxy.cc's formulas, over random geometries)
//     passes, and random and boundary headers pass exactly when the
//     reference allows them;
//  2. handshakes: a live listener during and after set-up, fed random
//     bytes, mutated hellos, wrong proofs and all of it split into random
//     pieces; nothing reaches the region, no peer is reported lost, the
//     listener stays up and the real peers still deliver;
//  3. streams: an authenticated peer sending good frames with one mutated
//     frame among them, in random pieces; everything it writes lies in its
//     own slots, everything before the bad frame arrives, nothing after it.
//
// usage: test_tcp_fuzz [--seed N] [--iterations N]
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tcp_rig.h"

using namespace arx;
using namespace arx::tcp_test;

namespace {

using Rng = std::mt19937_64;

uint64_t pick(Rng& rng, uint64_t lo, uint64_t hi) {  // uniform in [lo, hi]
  return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
}

// ---- 1. frames ----

// The reference, written from the layout's documented parts rather than
// from Layout::may_write: the byte ranges and flag words `carrier` may store
// into rank `at`'s region. A source's own parts: its psum slots, LL slots,
// bulk lanes and header slots; its flag words are every word of its psum
// and bulk FlagWords and its notice word. In a ring of 4, prev(at) also carries the
// parts of prev(prev(at)) (the source it relays) and writes at's relay area
// and relay words.
struct Allowed {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // [lo, hi)
  std::vector<uint64_t> flags;
};

void add_source(const Layout& L, int src, Allowed& a) {
  for (int par = 0; par < 2; ++par) {
    a.ranges.push_back({L.recv_offset(par, src), L.recv_offset(par, src) + L.slot_bytes});
    a.ranges.push_back({L.ll_recv_offset(par, src), L.ll_recv_offset(par, src) + kLLSlotBytes});
    if (L.bulk_lane) a.ranges.push_back({L.bulk_recv_offset(par, src), L.bulk_recv_offset(par, src) + L.bulk_lane});
    for (int f = 0; f < kFamilies; ++f) {
      const uint64_t h = L.flag_offset(header_word((Family)f, par, src));
      a.ranges.push_back({h, h + 8 * kDescriptorWords});
    }
  }
  const FlagWords psum = psum_words(L.world, kRoots), bulk = bulk_words(kRoots);
  // A source owns `stride` words whatever its channels use of them (an odd
  // stride leaves one spare).
  for (int i = 0; i < psum.stride; ++i) a.flags.push_back(L.flag_offset(psum.base + src * psum.stride + i));
  for (int r = 0; r < kRoots; ++r)
    for (int c = 0; c < kMaxPieces; ++c) a.flags.push_back(L.flag_offset(bulk.index(src, c, r)));
  a.flags.push_back(L.flag_offset(notice_word(src)));
}

Allowed allowed(const Layout& L, int carrier, int at) {
  Allowed a;
  const int w = L.world;
  const bool ring = L.topo.ring;
  const bool neighbour = !ring || carrier == (at + 1) % w || carrier == (at + w - 1) % w;
  if (carrier != at && neighbour) add_source(L, carrier, a);
  if (ring && w == 4 && carrier == (at + w - 1) % w) {
    add_source(L, (at + w - 2) % w, a);
    a.ranges.push_back({L.relay, L.relay_out});
    for (int r = 0; r < kRoots; ++r) a.flags.push_back(L.flag_offset(relay_word(r)));
  }
  return a;
}

bool ref_write(const Allowed& a, uint64_t off, uint64_t len) {
  if (len == 0) return true;
  for (auto [lo, hi] : a.ranges)
    if (off >= lo && off + len >= off && off + len <= hi) return true;
  return false;
}

bool ref_flag(const Allowed& a, uint64_t flag) {
  if (flag == kNoFlag) return true;
  for (uint64_t f : a.flags)
    if (f == flag) return true;
  return false;
}

// A write the protocol makes from `src` to `at` (comm/proxy.cc's posts,
// comm/relay.cc's relayed puts and records), over random geometries.
FrameHeader protocol_write(const Layout& L, int src, int at, Rng& rng) {
  const int world = L.world;
  const int root = (int)pick(rng, 0, kRoots - 1);
  const int par = (int)pick(rng, 0, 1);
  const FlagWords psum = psum_words(world, kRoots), bulk = bulk_words(kRoots);
  uint64_t lo = 0, hi = 0, off = 0, len = 0, dst = 0, flag = 0;
  // Whose lane: src's own, or (src relaying to at) the relayed source's.
  const int owner =
      L.topo.relays() && src == (at + world - 1) % world && pick(rng, 0, 1) ? (at + world - 2) % world : src;
  switch (pick(rng, 0, L.topo.relays() && owner == src && L.topo.relayed_source(at) == src ? 5 : 3)) {
    case 0: {  // a psum piece (one-shot, or a two-shot chunk)
      const int mode = (int)pick(rng, 1, 2);
      const uint64_t bytes = pick(rng, 0, mode == 2 ? std::min(L.send_bytes, world * L.slot_bytes) : L.slot_bytes);
      hi = bytes;
      if (mode == 2) piece_range(bytes, world, (int)pick(rng, 0, world - 1), lo, hi);
      if (hi - lo > L.slot_bytes) hi = lo + L.slot_bytes;
      root_split(hi - lo, root, kRoots, off, len);
      dst = L.recv_offset(par, owner) + off;
      flag = L.flag_offset(psum.index(owner, (int)pick(rng, 0, psum.pieces - 1), root));
      break;
    }
    case 1: {  // a bulk piece, or the fused combine's rows
      if (!L.bulk_lane) return FrameHeader{kFrameMagic, 0, 0, L.flag_offset(notice_word(owner)), 1};
      const uint64_t lane = pick(rng, 0, L.bulk_lane);
      if (pick(rng, 0, 1)) {
        piece_range(lane, (int)pick(rng, 0, kMaxPieces - 1), lo, hi);
      } else {
        lo = pick(rng, 0, lane);
        hi = pick(rng, lo, lane);
      }
      root_split(hi - lo, root, kRoots, off, len);
      dst = L.bulk_recv_offset(par, owner) + lo + off;
      flag = L.flag_offset(bulk.index(owner, (int)pick(rng, 0, kMaxPieces - 1), root));
      break;
    }
    case 2:  // the exact descriptor, before the flag words, without one
      return FrameHeader{kFrameMagic, L.flag_offset(header_word((Family)pick(rng, 0, 1), par, owner)),
                         8 * kDescriptorWords, kNoFlag, 0};
    case 3:  // a notice
      return FrameHeader{kFrameMagic, L.recv_offset(0, owner), 0, L.flag_offset(notice_word(owner)), 1};
    case 4: {  // to the relay: a staged lane, without a flag
      const Family f = (Family)pick(rng, 0, L.bulk_lane ? 1 : 0);
      const uint64_t n = L.relay_lane_bytes(f), o = pick(rng, 0, n);
      return FrameHeader{kFrameMagic, L.relay_offset(f, par) + o, pick(rng, 0, n - o), kNoFlag, 0};
    }
    default: {  // to the relay: a record and its relay word
      const uint64_t i = pick(rng, 0, 3 * kRing);
      return FrameHeader{kFrameMagic, L.relay_record_offset(root, i), sizeof(RelayRecord),
                         L.flag_offset(relay_word(root)), i + 1};
    }
  }
  return FrameHeader{kFrameMagic, dst, len, flag, pick(rng, 1, ~0ull)};
}

// A header an attacker might send as rank `src`: random, or near a boundary
// of something, with its own flag, another rank's, or any word.
FrameHeader hostile_header(const Layout& L, int world, int src, Rng& rng) {
  const FlagWords psum = psum_words(world, kRoots), bulk = bulk_words(kRoots);
  const uint64_t marks[] = {
      0,
      L.flags,
      L.recv,
      L.send,
      L.bulk_recv,
      L.bulk_recv_offset(1, 0),
      L.bulk_send,
      L.relay,
      L.relay_out,
      L.total,
      L.recv_offset(0, (int)pick(rng, 0, world - 1)),
      L.recv_offset(1, (int)pick(rng, 0, world - 1)),
      L.bulk_recv_offset((int)pick(rng, 0, 1), (int)pick(rng, 0, world - 1)),
      L.flag_offset(header_word((Family)pick(rng, 0, 1), (int)pick(rng, 0, 1), (int)pick(rng, 0, world - 1))),
      ~0ull};
  auto near = [&](uint64_t span) {
    const uint64_t m = marks[pick(rng, 0, sizeof marks / sizeof marks[0] - 1)];
    return m + pick(rng, 0, 2 * span) - span;
  };
  FrameHeader h{kFrameMagic, 0, 0, 0, pick(rng, 0, ~0ull)};
  h.offset = pick(rng, 0, 3) ? near(64) : pick(rng, 0, ~0ull);
  switch (pick(rng, 0, 4)) {
    case 0:
      h.len = 0;
      break;
    case 1:
      h.len = pick(rng, 1, 64);
      break;
    case 2:
      h.len = pick(rng, 1, L.slot_bytes + 64);
      break;
    case 3:
      h.len = ~0ull - pick(rng, 0, 64);
      break;
    default:
      h.len = pick(rng, 0, ~0ull);
      break;
  }
  const int r = (int)pick(rng, 0, kRoots - 1), other = (int)pick(rng, 0, world - 1);
  auto word_of = [&](int who) {
    switch (pick(rng, 0, 3)) {
      case 0:
        return psum.index(who, (int)pick(rng, 0, psum.pieces - 1), r);
      case 1:
        return bulk.index(who, (int)pick(rng, 0, kMaxPieces - 1), r);
      case 2:
        return notice_word(who);
      default:
        return relay_word(r);
    }
  };
  switch (pick(rng, 0, 5)) {
    case 0:
      h.flag_offset = L.flag_offset(word_of(src));
      break;
    case 1:
      h.flag_offset = kNoFlag;
      break;
    case 2:
      h.flag_offset = L.flag_offset(word_of(other));
      break;
    case 3:
      h.flag_offset = L.flag_offset((int)pick(rng, 0, kFlagWords)) + pick(rng, 0, 1) * pick(rng, 0, 7);
      break;
    default:
      h.flag_offset = pick(rng, 0, ~0ull);
      break;
  }
  if (pick(rng, 0, 19) == 0) h.magic = pick(rng, 0, ~0ull);
  if (pick(rng, 0, 19) == 0) h = FrameHeader{kByeMagic, 0, 0, 0, 0};  // a goodbye: no payload, frames may follow
  return h;
}

// Whether the receiver (rank `at`) ends the stream at this header (a goodbye
// it takes).
bool refused(const FrameHeader& h, const Layout& L, int src, int at) {
  return h.magic != kByeMagic && !check_frame(h, L, src, at).empty();
}

void fuzz_frames(Rng& rng, int iterations) {
  const int f0 = g_failures;
  long valid = 0, hostile = 0, accepted = 0;
  for (int it = 0; it < iterations; ++it) {
    const int world = (int)pick(rng, 2, kMaxWorld);
    // Small sizes keep the brute-force reference fast. Multiples of 16, as
    // Config::parse requires (two-shot chunks are 16-byte multiples).
    const uint64_t slot = 16 * pick(rng, 1, 40), send = 16 * pick(rng, 1, 80),
                   bulk = 16 * pick(rng, 0, 1) * pick(rng, 1, 60);
    const bool ring = world <= kMaxRingWorld && pick(rng, 0, 1);
    const Layout L =
        Layout::of(Geometry{(uint32_t)world, slot, send, bulk, ring ? TopologyKind::kRing : TopologyKind::kMesh});
    for (int k = 0; k < 50; ++k) {
      const int src = (int)pick(rng, 0, world - 1);
      const int at = ring && pick(rng, 0, 1) ? (src + 1) % world : (src + (int)pick(rng, 1, world - 1)) % world;
      const Allowed a = allowed(L, src, at);
      if (L.topo.linked(src, at)) {
        const FrameHeader good = protocol_write(L, src, at, rng);
        const std::string why = check_frame(good, L, src, at);
        ++valid;
        CHECK(why.empty() && ref_flag(a, good.flag_offset) && ref_write(a, good.offset, good.len),
              "a protocol write from rank %d to %d (world %d %s, slot %llu, bulk %llu; offset %llu, len %llu, flag "
              "%llu): check_frame says '%s', the reference %s",
              src, at, world, ring ? "ring" : "mesh", (unsigned long long)slot, (unsigned long long)bulk,
              (unsigned long long)good.offset, (unsigned long long)good.len, (unsigned long long)good.flag_offset,
              why.c_str(),
              ref_flag(a, good.flag_offset) && ref_write(a, good.offset, good.len) ? "allows it" : "does not");
        if (!why.empty()) return;
      }
      const FrameHeader bad = hostile_header(L, world, src, rng);
      const bool ok = check_frame(bad, L, src, at).empty();
      const bool want = bad.magic == kFrameMagic && ref_flag(a, bad.flag_offset) && ref_write(a, bad.offset, bad.len);
      ++hostile;
      accepted += ok;
      CHECK(ok == want,
            "rank %d to %d of %d %s, slot %llu, bulk %llu: header (offset %llu, len %llu, flag %llu) %s, "
            "the reference says %s",
            src, at, world, ring ? "ring" : "mesh", (unsigned long long)slot, (unsigned long long)bulk,
            (unsigned long long)bad.offset, (unsigned long long)bad.len, (unsigned long long)bad.flag_offset,
            ok ? "accepted" : "refused", want ? "allowed" : "not allowed");
      if (ok != want) return;
    }
  }
  printf(
      "%s frames: %ld protocol writes all accepted; %ld hostile headers, %ld accepted, each exactly as the "
      "brute-force reference says\n",
      verdict(f0), valid, hostile, accepted);
}

// ---- 2. handshakes ----

// Sends `bytes` in random pieces.
void send_in_pieces(int fd, const std::vector<uint8_t>& bytes, Rng& rng) {
  size_t at = 0;
  while (at < bytes.size()) {
    const size_t n = std::min<size_t>(bytes.size() - at, pick(rng, 1, 97));
    raw_send(fd, bytes.data() + at, n);
    at += n;
  }
}

std::vector<uint8_t> random_bytes(Rng& rng, size_t n) {
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = (uint8_t)rng();
  return v;
}

void mutate(std::vector<uint8_t>& v, Rng& rng) {
  const int n = (int)pick(rng, 1, 4);
  for (int i = 0; i < n && !v.empty(); ++i) {
    switch (pick(rng, 0, 2)) {
      case 0:
        v[pick(rng, 0, v.size() - 1)] ^= (uint8_t)(1u << pick(rng, 0, 7));
        break;
      case 1:
        v[pick(rng, 0, v.size() - 1)] = (uint8_t)rng();
        break;
      default:
        v.resize(pick(rng, 0, v.size()));
        break;  // cut short
    }
  }
}

void fuzz_handshakes(Rng& rng, int iterations) {
  const int f0 = g_failures;
  World w;
  if (!make_world(w, 3, 4096, 4096, /*make=*/1, {}, "", 8192)) return;
  Rank& me = w[0];
  const Layout& L = me.layout;
  memset(me.base(), 0x77, L.total);
  const std::vector<uint8_t> before(me.base(), me.base() + L.total);
  const int port = port_of(w.details[0]);
  const crypto::Digest view = tcp_auth::view_of(w.details);
  // Half the streams come while rank 0 is in set-up, half after.
  Status connected;
  std::thread setup([&] { connected = me.t->connect(w.details, 60); });
  std::vector<std::vector<int>> in;
  long closed = 0, left_open = 0;
  const auto t0 = Clock::now();
  for (int it = 0; it < iterations; ++it) {
    if (it == iterations / 2) {  // the real peers get in mid-way
      in.assign(3, std::vector<int>(kRoots, -1));
      for (int r = 1; r < 3; ++r)
        for (int root = 0; root < kRoots; ++root) in[r][root] = w.fake(r).dial(port, 0, root);
      setup.join();
      CHECK(connected.ok(), "set-up amid the fuzz: %s", connected.message().c_str());
    }
    std::vector<uint8_t> bytes;
    Hello h;
    tcp_auth::make_hello(3, (int)pick(rng, 0, 3), (int)pick(rng, 0, 2), view, h);
    const uint8_t* hb = reinterpret_cast<const uint8_t*>(&h);
    switch (pick(rng, 0, 4)) {
      case 0:
        bytes = random_bytes(rng, pick(rng, 0, 300));
        break;
      case 1:  // a mutated hello, then noise
        bytes.assign(hb, hb + sizeof h);
        mutate(bytes, rng);
        if (pick(rng, 0, 1)) {
          const auto noise = random_bytes(rng, pick(rng, 0, 200));
          bytes.insert(bytes.end(), noise.begin(), noise.end());
        }
        break;
      case 2: {  // a good hello, then a random "proof" and frames
        bytes.assign(hb, hb + sizeof h);
        const auto noise = random_bytes(rng, pick(rng, 1, 300));
        bytes.insert(bytes.end(), noise.begin(), noise.end());
        break;
      }
      case 3: {  // a good hello and a proof-shaped answer with the right magic
        bytes.assign(hb, hb + sizeof h);
        Proof p{kProofMagic, {}};
        const auto mac = random_bytes(rng, sizeof p.mac);
        memcpy(p.mac, mac.data(), sizeof p.mac);
        const uint8_t* pb = reinterpret_cast<const uint8_t*>(&p);
        bytes.insert(bytes.end(), pb, pb + sizeof p);
        break;
      }
      default: {  // frames first, as if authenticated
        FrameHeader f{kFrameMagic, L.recv_offset(0, 1), 64, L.flag_offset(flag_index(1, 0)), 99};
        const uint8_t* fb = reinterpret_cast<const uint8_t*>(&f);
        for (int k = 0; k < 3; ++k) bytes.insert(bytes.end(), fb, fb + sizeof f);
        mutate(bytes, rng);
        break;
      }
    }
    const int fd = raw_connect(port);
    CHECK(fd >= 0, "iteration %d: the listener is gone", it);
    if (fd < 0) break;
    send_in_pieces(fd, bytes, rng);
    // A whole message gets an answer and a close; a cut-short one waits for
    // more, until we close (or the listener's deadline).
    shutdown(fd, SHUT_WR);
    if (read_until_closed(fd, 10) >= 0)
      ++closed;
    else
      ++left_open;
    close(fd);
  }
  if (setup.joinable()) setup.join();
  CHECK(left_open == 0, "%ld streams were left open after their sender finished", left_open);
  uint64_t changed = 0;
  for (uint64_t i = 0; i < L.total; ++i) changed += me.base()[i] != before[i];
  CHECK(changed == 0, "the fuzz changed %llu bytes of the region", (unsigned long long)changed);
  CHECK(me.lost_count() == 0, "strangers are not peers, yet on_peer_lost fired: %s", me.lost_text().c_str());
  // The real peers still deliver.
  for (int r = 1; r < 3; ++r) {
    FrameHeader f{kFrameMagic, L.recv_offset(1, r), 16, L.flag_offset(flag_index(r, 1)), 4242};
    std::vector<uint8_t> payload(16, (uint8_t)r);
    raw_send(in[r][1], &f, sizeof f);
    raw_send(in[r][1], payload.data(), payload.size());
    CHECK(wait_flag(me.base(), L.flag_offset(flag_index(r, 1)), 4242) &&
              memcmp(me.base() + L.recv_offset(1, r), payload.data(), 16) == 0,
          "rank %d's genuine stream does not deliver after the fuzz", r);
  }
  printf(
      "%s handshakes: %d hostile streams (%ld closed by the listener) in %.1f s, nothing written, no peer lost, "
      "the real peers deliver\n",
      verdict(f0), iterations, closed, since(t0));
}

// ---- 3. streams of an authenticated peer ----

void fuzz_streams(Rng& rng, int iterations) {
  const int f0 = g_failures;
  long frames = 0, ended = 0;
  const auto t0 = Clock::now();
  for (int it = 0; it < iterations; ++it) {
    World w;
    if (!make_world(w, 2, 512, 1024, /*make=*/1, {}, "", 2048)) return;
    std::vector<std::vector<int>> in;
    if (!connect_with_fakes(w, in).ok()) {
      CHECK(false, "iteration %d: connect", it);
      return;
    }
    Rank& me = w[0];
    const Layout& L = me.layout;
    memset(me.base(), 0x33, L.total);
    const std::vector<uint8_t> before(me.base(), me.base() + L.total);
    const Allowed mine = allowed(L, 1, 0);
    // Good frames, each with its own flag value so arrival can be checked,
    // and maybe one hostile frame among them (after it, nothing counts).
    const int n = (int)pick(rng, 1, 12), bad_at = pick(rng, 0, 3) ? (int)pick(rng, 0, n - 1) : -1;
    std::vector<uint8_t> bytes;
    std::vector<FrameHeader> sent;
    for (int k = 0; k < n; ++k) {
      FrameHeader h = k == bad_at ? hostile_header(L, 2, 1, rng) : protocol_write(L, 1, 0, rng);
      if (k != bad_at) h.flag_value = ((uint64_t)it << 32) + (uint64_t)k + 1;
      const uint8_t* hb = reinterpret_cast<const uint8_t*>(&h);
      bytes.insert(bytes.end(), hb, hb + sizeof h);
      const auto payload = random_bytes(rng, (size_t)std::min<uint64_t>(h.len, 4096));
      bytes.insert(bytes.end(), payload.begin(), payload.end());
      sent.push_back(h);
    }
    const int root = (int)pick(rng, 0, 1);
    send_in_pieces(in[1][root], bytes, rng);
    const bool bad_refused = bad_at >= 0 && refused(sent[bad_at], L, 1, 0);
    // Everything before the first refused frame lands; its last flag says so.
    int last_good = -1;
    for (int k = 0; k < n; ++k) {
      if (refused(sent[k], L, 1, 0)) break;
      if (sent[k].magic == kFrameMagic && sent[k].flag_offset != kNoFlag) last_good = k;
    }
    if (bad_refused) {
      ++ended;
      CHECK(me.wait_lost(1), "iteration %d: a refused frame was not reported", it);
    } else if (last_good >= 0 && bad_at < 0) {
      const FrameHeader& g = sent[last_good];
      CHECK(wait_flag(me.base(), g.flag_offset, g.flag_value), "iteration %d: the last good frame did not arrive", it);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    me.t->close();
    frames += n;
    for (uint64_t i = 0; i < L.total; ++i) {
      if (me.base()[i] == before[i]) continue;
      bool allowed = false;
      for (int k = 0; k < n && !allowed; ++k) {
        const FrameHeader& h = sent[k];
        if (refused(h, L, 1, 0)) break;  // nothing after a refused frame is read
        if (h.magic != kFrameMagic) continue;
        allowed = (i >= h.offset && i < h.offset + h.len) || (i >= h.flag_offset && i < h.flag_offset + 8);
      }
      CHECK(allowed && (ref_write(mine, i, 1) || ref_flag(mine, i & ~7ull)),
            "iteration %d: byte %llu changed, outside what rank 1 may write", it, (unsigned long long)i);
      if (!allowed) break;
    }
  }
  printf(
      "%s streams: %d authenticated streams, %ld frames in random pieces, %ld streams ended by a refused frame, "
      "every change inside the sender's own slots, %.1f s\n",
      verdict(f0), iterations, frames, ended, since(t0));
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  uint64_t seed = 20240612;
  int iterations = 300;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--seed"))
      seed = strtoull(argv[i + 1], nullptr, 10);
    else if (!strcmp(argv[i], "--iterations"))
      iterations = atoi(argv[i + 1]);
  }
  printf("test_tcp_fuzz: seed %llu, %d iterations\n", (unsigned long long)seed, iterations);
  const auto t0 = Clock::now();
  Rng rng(seed);
  fuzz_frames(rng, iterations * 10);
  fuzz_handshakes(rng, iterations);
  fuzz_streams(rng, iterations / 5);
  if (g_failures) {
    fprintf(stderr, "test_tcp_fuzz: %d check(s) FAILED (seed %llu)\n", g_failures, (unsigned long long)seed);
    return 1;
  }
  printf("test_tcp_fuzz: all passed in %.1f s\n", since(t0));
  return 0;
}

// The layout's promises (base/layout.h): the buffers do not overlap, each
// peer may write only its own slots and flag words, this rank's own areas
// are nobody else's, and the pieces of a payload tile it. And the channel's
// numbering of a collective's triggers (comm/channel.h, trigger_index):
// every index of the collective once, piece-major, destinations in send
// order, which is the order the proxy takes them in.
#include <cstdio>
#include <vector>

#include "base/layout.h"
#include "comm/channel.h"
#include "rig.h"

using namespace arx;

int main() {
  for (uint32_t world : {2u, 3u, 8u}) {
    const Layout l = Layout::of(Geometry{world, 1 << 20, 4 << 20, 32 << 20});
    EXPECT(l.flags >= l.control + sizeof(Control) && l.recv >= l.flags + 8 * kFlagWords &&
               l.ll_recv >= l.recv + 2 * world * l.slot_bytes && l.send >= l.ll_recv + 2 * world * kLLSlotBytes &&
               l.ring >= l.send + 2 * l.send_bytes && l.bulk_recv >= l.ring + kRing * sizeof(Trigger) &&
               l.bulk_send >= l.bulk_recv + 2 * world * l.bulk_lane && l.total >= l.bulk_send + 2 * world * l.bulk_lane,
           "world %u: the areas follow each other without overlap", world);
    EXPECT(l.inbox_lo() == l.flags && l.inbox_hi() == l.ll_recv + 2 * world * kLLSlotBytes,
           "world %u: the flag page, the psum slots and the LL slots are one window", world);
    EXPECT(
        l.bulk_lane * world >= (32u << 20) && l.bulk_lane % 16 == 0 && l.bulk_lane * world < (32u << 20) + 16 * world,
        "world %u: bulk lanes hold a world-th of the bulk bytes each, 16-aligned", world);
    for (int src = 0; src < (int)world; ++src) {
      const int other = (src + 1) % world;
      for (int p = 0; p < 2; ++p) {
        EXPECT(l.src_may_write(src, l.recv_offset(p, src), l.slot_bytes), "its psum slot");
        EXPECT(!l.src_may_write(src, l.recv_offset(p, src), l.slot_bytes + 1), "but not past it");
        EXPECT(!l.src_may_write(src, l.recv_offset(p, other), 1), "not another's psum slot");
        EXPECT(l.src_may_write(src, l.bulk_recv_offset(p, src), l.bulk_lane), "its bulk lane");
        EXPECT(!l.src_may_write(src, l.bulk_recv_offset(p, other), 16), "not another's bulk lane");
        EXPECT(!l.src_may_write(src, l.bulk_recv_offset(p, src) + l.bulk_lane - 8, 16), "no write straddles lanes");
        EXPECT(l.src_may_write(src, l.ll_recv_offset(p, src), kLLSlotBytes), "its LL slot");
        EXPECT(!l.src_may_write(src, l.ll_recv_offset(p, src), kLLSlotBytes + 1), "but not past it");
        EXPECT(!l.src_may_write(src, l.ll_recv_offset(p, other), 16), "not another's LL slot");
      }
      EXPECT(!l.src_may_write(src, l.control, 8) && !l.src_may_write(src, l.send, 1) &&
                 !l.src_may_write(src, l.ring, 8) && !l.src_may_write(src, l.bulk_send, 16) &&
                 !l.src_may_write(src, l.flags, 8),
             "this rank's own areas are not a peer's to write");
      for (int roots : {1, 2}) {
        const FlagWords pw = psum_words((int)world, roots), bw = bulk_words(roots);
        EXPECT(pw.pieces >= 1, "psum pieces per source");
        for (int piece : {0, pw.pieces - 1})
          for (int r = 0; r < roots; ++r) {
            EXPECT(l.src_may_flag(src, l.flag_offset(pw.index(src, piece, r))), "its psum words");
            EXPECT(!l.src_may_flag(other, l.flag_offset(pw.index(src, piece, r))), "not another's psum words");
          }
        for (int r = 0; r < roots; ++r) {
          EXPECT(l.src_may_flag(src, l.flag_offset(bw.index(src, kMaxPieces - 1, r))), "its bulk words");
          EXPECT(!l.src_may_flag(other, l.flag_offset(bw.index(src, 0, r))), "not another's bulk words");
        }
      }
      EXPECT(!l.src_may_flag(src, l.handshake_offset(src)) &&
                 !l.src_may_flag(src, l.flag_offset(heard_word(Family::kPsum, src))) &&
                 !l.src_may_flag(src, l.flag_offset(kPeerMemoryOfferWord)) &&
                 !l.src_may_flag(src, l.flag_offset(0) + 4),
             "the handshake, heard and peer-memory words, and unaligned offsets, are no carrier's to write");
      EXPECT(l.src_may_flag(src, l.flag_offset(notice_word(src))) &&
                 !l.src_may_flag(other, l.flag_offset(notice_word(src))),
             "a source's notice word is its own");
      for (int f = 0; f < kFamilies; ++f)
        for (int p = 0; p < 2; ++p) {
          const uint64_t h = l.flag_offset(header_word((Family)f, p, src));
          EXPECT(l.src_may_write(src, h, 8 * kDescriptorWords) && !l.src_may_write(other, h, 8) &&
                     !l.src_may_write(src, h, 8 * kDescriptorWords + 8) && !l.src_may_flag(src, h),
                 "its header slots are its own to write as data, not as flag words");
        }
    }
  }
  // piece_range tiles the bytes in 16-aligned pieces, none longer than
  // bytes / n + 16 (what a bulk lane's piece slots hold, cuda/launch.cc);
  // without n it is kMaxPieces pieces.
  for (uint64_t bytes : {0ull, 1ull, 15ull, 100ull, 129ull, 130ull, 1000003ull}) {
    for (int n : {1, 3, kMaxPieces, 64}) {
      uint64_t covered = 0;
      for (int c = 0; c < n; ++c) {
        uint64_t lo, hi;
        piece_range(bytes, n, c, lo, hi);
        EXPECT(lo == covered && hi >= lo && (lo % 16 == 0 || lo == bytes) && hi - lo <= bytes / n + 16,
               "pieces tile %llu bytes in %d", (unsigned long long)bytes, n);
        if (n == kMaxPieces) {
          uint64_t lo8, hi8;
          piece_range(bytes, c, lo8, hi8);
          EXPECT(lo8 == lo && hi8 == hi, "piece_range without n is kMaxPieces pieces");
        }
        covered = hi;
      }
      EXPECT(covered == bytes, "the last piece ends %llu bytes in %d", (unsigned long long)bytes, n);
    }
  }
  for (int world = 2; world <= kMaxWorld; ++world)
    for (int rank = 0; rank < world; ++rank) {
      for (int pieces : {1, kMaxPieces}) {
        std::vector<int> hit(pieces * (world - 1), 0);
        uint64_t expect = 0;
        for (int p = 0; p < pieces; ++p)
          for (int step = 1; step < world; ++step) {
            const uint64_t at = trigger_index(Fan::kEachPeer, rank, world, p, (uint64_t)((rank + step) % world));
            EXPECT(at == expect++, "rank %d of %d: piece %d to rank + %d at %llu", rank, world, p, step,
                   (unsigned long long)at);
            if (at < hit.size()) ++hit[at];
          }
        for (int h : hit) EXPECT(h == 1, "rank %d of %d: each index once", rank, world);
        for (int p = 0; p < pieces; ++p)
          EXPECT(trigger_index(Fan::kEveryPeer, rank, world, p, kEveryPeer) == (uint64_t)p, "one entry a piece");
      }
    }
  printf("%s\n", testing::g_failures ? "FAILED" : "layout: ok");
  return testing::g_failures ? 1 : 0;
}

// The tcp carrier's wire format, shared by the carrier (tcp.cc) and the
// tests that speak it by hand as a stranger or a faulty peer would.
#pragma once

#include <cstddef>
#include <cstdint>

namespace arx::tcp_wire {

// Wire format. Words travel in host order: every supported host (x86-64,
// aarch64) is little-endian, and a byte-swapped peer fails the magic check.
constexpr uint64_t kHelloMagic = 0x4f4c4c4548585241ull;  // "ARXHELLO"
constexpr uint64_t kFrameMagic = 0x454d415246585241ull;  // "ARXFRAME"
constexpr uint64_t kByeMagic = 0x0000455942585241ull;    // "ARXBYE": a deliberate close follows
constexpr uint64_t kAckMagic = 0x00004b4341585241ull;    // "ARXACK": the hello was accepted
constexpr uint32_t kWireVersion = 1;
constexpr size_t kMaxSecret = 64;
constexpr const char* kDetailsTag = "arx-tcp/1";

struct Hello {
  uint64_t magic;
  uint32_t version;
  int32_t world, rank, root;
  uint32_t secret_len;
  uint32_t reserved;
  uint8_t secret[kMaxSecret];  // zero-padded past secret_len
};
static_assert(sizeof(Hello) == 96, "Hello is read by the peer as raw bytes: keep its layout fixed");

struct FrameHeader {
  uint64_t magic;  // kFrameMagic, or kByeMagic (other fields zero)
  uint64_t offset, len, flag_offset, flag_value;
};
static_assert(sizeof(FrameHeader) == 40, "FrameHeader is read by the peer as raw bytes: keep its layout fixed");

}  // namespace arx::tcp_wire

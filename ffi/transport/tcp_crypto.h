// The few primitives the tcp carrier's handshake needs, self-contained so
// that the core depends on no crypto library: SHA-256 (FIPS 180-4),
// HMAC-SHA256 (RFC 2104) and X25519 (RFC 7748), plus the kernel's random
// bytes. They run at set-up only (a key pair per carrier, one
// Diffie-Hellman and a few MACs per link), never on the data path, so they
// are written for clarity and constant time, not speed. Tested against the
// RFCs' vectors (tests/cpp/test_tcp_auth.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace arx::crypto {

constexpr size_t kHashBytes = 32;  // SHA-256 and HMAC-SHA256 output
constexpr size_t kKeyBytes = 32;   // X25519 scalars and points

struct Digest {
  uint8_t b[kHashBytes];
};

// Incremental SHA-256.
class Sha256 {
 public:
  Sha256();
  Sha256& update(const void* data, size_t len);
  Sha256& update(const std::string& s) { return update(s.data(), s.size()); }
  // A length-prefixed field (u32 length, then the bytes): concatenated
  // fields then cannot be re-split into other fields with the same hash input.
  Sha256& field(const void* data, size_t len);
  Sha256& field(const std::string& s) { return field(s.data(), s.size()); }
  Digest final();

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t used_ = 0;
  uint64_t total_ = 0;
};

Digest sha256(const void* data, size_t len);

// HMAC-SHA256 of the concatenation of the parts, under `key` (any length).
class Hmac {
 public:
  Hmac(const void* key, size_t key_len);
  Hmac& update(const void* data, size_t len) {
    inner_.update(data, len);
    return *this;
  }
  Hmac& field(const void* data, size_t len) {
    inner_.field(data, len);
    return *this;
  }
  Hmac& field(const std::string& s) { return field(s.data(), s.size()); }
  Digest final();

 private:
  Sha256 inner_;
  uint8_t opad_[64];
};

// X25519(scalar, u): the u-coordinate of scalar * u on Curve25519, with the
// scalar clamped as RFC 7748 section 5 says. Returns false when the result
// is all zeros (u of small order): such a "shared secret" is known to
// anyone, so the caller must refuse the peer's key.
bool x25519(uint8_t out[kKeyBytes], const uint8_t scalar[kKeyBytes], const uint8_t u[kKeyBytes]);
// The public key of `priv`: X25519(priv, 9).
void x25519_base(uint8_t pub[kKeyBytes], const uint8_t priv[kKeyBytes]);

// Fills buf with bytes from the kernel's CSPRNG (getrandom). False if the
// kernel refused (then nothing secret may be made from buf).
bool random_bytes(void* buf, size_t len);

// Compares in time that depends only on len, not on where a and b differ.
bool equal_ct(const void* a, const void* b, size_t len);

std::string to_hex(const void* data, size_t len);
// Parses exactly 2 * len hex digits into out; false on anything else.
bool from_hex(const std::string& hex, void* out, size_t len);

}  // namespace arx::crypto

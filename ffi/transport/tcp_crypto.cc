#include "transport/tcp_crypto.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace arx::crypto {

// ---- SHA-256 (FIPS 180-4) ----

namespace {

constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

}  // namespace

Sha256::Sha256() : h_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19} {}

void Sha256::block(const uint8_t* p) {
  uint32_t w[64];
  for (int i = 0; i < 16; ++i)
    w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
  for (int i = 16; i < 64; ++i) {
    const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
    const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
    w[i] = w[i - 16] + s0 + w[i - 7] + s1;
  }
  uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
  for (int i = 0; i < 64; ++i) {
    const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[i] + w[i];
    const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h_[0] += a, h_[1] += b, h_[2] += c, h_[3] += d, h_[4] += e, h_[5] += f, h_[6] += g, h_[7] += h;
}

Sha256& Sha256::update(const void* data, size_t len) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  total_ += len;
  while (len > 0) {
    const size_t take = std::min(len, sizeof buf_ - used_);
    memcpy(buf_ + used_, p, take);
    used_ += take;
    p += take;
    len -= take;
    if (used_ == sizeof buf_) {
      block(buf_);
      used_ = 0;
    }
  }
  return *this;
}

Sha256& Sha256::field(const void* data, size_t len) {
  const uint8_t n[4] = {(uint8_t)len, (uint8_t)(len >> 8), (uint8_t)(len >> 16), (uint8_t)(len >> 24)};
  update(n, sizeof n);
  return update(data, len);
}

Digest Sha256::final() {
  const uint64_t bits = total_ * 8;
  const uint8_t one = 0x80, zero = 0;
  update(&one, 1);
  while (used_ != 56) update(&zero, 1);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = (uint8_t)(bits >> (56 - 8 * i));
  update(len, 8);
  Digest d;
  for (int i = 0; i < 8; ++i)
    for (int k = 0; k < 4; ++k) d.b[4 * i + k] = (uint8_t)(h_[i] >> (24 - 8 * k));
  return d;
}

Digest sha256(const void* data, size_t len) { return Sha256().update(data, len).final(); }

// ---- HMAC-SHA256 (RFC 2104) ----

Hmac::Hmac(const void* key, size_t key_len) {
  uint8_t k[64] = {};
  if (key_len > sizeof k) {
    const Digest d = sha256(key, key_len);
    memcpy(k, d.b, sizeof d.b);
  } else if (key_len) {
    memcpy(k, key, key_len);
  }
  uint8_t ipad[64];
  for (int i = 0; i < 64; ++i) {
    ipad[i] = k[i] ^ 0x36;
    opad_[i] = k[i] ^ 0x5c;
  }
  inner_.update(ipad, sizeof ipad);
}

Digest Hmac::final() {
  const Digest in = inner_.final();
  return Sha256().update(opad_, sizeof opad_).update(in.b, sizeof in.b).final();
}

// ---- X25519 (RFC 7748), after TweetNaCl's field arithmetic ----
//
// A field element of GF(2^255 - 19) is 16 limbs of 16 bits held in int64s
// (limbs may run over 16 bits between carries). Every operation below runs
// the same instructions whatever the values: the ladder swaps with masks,
// never with branches on secret bits.

namespace {

using Fe = int64_t[16];

void carry(Fe o) {
  for (int i = 0; i < 16; ++i) {
    o[i] += (int64_t)1 << 16;
    const int64_t c = o[i] >> 16;
    // Limb 15 carries into limb 0 times 38 (2^256 = 38 mod p), less the
    // bias of 1 << 16 added above.
    o[(i + 1) * (i < 15)] += c - 1 + 37 * (c - 1) * (i == 15);
    o[i] -= c * ((int64_t)1 << 16);
  }
}

// Swaps p and q when bit is 1, without a branch.
void swap_if(Fe p, Fe q, int64_t bit) {
  const int64_t mask = ~(bit - 1);
  for (int i = 0; i < 16; ++i) {
    const int64_t t = mask & (p[i] ^ q[i]);
    p[i] ^= t;
    q[i] ^= t;
  }
}

void pack(uint8_t out[32], const Fe n) {
  Fe t, m;
  for (int i = 0; i < 16; ++i) t[i] = n[i];
  carry(t);
  carry(t);
  carry(t);
  // Subtract p twice, keeping the result whenever it does not go negative.
  for (int j = 0; j < 2; ++j) {
    m[0] = t[0] - 0xffed;
    for (int i = 1; i < 15; ++i) {
      m[i] = t[i] - 0xffff - ((m[i - 1] >> 16) & 1);
      m[i - 1] &= 0xffff;
    }
    m[15] = t[15] - 0x7fff - ((m[14] >> 16) & 1);
    const int64_t borrow = (m[15] >> 16) & 1;
    m[14] &= 0xffff;
    swap_if(t, m, 1 - borrow);
  }
  for (int i = 0; i < 16; ++i) {
    out[2 * i] = (uint8_t)(t[i] & 0xff);
    out[2 * i + 1] = (uint8_t)(t[i] >> 8);
  }
}

void unpack(Fe o, const uint8_t in[32]) {
  for (int i = 0; i < 16; ++i) o[i] = in[2 * i] + ((int64_t)in[2 * i + 1] << 8);
  o[15] &= 0x7fff;  // RFC 7748: the top bit of u is ignored
}

void add(Fe o, const Fe a, const Fe b) {
  for (int i = 0; i < 16; ++i) o[i] = a[i] + b[i];
}

void sub(Fe o, const Fe a, const Fe b) {
  for (int i = 0; i < 16; ++i) o[i] = a[i] - b[i];
}

void mul(Fe o, const Fe a, const Fe b) {
  int64_t t[31] = {};
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) t[i + j] += a[i] * b[j];
  for (int i = 0; i < 15; ++i) t[i] += 38 * t[i + 16];
  for (int i = 0; i < 16; ++i) o[i] = t[i];
  carry(o);
  carry(o);
}

// o = i^(p - 2) = 1 / i.
void invert(Fe o, const Fe in) {
  Fe c;
  for (int i = 0; i < 16; ++i) c[i] = in[i];
  for (int a = 253; a >= 0; --a) {
    mul(c, c, c);
    if (a != 2 && a != 4) mul(c, c, in);
  }
  for (int i = 0; i < 16; ++i) o[i] = c[i];
}

void scalarmult(uint8_t q[32], const uint8_t n[32], const uint8_t p[32]) {
  static const Fe k121665 = {0xDB41, 1};  // (486662 - 2) / 4
  uint8_t z[32];
  memcpy(z, n, 32);
  z[31] = (uint8_t)((n[31] & 127) | 64);
  z[0] &= 248;
  Fe x, a = {1}, b, c = {}, d = {1}, e, f;
  unpack(x, p);
  for (int i = 0; i < 16; ++i) b[i] = x[i];
  // The Montgomery ladder (RFC 7748 section 5), one step per scalar bit.
  for (int i = 254; i >= 0; --i) {
    const int64_t bit = (z[i >> 3] >> (i & 7)) & 1;
    swap_if(a, b, bit);
    swap_if(c, d, bit);
    add(e, a, c);
    sub(a, a, c);
    add(c, b, d);
    sub(b, b, d);
    mul(d, e, e);
    mul(f, a, a);
    mul(a, c, a);
    mul(c, b, e);
    add(e, a, c);
    sub(a, a, c);
    mul(b, a, a);
    sub(c, d, f);
    mul(a, c, k121665);
    add(a, a, d);
    mul(c, c, a);
    mul(a, d, f);
    mul(d, b, x);
    mul(b, e, e);
    swap_if(a, b, bit);
    swap_if(c, d, bit);
  }
  invert(c, c);
  mul(a, a, c);
  pack(q, a);
  memset(z, 0, sizeof z);
}

}  // namespace

bool x25519(uint8_t out[kKeyBytes], const uint8_t scalar[kKeyBytes], const uint8_t u[kKeyBytes]) {
  scalarmult(out, scalar, u);
  uint8_t any = 0;
  for (size_t i = 0; i < kKeyBytes; ++i) any |= out[i];
  return any != 0;
}

void x25519_base(uint8_t pub[kKeyBytes], const uint8_t priv[kKeyBytes]) {
  static const uint8_t nine[32] = {9};
  scalarmult(pub, priv, nine);
}

// ---- helpers ----

bool random_bytes(void* buf, size_t len) {
  uint8_t* p = static_cast<uint8_t*>(buf);
  while (len > 0) {
    const ssize_t r = getrandom(p, len, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += r;
    len -= (size_t)r;
  }
  return true;
}

bool equal_ct(const void* a, const void* b, size_t len) {
  const uint8_t* x = static_cast<const uint8_t*>(a);
  const uint8_t* y = static_cast<const uint8_t*>(b);
  uint8_t diff = 0;
  for (size_t i = 0; i < len; ++i) diff |= x[i] ^ y[i];
  return diff == 0;
}

std::string to_hex(const void* data, size_t len) {
  static const char digits[] = "0123456789abcdef";
  const uint8_t* p = static_cast<const uint8_t*>(data);
  std::string s(2 * len, '0');
  for (size_t i = 0; i < len; ++i) {
    s[2 * i] = digits[p[i] >> 4];
    s[2 * i + 1] = digits[p[i] & 15];
  }
  return s;
}

bool from_hex(const std::string& hex, void* out, size_t len) {
  if (hex.size() != 2 * len) return false;
  uint8_t* o = static_cast<uint8_t*>(out);
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < len; ++i) {
    const int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    o[i] = (uint8_t)(hi << 4 | lo);
  }
  return true;
}

}  // namespace arx::crypto

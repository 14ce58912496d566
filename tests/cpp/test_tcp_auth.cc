// Who may open a tcp stream into an endpoint (transport/tcp_auth.h):
//  - the primitives against their RFCs' vectors (SHA-256, HMAC-SHA256, X25519);
//  - the handshake's messages: a round trip passes, and any changed bit,
//    wrong key or reflected MAC fails;
//  - strangers during set-up, holding everything the rendezvous store
//    shows (every rank's details, and the shared secret when no
//    JAX_ARX_SECRET is set): each is refused with its reason, writes
//    nothing, and the real peers still connect;
//  - someone who rewrote a rank's details in the store: the ranks whose
//    views differ fail set-up and say why; with JAX_ARX_SECRET even the
//    rank that saw only forged details fails;
//  - a second holder of a rank's key: refused, and the rank that holds
//    two is told (set-up fails, or the peer is reported lost);
//  - crowds of silent and of stalled connections before and during set-up
//    cannot keep the real peers out.
// Returns non-zero on failure. usage: test_tcp_auth [--quick]
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tcp_rig.h"
#include "transport/tcp_carrier.h"
#include "transport/tcp_crypto.h"

using namespace arx;
using namespace arx::tcp_test;

namespace {

std::string hex_of(const crypto::Digest& d) { return crypto::to_hex(d.b, sizeof d.b); }

std::string x25519_hex(const std::string& scalar, const std::string& u) {
  uint8_t s[32], p[32], o[32];
  crypto::from_hex(scalar, s, 32);
  crypto::from_hex(u, p, 32);
  crypto::x25519(o, s, p);
  return crypto::to_hex(o, 32);
}

// ---- the primitives ----

void test_vectors(bool quick) {
  const int f0 = g_failures;
  struct {
    std::string in, want;
  } sha[] = {
      {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
      {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
      {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
       "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
      {std::string(1000000, 'a'), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"},
  };
  for (auto& v : sha)
    CHECK(hex_of(crypto::sha256(v.in.data(), v.in.size())) == v.want, "SHA-256 of %zu bytes", v.in.size());
  // The same input fed in uneven pieces.
  crypto::Sha256 pieces;
  const std::string m = sha[2].in;
  for (size_t i = 0; i < m.size(); i += 7) pieces.update(m.data() + i, std::min<size_t>(7, m.size() - i));
  CHECK(hex_of(pieces.final()) == sha[2].want, "SHA-256 fed in pieces");

  // RFC 4231 test cases 1, 2 and 6 (a key longer than a block).
  struct {
    std::string key, data, want;
  } mac[] = {
      {std::string(20, '\x0b'), "Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"},
      {"Jefe", "what do ya want for nothing?", "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"},
      {std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First",
       "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"},
  };
  for (auto& v : mac)
    CHECK(hex_of(crypto::Hmac(v.key.data(), v.key.size()).update(v.data.data(), v.data.size()).final()) == v.want,
          "HMAC-SHA256 with a %zu-byte key", v.key.size());

  // RFC 7748 section 5.2.
  CHECK(x25519_hex("a546e36bf0527c9d3b16154b82465edd62144c0ac1fc5a18506a2244ba449ac4",
                   "e6db6867583030db3594c1a424b15f7c726624ec26b3353b10a903a6d0ab1c4c") ==
            "c3da55379de9c6908e94ea4df28d084f32eccf03491c71f754b4075577a28552",
        "X25519 vector 1");
  CHECK(x25519_hex("4b66e9d4d1b4673c5ad22691957d6af5c11b6421e0ea01d42ca4169e7918ba0d",
                   "e5210f12786811d3f4b7959d0538ae2c31dbe7106fc03c3efc4cd549c715a493") ==
            "95cbde9476e8907d7aade45cb4b873f88b595a68799fa152e6f8f7647aac7957",
        "X25519 vector 2 (u with its top bit set)");
  // Section 5.2's iteration: k, u = X25519(k, u), k (--quick: once, for sanitizer builds).
  uint8_t k[32] = {9}, u[32] = {9}, r[32];
  for (int i = 1; i <= (quick ? 1 : 1000); ++i) {
    crypto::x25519(r, k, u);
    memcpy(u, k, 32);
    memcpy(k, r, 32);
    if (i == 1)
      CHECK(crypto::to_hex(k, 32) == "422c8e7a6227d7bca1350b3e2bb7279f7897b87bb6854b783c60e80311ae3079",
            "X25519 after one iteration");
  }
  if (!quick)
    CHECK(crypto::to_hex(k, 32) == "684cf59ba83309552800ef566f2f4d3c1c3887c49360e3875f2eb94d99532c51",
          "X25519 after 1000 iterations");
  // Section 6.1: both sides of a Diffie-Hellman exchange.
  uint8_t a[32], b[32], apub[32], bpub[32], s1[32], s2[32];
  crypto::from_hex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a", a, 32);
  crypto::from_hex("5dab087e624a8a4b79e17f8b83800ee66f3bb1292618b6fd1c2f8b27ff88e0eb", b, 32);
  crypto::x25519_base(apub, a);
  crypto::x25519_base(bpub, b);
  CHECK(crypto::to_hex(apub, 32) == "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a", "Alice's key");
  CHECK(crypto::to_hex(bpub, 32) == "de9edb7d7b7dc1b4d35b61c2ece435373f8343c85b78674dadfc7e146f882b4f", "Bob's key");
  CHECK(crypto::x25519(s1, a, bpub) && crypto::x25519(s2, b, apub) &&
            crypto::to_hex(s1, 32) == "4a5d9d5ba4ce2de1728e3bf480350f25e07e21c947d19e3376f09b3c1e161742" &&
            memcmp(s1, s2, 32) == 0,
        "the shared secret");
  // Points of small order give a zero result, which x25519 refuses.
  uint8_t zero[32] = {}, one[32] = {1};
  CHECK(!crypto::x25519(r, a, zero) && !crypto::x25519(r, a, one), "small-order points must be refused");
  printf(
      "%s vectors: SHA-256 (4), HMAC-SHA256 (RFC 4231: 3), X25519 (RFC 7748: 2 + 1000 iterations + DH), "
      "small-order points refused\n",
      verdict(f0));
}

// ---- the handshake's messages, without sockets ----

void test_messages() {
  const int f0 = g_failures;
  tcp_auth::KeyPair ka, kb, kc;
  tcp_auth::make_key_pair(ka);
  tcp_auth::make_key_pair(kb);
  tcp_auth::make_key_pair(kc);
  const std::vector<std::string> details = {tcp_auth::format_details("10.0.0.1", 1000, ka.pub),
                                            tcp_auth::format_details("10.0.0.2", 1001, kb.pub),
                                            tcp_auth::format_details("10.0.0.3", 1002, kc.pub)};
  const crypto::Digest view = tcp_auth::view_of(details);
  crypto::Digest k01, k10, k02, k01_other_secret;
  CHECK(tcp_auth::pair_key(ka, 0, 1, kb.pub, view, kSecret, k01) &&
            tcp_auth::pair_key(kb, 1, 0, ka.pub, view, kSecret, k10) &&
            tcp_auth::pair_key(ka, 0, 2, kc.pub, view, kSecret, k02) &&
            tcp_auth::pair_key(ka, 0, 1, kb.pub, view, kSecret + "x", k01_other_secret),
        "pair keys");
  CHECK(memcmp(k01.b, k10.b, 32) == 0, "both ends of a pair must derive the same key");
  CHECK(memcmp(k01.b, k02.b, 32) != 0 && memcmp(k01.b, k01_other_secret.b, 32) != 0,
        "keys of other pairs or other secrets must differ");
  tcp_auth::Details d;
  std::string why;
  CHECK(tcp_auth::parse_details(details[1], d, why) && d.port == 1001 && d.host == "10.0.0.2" &&
            memcmp(d.pub, kb.pub, 32) == 0,
        "details round trip: %s", why.c_str());
  for (const std::string& bad :
       {details[1] + " ", details[1].substr(0, details[1].size() - 1), std::string("arx-tcp/1 10.0.0.2 1001"),
        details[1] + "0", std::string("arx-tcp/2 10.0.0.2 0 ") + crypto::to_hex(kb.pub, 32)})
    CHECK(!tcp_auth::parse_details(bad, d, why), "bad details accepted: '%s'", bad.c_str());

  // Rank 1 dials rank 0.
  Hello h;
  Challenge c;
  CHECK(tcp_auth::make_hello(3, 1, 1, view, h), "hello");
  CHECK(tcp_auth::check_hello(h, 0, 3, view, why) == Reject::kNone, "a good hello: %s", why.c_str());
  CHECK(tcp_auth::make_challenge(h, k01, c), "challenge");
  CHECK(tcp_auth::challenge_valid(h, c, k10), "the dialer must accept the right acceptor");
  const Proof p = tcp_auth::make_proof(h, c, k10);
  CHECK(tcp_auth::proof_valid(h, c, k01, p), "the acceptor must accept the right dialer");
  // Fresh nonces: two hellos, two challenges never repeat.
  Hello h2;
  Challenge c2;
  tcp_auth::make_hello(3, 1, 1, view, h2);
  tcp_auth::make_challenge(h, k01, c2);
  CHECK(memcmp(h.nonce, h2.nonce, 32) != 0 && memcmp(c.nonce, c2.nonce, 32) != 0, "nonces repeat");
  // Every single changed bit of any message makes its check fail.
  int flips = 0, passed = 0;
  for (size_t i = 0; i < sizeof(Hello) * 8; ++i) {
    Hello x = h;
    reinterpret_cast<uint8_t*>(&x)[i / 8] ^= (uint8_t)(1u << (i % 8));
    ++flips;
    passed += tcp_auth::challenge_valid(x, c, k10) || tcp_auth::proof_valid(x, c, k01, p);
  }
  for (size_t i = 0; i < sizeof(Challenge) * 8; ++i) {
    Challenge x = c;
    reinterpret_cast<uint8_t*>(&x)[i / 8] ^= (uint8_t)(1u << (i % 8));
    ++flips;
    passed += tcp_auth::challenge_valid(h, x, k10) || tcp_auth::proof_valid(h, x, k01, p);
  }
  for (size_t i = 0; i < sizeof(Proof) * 8; ++i) {
    Proof x = p;
    reinterpret_cast<uint8_t*>(&x)[i / 8] ^= (uint8_t)(1u << (i % 8));
    ++flips;
    passed += tcp_auth::proof_valid(h, c, k01, x);
  }
  CHECK(passed == 0, "%d of %d single-bit changes still passed", passed, flips);
  // The wrong key, and a reflection: the acceptor's MAC sent back as a proof.
  CHECK(!tcp_auth::challenge_valid(h, c, k02) && !tcp_auth::proof_valid(h, c, k02, p), "another pair's key passed");
  Proof reflected{kProofMagic, {}};
  memcpy(reflected.mac, c.mac, 32);
  CHECK(!tcp_auth::proof_valid(h, c, k01, reflected), "the acceptor's own MAC passed as the dialer's proof");
  // check_hello's reasons.
  struct {
    const char* what;
    int world, rank, root;
    uint32_t version;
    bool same_view;
    Reject want;
  } hellos[] = {
      {"our own rank", 3, 0, 0, kWireVersion, true, Reject::kHello},
      {"rank out of range", 3, 3, 0, kWireVersion, true, Reject::kHello},
      {"negative rank", 3, -1, 0, kWireVersion, true, Reject::kHello},
      {"root out of range", 3, 1, 2, kWireVersion, true, Reject::kHello},
      {"negative root", 3, 1, -1, kWireVersion, true, Reject::kHello},
      {"another world", 4, 1, 0, kWireVersion, true, Reject::kHello},
      {"wire version 1", 3, 1, 0, 1, true, Reject::kVersion},
      {"another view", 3, 1, 0, kWireVersion, false, Reject::kView},
  };
  for (auto& v : hellos) {
    Hello x;
    tcp_auth::make_hello(v.world, v.rank, v.root, view, x);
    x.version = v.version;
    if (!v.same_view) x.view[5] ^= 1;
    CHECK(tcp_auth::check_hello(x, 0, 3, view, why) == v.want, "%s: %s", v.what, why.c_str());
  }
  printf(
      "%s messages: keys agree per pair and differ across pairs and secrets; %d single-bit changes, another "
      "pair's key and a reflected MAC all refused\n",
      verdict(f0), flips);
}

// ---- strangers during set-up ----

// A stranger's attempt: what it sends, and the verdict it must get.
struct Attempt {
  const char* what;
  std::vector<uint8_t> bytes;  // everything it sends before reading
  bool proof_after_challenge;  // then answers a challenge with `key`
  crypto::Digest key;
  Reject want;
};

template <typename T>
std::vector<uint8_t> bytes_of(const T& v) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(&v);
  return std::vector<uint8_t>(p, p + sizeof v);
}

// Runs one attempt against rank 0 at `port`; returns the reject code seen
// (Reject::kNone if it got an ack: the stranger got in).
Reject run_attempt(int port, const Attempt& a, std::string& seen) {
  const int fd = raw_connect(port);
  if (fd < 0) {
    seen = "could not connect";
    return Reject::kNone;
  }
  raw_send(fd, a.bytes.data(), a.bytes.size());
  Reject got = Reject::kNone;
  uint64_t magic = 0;
  const auto deadline = tcp_io::deadline_after(10);
  if (tcp_io::recv_exact(fd, &magic, 8, deadline) != 0) {
    seen = "closed without a verdict";
  } else if (magic == kChallengeMagic) {
    Challenge c{};
    c.magic = magic;
    tcp_io::recv_exact(fd, reinterpret_cast<uint8_t*>(&c) + 8, sizeof c - 8, deadline);
    Hello h;
    memcpy(&h, a.bytes.data(), sizeof h);
    const Proof p = tcp_auth::make_proof(h, c, a.key);
    raw_send(fd, &p, sizeof p);
    Verdict v{};
    tcp_io::recv_exact(fd, &v, sizeof v, deadline);
    seen = strf("challenged, then %s", v.magic == kAckMagic ? "ACKED" : reject_name((Reject)v.code));
    got = v.magic == kAckMagic ? Reject::kNone : (Reject)v.code;
  } else if (magic == kRejectMagic) {
    uint64_t code = 0;
    tcp_io::recv_exact(fd, &code, 8, deadline);
    got = (Reject)(uint32_t)code;
    seen = strf("rejected: %s", reject_name(got));
  } else {
    seen = strf("answered 0x%016llx", (unsigned long long)magic);
  }
  CHECK(read_until_closed(fd) >= 0, "%s: the listener kept the stream open after refusing it", a.what);
  close(fd);
  return got;
}

void test_strangers() {
  const int f0 = g_failures;
  World w;
  if (!make_world(w, 3, 4096, 4096, /*make=*/1)) return;
  Rank& victim = w[0];
  const Layout& L = victim.layout;
  memset(victim.base(), 0x5c, L.total);
  const std::vector<uint8_t> before(victim.base(), victim.base() + L.total);
  const int port = port_of(w.details[0]);
  // Rank 0 is in set-up: connect() waits for its peers while strangers try.
  Status connected;
  std::thread setup([&] { connected = victim.t->connect(w.details, 20); });

  // What the store shows: every rank's details (so the view) and, without
  // JAX_ARX_SECRET, the shared secret. A stranger can make its own key
  // pair and a "pair key" from all that, but not the real ranks' keys.
  const crypto::Digest view = tcp_auth::view_of(w.details);
  tcp_auth::KeyPair mine;
  tcp_auth::make_key_pair(mine);
  crypto::Digest own_dh_key, secret_as_key, zero_key{};
  {
    tcp_auth::Details d0;
    std::string why;
    tcp_auth::parse_details(w.details[0], d0, why);
    tcp_auth::pair_key(mine, 2, 0, d0.pub, view, kSecret, own_dh_key);
  }
  memcpy(secret_as_key.b, crypto::sha256(kSecret.data(), kSecret.size()).b, 32);
  auto hello = [&](int rank, int root, bool right_view, uint32_t version = kWireVersion) {
    Hello h;
    tcp_auth::make_hello(3, rank, root, view, h);
    h.version = version;
    if (!right_view) h.view[0] ^= 0xff;
    return bytes_of(h);
  };
  // Version 1's hello carried the secret itself: what today's store gives away.
  std::vector<uint8_t> v1 = hello(2, 0, true, 1);
  memcpy(v1.data() + 32, kSecret.data(), std::min<size_t>(kSecret.size(), 64));
  FrameHeader frame{kFrameMagic, L.recv_offset(0, 2), 256, L.flag_offset(flag_index(2, 0)), 12345};
  std::vector<uint8_t> frame_first = bytes_of(frame);
  frame_first.resize(sizeof(Hello) + 256, 0xee);
  const Attempt attempts[] = {
      {"a version-1 hello carrying the shared secret", v1, false, {}, Reject::kVersion},
      {"a data frame instead of a hello", frame_first, false, {}, Reject::kHello},
      {"garbage", std::vector<uint8_t>(sizeof(Hello), 0xa5), false, {}, Reject::kHello},
      {"the wrong view", hello(2, 0, false), false, {}, Reject::kView},
      {"our own rank", hello(0, 0, true), false, {}, Reject::kHello},
      {"rank 2, answering with its own Diffie-Hellman key", hello(2, 0, true), true, own_dh_key, Reject::kProof},
      {"rank 2, answering with the shared secret's hash", hello(2, 1, true), true, secret_as_key, Reject::kProof},
      {"rank 1, answering with a zero key", hello(1, 0, true), true, zero_key, Reject::kProof},
  };
  for (const Attempt& a : attempts) {
    std::string seen;
    const Reject got = run_attempt(port, a, seen);
    CHECK(got == a.want, "%s: want '%s', saw %s", a.what, reject_name(a.want), seen.c_str());
  }
  // The real peers still get in, and rank 0's set-up succeeds.
  std::vector<std::vector<int>> in(3, std::vector<int>(kRoots, -1));
  for (int r = 1; r < 3; ++r)
    for (int root = 0; root < kRoots; ++root) {
      in[r][root] = w.fake(r).dial(port, 0, root);
      CHECK(in[r][root] >= 0, "fake rank %d root %d could not get in after the strangers", r, root);
    }
  setup.join();
  CHECK(connected.ok(), "rank 0's connect: %s", connected.message().c_str());
  uint64_t changed = 0;
  for (uint64_t i = 0; i < L.total; ++i) changed += victim.base()[i] != before[i];
  CHECK(changed == 0, "strangers changed %llu bytes of the region", (unsigned long long)changed);
  CHECK(victim.lost_count() == 0, "strangers are not peers, yet on_peer_lost fired: %s", victim.lost_text().c_str());
  // And after set-up, the stream of a real peer delivers.
  std::vector<uint8_t> payload(8, 0x3c);
  FrameHeader h{kFrameMagic, L.recv_offset(1, 1), 8, L.flag_offset(flag_index(1, 0)), 77};
  raw_send(in[1][0], &h, sizeof h);
  raw_send(in[1][0], payload.data(), payload.size());
  CHECK(wait_flag(victim.base(), L.flag_offset(flag_index(1, 0)), 77) &&
            memcmp(victim.base() + L.recv_offset(1, 1), payload.data(), 8) == 0,
        "the genuine stream does not deliver");
  printf("%s strangers: %zu kinds refused during set-up with their reason, nothing written, the real peers got in\n",
         verdict(f0), sizeof attempts / sizeof attempts[0]);
}

// ---- someone who rewrote a rank's details in the store ----
//
// Ranks 0 and 1 are real. An attacker M (a FakeRank with its own key)
// replaced rank 1's details by its own before rank 0 read them, and plays
// rank 1 towards rank 0; rank 1 read the true details.
void test_substituted_details() {
  for (bool psk : {false, true}) {
    const int f0 = g_failures;
    World w;
    // With JAX_ARX_SECRET, the real ranks share a secret M does not know.
    const std::string secret = psk ? "the job's JAX_ARX_SECRET, not in the store" : kSecret;
    if (!make_world(w, 2, 4096, 4096, -1, {secret, secret})) return;
    FakeRank m(1, 2);
    std::vector<std::string> forged = w.details;
    forged[1] = m.details();
    m.start(forged);  // M derives its key from what rank 0 sees, with the public secret
    Status st[2];
    std::thread r0([&] { st[0] = w[0].t->connect(forged, 4); });
    std::thread r1([&] { st[1] = w[1].t->connect(w.details, 4); });
    tcp_auth::Result mres[2];
    const int port0 = port_of(w.details[0]);
    for (int root = 0; root < kRoots; ++root) m.dial(port0, 0, root, &mres[root]);
    r0.join();
    r1.join();
    // Rank 1 is refused by rank 0 for reading other details, and says so.
    CHECK(!st[1].ok() && contains(st[1].message(), "rank 0 at") &&
              contains(st[1].message(), "read different connection details") &&
              contains(st[1].message(), "posing as a rank"),
          "psk=%d: rank 1: '%s'", psk, st[1].message().c_str());
    if (psk) {
      // M cannot prove the pair's key: rank 0 fails too, naming the impostor.
      CHECK(mres[0].outcome == tcp_auth::Outcome::kImpostor, "psk: M's dial: outcome %d", (int)mres[0].outcome);
      CHECK(!st[0].ok() && contains(st[0].message(), "answered as rank 1") &&
                contains(st[0].message(), "did not prove it holds the key"),
            "psk: rank 0: '%s'", st[0].message().c_str());
    } else {
      // Without a secret of the job's own, M passes with rank 0 (a man in
      // the middle of the rendezvous): rank 0's set-up succeeds here, and
      // fails at jax_arx.initialize's barrier, which rank 1 never reaches.
      CHECK(mres[0].outcome == tcp_auth::Outcome::kOk, "no psk: M's dial: outcome %d", (int)mres[0].outcome);
      CHECK(st[0].ok(), "no psk: rank 0: '%s'", st[0].message().c_str());
    }
    printf("%s substituted details (%s): rank 1 told '%.150s...'; rank 0: %s\n", verdict(f0),
           psk ? "JAX_ARX_SECRET set" : "no JAX_ARX_SECRET", st[1].message().c_str(),
           st[0].ok() ? "connected to the impostor (caught by the barrier)" : st[0].message().c_str());
  }
}

// ---- a second holder of a rank's key ----

void test_second_holder() {
  const int f0 = g_failures;
  World w;
  if (!make_world(w, 2, 4096, 4096, /*make=*/1)) return;
  const int port = port_of(w.details[0]);
  Status st;
  std::thread setup([&] { st = w[0].t->connect(w.details, 10); });
  // Root 0 twice during set-up: the second is refused, and set-up fails.
  tcp_auth::Result r1, r2, r3;
  CHECK(w.fake(1).dial(port, 0, 0, &r1) >= 0, "first stream of rank 1 root 0");
  CHECK(
      w.fake(1).dial(port, 0, 0, &r2) < 0 && r2.outcome == tcp_auth::Outcome::kRejected && r2.reject == Reject::kTaken,
      "a second stream for rank 1 root 0: outcome %d reject %d", (int)r2.outcome, (int)r2.reject);
  w.fake(1).dial(port, 0, 1, &r3);
  setup.join();
  CHECK(!st.ok() && contains(st.message(), "a second stream from") &&
            contains(st.message(), "proved it holds rank 1's key (root 0)") &&
            contains(st.message(), "two processes run as rank 1"),
        "set-up with two holders of rank 1's key: '%s'", st.message().c_str());
  printf("%s second holder during set-up: '%.160s...'\n", verdict(f0), st.message().c_str());

  // After set-up: the endpoint is told its peer is compromised.
  const int f1 = g_failures;
  World v;
  if (!make_world(v, 2, 4096, 4096, /*make=*/1)) return;
  std::vector<std::vector<int>> in;
  CHECK(connect_with_fakes(v, in).ok(), "connect");
  tcp_auth::Result again;
  CHECK(v.fake(1).dial(port_of(v.details[0]), 0, 1, &again) < 0 && again.reject == Reject::kTaken,
        "a second stream after set-up: outcome %d reject %d", (int)again.outcome, (int)again.reject);
  CHECK(v[0].wait_lost(1) && contains(v[0].lost_text(), "peer 1: a second stream"),
        "after set-up, a second holder of rank 1's key should be reported: %s", v[0].lost_text().c_str());
  printf("%s second holder after set-up: reported as '%.120s...'\n", verdict(f1), v[0].lost_text().c_str());
}

// ---- crowds of connections cannot keep the real peers out ----
//
// Ranks 0 and 1 are real, rank 2 is played by the test and dials in last,
// so set-up stays open while the crowd gathers: before set-up, 3 x
// kMaxPending silent connections to each real rank (the old carrier refused
// every connection past 64, the real peers' included); during it, as many
// more again, a third of them hellos that never send a proof.

void test_crowds() {
  const int f0 = g_failures;
  World w;
  if (!make_world(w, 3, 4096, 4096, /*make=*/2)) return;
  const int ports[2] = {port_of(w.details[0]), port_of(w.details[1])};
  const int n = 3 * (int)TcpTransport::kMaxPending;
  std::vector<int> crowd;
  for (int i = 0; i < n; ++i)
    for (int port : ports) crowd.push_back(raw_connect(port));
  std::vector<Status> st(2);
  std::vector<std::thread> setup;
  const auto t0 = Clock::now();
  for (int r = 0; r < 2; ++r) setup.emplace_back([&, r] { st[r] = w[r].t->connect(w.details, 30); });
  const crypto::Digest view = tcp_auth::view_of(w.details);
  for (int i = 0; i < 2 * n; ++i) {
    const int fd = raw_connect(ports[i % 2]);
    if (i % 3 == 0) {
      Hello h;
      tcp_auth::make_hello(3, 2, i % 2, view, h);  // a right hello for rank 2: the proof never comes
      raw_send(fd, &h, sizeof h);
    }
    crowd.push_back(fd);
  }
  for (int r = 0; r < 2; ++r)
    for (int root = 0; root < kRoots; ++root) {
      tcp_auth::Result res;
      CHECK(w.fake(2).dial(ports[r], r, root, &res) >= 0, "rank 2 root %d into rank %d through the crowd: %d %s", root,
            r, (int)res.outcome, res.detail.c_str());
    }
  for (auto& t : setup) t.join();
  const double took = since(t0);
  for (int r = 0; r < 2; ++r) CHECK(st[r].ok(), "rank %d in a crowd: %s", r, st[r].message().c_str());
  // And they work.
  if (st[0].ok() && st[1].ok()) {
    uint8_t* src = w[0].base() + w[0].layout.send_offset(0);
    memset(src, 0x42, 64);
    Status s = w[0].t->put(1, 0, src, w[1].layout.recv_offset(0, 0), 64, w[1].layout.flag_offset(flag_index(0, 0)), 3);
    CHECK(s.ok() && wait_flag(w[1].base(), w[1].layout.flag_offset(flag_index(0, 0)), 3), "put after the crowd: %s",
          s.message().c_str());
  }
  for (int fd : crowd)
    if (fd >= 0) close(fd);
  printf("%s crowds: %zu connections that never authenticate (half of them during set-up), set-up done in %.1f s\n",
         verdict(f0), crowd.size(), took);
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  const auto t0 = Clock::now();
  test_vectors(argc > 1 && !strcmp(argv[1], "--quick"));
  test_messages();
  test_strangers();
  test_substituted_details();
  test_second_holder();
  test_crowds();
  if (g_failures) {
    fprintf(stderr, "test_tcp_auth: %d check(s) FAILED\n", g_failures);
    return 1;
  }
  printf("test_tcp_auth: all passed in %.1f s\n", since(t0));
  return 0;
}

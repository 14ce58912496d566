// The verbs carrier against real verbs devices (soft-RoCE in CI: see
// tests/verbs/), plus the parts that need no device.
//
//   test_verbs_transport --host-only   (also: no devices named)
//       device selection and GID discovery on a fake sysfs tree, and the
//       errors a machine without RDMA devices (or libibverbs) gives.
//   test_verbs_transport --hca0 rxe0 --hca1 rxe1 [--roots N] [--gid0 I --gid1 I] [--ring]
//       forks rank 1; the two ranks connect over the named devices
//       (comma-separated: two roots) and run: patterned data and flags
//       through the protocol's two parities, thousands of back-to-back puts,
//       a large put, bounds checks, then a peer that closes its carrier, a
//       peer that never connects (the connection probe fails, naming it) and
//       a peer that exits mid-stream, each of which must surface as an error
//       naming the peer, within a bounded time. --ring: the two ranks are a
//       ring of 2 (JAX_ARX_TOPOLOGY=ring), each device list the port facing
//       prev, then the port facing next (one or two devices each).
// Environment instead of flags: ARX_TEST_HCA0, ARX_TEST_HCA1.
// Prints "PASS name ..." / "FAIL name: ..." lines; exits non-zero on failure.
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "base/atomics.h"
#include "base/config.h"
#include "base/layout.h"
#include "base/region.h"
#include "transport/transport.h"
#include "transport/verbs_device.h"

using namespace arx;

namespace {

// The word of psum piece 0 that `src` stores over `root` (two roots).
int flag_index(const Layout& L, int src, int root) { return psum_words(L.world, kRoots).index(src, 0, root); }


int g_rank = 0;
int g_failures = 0;
constexpr char kSecret[] = "test-secret";  // the communicator's secret in these tests

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void pass(const std::string& name, const std::string& what) {
  printf("[rank %d] PASS %s %s\n", g_rank, name.c_str(), what.c_str());
  fflush(stdout);
}
void failed(const std::string& name, const std::string& what) {
  printf("[rank %d] FAIL %s: %s\n", g_rank, name.c_str(), what.c_str());
  fflush(stdout);
  ++g_failures;
}
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- parts that need no device ------------------------------------------------

void write_file(const std::string& path, const std::string& text) {
  std::string dir = path.substr(0, path.rfind('/'));
  for (size_t i = 1; i <= dir.size(); ++i)
    if (i == dir.size() || dir[i] == '/') mkdir(dir.substr(0, i).c_str(), 0755);
  std::ofstream(path) << text << "\n";
}

void test_sysfs() {
  char tmpl[] = "/tmp/arx-sysfs-XXXXXX";
  const std::string root = mkdtemp(tmpl);
  // rxe9: link-local GIDs, an IPv4 on a VLAN (lower index), then the IPv4 of
  // its own netdev, v1 before v2, and an unused entry.
  const std::string p = root + "/rxe9/ports/1/";
  struct Row { int i; const char *gid, *type, *ndev; };
  const Row rows[] = {
      {0, "fe80:0000:0000:0000:5054:00ff:fe12:3456", "IB/RoCE v1", "veth0"},
      {1, "fe80:0000:0000:0000:5054:00ff:fe12:3456", "RoCE v2", "veth0"},
      {2, "0000:0000:0000:0000:0000:ffff:c633:6409", "IB/RoCE v1", "veth0.100"},
      {3, "0000:0000:0000:0000:0000:ffff:c633:6409", "RoCE v2", "veth0.100"},
      {4, "0000:0000:0000:0000:0000:ffff:c633:6401", "IB/RoCE v1", "veth0"},
      {5, "0000:0000:0000:0000:0000:ffff:c633:6401", "RoCE v2", "veth0"},
      {6, "0000:0000:0000:0000:0000:0000:0000:0000", "", ""},
  };
  for (const Row& r : rows) {
    write_file(p + "gids/" + std::to_string(r.i), r.gid);
    if (*r.type) write_file(p + "gid_attrs/types/" + std::to_string(r.i), r.type);
    if (*r.ndev) write_file(p + "gid_attrs/ndevs/" + std::to_string(r.i), r.ndev);
  }
  write_file(root + "/rxe9/parent", "veth0");
  // mlx9: a PCI function whose only IPv4 GID is RoCE v1.
  write_file(root + "/mlx9/device/net/eth7/ifindex", "7");
  write_file(root + "/mlx9/ports/1/gids/0", "0000:0000:0000:0000:0000:ffff:0a00:0001");
  write_file(root + "/mlx9/ports/1/gid_attrs/types/0", "IB/RoCE v1");
  write_file(root + "/mlx9/ports/1/gid_attrs/ndevs/0", "eth7");

  const auto table = verbs::read_gid_table(root, "rxe9", 1);
  const auto own = verbs::own_netdevs(root, "rxe9");
  std::string why;
  const int pick = verbs::pick_roce_v2_gid(table, own, why);
  if (table.size() == 6 && own == std::vector<std::string>{"veth0"} && pick == 5)
    pass("sysfs-gid", "RoCE v2 IPv4 GID of the own netdev picked (index 5 over the VLAN's 3)");
  else
    failed("sysfs-gid", "table " + std::to_string(table.size()) + " rows, pick " + std::to_string(pick));
  const int vlan_only = verbs::pick_roce_v2_gid(table, {"eth9"}, why);
  if (vlan_only == 3) pass("sysfs-gid-fallback", "without an own-netdev GID, the lowest RoCE v2 IPv4 GID");
  else failed("sysfs-gid-fallback", "picked " + std::to_string(vlan_only));
  why.clear();
  const auto mt = verbs::read_gid_table(root, "mlx9", 1);
  const int none = verbs::pick_roce_v2_gid(mt, verbs::own_netdevs(root, "mlx9"), why);
  if (none == -1 && contains(why, "10.0.0.1 IB/RoCE v1 on eth7")) pass("sysfs-gid-none", "says: " + why);
  else failed("sysfs-gid-none", "picked " + std::to_string(none) + ", why: " + why);
  if (system(("rm -rf " + root).c_str()) != 0) failed("sysfs", "cleanup");

  std::vector<verbs::HcaSpec> specs;
  bool ok = verbs::parse_hca_list("mlx5_0,mlx5_1:2", specs).ok() && specs.size() == 2 && specs[0].name == "mlx5_0" &&
            specs[0].port == 0 && specs[1].name == "mlx5_1" && specs[1].port == 2;
  ok = ok && verbs::parse_hca_list("=rxe0", specs).ok() && specs.size() == 1 && specs[0].name == "rxe0";
  ok = ok && verbs::parse_hca_list("", specs).ok() && specs.empty();
  const Status excl = verbs::parse_hca_list("^mlx5_0", specs);
  const Status three = verbs::parse_hca_list("a,b,c", specs);
  const Status badport = verbs::parse_hca_list("mlx5_0:x", specs);
  ok = ok && !excl.ok() && !three.ok() && contains(three.message(), "one or two") && !badport.ok();
  if (ok) pass("hca-list", "JAX_ARX_IB_HCA forms parsed, bad ones refused");
  else failed("hca-list", excl.message() + " | " + three.message() + " | " + badport.message());

  uint8_t g[16];
  ok = verbs::parse_gid("0000:0000:0000:0000:0000:ffff:c633:6401", g) && verbs::gid_text(g) == "198.51.100.1" &&
       verbs::parse_gid("fe80:0000:0000:0000:5054:00ff:fe12:3456", g) &&
       verbs::gid_text(g) == "fe80::5054:ff:fe12:3456";
  if (ok) pass("gid-text", "IPv4-mapped GIDs print as addresses");
  else failed("gid-text", verbs::gid_text(g));
}

// An endpoint-like owner of a region and a carrier, for one rank.
struct Rank {
  Config config;
  Layout layout;
  std::unique_ptr<Region> region;
  std::unique_ptr<Transport> t;
  std::atomic<int> lost_peer{-1};
  std::string lost_why;
  uint64_t* word(uint64_t off) { return reinterpret_cast<uint64_t*>(region->base() + off); }
  uint8_t* at(uint64_t off) { return region->base() + off; }
};

Status make_rank(Rank& r, int rank, int world, const std::string& hca, uint64_t slot_bytes, int64_t gid_index = -1,
                 bool ring = false) {
  r.config.ib_hca = hca;
  r.config.ib_gid_index = gid_index;
  r.config.timeout_s = 20;
  r.config.verbose = std::getenv("ARX_TEST_VERBOSE") != nullptr;
  // Soft-RoCE retries forever at retry_cnt 7 (see verbs.cc): 6 makes a lost
  // peer fail the writes after 7 tries. Under TCG a vCPU can stall past the
  // default 67 ms QP timeout, and the spurious resends that follow have hit
  // a 6.1 rxe bug (a NAK "remote invalid request" mid-write, about once in
  // 15 runs): 268 ms per try keeps resends rare and detection near 2 s.
  // Small WRs exercise the chunked path.
  r.config.ib_retry_cnt = 6;
  r.config.ib_timeout = 16;
  r.config.ib_chunk_bytes = 65536;
  Geometry geo;
  geo.world = world;
  geo.slot_bytes = slot_bytes;
  geo.send_bytes = slot_bytes;
  geo.topology = ring ? TopologyKind::kRing : TopologyKind::kMesh;
  r.config.topology = geo.topology;
  r.layout = Layout::of(geo);
  ARX_RETURN_IF_ERROR(Region::create(r.layout.total, false, r.region));
  TransportContext ctx;
  ctx.rank = rank;
  ctx.world = world;
  ctx.region = r.region.get();
  ctx.layout = r.layout;
  ctx.secret = kSecret;
  ctx.config = &r.config;
  ctx.label = strf("test rank %d of %d", rank, world);
  ctx.on_peer_lost = [&r](int peer, const std::string& why) {
    r.lost_why = why;
    r.lost_peer.store(peer);
  };
  return make_verbs_transport(ctx, r.t);
}

// A ring's device list names two ports, prev's first; another count fails
// construction, naming the rank, its neighbours and the form to use. The
// check comes before any device is opened, so it runs without devices.
void test_ring_device_list() {
  bool ok = true;
  std::string said;
  for (const char* hca : {"rxe0,rxe1,rxe2", "", "rxe0"}) {
    Rank r;
    const Status st = make_rank(r, 2, 4, hca, 1 << 16, -1, true);
    said += (said.empty() ? "" : " | ") + st.message();
    if (contains(st.message(), "without rdma-core") || contains(st.message(), "could not load libibverbs")) continue;
    ok = ok && !st.ok() && contains(st.message(), "rank 2 lists the port facing the previous rank (rank 1), then the "
                                                  "port facing the next rank (rank 3)");
  }
  Rank five;
  const Status st = make_rank(five, 0, 4, "a,b,c,d,e", 1 << 16, -1, true);
  ok = ok && !st.ok() && (contains(st.message(), "a ring takes at most four") || contains(st.message(), "rdma-core") ||
                          contains(st.message(), "libibverbs"));
  if (ok) pass("ring-device-list", said);
  else failed("ring-device-list", said + " | " + st.message());
}

void test_no_device_errors() {
  Rank r;
  const Status st = make_rank(r, 0, 2, "", 1 << 16);
  if (!st.ok() && contains(st.message(), "JAX_ARX_TRANSPORT=tcp"))
    pass("no-devices", "construction fails with: " + st.message());
  else
    failed("no-devices", st.ok() ? "a carrier was built on a host without RDMA devices" : st.message());
}

// A process whose libibverbs cannot be loaded gets a clear error. Loading is
// once per process, so this runs in a child forked before anything loaded it.
void test_load_failure() {
  fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    Rank r;
    r.config.ibverbs_lib = "/nonexistent/libibverbs.so.1";
    const Status st = make_rank(r, 0, 2, "", 1 << 16);
    const bool ok = !st.ok() && (contains(st.message(), "/nonexistent/libibverbs.so.1") ||
                                 contains(st.message(), "no rdma-core headers") ||
                                 contains(st.message(), "without rdma-core"));
    printf("[rank 0] %s load-failure %s\n", ok ? "PASS" : "FAIL", st.message().c_str());
    fflush(stdout);
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++g_failures;
}

// ---- two ranks ------------------------------------------------------------------

int g_sock = -1;  // to the other rank

bool send_all(const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n) {
    const ssize_t k = send(g_sock, c, n, MSG_NOSIGNAL);
    if (k <= 0) return false;
    c += k;
    n -= (size_t)k;
  }
  return true;
}
bool recv_all(void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n) {
    const ssize_t k = recv(g_sock, c, n, 0);
    if (k <= 0) return false;
    c += k;
    n -= (size_t)k;
  }
  return true;
}
bool send_str(const std::string& s) {
  const uint64_t n = s.size();
  return send_all(&n, 8) && send_all(s.data(), n);
}
bool recv_str(std::string& s) {
  uint64_t n = 0;
  if (!recv_all(&n, 8) || n > (1 << 20)) return false;
  s.resize(n);
  return recv_all(s.data(), n);
}
bool barrier() {
  char c = 'b';
  return send_all(&c, 1) && recv_all(&c, 1);
}

// Deterministic bytes that differ by sender, sequence number and position.
void pattern(uint8_t* out, uint64_t n, int src, uint64_t seq) {
  uint64_t x = 0x9E3779B97F4A7C15ull * (seq + 1) ^ (uint64_t)(src + 1) << 56;
  for (uint64_t i = 0; i < n; ++i) {
    if (i % 8 == 0) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
    }
    out[i] = (uint8_t)(x >> (8 * (i % 8)));
  }
}

bool check_pattern(const uint8_t* got, uint64_t n, int src, uint64_t seq, std::string& err) {
  std::vector<uint8_t> want(n);
  pattern(want.data(), n, src, seq);
  for (uint64_t i = 0; i < n; ++i)
    if (got[i] != want[i]) {
      err = strf("byte %llu of %llu from rank %d seq %llu is 0x%02x, expected 0x%02x", (unsigned long long)i,
                 (unsigned long long)n, src, (unsigned long long)seq, got[i], want[i]);
      return false;
    }
  return true;
}

// Waits until the flag word's progress reaches `want`'s, as the device side
// does (progress only grows), calling poll() as a proxy would. At equal
// progress the whole word must match; the peer may already be further on.
Status wait_flag(Rank& r, uint64_t off, uint64_t want, double limit_s = 30) {
  const double t0 = now_s();
  uint64_t last = 0;
  for (;;) {
    const uint64_t v = load_acquire(r.word(off));
    if (flag_seq(v) < flag_seq(last))
      return Status::Error(strf("flag at %llu went backwards: 0x%llx after 0x%llx", (unsigned long long)off,
                                (unsigned long long)v, (unsigned long long)last));
    last = v;
    if (flag_seq(v) == flag_seq(want) && v != want)
      return Status::Error(strf("flag at %llu is 0x%llx, expected 0x%llx", (unsigned long long)off,
                                (unsigned long long)v, (unsigned long long)want));
    if (flag_seq(v) >= flag_seq(want)) return Status::Ok();
    ARX_RETURN_IF_ERROR(r.t->poll());
    if (now_s() - t0 > limit_s)
      return Status::Error(strf("flag at %llu stayed 0x%llx, waiting for 0x%llx for %.0f s", (unsigned long long)off,
                                (unsigned long long)v, (unsigned long long)want, limit_s));
    sched_yield();
  }
}

// The protocol's one-shot exchange for `seq` of `bytes`: copy into
// send[parity], put to the peer split over the roots, wait for the peer's
// flags, check its data. Parity reuse is safe as the protocol proves.
Status exchange(Rank& r, int rank, int peer, uint64_t seq, uint64_t bytes) {
  const int par = seq & 1, roots = r.t->roots();
  const uint64_t word = flag_word(seq, bytes * 0x9E3779B1u);  // any descriptor; flag_word masks it
  uint8_t* send = r.at(r.layout.send_offset(par));
  pattern(send, bytes, rank, seq);
  for (int root = 0; root < roots; ++root) {
    uint64_t off, len;
    root_split(bytes, root, roots, off, len);
    ARX_RETURN_IF_ERROR(r.t->put(peer, root, send + off, r.layout.recv_offset(par, rank) + off, len,
                                 r.layout.flag_offset(flag_index(r.layout, rank, root)), word));
  }
  for (int root = 0; root < roots; ++root)
    ARX_RETURN_IF_ERROR(wait_flag(r, r.layout.flag_offset(flag_index(r.layout, peer, root)), word));
  std::string err;
  if (!check_pattern(r.at(r.layout.recv_offset(par, peer)), bytes, peer, seq, err)) return Status::Error(err);
  return Status::Ok();
}

struct Args {
  std::string hca[2];
  int roots = 0;         // expected roots(); 0: do not check
  int gid[2] = {-1, -1};  // expected discovered GID index; -1: do not check
  int burst = 5000;
  uint64_t slot_bytes = 4 << 20;
  double detect_limit_s = 15;
  bool ring = false;  // a ring of 2: device lists name the port facing prev, then next
};

// The carrier's details of rank 0 and rank 1, exchanged over the socket.
Status connect_pair(Rank& r, int rank) {
  std::string mine = r.t->details(), theirs;
  if (!send_str(mine) || !recv_str(theirs)) return Status::Error("details exchange with the other rank failed");
  std::vector<std::string> all(2);
  all[rank] = mine;
  all[1 - rank] = theirs;
  ARX_RETURN_IF_ERROR(r.t->connect(all, 30));
  if (!barrier()) return Status::Error("barrier after connect failed");
  return Status::Ok();
}

// Rank 0's side of a peer that went away: puts and polls until the carrier
// reports it; the error must name rank 1, and on_peer_lost must fire.
void expect_peer_lost(Rank& r, const std::string& name, double limit_s) {
  const double t0 = now_s();
  Status st;
  uint64_t seq = 1000000;
  while (st.ok() && now_s() - t0 < limit_s) {
    uint8_t* src = r.at(r.layout.send_offset(0));
    pattern(src, 256, 0, seq);
    st = r.t->put(1, 0, src, r.layout.recv_offset(0, 0), 256, r.layout.flag_offset(flag_index(r.layout, 0, 0)),
                  flag_word(seq++, 0));
    if (st.ok()) st = r.t->poll();
    usleep(1000);
  }
  const double dt = now_s() - t0;
  if (st.ok()) {
    failed(name, strf("no error after %.1f s of puts to a peer that is gone (a silent stall)", dt));
    return;
  }
  const Status again = r.t->poll();
  const bool names_peer = contains(st.message(), "rank 1");
  const bool sticky = again.message() == st.message();
  const bool told = r.lost_peer.load() == 1 && contains(r.lost_why, "rank 1");
  if (names_peer && sticky && told)
    pass(name, strf("detected in %.2f s: %s", dt, st.message().c_str()));
  else
    failed(name, strf("after %.2f s: names rank 1 %d, sticky %d, on_peer_lost(peer %d) %d: %s", dt, names_peer,
                      sticky, r.lost_peer.load(), told, st.message().c_str()));
}

void run_rank(int rank, const Args& a) {
  const int peer = 1 - rank;
  Rank r;
  Status st = make_rank(r, rank, 2, a.hca[rank], a.slot_bytes, -1, a.ring);
  if (!st.ok()) {
    failed("construct", st.message());
    return;
  }
  if (a.roots && r.t->roots() != a.roots)
    failed("construct", strf("roots() is %d, expected %d", r.t->roots(), a.roots));
  else
    pass("construct", strf("%s: %d root%s, details %zu bytes", a.hca[rank].c_str(), r.t->roots(),
                           r.t->roots() == 1 ? "" : "s", r.t->details().size()));
#if ARX_HAVE_VERBS
  if (a.gid[rank] >= 0) {
    // The carrier's own choice, through the same function it calls.
    const verbs::Api* api = nullptr;
    std::vector<verbs::Device> devs;
    std::string note;
    st = verbs::load("", api);
    if (st.ok()) st = verbs::open_devices(*api, a.hca[rank], -1, 4, devs, note);
    if (!st.ok()) failed("gid-discovery", st.message());
    else if (devs[0].gid_index == a.gid[rank])
      pass("gid-discovery", "found the VM's RoCE v2 IPv4 GID: " + verbs::describe(devs[0]));
    else
      failed("gid-discovery", strf("found %s, the VM set up index %d", verbs::describe(devs[0]).c_str(), a.gid[rank]));
    if (api) verbs::close_devices(*api, devs);
  }
#endif
  // The details go through the rendezvous store, which anyone who reaches
  // the coordinator reads: no trace of the secret in them, neither itself
  // nor the 64-bit FNV-1a hash that version 2 of the details carried (an
  // oracle to guess JAX_ARX_SECRET against offline).
  {
    const std::string d = r.t->details();
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char c : std::string(kSecret)) h = (h ^ c) * 0x100000001b3ull;
    const std::string hash(reinterpret_cast<const char*>(&h), sizeof h);
    if (d.find(kSecret) == std::string::npos && d.find(hash) == std::string::npos)
      pass("details-keep-the-secret", "neither the secret nor its hash is in the details");
    else
      failed("details-keep-the-secret", "the details carry the secret or its FNV-1a hash");
  }
  // Details that are not the peer's are refused before any QP changes state.
  {
    std::vector<std::string> bad(2);
    bad[rank] = r.t->details();
    bad[peer] = "short";
    const Status size = r.t->connect(bad, 1);
    bad[peer] = r.t->details();  // this rank's own details in the peer's slot
    const Status slot = r.t->connect(bad, 1);
    const std::string who = strf("rank %d's connection details", peer);
    if (contains(size.message(), who) && contains(slot.message(), who) && contains(slot.message(), "belong to"))
      pass("bad-details", slot.message());
    else
      failed("bad-details", size.message() + " | " + slot.message());
  }
  st = connect_pair(r, rank);
  if (!st.ok()) {
    failed("connect", st.message());
    return;
  }
  pass("connect", "QPs at RTS on both ranks");

  // 1. Patterned data and flags through both parities, sizes from nothing
  // to a whole slot, odd ones included.
  const uint64_t sizes[] = {0, 8, 16, 24, 1000, 4096, 65536, 65552, 300000, a.slot_bytes};
  const int nsizes = sizeof sizes / sizeof sizes[0];
  double t0 = now_s();
  uint64_t seq = 0;
  for (int i = 0; i < 3 * nsizes && st.ok(); ++i) {
    const uint64_t bytes = sizes[i % nsizes];
    st = exchange(r, rank, peer, ++seq, bytes);
  }
  if (st.ok())
    pass("pattern", strf("%llu exchanges (0 B to %llu B, both parities) checked byte for byte in %.2f s",
                         (unsigned long long)seq, (unsigned long long)a.slot_bytes, now_s() - t0));
  else
    failed("pattern", strf("at seq %llu: %s", (unsigned long long)seq, st.message().c_str()));
  if (!barrier()) return;

  // 2. Back-to-back puts, many times the send queue's depth, without
  // waiting: each writes 64 fresh bytes (sources never reused) into one of
  // 128 places, then its flag. In-order placement means that when the last
  // flag lands, every place holds the last put aimed at it.
  if (st.ok()) {
    t0 = now_s();
    const int roots = r.t->roots();
    const uint64_t src0 = r.layout.send_offset(0), dst0 = r.layout.recv_offset(0, rank);
    const int n = a.burst;
    for (int i = 0; i < n && st.ok(); ++i) {
      const int root = i % roots;
      uint8_t* src = r.at(src0 + (uint64_t)i * 64 % (2 * a.slot_bytes));
      pattern(src, 64, rank, 50000 + i);
      st = r.t->put(peer, root, src, dst0 + (uint64_t)(i % 128) * 64, 64,
                    r.layout.flag_offset(flag_index(r.layout, rank, root) + 2), flag_word(i + 1, 7));
    }
    const double post_s = now_s() - t0;
    for (int root = 0; root < roots && st.ok(); ++root) {
      int last = n - 1;
      while (last % roots != root) --last;
      st = wait_flag(r, r.layout.flag_offset(flag_index(r.layout, peer, root) + 2), flag_word(last + 1, 7));
    }
    std::string err;
    for (int k = 0; k < 128 && st.ok(); ++k) {
      int i = n - 1;
      while (i % 128 != k) --i;
      if (!check_pattern(r.at(r.layout.recv_offset(0, peer) + (uint64_t)k * 64), 64, peer, 50000 + i, err))
        st = Status::Error(err);
    }
    if (st.ok()) st = r.t->poll();
    if (st.ok())
      pass("burst", strf("%d back-to-back puts (%d per root) posted in %.2f s, all landed in order in %.2f s", n,
                         n / roots, post_s, now_s() - t0));
    else
      failed("burst", st.message());
  }
  if (!barrier()) return;

  // 3. One large put: a whole slot of fresh bytes, split over the roots.
  if (st.ok()) {
    t0 = now_s();
    const uint64_t bytes = a.slot_bytes;
    const uint64_t word = flag_word(1, 9);
    uint8_t* send = r.at(r.layout.send_offset(1));
    pattern(send, bytes, rank, 424242);
    const int roots = r.t->roots();
    for (int root = 0; root < roots && st.ok(); ++root) {
      uint64_t off, len;
      root_split(bytes, root, roots, off, len);
      st = r.t->put(peer, root, send + off, r.layout.recv_offset(1, rank) + off, len,
                    r.layout.flag_offset(flag_index(r.layout, rank, root) + 4), word);
    }
    for (int root = 0; root < roots && st.ok(); ++root)
      st = wait_flag(r, r.layout.flag_offset(flag_index(r.layout, peer, root) + 4), word);
    std::string err;
    if (st.ok() && !check_pattern(r.at(r.layout.recv_offset(1, peer)), bytes, peer, 424242, err))
      st = Status::Error(err);
    const double dt = now_s() - t0;
    if (st.ok())
      pass("large", strf("%llu B in one put per root, checked, %.2f s (%.1f MB/s each way, emulated)",
                         (unsigned long long)bytes, dt, bytes / dt / 1e6));
    else
      failed("large", st.message());
  }

  // 4. Bounds: writes outside the peer's inbox or from outside the region
  // are refused before anything is posted, and break nothing.
  {
    const uint64_t lo = r.layout.inbox_lo(), hi = r.layout.inbox_hi();
    uint8_t* src = r.at(r.layout.send_offset(0));
    const Status below = r.t->put(peer, 0, src, 0, 64, r.layout.flag_offset(0), 1);              // the control block
    const Status above = r.t->put(peer, 0, src, hi - 32, 64, r.layout.flag_offset(0), 1);        // past the inbox
    const Status flag = r.t->put(peer, 0, src, lo, 0, r.layout.send_offset(0), 1);               // a "flag" in send
    const Status unaligned = r.t->put(peer, 0, src, lo, 0, r.layout.flag_offset(0) + 4, 1);
    uint8_t outside[64] = {};
    const Status source = r.t->put(peer, 0, outside, r.layout.recv_offset(0, rank), 64, r.layout.flag_offset(0), 1);
    const Status self = r.t->put(rank, 0, src, r.layout.recv_offset(0, rank), 64, r.layout.flag_offset(0), 1);
    const Status after = r.t->poll();
    if (!below.ok() && !above.ok() && !flag.ok() && !unaligned.ok() && !source.ok() && !self.ok() && after.ok() &&
        contains(above.message(), "slots"))
      pass("bounds", "writes outside the peer's inbox, from outside the region, or to itself are refused: " +
                         above.message());
    else
      failed("bounds", strf("accepted a bad put (below %d above %d flag %d unaligned %d source %d self %d) or "
                            "poll failed: %s",
                            below.ok(), above.ok(), flag.ok(), unaligned.ok(), source.ok(), self.ok(),
                            after.message().c_str()));
  }
  if (!barrier()) return;

  // 5. A peer that destroys its QPs mid-stream (close()): rank 0 must get
  // an error naming rank 1 from poll() within the QP's retry budget.
  if (rank == 1) {
    r.t->close();
    const Status after = r.t->put(peer, 0, r.at(r.layout.send_offset(0)), r.layout.recv_offset(0, rank), 8,
                                  r.layout.flag_offset(0), 1);
    if (!after.ok()) pass("closed-put", "put() after close(): " + after.message());
    else failed("closed-put", "put() after close() succeeded");
    char c = 'c';
    send_all(&c, 1);
  } else {
    char c;
    recv_all(&c, 1);
    expect_peer_lost(r, "peer-close", a.detect_limit_s);
  }
  barrier();
  r.t.reset();

  // 6. A peer that never connects: its queue pairs stay in INIT and take no
  // write, so rank 0's connection probe fails, naming rank 1 (and in a ring
  // the port), within the QP's retry budget instead of at the first put.
  {
    Rank r1;
    st = make_rank(r1, rank, 2, a.hca[rank], 1 << 16, -1, a.ring);
    std::string mine = r1.t ? r1.t->details() : "", theirs;
    if (!st.ok() || !send_str(mine) || !recv_str(theirs)) {
      failed("silent-peer", "setting up: " + st.message());
      return;
    }
    if (rank == 0) {
      std::vector<std::string> all = {mine, theirs};
      const double t0 = now_s();
      const Status c = r1.t->connect(all, 30);
      const double dt = now_s() - t0;
      if (!c.ok() && contains(c.message(), "no answer from rank 1") && contains(c.message(), "connection probe") &&
          (!a.ring || contains(c.message(), "the port facing")) && dt < a.detect_limit_s)
        pass("silent-peer", strf("connect failed in %.2f s: %s", dt, c.message().c_str()));
      else
        failed("silent-peer", strf("after %.2f s: %s", dt, c.ok() ? "connected to a peer that never did" :
                                                                    c.message().c_str()));
    }
    barrier();
  }

  // 7. A peer process that exits mid-stream: fresh carriers, one exchange to
  // show the link is up, then rank 1 exits and its kernel tears its QPs down.
  Rank r2;
  st = make_rank(r2, rank, 2, a.hca[rank], 1 << 16, -1, a.ring);
  if (st.ok()) st = connect_pair(r2, rank);
  if (st.ok()) st = exchange(r2, rank, peer, 1, 4096);
  if (!st.ok()) {
    failed("peer-exit", "setting up: " + st.message());
    return;
  }
  if (rank == 1) {
    pass("peer-exit-setup", "fresh carrier connected and exchanged; exiting now");
    fflush(stdout);
    _exit(g_failures ? 1 : 0);  // rank 1 ends here, its QPs with it
  }
  int status = 0;
  waitpid(-1, &status, 0);  // rank 1 is this process's only child
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed("rank 1", strf("exited with status 0x%x", status));
  expect_peer_lost(r2, "peer-exit", a.detect_limit_s);
}

int run_pair(const Args& a) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
    perror("socketpair");
    return 2;
  }
  fflush(stdout);
  const pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    return 2;
  }
  if (pid == 0) {
    g_rank = 1;
    g_sock = sv[1];
    close(sv[0]);
    alarm(600);  // never outlive a broken run
    run_rank(1, a);
    fflush(stdout);
    _exit(g_failures ? 1 : 0);
  }
  g_rank = 0;
  g_sock = sv[0];
  close(sv[1]);
  run_rank(0, a);
  // run_rank(0) reaped rank 1 when it got that far; otherwise reap it here.
  int status = 0;
  pid_t got = waitpid(pid, &status, WNOHANG);
  if (got == 0) {
    close(g_sock);  // a rank 1 blocked on the socket gives up
    got = waitpid(pid, &status, 0);
  }
  if (got == pid && (!WIFEXITED(status) || WEXITSTATUS(status) != 0))
    failed("rank 1", strf("exited with status 0x%x", status));
  return g_failures;
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  Args a;
  bool host_only = false;
  if (const char* e = std::getenv("ARX_TEST_HCA0")) a.hca[0] = e;
  if (const char* e = std::getenv("ARX_TEST_HCA1")) a.hca[1] = e;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        fprintf(stderr, "%s needs a value\n", k.c_str());
        exit(2);
      }
      return argv[++i];
    };
    if (k == "--host-only") host_only = true;
    else if (k == "--hca0") a.hca[0] = val();
    else if (k == "--hca1") a.hca[1] = val();
    else if (k == "--roots") a.roots = std::stoi(val());
    else if (k == "--gid0") a.gid[0] = std::stoi(val());
    else if (k == "--gid1") a.gid[1] = std::stoi(val());
    else if (k == "--burst") a.burst = std::stoi(val());
    else if (k == "--slot-bytes") a.slot_bytes = std::stoull(val());
    else if (k == "--detect-limit") a.detect_limit_s = std::stod(val());
    else if (k == "--ring") a.ring = true;
    else {
      fprintf(stderr, "usage: %s --host-only | --hca0 DEV[,DEV] --hca1 DEV[,DEV] [--roots N] [--gid0 I --gid1 I] "
                      "[--burst N] [--slot-bytes B] [--detect-limit S] [--ring]\n", argv[0]);
      return 2;
    }
  }
  if (!host_only && (a.hca[0].empty() || a.hca[1].empty())) {
    printf("no devices named for both ranks (--hca0 rxe0 --hca1 rxe1, or ARX_TEST_HCA0/1): device-free checks only\n");
    host_only = true;
  }
  test_sysfs();
  if (host_only) {
    test_load_failure();  // first: a forked child inherits a library already loaded
    test_no_device_errors();
    test_ring_device_list();
  } else {
#if ARX_HAVE_VERBS
    // Wrong settings fail construction with what to set.
    {
      Rank r;
      const Status st = make_rank(r, 0, 2, "nosuchdev0", 1 << 16);
      if (!st.ok() && contains(st.message(), "JAX_ARX_IB_HCA") && contains(st.message(), "rxe"))
        pass("bad-hca", st.message());
      else
        failed("bad-hca", st.ok() ? "accepted" : st.message());
      Rank r2;
      const Status st2 = make_rank(r2, 0, 2, a.hca[0], 1 << 16, 250, a.ring);
      if (!st2.ok() && contains(st2.message(), "JAX_ARX_IB_GID_INDEX")) pass("bad-gid-index", st2.message());
      else failed("bad-gid-index", st2.ok() ? "accepted" : st2.message());
    }
#endif
    run_pair(a);
  }
  if (g_rank != 0) return g_failures ? 1 : 0;
  printf("test_verbs_transport: %s (%d failure%s)\n", g_failures ? "FAILED" : "ALL PASSED", g_failures,
         g_failures == 1 ? "" : "s");
  return g_failures ? 1 : 0;
}

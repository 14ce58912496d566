// The verbs carrier's parts that need no RDMA device: device selection and
// GID discovery on a fake sysfs tree, a ring's device list, and the errors a
// machine without RDMA devices (or without libibverbs, or built without
// rdma-core's headers) gives. Built with and without ARX_HAVE_VERBS
// (tests/test_verbs.py). test_verbs_transport.cc runs the carrier itself.
// Prints "PASS name ..." / "FAIL name: ..." lines; exits non-zero on failure.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "transport/verbs_device.h"
#include "verbs_rig.h"

using namespace arx;
using namespace arx_test;

namespace {

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
  struct Row {
    int i;
    const char *gid, *type, *ndev;
  };
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
  if (vlan_only == 3)
    pass("sysfs-gid-fallback", "without an own-netdev GID, the lowest RoCE v2 IPv4 GID");
  else
    failed("sysfs-gid-fallback", "picked " + std::to_string(vlan_only));
  why.clear();
  const auto mt = verbs::read_gid_table(root, "mlx9", 1);
  const int none = verbs::pick_roce_v2_gid(mt, verbs::own_netdevs(root, "mlx9"), why);
  if (none == -1 && contains(why, "10.0.0.1 IB/RoCE v1 on eth7"))
    pass("sysfs-gid-none", "says: " + why);
  else
    failed("sysfs-gid-none", "picked " + std::to_string(none) + ", why: " + why);
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
  if (ok)
    pass("hca-list", "JAX_ARX_IB_HCA forms parsed, bad ones refused");
  else
    failed("hca-list", excl.message() + " | " + three.message() + " | " + badport.message());

  uint8_t g[16];
  ok = verbs::parse_gid("0000:0000:0000:0000:0000:ffff:c633:6401", g) && verbs::gid_text(g) == "198.51.100.1" &&
       verbs::parse_gid("fe80:0000:0000:0000:5054:00ff:fe12:3456", g) &&
       verbs::gid_text(g) == "fe80::5054:ff:fe12:3456";
  if (ok)
    pass("gid-text", "IPv4-mapped GIDs print as addresses");
  else
    failed("gid-text", verbs::gid_text(g));
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
    ok = ok && !st.ok() &&
         contains(st.message(),
                  "rank 2 lists the port facing the previous rank (rank 1), then the "
                  "port facing the next rank (rank 3)");
  }
  Rank five;
  const Status st = make_rank(five, 0, 4, "a,b,c,d,e", 1 << 16, -1, true);
  ok = ok && !st.ok() &&
       (contains(st.message(), "a ring takes at most four") || contains(st.message(), "rdma-core") ||
        contains(st.message(), "libibverbs"));
  if (ok)
    pass("ring-device-list", said);
  else
    failed("ring-device-list", said + " | " + st.message());
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
    const bool ok =
        !st.ok() && (contains(st.message(), "/nonexistent/libibverbs.so.1") ||
                     contains(st.message(), "no rdma-core headers") || contains(st.message(), "without rdma-core"));
    printf("[rank 0] %s load-failure %s\n", ok ? "PASS" : "FAIL", st.message().c_str());
    fflush(stdout);
    _exit(ok ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++g_failures;
}
}  // namespace

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  test_load_failure();  // first: a forked child inherits a library already loaded
  test_sysfs();
  test_no_device_errors();
  test_ring_device_list();
  printf("test_verbs_device: %s (%d failure%s)\n", g_failures ? "FAILED" : "ALL PASSED", g_failures,
         g_failures == 1 ? "" : "s");
  return g_failures ? 1 : 0;
}

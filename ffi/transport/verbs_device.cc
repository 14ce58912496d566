#include "transport/verbs_device.h"

#include <arpa/inet.h>
#include <dirent.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <utility>

namespace arx::verbs {
namespace {

// The first line of a sysfs file, or "" (also for the EINVAL that reading an
// unused GID's attributes returns).
std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  if (!f || !std::getline(f, s)) return "";
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
  return s;
}

std::vector<std::string> list_dir(const std::string& path) {
  std::vector<std::string> out;
  if (DIR* d = opendir(path.c_str())) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') out.push_back(e->d_name);
    closedir(d);
  }
  return out;
}

bool is_ipv4_mapped(const uint8_t raw[16]) {
  for (int i = 0; i < 10; ++i)
    if (raw[i]) return false;
  return raw[10] == 0xff && raw[11] == 0xff;
}

bool is_zero(const uint8_t raw[16]) {
  for (int i = 0; i < 16; ++i)
    if (raw[i]) return false;
  return true;
}

std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && (s[a] == ' ' || s[a] == '\t')) ++a;
  while (b > a && (s[b - 1] == ' ' || s[b - 1] == '\t')) --b;
  return s.substr(a, b - a);
}

}  // namespace

Status parse_hca_list(const std::string& text, std::vector<HcaSpec>& out, size_t max_entries) {
  out.clear();
  std::string t = trim(text);
  if (!t.empty() && t[0] == '=') t = t.substr(1);  // NCCL's "exact names" prefix: names are always exact here
  if (t.empty()) return Status::Ok();
  if (t[0] == '^')
    return Status::Error(
        strf("jax_arx: JAX_ARX_IB_HCA=%s: exclusion lists ('^') are not supported; name the "
             "device of each root, e.g. JAX_ARX_IB_HCA=mlx5_0,mlx5_1",
             text.c_str()));
  size_t start = 0;
  while (start <= t.size()) {
    const size_t comma = std::min(t.find(',', start), t.size());
    const std::string item = trim(t.substr(start, comma - start));
    start = comma + 1;
    HcaSpec spec;
    const size_t colon = item.find(':');
    spec.name = item.substr(0, colon);
    if (colon != std::string::npos) {
      const std::string p = item.substr(colon + 1);
      char* end = nullptr;
      const long port = std::strtol(p.c_str(), &end, 10);
      if (p.empty() || *end || port < 1 || port > 255) spec.name.clear();
      spec.port = (int)port;
    }
    if (spec.name.empty())
      return Status::Error(
          strf("jax_arx: JAX_ARX_IB_HCA=%s: '%s' is not a device name with an optional port "
               "(mlx5_0 or mlx5_0:1)",
               text.c_str(), item.c_str()));
    out.push_back(spec);
  }
  if (out.size() > max_entries && max_entries <= 2)
    return Status::Error(
        strf("jax_arx: JAX_ARX_IB_HCA=%s lists %zu devices; the verbs carrier takes one or two, "
             "the devices of root 0 and root 1 (e.g. the two PCIe functions of one port on GB10; "
             "four, two ports of two, only in a ring: JAX_ARX_TOPOLOGY=ring)",
             text.c_str(), out.size()));
  if (out.size() > max_entries)
    return Status::Error(
        strf("jax_arx: JAX_ARX_IB_HCA=%s lists %zu devices; a ring takes at most four: the port "
             "facing the previous rank, then the port facing the next, each as its two functions",
             text.c_str(), out.size()));
  return Status::Ok();
}

bool parse_gid(const std::string& text, uint8_t raw[16]) { return inet_pton(AF_INET6, text.c_str(), raw) == 1; }

std::string gid_text(const uint8_t raw[16]) {
  if (is_ipv4_mapped(raw)) return strf("%u.%u.%u.%u", raw[12], raw[13], raw[14], raw[15]);
  char buf[INET6_ADDRSTRLEN] = {};
  if (!inet_ntop(AF_INET6, raw, buf, sizeof buf)) return "?";
  return buf;
}

std::vector<GidEntry> read_gid_table(const std::string& sysfs, const std::string& dev, int port) {
  const std::string dir = strf("%s/%s/ports/%d/", sysfs.c_str(), dev.c_str(), port);
  std::vector<GidEntry> out;
  for (const std::string& name : list_dir(dir + "gids")) {
    char* end = nullptr;
    const long index = std::strtol(name.c_str(), &end, 10);
    if (*end || index < 0) continue;
    GidEntry e;
    e.index = (int)index;
    e.gid = read_line(dir + "gids/" + name);
    uint8_t raw[16];
    if (!parse_gid(e.gid, raw) || is_zero(raw)) continue;
    e.type = read_line(dir + "gid_attrs/types/" + name);
    e.ndev = read_line(dir + "gid_attrs/ndevs/" + name);
    out.push_back(e);
  }
  std::sort(out.begin(), out.end(), [](const GidEntry& a, const GidEntry& b) { return a.index < b.index; });
  return out;
}

std::vector<std::string> own_netdevs(const std::string& sysfs, const std::string& dev) {
  std::vector<std::string> out = list_dir(strf("%s/%s/device/net", sysfs.c_str(), dev.c_str()));
  const std::string parent = read_line(strf("%s/%s/parent", sysfs.c_str(), dev.c_str()));
  if (!parent.empty() && std::find(out.begin(), out.end(), parent) == out.end()) out.push_back(parent);
  return out;
}

int pick_roce_v2_gid(const std::vector<GidEntry>& table, const std::vector<std::string>& own, std::string& why) {
  int best = -1;
  bool best_own = false;
  for (const GidEntry& e : table) {
    uint8_t raw[16];
    if (e.type != "RoCE v2" || !parse_gid(e.gid, raw) || !is_ipv4_mapped(raw)) continue;
    const bool mine = own.empty() || std::find(own.begin(), own.end(), e.ndev) != own.end();
    if (best < 0 || (mine && !best_own)) {
      best = e.index;
      best_own = mine;
    }
  }
  if (best >= 0) return best;
  if (table.empty()) {
    why = "its GID table is empty (no IP address on its netdev?)";
    return -1;
  }
  why = "its GID table holds no RoCE v2 GID with an IPv4 address:";
  size_t shown = 0;
  for (const GidEntry& e : table) {
    if (++shown > 8) {
      why += strf(" (and %zu more)", table.size() - 8);
      break;
    }
    uint8_t raw[16];
    parse_gid(e.gid, raw);
    why += strf(" [%d] %s %s%s%s", e.index, gid_text(raw).c_str(), e.type.empty() ? "(no type)" : e.type.c_str(),
                e.ndev.empty() ? "" : " on ", e.ndev.c_str());
  }
  return -1;
}

#if ARX_HAVE_VERBS

namespace {

const char* port_state_name(ibv_port_state s) {
  switch (s) {
    case IBV_PORT_NOP:
      return "NOP";
    case IBV_PORT_DOWN:
      return "DOWN";
    case IBV_PORT_INIT:
      return "INIT";
    case IBV_PORT_ARMED:
      return "ARMED";
    case IBV_PORT_ACTIVE:
      return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER:
      return "ACTIVE_DEFER";
    default:
      return "unknown";
  }
}

// Opens `dev`, picks its port (want_port, or the first active one) and its GID.
Status open_one(const Api& api, ibv_device* dev, const std::string& name, int want_port, int64_t gid_index, Device& d) {
  d = Device();
  d.name = name;
  errno = 0;
  d.ctx = api.open_device(dev);
  if (!d.ctx)
    return Status::Error(
        strf("jax_arx: ibv_open_device(%s) failed: %s; the user needs read-write access to "
             "/dev/infiniband/uverbs* (containers: pass --device=/dev/infiniband), or name another "
             "device in JAX_ARX_IB_HCA",
             name.c_str(), error_text(-1).c_str()));
  auto fail = [&](std::string message) {
    api.close_device(d.ctx);
    d.ctx = nullptr;
    return Status::Error(std::move(message));
  };
  if (int rc = api.query_device(d.ctx, &d.attr))
    return fail(strf("jax_arx: ibv_query_device(%s) failed: %s", name.c_str(), error_text(rc).c_str()));
  const int ports = d.attr.phys_port_cnt;
  if (want_port > ports)
    return fail(strf("jax_arx: JAX_ARX_IB_HCA asks for %s port %d, but %s has %d port%s", name.c_str(), want_port,
                     name.c_str(), ports, ports == 1 ? "" : "s"));
  std::string states;
  for (int p = want_port ? want_port : 1; p <= (want_port ? want_port : ports); ++p) {
    ibv_port_attr pa;
    if (int rc = query_port(api, d.ctx, (uint8_t)p, &pa))
      return fail(strf("jax_arx: ibv_query_port(%s port %d) failed: %s", name.c_str(), p, error_text(rc).c_str()));
    if (pa.state == IBV_PORT_ACTIVE) {
      d.port = p;
      d.port_attr = pa;
      break;
    }
    states += strf("%sport %d is %s (physical state %d)", states.empty() ? "" : ", ", p, port_state_name(pa.state),
                   (int)pa.phys_state);
  }
  if (!d.port)
    return fail(
        strf("jax_arx: %s has no active port: %s. Bring its link up (check the cable and `ip link` of its "
             "netdev; ibv_devinfo shows the port state) or name another device in JAX_ARX_IB_HCA",
             name.c_str(), states.c_str()));
  d.ethernet = d.port_attr.link_layer == IBV_LINK_LAYER_ETHERNET;
  const std::string where = strf("%s port %d", name.c_str(), d.port);
  const std::vector<GidEntry> table =
      d.ethernet ? read_gid_table(kSysfsInfiniband, name, d.port) : std::vector<GidEntry>();
  if (gid_index >= 0) {
    d.gid_forced = true;
    if (gid_index >= d.port_attr.gid_tbl_len)
      return fail(
          strf("jax_arx: JAX_ARX_IB_GID_INDEX=%lld, but the GID table of %s has %d entries; unset it to "
               "find the RoCE v2 GID, or pick an index that show_gids (or ibv_devinfo -v) lists",
               (long long)gid_index, where.c_str(), d.port_attr.gid_tbl_len));
    d.gid_index = (int)gid_index;
  } else if (d.ethernet) {
    std::string why;
    d.gid_index = pick_roce_v2_gid(table, own_netdevs(kSysfsInfiniband, name), why);
    if (d.gid_index < 0)
      return fail(
          strf("jax_arx: %s: %s. RoCE v2 needs an IPv4 address on the device's netdev (ip addr add "
               "ADDR/PREFIX dev NETDEV; `rdma link` shows which netdev), or set JAX_ARX_IB_GID_INDEX to "
               "the GID to use",
               where.c_str(), why.c_str()));
  } else {
    d.gid_index = 0;  // InfiniBand: GID 0 is the port GUID's; peers are addressed by LID
  }
  for (const GidEntry& e : table)
    if (e.index == d.gid_index) d.netdev = e.ndev;
  if (int rc = api.query_gid(d.ctx, (uint8_t)d.port, d.gid_index, &d.gid))
    return fail(strf("jax_arx: ibv_query_gid(%s, index %d) failed: %s; %s", where.c_str(), d.gid_index,
                     error_text(rc).c_str(),
                     d.gid_forced ? "JAX_ARX_IB_GID_INDEX names an unusable entry; unset it to find the RoCE v2 GID"
                                  : "set JAX_ARX_IB_GID_INDEX to an index that show_gids lists"));
  if (is_zero(d.gid.raw))
    return fail(strf("jax_arx: GID index %d of %s is empty; %s", d.gid_index, where.c_str(),
                     d.gid_forced ? "unset JAX_ARX_IB_GID_INDEX to find the RoCE v2 GID, or pick an index that "
                                    "show_gids lists"
                                  : "set JAX_ARX_IB_GID_INDEX to an index that show_gids lists"));
  return Status::Ok();
}

}  // namespace

std::string describe(const Device& d) {
  return strf("%s port %d GID[%d] %s%s%s", d.name.c_str(), d.port, d.gid_index, gid_text(d.gid.raw).c_str(),
              d.netdev.empty() ? "" : " on ", d.netdev.c_str());
}

void close_devices(const Api& api, std::vector<Device>& devices) {
  for (Device& d : devices)
    if (d.ctx) api.close_device(d.ctx);
  devices.clear();
}

Status open_devices(const Api& api, const std::string& hca, int64_t gid_index, size_t max_entries,
                    std::vector<Device>& out, std::string& note) {
  std::vector<HcaSpec> specs;
  ARX_RETURN_IF_ERROR(parse_hca_list(hca, specs, max_entries));
  int n = 0;
  errno = 0;
  ibv_device** list = api.get_device_list(&n);
  if (!list || n <= 0) {
    const std::string e = error_text(-1);
    if (list) api.free_device_list(list);
    return Status::Error(
        strf("jax_arx: no RDMA devices found (ibv_get_device_list: %s). No RDMA driver is loaded "
             "(mlx5_ib; rdma_rxe for soft-RoCE), or /dev/infiniband and /sys/class/infiniband are "
             "not visible here (containers). ibv_devices lists the devices; set "
             "JAX_ARX_TRANSPORT=tcp to run without RDMA",
             n == 0 && list ? "none" : e.c_str()));
  }
  std::vector<std::pair<std::string, ibv_device*>> all;
  for (int i = 0; i < n; ++i) all.emplace_back(api.get_device_name(list[i]), list[i]);
  std::sort(all.begin(), all.end());
  std::string names;
  for (const auto& [name, dev] : all) names += (names.empty() ? "" : ", ") + name;

  std::vector<Device> devices;
  Status st;
  if (!specs.empty()) {
    for (const HcaSpec& spec : specs) {
      auto it = std::find_if(all.begin(), all.end(), [&](const auto& p) { return p.first == spec.name; });
      if (it == all.end()) {
        st =
            Status::Error(strf("jax_arx: JAX_ARX_IB_HCA names %s, which is not an RDMA device of this host (it has "
                               "%s); set JAX_ARX_IB_HCA to one or two of these",
                               spec.name.c_str(), names.c_str()));
        break;
      }
      Device d;
      st = open_one(api, it->second, it->first, spec.port, gid_index, d);
      if (!st.ok()) break;
      devices.push_back(d);
    }
  } else {
    std::string skipped;
    for (const auto& [name, dev] : all) {
      Device d;
      Status s = open_one(api, dev, name, 0, gid_index, d);
      if (!s.ok()) {
        skipped += "\n  " + s.message();
        continue;
      }
      devices.push_back(d);
      if (devices.size() == 2) break;
    }
    if (devices.empty())
      st =
          Status::Error(strf("jax_arx: none of this host's RDMA devices (%s) has an active port with a usable GID:%s"
                             "\nSet JAX_ARX_IB_HCA (and, if needed, JAX_ARX_IB_GID_INDEX), or JAX_ARX_TRANSPORT=tcp",
                             names.c_str(), skipped.c_str()));
    else if (all.size() > devices.size())
      note = strf("devices chosen among %s; set JAX_ARX_IB_HCA to choose", names.c_str());
  }
  api.free_device_list(list);  // opened contexts stay valid
  if (!st.ok()) {
    close_devices(api, devices);
    return st;
  }
  out = std::move(devices);
  return Status::Ok();
}

#endif  // ARX_HAVE_VERBS

}  // namespace arx::verbs

// Which RDMA devices and ports a verbs carrier uses, and which GID on each.
//
// Devices come from JAX_ARX_IB_HCA (Config::ib_hca), NCCL_IB_HCA style:
// "mlx5_0,mlx5_1", optionally with a port ("mlx5_0:1"). Each entry is one
// root: two entries split every write over two NIC functions (GB10's two
// PCIe roots), one sends it whole. Empty: the first one or two devices, by
// name, that have an active port. In a ring the list names two ports, the
// one facing prev first, each as one or two entries (verbs_carrier.h).
//
// On RoCE the GID index is found, never assumed: the table's order depends
// on the driver, the addresses configured and their order, so index 3 on one
// box is index 1 on the next. The pick is the RoCE v2 GID holding an IPv4
// address (::ffff:a.b.c.d) of the device's own netdev, read from sysfs
// (ports/<p>/gids/<i>, gid_attrs/types/<i>, gid_attrs/ndevs/<i>), which
// every kernel since 4.9 provides. Config::ib_gid_index >= 0 forces one.
//
// The sysfs half below needs no verbs headers, so its tests run anywhere.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

#include "transport/verbs_build.h"
#if ARX_HAVE_VERBS
#include "transport/verbs_lib.h"
#endif

namespace arx::verbs {

constexpr const char* kSysfsInfiniband = "/sys/class/infiniband";

// One entry of JAX_ARX_IB_HCA. port 0: the device's first active port.
struct HcaSpec {
  std::string name;
  int port = 0;
};
// At most `max_entries`: 2 in a mesh (root 0, root 1), 4 in a ring.
Status parse_hca_list(const std::string& text, std::vector<HcaSpec>& out, size_t max_entries = 2);

// One used row of a port's GID table, as sysfs shows it.
struct GidEntry {
  int index = 0;
  std::string gid;   // "0000:0000:0000:0000:0000:ffff:c633:6401"
  std::string type;  // "RoCE v2", "IB/RoCE v1", or empty where the kernel has no gid_attrs
  std::string ndev;  // the netdev the GID belongs to ("veth0", "eth0.100"), or empty
};
std::vector<GidEntry> read_gid_table(const std::string& sysfs, const std::string& dev, int port);
// The netdevs of the device itself: <dev>/device/net/* (a PCI function), or
// the contents of <dev>/parent (soft-RoCE).
std::vector<std::string> own_netdevs(const std::string& sysfs, const std::string& dev);
// The RoCE v2 IPv4 GID, preferring one on an own netdev over one on another
// (a VLAN or macvlan on top), then the lowest index. -1 when there is none;
// `why` then says what the table holds.
int pick_roce_v2_gid(const std::vector<GidEntry>& table, const std::vector<std::string>& own, std::string& why);
// "198.51.100.1" for an IPv4-mapped GID, else the 8 hex groups.
std::string gid_text(const uint8_t raw[16]);
// Parses sysfs's 8-group form; false when malformed.
bool parse_gid(const std::string& text, uint8_t raw[16]);
// The bytes of an enum ibv_mtu value (1 = 256 ... 5 = 4096).
inline int mtu_bytes(int mtu) { return mtu >= 1 && mtu <= 5 ? 128 << mtu : 0; }

#if ARX_HAVE_VERBS

// One opened device, its chosen port and GID.
struct Device {
  std::string name;
  int port = 0;
  ibv_context* ctx = nullptr;
  ibv_device_attr attr{};
  ibv_port_attr port_attr{};
  bool ethernet = true;  // RoCE; false: InfiniBand link layer (addressed by LID)
  int gid_index = 0;
  ibv_gid gid{};
  std::string netdev;  // the GID's netdev, for messages
  bool gid_forced = false;
};

// Opens the devices `hca` names (at most `max_entries`, as parse_hca_list;
// or finds one or two, when empty) and picks each one's port and GID. Errors say which device, port or GID was wrong
// and which setting fixes it; on error nothing stays open.
Status open_devices(const Api& api, const std::string& hca, int64_t gid_index, size_t max_entries,
                    std::vector<Device>& out, std::string& note);
void close_devices(const Api& api, std::vector<Device>& devices);
// "rxe0 port 1 GID[3] 198.51.100.1", for messages.
std::string describe(const Device& d);

#endif  // ARX_HAVE_VERBS

}  // namespace arx::verbs

// kvbridge::verbs::Discover: the RDMA devices of this machine and their ports, as the verbs
// transport chooses rails from them (docs/transports/verbs.md). Reads libibverbs
// (ibv_get_device_list, ibv_query_device, ibv_query_port) and sysfs
// (/sys/class/infiniband/<dev>/device: NUMA node and PCI address).
// Thread-safety: Discover may be called from any thread; it keeps no state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvbridge/plugin/sdk/common.hpp"

namespace kvbridge::verbs {

struct PortInfo {
  uint8_t port = 0;        // 1-based, as libibverbs numbers them
  bool active = false;     // IBV_PORT_ACTIVE
  bool ethernet = false;   // link layer Ethernet (RoCE), else InfiniBand
  uint16_t lid = 0;        // InfiniBand only
  uint32_t gid_table = 0;  // GIDs the port has
  std::string state;       // "ACTIVE", "DOWN", ... (ibv_port_state_str)
};

struct DeviceInfo {
  std::string name;    // "mlx5_0"
  std::string pci;     // "0000:17:00.0", "" when sysfs does not say
  int numa_node = -1;  // -1 when sysfs does not say
  std::string error;   // set when the device could not be opened or queried (ports empty)
  std::vector<PortInfo> ports;
};

// Every RDMA device libibverbs lists. UNAVAILABLE "no RDMA device (...)" when it lists none
// (or cannot list: no kernel support), naming what libibverbs said.
plugin::sdk::Result<std::vector<DeviceInfo>> Discover();

// The same, with sysfs read under `sysfs_root` instead of /sys (tests).
plugin::sdk::Result<std::vector<DeviceInfo>> Discover(const std::string& sysfs_root);

}  // namespace kvbridge::verbs

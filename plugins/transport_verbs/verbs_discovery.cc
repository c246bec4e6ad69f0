#include "verbs_discovery.h"

#include <infiniband/verbs.h>
#include <limits.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

namespace kvbridge::verbs {
namespace {

namespace sdk = kvbridge::plugin::sdk;

std::string ReadLine(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

// "0000:17:00.0" from the device link ".../0000:16:02.0/0000:17:00.0".
std::string PciOf(const std::string& device_dir) {
  char buf[PATH_MAX];
  const ssize_t n = readlink(device_dir.c_str(), buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  std::string target(buf, static_cast<size_t>(n));
  const size_t slash = target.rfind('/');
  return slash == std::string::npos ? target : target.substr(slash + 1);
}

DeviceInfo Describe(ibv_device* dev, const std::string& sysfs_root) {
  DeviceInfo d;
  d.name = ibv_get_device_name(dev);
  const std::string dir = sysfs_root + "/class/infiniband/" + d.name + "/device";
  d.pci = PciOf(dir);
  const std::string numa = ReadLine(dir + "/numa_node");
  if (!numa.empty()) d.numa_node = std::atoi(numa.c_str());
  ibv_context* ctx = ibv_open_device(dev);
  if (ctx == nullptr) {
    d.error = std::string("ibv_open_device: ") + std::strerror(errno);
    return d;
  }
  ibv_device_attr attr{};
  if (const int rc = ibv_query_device(ctx, &attr); rc != 0) {
    d.error = std::string("ibv_query_device: ") + std::strerror(rc);
  } else {
    for (uint8_t p = 1; p <= attr.phys_port_cnt; ++p) {
      ibv_port_attr pa{};
      if (ibv_query_port(ctx, p, &pa) != 0) continue;
      PortInfo port;
      port.port = p;
      port.active = pa.state == IBV_PORT_ACTIVE;
      port.ethernet = pa.link_layer == IBV_LINK_LAYER_ETHERNET;
      port.lid = pa.lid;
      port.gid_table = static_cast<uint32_t>(pa.gid_tbl_len);
      port.state = ibv_port_state_str(pa.state);
      d.ports.push_back(port);
    }
  }
  ibv_close_device(ctx);
  return d;
}

}  // namespace

sdk::Result<std::vector<DeviceInfo>> Discover() { return Discover("/sys"); }

sdk::Result<std::vector<DeviceInfo>> Discover(const std::string& sysfs_root) {
  int n = 0;
  errno = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list == nullptr) {
    const int err = errno;
    return sdk::Status(KVB_ERR_UNAVAILABLE, std::string("no RDMA device (ibv_get_device_list: ") +
                                                (err != 0 ? std::strerror(err) : "failed") + ")");
  }
  std::vector<DeviceInfo> out;
  for (int i = 0; i < n; ++i) out.push_back(Describe(list[i], sysfs_root));
  ibv_free_device_list(list);
  if (out.empty()) {
    return sdk::Status(KVB_ERR_UNAVAILABLE,
                       "no RDMA device (ibv_get_device_list found none; no RDMA NIC, or its "
                       "driver or rdma-core provider is not loaded)");
  }
  return out;
}

}  // namespace kvbridge::verbs

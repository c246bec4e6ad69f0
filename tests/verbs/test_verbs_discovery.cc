// verbs::Discover (plugins/transport_verbs/verbs_discovery.h) against this machine's libibverbs:
// without an RDMA device (the test machine) it is UNAVAILABLE "no RDMA device (...)"; where
// devices exist each is named and its ports listed (or the error that kept them from it).
#include <gtest/gtest.h>

#include <iostream>
#include <string>

#include "verbs_discovery.h"

namespace kvbridge::verbs {
namespace {

TEST(VerbsDiscovery, NoDeviceIsANamedUnavailableElseEveryDeviceIsDescribed) {
  auto devices = Discover();
  if (!devices.ok()) {
    EXPECT_EQ(devices.status().code(), KVB_ERR_UNAVAILABLE) << devices.status().message();
    EXPECT_EQ(devices.status().message().rfind("no RDMA device (", 0), 0u)
        << devices.status().message();
    std::cout << "[ INFO     ] " << devices.status().message() << "\n";
    return;
  }
  ASSERT_FALSE(devices.value().empty());
  for (const DeviceInfo& d : devices.value()) {
    EXPECT_FALSE(d.name.empty());
    EXPECT_TRUE(!d.ports.empty() || !d.error.empty()) << d.name << " has no port and no error";
    for (const PortInfo& p : d.ports) {
      EXPECT_GE(p.port, 1);
      EXPECT_FALSE(p.state.empty());
    }
    std::cout << "[ INFO     ] " << d.name << " pci " << d.pci << " numa " << d.numa_node << ", "
              << d.ports.size() << " port(s)" << (d.error.empty() ? "" : ", " + d.error) << "\n";
  }
}

}  // namespace
}  // namespace kvbridge::verbs

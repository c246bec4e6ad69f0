// A real `kvbridge master` process on a free loopback port and store::MasterClient instances
// pointed at it: the fixture of tests/store/test_master_client.cc and
// tests/store/test_master_fast_port.cc.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <memory>
#include <string>
#include <vector>

#include "store/master_client.h"
#include "tests/common/test_util.h"
#include "tests/store/store_procs.h"

namespace kvbridge::testing {

class MasterClientFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    port_ = FreePort();
    address_ = "127.0.0.1:" + std::to_string(port_);
  }

  // Starts (or starts again, on the same port) the master, with `token` as its cluster token
  // and `extra` flags.
  void StartMaster(const std::string& token = "", const std::vector<std::string>& extra = {}) {
    if (!token.empty()) setenv("KVBRIDGE_CLUSTER_TOKEN", token.c_str(), 1);
    master_ = testing::StartMaster(address_, extra);
    if (!token.empty()) unsetenv("KVBRIDGE_CLUSTER_TOKEN");
    ASSERT_TRUE(master_);
  }

  std::unique_ptr<store::MasterClient> Client(uint32_t rpc_timeout_ms,
                                              const std::string& token = "",
                                              bool heartbeat_channel = false,
                                              bool fast_path = true) {
    store::MasterClient::Options o;
    o.address = address_;
    o.cluster_token = token;
    o.retry.rpc_timeout_ms = rpc_timeout_ms;
    o.heartbeat_channel = heartbeat_channel;
    o.fast_path = fast_path;
    return std::make_unique<store::MasterClient>(std::move(o));
  }

  uint16_t port_ = 0;
  std::string address_;
  std::unique_ptr<ChildProcess> master_;
  const std::vector<std::string> keys_{"k0", "k1"};
};

}  // namespace kvbridge::testing

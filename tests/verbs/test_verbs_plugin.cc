// libkvb_transport_verbs.so through the real plugin loader and the transfer engine, on this
// machine: without an RDMA device its probe is UNAVAILABLE naming "no RDMA device", an engine
// with the default transports starts without it, and an engine naming ["verbs"] fails with that
// reason. Where a device exists these cases skip (tests/conformance runs "verbs" there).
#include <gtest/gtest.h>

#include <string>

#include "core/plugin_loader.h"
#include "kvbridge/engine.h"
#include "verbs_discovery.h"

namespace kvbridge {
namespace {

const std::string kPlugin = std::string(KVBRIDGE_PLUGIN_BUILD_DIR) + "/libkvb_transport_verbs.so";

#define SKIP_WITH_A_DEVICE()                              \
  if (verbs::Discover().ok())                             \
  GTEST_SKIP() << "this machine has an RDMA device; the " \
                  "conformance suite runs verbs on it instead"

TEST(VerbsPlugin, ProbeThroughTheLoaderIsUnavailableNamingNoRdmaDevice) {
  SKIP_WITH_A_DEVICE();
  core::PluginRegistry reg;
  const core::PluginInfo& info = reg.LoadFile(kPlugin);
  EXPECT_EQ(info.name, "verbs");
  EXPECT_EQ(info.kind, KVB_PLUGIN_TRANSPORT);
  ASSERT_EQ(info.state, core::PluginState::kUnavailable) << info.reason;
  EXPECT_NE(info.reason.find("no RDMA device"), std::string::npos) << info.reason;
  const uint64_t want = KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM | KVB_TCAP_CUDA_MEM |
                        KVB_TCAP_CUDA_DIRECT | KVB_TCAP_STATS;
  EXPECT_EQ(info.caps, want) << "not OPT_IN: where a NIC exists it is used";
}

TEST(VerbsPlugin, AnEngineWithDefaultTransportsStartsWithoutIt) {
  SKIP_WITH_A_DEVICE();
  EngineOptions o;
  o.node_id = "verbs-default";
  o.plugin_path = KVBRIDGE_PLUGIN_BUILD_DIR;
  auto e = TransferEngine::Create(o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
}

TEST(VerbsPlugin, AnEngineNamingVerbsFailsUnavailable) {
  SKIP_WITH_A_DEVICE();
  EngineOptions o;
  o.node_id = "verbs-named";
  o.plugin_path = KVBRIDGE_PLUGIN_BUILD_DIR;
  o.transports = {"verbs"};
  auto e = TransferEngine::Create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kUnavailable) << e.status().ToString();
  EXPECT_NE(e.status().message().find("no RDMA device"), std::string::npos)
      << e.status().ToString();
}

}  // namespace
}  // namespace kvbridge

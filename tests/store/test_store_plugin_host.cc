// One plugin scan per process: the storage nodes' engines, DRAM pools and SSD tiers and the
// client's engine of an EmbeddedCluster all take their plugins from one core::PluginHost
// (csrc/core/plugin_host.h). Before it, each engine, pool and tier scanned the directories anew.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "core/plugin_host.h"
#include "kvbridge/store.h"
#include "tests/common/test_util.h"

namespace kvbridge {
namespace {

namespace fs = std::filesystem;
using testing::Buffer;
using testing::Must;

TEST(PluginHost, OneScanPerProcess) {
  const fs::path ssd_so = fs::path(KVBRIDGE_PLUGIN_BUILD_DIR_FOR_TESTS) / "libkvb_storage_ssd.so";
  if (!fs::exists(ssd_so)) GTEST_SKIP() << ssd_so << " is not built";
  const fs::path dir = fs::temp_directory_path() / ("kvb-one-scan-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "plugins");  // empty: makes this test's search path its own

  EmbeddedClusterOptions o;
  o.nodes = 2;
  o.dram_bytes_per_node = 8u << 20;
  o.ssd_dir = (dir / "ssd").string();
  o.ssd_bytes_per_node = 64u << 20;
  o.engine.transports = {"tcp"};
  o.engine.plugin_path = (dir / "plugins").string();
  const uint64_t before = core::PluginHost::ScanCount();
  {
    auto cluster = Must(EmbeddedCluster::Start(o));
    EXPECT_EQ(core::PluginHost::ScanCount() - before, 1u)
        << "3 engines, 2 DRAM pools and 2 SSD tiers in one process: one scan";
    for (const auto& node : cluster->nodes()) {
      EXPECT_TRUE(node->ssd_status().ok()) << node->ssd_status().ToString();
    }
    // The shared instances still move bytes.
    Buffer arena(8192);
    arena.Fill(1, 0, 4096);
    StoreClient& client = cluster->client();
    ASSERT_TRUE(client.RegisterBuffer(arena.data(), arena.size()).ok());
    const std::vector<std::string> keys = {"k"};
    const std::vector<std::vector<BufferRef>> put = {{BufferRef{arena.data(), 4096}}};
    const std::vector<std::vector<BufferRef>> get = {{BufferRef{arena.data() + 4096, 4096}}};
    ASSERT_TRUE(client.BatchPutFrom(keys, put)[0].ok());
    ASSERT_TRUE(client.BatchGetInto(keys, get)[0].ok());
    EXPECT_TRUE(arena.Matches(1, 4096, 4096, 0));
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvbridge

// core::PluginHost (one scan per search path per process, instances keep the libraries mapped)
// and core::StorageInstance's status mapping, with the testing plugins. The transport wrapper
// is pinned in test_mock_transport.cc; one scan for a whole storage node process in
// tests/store/test_store_plugin_host.cc.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "core/plugin_host.h"

namespace kvbridge::core {
namespace {

const std::string kTestDir = KVBRIDGE_TEST_PLUGIN_BUILD_DIR;
const std::string kMockTransport = kTestDir + "/libkvb_transport_mock.so";

bool Mapped(const std::string& path) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) return false;
  dlclose(h);  // drops only the reference NOLOAD added
  return true;
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kvb_host_XXXXXX").string();
    EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(PluginHost, SameSearchPathSharesOneHostScannedOnce) {
  TempDir extra;  // makes this test's path list its own
  const uint64_t before = PluginHost::ScanCount();
  auto a = PluginHost::Acquire({extra.path(), kTestDir});
  EXPECT_EQ(PluginHost::ScanCount(), before + 1);
  // The same directories under other names, and repeated: the same host, no scan.
  auto b = PluginHost::Acquire({extra.path() + "/.", kTestDir + "/", extra.path()});
  EXPECT_EQ(a, b);
  EXPECT_EQ(PluginHost::ScanCount(), before + 1);
  EXPECT_EQ(a->dirs().size(), 2u);
  EXPECT_NE(a->registry().Find(KVB_PLUGIN_TRANSPORT, "mock"), nullptr);
  // Another order is another search path (the first plugin of a name wins).
  auto c = PluginHost::Acquire({kTestDir, extra.path()});
  EXPECT_NE(c, a);
  EXPECT_EQ(PluginHost::ScanCount(), before + 2);
  // Once nobody holds it, the next Acquire scans again (plugins added since are seen).
  a.reset();
  b.reset();
  auto d = PluginHost::Acquire({extra.path(), kTestDir});
  EXPECT_EQ(PluginHost::ScanCount(), before + 3);
}

TEST(PluginHost, InstancesKeepTheLibraryMapped) {
  TempDir extra;
  const bool mapped_before = Mapped(kMockTransport);  // another holder in this process
  auto host = PluginHost::Acquire({extra.path(), kTestDir});
  const PluginInfo* mock = host->registry().Find(KVB_PLUGIN_TRANSPORT, "mock");
  ASSERT_NE(mock, nullptr);
  TransportConfig config;
  config.node_id = "host-test";
  config.incarnation = 7;
  auto t = host->CreateTransport(*mock, config);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  host.reset();  // the instance holds it
  EXPECT_TRUE(Mapped(kMockTransport));
  EXPECT_EQ(t.value()->endpoints(), "mock:host-test");  // still callable
  t.value().reset();
  if (!mapped_before) {
    EXPECT_FALSE(Mapped(kMockTransport)) << "unmapped with the last instance";
  }
}

// ABI 1.3 instance_caps: the instance's caps are its descriptor's, less what instance_caps left
// out; a bit the descriptor lacks is never added.
TEST(PluginHost, AnInstanceNarrowsItsCapsButNeverWidensThem) {
  auto host = PluginHost::Acquire({kTestDir});
  const PluginInfo* mock = host->registry().Find(KVB_PLUGIN_TRANSPORT, "mock");
  ASSERT_NE(mock, nullptr);
  ASSERT_NE(mock->caps & KVB_TCAP_STATS, 0u);
  ASSERT_EQ(mock->caps & KVB_TCAP_CUDA_MEM, 0u);
  TransportConfig config;
  config.node_id = "caps-a";
  auto plain = host->CreateTransport(*mock, config);
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain.value()->caps(), mock->caps);
  config.node_id = "caps-b";
  config.plugin_config["mock.instance_caps"] =
      std::to_string(KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM | KVB_TCAP_CUDA_MEM |
                     KVB_TCAP_CUDA_DIRECT);
  auto narrowed = host->CreateTransport(*mock, config);
  ASSERT_TRUE(narrowed.ok()) << narrowed.status().ToString();
  EXPECT_EQ(narrowed.value()->caps(), KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM);
}

TEST(PluginHost, StorageRequirementsAreCheckedBeforeCreate) {
  auto host = PluginHost::Acquire({KVBRIDGE_PLUGIN_BUILD_DIR, kTestDir});
  StorageConfig config;
  config.node_id = "host-test";
  config.capacity_bytes = 4u << 20;
  config.require_caps = KVB_SCAP_OBJECTS;
  auto s = host->CreateStorage("dram", config);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(s.status().Is(StatusCode::kUnavailable));
  EXPECT_EQ(s.status().message(), "storage plugin 'dram': does not store keyed objects");
  config.require_meta = true;
  s = host->CreateStorage("dram", config);
  EXPECT_EQ(s.status().message(),
            "storage plugin 'dram': does not store keyed objects with metadata (ABI 1.1)");
  s = host->CreateStorage("no_such_plugin", config);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(s.status().Is(StatusCode::kUnavailable));
  EXPECT_NE(s.status().message().find("no storage plugin named 'no_such_plugin'"),
            std::string::npos)
      << s.status().ToString();
  config.require_caps = KVB_SCAP_POOL;
  config.require_meta = false;
  config.capacity_bytes = 0;  // the plugin's create() refuses it: its message, in context
  s = host->CreateStorage("dram", config);
  ASSERT_FALSE(s.ok());
  EXPECT_TRUE(s.status().Is(StatusCode::kInvalidArgument)) << s.status().ToString();
  EXPECT_EQ(s.status().message().rfind("storage plugin 'dram': ", 0), 0u) << s.status().ToString();
}

TEST(StorageInstance, StatusesMapFromTheAbi) {
  auto host = PluginHost::Acquire({kTestDir});
  StorageConfig config;
  config.node_id = "host-test";
  config.capacity_bytes = 1u << 20;
  auto created = host->CreateStorage("mock", config);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  StorageInstance& s = *created.value();
  EXPECT_EQ(s.name(), "mock");
  EXPECT_TRUE(s.has_meta());

  std::vector<uint8_t> v(100, 7);
  kvb_iovec_t iov{v.data(), v.size()};
  ASSERT_TRUE(s.Put("k", {&iov, 1}).ok());
  EXPECT_TRUE(s.Put("k", {&iov, 1}).Is(StatusCode::kAlreadyExists));
  std::vector<uint8_t> small(10);
  kvb_iovec_t small_iov{small.data(), small.size()};
  uint64_t length = 0;
  EXPECT_TRUE(s.Get("k", {&small_iov, 1}, &length).Is(StatusCode::kInvalidArgument));
  EXPECT_EQ(length, 100u) << "the size comes back with a too-small buffer";
  std::vector<uint8_t> out(100);
  kvb_iovec_t out_iov{out.data(), out.size()};
  ASSERT_TRUE(s.Get("k", {&out_iov, 1}, &length).ok());
  EXPECT_EQ(out, v);
  EXPECT_TRUE(s.Get("absent", {&out_iov, 1}).IsNotFound());
  std::vector<std::string> keys;
  ASSERT_TRUE(s.ForEach([&](std::string_view key, uint64_t len) {
                 keys.emplace_back(key);
                 EXPECT_EQ(len, 100u);
               }).ok());
  EXPECT_EQ(keys, std::vector<std::string>{"k"});
  Result<StorageUsage> u = s.Usage();
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_GE(u.value().object_count, 1u);
  ASSERT_TRUE(s.Remove("k").ok());
  EXPECT_TRUE(s.Remove("k").IsNotFound());
  EXPECT_TRUE(s.Free(12345).IsNotFound());
  EXPECT_TRUE(s.Alloc(0).status().Is(StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace kvbridge::core

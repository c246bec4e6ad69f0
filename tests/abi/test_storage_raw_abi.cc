// What a storage plugin promises at the C ABI itself, below core::StorageInstance (which would
// hide it): the documented out-parameter and error-buffer rules of kvb_storage_ops_t
// (csrc/include/kvbridge/plugin/storage.h), checked on every storage plugin the build produced,
// through the real loader. The behaviour suite is tests/conformance/test_storage_conformance.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/host_services.h"
#include "core/plugin_host.h"

namespace kvbridge::core {
namespace {

constexpr uint64_t kCapacity = 8u << 20;
constexpr uint64_t kSentinel = 0x5eed5eed5eed5eedull;

PluginHost& Plugins() {
  static const std::shared_ptr<PluginHost> host = PluginHost::Acquire({KVBRIDGE_PLUGIN_BUILD_DIR});
  return *host;
}

std::vector<const PluginInfo*> StoragePlugins() {
  std::vector<const PluginInfo*> out;
  for (const PluginInfo& p : Plugins().registry().plugins()) {
    if (p.kind == KVB_PLUGIN_STORAGE && p.storage_ops() != nullptr) out.push_back(&p);
  }
  return out;
}

// A fresh directory for a file-backed plugin's params.path, removed with the object.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kvb_raw_abi_XXXXXX").string();
    path_ = mkdtemp(tmpl.data()) != nullptr ? tmpl : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

kvb_storage_params_t Params(uint64_t capacity, const std::string& dir) {
  return kvb_storage_params_t{.struct_size = sizeof(kvb_storage_params_t),
                              .node_id = "raw-abi",
                              .capacity_bytes = capacity,
                              .path = dir.c_str(),
                              .on_evict = nullptr,
                              .on_evict_user = nullptr};
}

TEST(StorageRawAbi, TheBuildProducedStoragePlugins) {
  std::vector<std::string> names;
  for (const PluginInfo* p : StoragePlugins()) names.push_back(p->name);
  EXPECT_NE(std::find(names.begin(), names.end(), "dram"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "ssd"), names.end());
}

// A refused create writes a NUL-terminated, non-empty message that names the bad field, within
// err_len even when the buffer is too small for the whole message, and leaves *out NULL.
TEST(StorageRawAbi, RefusedCreateWritesATerminatedMessageWithinTheBuffer) {
  HostServices host({}, std::nullopt, nullptr);
  for (const PluginInfo* p : StoragePlugins()) {
    SCOPED_TRACE(p->name);
    const kvb_storage_ops_t* ops = p->storage_ops();
    TempDir dir;
    ASSERT_FALSE(dir.path().empty());
    const kvb_storage_params_t params = Params(0, dir.path());  // capacity 0 is invalid
    for (uint32_t err_len : {256u, 8u}) {
      std::vector<char> err(300, 'x');
      kvb_storage_t* s = nullptr;
      EXPECT_EQ(ops->create(host.table(), &params, &s, err.data(), err_len),
                KVB_ERR_INVALID_ARGUMENT);
      EXPECT_EQ(s, nullptr);
      ASSERT_NE(std::memchr(err.data(), '\0', err_len), nullptr)
          << "message not NUL-terminated within err_len " << err_len;
      EXPECT_GT(std::strlen(err.data()), 0u) << "no message";
      EXPECT_EQ(err[err_len], 'x') << "wrote past err_len " << err_len;
      if (err_len == 256) {
        EXPECT_NE(std::string(err.data()).find("capacity"), std::string::npos) << err.data();
      }
    }
  }
}

// POOL plugins: a failed alloc (no room, length 0) leaves *offset as it was.
TEST(StorageRawAbi, FailedAllocLeavesTheOffsetUntouched) {
  HostServices host({}, std::nullopt, nullptr);
  int pools = 0;
  for (const PluginInfo* p : StoragePlugins()) {
    if ((p->caps & KVB_SCAP_POOL) == 0) continue;
    ++pools;
    SCOPED_TRACE(p->name);
    const kvb_storage_ops_t* ops = p->storage_ops();
    TempDir dir;
    const kvb_storage_params_t params = Params(kCapacity, dir.path());
    kvb_storage_t* s = nullptr;
    char err[256] = {0};
    ASSERT_EQ(ops->create(host.table(), &params, &s, err, sizeof(err)), KVB_OK) << err;
    void* addr = nullptr;
    uint64_t length = 0;
    ASSERT_EQ(ops->get_segment(s, &addr, &length), KVB_OK);
    uint64_t off = kSentinel;
    EXPECT_EQ(ops->alloc(s, length + 1, &off), KVB_ERR_NO_SPACE);
    EXPECT_EQ(off, kSentinel) << "NO_SPACE wrote the offset";
    EXPECT_EQ(ops->alloc(s, 0, &off), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(off, kSentinel) << "INVALID_ARGUMENT wrote the offset";
    uint64_t whole = kSentinel;
    ASSERT_EQ(ops->alloc(s, length, &whole), KVB_OK);
    EXPECT_EQ(whole, 0u);
    EXPECT_EQ(ops->alloc(s, 4096, &off), KVB_ERR_NO_SPACE);  // full now
    EXPECT_EQ(off, kSentinel) << "NO_SPACE on a full pool wrote the offset";
    EXPECT_EQ(ops->free(s, whole), KVB_OK);
    ops->destroy(s);
  }
  EXPECT_GT(pools, 0) << "no POOL storage plugin was built";
}

}  // namespace
}  // namespace kvbridge::core

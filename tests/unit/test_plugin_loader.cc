// The plugin loader against real .so files (plugins/testing): what it loads, what it refuses,
// what it reports unavailable, and that every reason names the file and the cause.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/host_services.h"
#include "core/plugin_loader.h"

namespace kvbridge::core {
namespace {

namespace fs = std::filesystem;

const std::string kTestDir = KVBRIDGE_TEST_PLUGIN_BUILD_DIR;

std::string TestPlugin(const std::string& file) { return kTestDir + "/" + file; }

// A fresh directory under the test's temp dir, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "kvb_loader_XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Sets an environment variable for one scope and restores the old value.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)

// --- Loading real files -------------------------------------------------------------------

TEST(PluginLoader, LoadsMockTransport) {
  PluginRegistry reg;
  const std::string path = TestPlugin("libkvb_transport_mock.so");
  const PluginInfo& info = reg.LoadFile(path);
  ASSERT_EQ(info.state, PluginState::kLoaded) << info.reason;
  EXPECT_EQ(info.path, path);
  EXPECT_EQ(info.name, "mock");
  EXPECT_EQ(info.kind, KVB_PLUGIN_TRANSPORT);
  EXPECT_TRUE(info.caps & KVB_TCAP_WRITE);
  EXPECT_TRUE(info.reason.empty());
  ASSERT_NE(info.descriptor, nullptr);
  EXPECT_NE(info.transport_ops(), nullptr);
  EXPECT_EQ(info.storage_ops(), nullptr);
}

// ABI 1.5 through the raw table: with mock.local_only=1 the mock marks what it registers
// KVB_REG_LOCAL_ONLY, and refuses (UNSUPPORTED, nothing registered) a region of a 1.4 host,
// which has no reg_flags and so could not keep the key local.
TEST(PluginLoader, MockLocalOnlyNeedsRegFlagsFromTheHost) {
  PluginRegistry reg;
  const PluginInfo& info = reg.LoadFile(TestPlugin("libkvb_transport_mock.so"));
  ASSERT_EQ(info.state, PluginState::kLoaded) << info.reason;
  const kvb_transport_ops_t* ops = info.transport_ops();
  ASSERT_NE(ops, nullptr);
  HostServices host(std::map<std::string, std::string>{{"mock.local_only", "1"}});
  kvb_transport_params_t params{sizeof(params), "lo-raw", 5, nullptr, nullptr};
  kvb_transport_t* t = nullptr;
  char err[256] = "";
  ASSERT_EQ(ops->create(host.table(), &params, &t, err, sizeof(err)), KVB_OK) << err;
  std::vector<uint8_t> mem(4096);
  uint32_t flags = 0;
  kvb_region_t r{sizeof(r), KVB_MEM_HOST, 1, mem.data(), mem.size(), -1, &flags};
  uint8_t key[16];
  uint32_t key_len = 0;
  r.struct_size = offsetof(kvb_region_t, reg_flags);  // a 1.4 host's region
  EXPECT_EQ(ops->register_memory(t, &r, key, sizeof(key), &key_len), KVB_ERR_UNSUPPORTED);
  EXPECT_EQ(ops->deregister_memory(t, 1), KVB_ERR_NOT_FOUND) << "registered all the same";
  r.struct_size = sizeof(r);
  EXPECT_EQ(ops->register_memory(t, &r, key, sizeof(key), &key_len), KVB_OK);
  EXPECT_EQ(flags, KVB_REG_LOCAL_ONLY);
  EXPECT_EQ(ops->deregister_memory(t, 1), KVB_OK);
  ops->destroy(t);
}

TEST(PluginLoader, LoadsMockStorageAndItWorks) {
  PluginRegistry reg;
  const PluginInfo& info = reg.LoadFile(TestPlugin("libkvb_storage_mock.so"));
  ASSERT_EQ(info.state, PluginState::kLoaded) << info.reason;
  EXPECT_EQ(info.name, "mock");
  EXPECT_EQ(info.kind, KVB_PLUGIN_STORAGE);
  EXPECT_EQ(info.transport_ops(), nullptr);
  const kvb_storage_ops_t* ops = info.storage_ops();
  ASSERT_NE(ops, nullptr);

  HostServices host(std::map<std::string, std::string>{});
  kvb_storage_params_t params{sizeof(params), "n", 4096, nullptr, nullptr, nullptr};
  kvb_storage_t* s = nullptr;
  char err[256] = "";
  ASSERT_EQ(ops->create(host.table(), &params, &s, err, sizeof(err)), KVB_OK) << err;
  uint64_t a = 0, b = 0, c = 0;
  EXPECT_EQ(ops->alloc(s, 1000, &a), KVB_OK);
  EXPECT_EQ(ops->alloc(s, 1000, &b), KVB_OK);
  EXPECT_NE(a, b);
  EXPECT_EQ(ops->alloc(s, 4096, &c), KVB_ERR_NO_SPACE);
  EXPECT_EQ(ops->free(s, a), KVB_OK);
  EXPECT_EQ(ops->free(s, a), KVB_ERR_NOT_FOUND);
  EXPECT_EQ(ops->free(s, b), KVB_OK);
  EXPECT_EQ(ops->alloc(s, 4096, &c), KVB_OK) << "freed blocks were not merged";
  EXPECT_EQ(ops->free(s, c), KVB_OK);

  const uint8_t key[] = {'k', '1'};
  char part1[] = "hello ", part2[] = "world";
  kvb_iovec_t in[] = {{part1, 6}, {part2, 5}};
  EXPECT_EQ(ops->put(s, key, 2, in, 2), KVB_OK);
  EXPECT_EQ(ops->put(s, key, 2, in, 2), KVB_ERR_ALREADY_EXISTS);
  char small[4], out[32] = "";
  uint64_t len = 0;
  kvb_iovec_t too_small{small, sizeof(small)};
  EXPECT_EQ(ops->get(s, key, 2, &too_small, 1, &len), KVB_ERR_INVALID_ARGUMENT);
  kvb_iovec_t whole{out, sizeof(out)};
  EXPECT_EQ(ops->get(s, key, 2, &whole, 1, &len), KVB_OK);
  EXPECT_EQ(len, 11u);
  EXPECT_EQ(std::string(out, len), "hello world");
  kvb_storage_usage_t usage{sizeof(usage), 0, 0, 0};
  EXPECT_EQ(ops->usage(s, &usage), KVB_OK);
  EXPECT_EQ(usage.object_count, 1u);
  EXPECT_EQ(usage.used_bytes, 11u);
  EXPECT_EQ(ops->remove(s, key, 2), KVB_OK);
  EXPECT_EQ(ops->get(s, key, 2, &whole, 1, &len), KVB_ERR_NOT_FOUND);
  ops->destroy(s);
}

TEST(PluginLoader, MockStorageKeepsMetadataWithObjects) {
  PluginRegistry reg;
  const PluginInfo& info = reg.LoadFile(TestPlugin("libkvb_storage_mock.so"));
  ASSERT_EQ(info.state, PluginState::kLoaded) << info.reason;
  const kvb_storage_ops_t* ops = info.storage_ops();
  ASSERT_NE(ops, nullptr);
  ASSERT_TRUE(StorageHasMetaOps(*ops));
  HostServices host(std::map<std::string, std::string>{});
  kvb_storage_params_t params{sizeof(params), "n", 4096, nullptr, nullptr, nullptr};
  kvb_storage_t* s = nullptr;
  char err[256] = "";
  ASSERT_EQ(ops->create(host.table(), &params, &s, err, sizeof(err)), KVB_OK) << err;
  char data[] = "abc";
  kvb_iovec_t iov{data, 3};
  const uint8_t meta[] = {1, 2, 3, 4, 5};
  const std::vector<uint8_t> too_long(KVB_STORAGE_META_MAX + 1, 7);
  EXPECT_EQ(ops->put_meta(s, reinterpret_cast<const uint8_t*>("m"), 1, &iov, 1, too_long.data(),
                          static_cast<uint32_t>(too_long.size())),
            KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ops->put_meta(s, reinterpret_cast<const uint8_t*>("m"), 1, &iov, 1, meta, 5), KVB_OK);
  EXPECT_EQ(ops->put_meta(s, reinterpret_cast<const uint8_t*>("m"), 1, &iov, 1, meta, 5),
            KVB_ERR_ALREADY_EXISTS);
  EXPECT_EQ(ops->put(s, reinterpret_cast<const uint8_t*>("p"), 1, &iov, 1), KVB_OK);
  std::map<std::string, std::vector<uint8_t>> seen;
  ASSERT_EQ(ops->for_each_meta(
                s,
                [](void* user, const uint8_t* key, uint32_t key_len, uint64_t length,
                   const uint8_t* m, uint32_t m_len) {
                  EXPECT_EQ(length, 3u);
                  (*static_cast<std::map<std::string, std::vector<uint8_t>>*>(
                      user))[std::string(reinterpret_cast<const char*>(key), key_len)] = {
                      m, m + m_len};
                },
                &seen),
            KVB_OK);
  EXPECT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen["m"], std::vector<uint8_t>(meta, meta + 5));
  EXPECT_TRUE(seen["p"].empty()) << "a plain put has no metadata";
  ops->destroy(s);
}

TEST(PluginLoader, WrongAbiMajorIsRefused) {
  PluginRegistry reg;
  const std::string path = TestPlugin("libkvb_transport_bad_abi_major.so");
  const PluginInfo& info = reg.LoadFile(path);
  EXPECT_EQ(info.state, PluginState::kRefused);
  EXPECT_HAS(info.reason, path);
  EXPECT_HAS(info.reason, "ABI major 2, host speaks 1");
  EXPECT_EQ(info.descriptor, nullptr);
  EXPECT_TRUE(info.name.empty()) << "a descriptor of another major must not be read further";
}

TEST(PluginLoader, MissingQuerySymbolIsRefused) {
  PluginRegistry reg;
  const std::string path = TestPlugin("libkvb_transport_no_query.so");
  const PluginInfo& info = reg.LoadFile(path);
  EXPECT_EQ(info.state, PluginState::kRefused);
  EXPECT_HAS(info.reason, path);
  EXPECT_HAS(info.reason, "no 'kvb_plugin_query' symbol");
}

TEST(PluginLoader, QueryReturningNullIsRefused) {
  PluginRegistry reg;
  const std::string path = TestPlugin("libkvb_transport_query_null.so");
  const PluginInfo& info = reg.LoadFile(path);
  EXPECT_EQ(info.state, PluginState::kRefused);
  EXPECT_HAS(info.reason, path);
  EXPECT_HAS(info.reason, "does not support host ABI 1.x");
}

TEST(PluginLoader, NullRequiredSlotIsRefused) {
  PluginRegistry reg;
  const std::string path = TestPlugin("libkvb_transport_null_required.so");
  const PluginInfo& info = reg.LoadFile(path);
  EXPECT_EQ(info.state, PluginState::kRefused);
  EXPECT_HAS(info.reason, path + ": required slot 'post' is NULL");
  EXPECT_EQ(info.name, "null_required");  // readable, so Find() can explain
  EXPECT_EQ(info.transport_ops(), nullptr);
}

TEST(PluginLoader, CapsNotMatchingSlotsAreRefused) {
  PluginRegistry reg;
  const std::string path = TestPlugin("libkvb_transport_caps_no_rw.so");
  const PluginInfo& info = reg.LoadFile(path);
  EXPECT_EQ(info.state, PluginState::kRefused);
  EXPECT_HAS(info.reason, path);
  EXPECT_HAS(info.reason, "neither READ nor WRITE");
}

TEST(PluginLoader, NullOptionalSlotIsRefused) {
  PluginRegistry reg;
  const std::string path = TestPlugin("libkvb_transport_null_optional.so");
  const PluginInfo& info = reg.LoadFile(path);
  EXPECT_EQ(info.state, PluginState::kRefused);
  EXPECT_HAS(info.reason,
             path + ": optional slot 'get_stats' is NULL (point it to an unsupported stub)");
}

TEST(PluginLoader, ProbeUnavailableIsUnavailableWithReason) {
  PluginRegistry reg;
  const std::string path = TestPlugin("libkvb_transport_probe_unavailable.so");
  const PluginInfo& info = reg.LoadFile(path);
  EXPECT_EQ(info.state, PluginState::kUnavailable);
  EXPECT_HAS(info.reason, path);
  EXPECT_HAS(info.reason, "no such device");
  EXPECT_EQ(info.name, "probe_unavailable");
  EXPECT_EQ(info.descriptor, nullptr);
}

TEST(PluginLoader, MissingDependencyIsUnavailableWithDlerror) {
  PluginRegistry reg;
  const std::string path = TestPlugin("libkvb_transport_missing_dep.so");
  const PluginInfo& info = reg.LoadFile(path);
  EXPECT_EQ(info.state, PluginState::kUnavailable);
  EXPECT_HAS(info.reason, path);
  EXPECT_HAS(info.reason, "libkvbtest_missing_dep_helper.so");
  EXPECT_HAS(info.reason, "cannot open shared object file");
}

TEST(PluginLoader, MissingPluginFileIsRefusedNotUnavailable) {
  PluginRegistry reg;
  TempDir dir;
  const std::string path = dir.path() + "/libkvb_transport_gone.so";
  const PluginInfo& info = reg.LoadFile(path);
  EXPECT_EQ(info.state, PluginState::kRefused);
  EXPECT_HAS(info.reason, path);
}

TEST(PluginLoader, NotASharedObjectIsRefused) {
  TempDir dir;
  const std::string path = dir.path() + "/libkvb_transport_garbage.so";
  std::ofstream(path) << "this is not an ELF file\n";
  PluginRegistry reg;
  const PluginInfo& info = reg.LoadFile(path);
  EXPECT_EQ(info.state, PluginState::kRefused);
  EXPECT_HAS(info.reason, path);
}

// --- Scan, Find, duplicates -----------------------------------------------------------------

TEST(PluginRegistry, ScanLoadsTheGoodAndRecordsTheRest) {
  PluginRegistry reg;
  reg.Scan({kTestDir, "/nonexistent/kvbridge/plugins"});
  std::vector<std::string> files;
  for (const PluginInfo& p : reg.plugins()) files.push_back(fs::path(p.path).filename());
  EXPECT_TRUE(std::is_sorted(files.begin(), files.end()));
  for (const char* f :
       {"libkvb_storage_mock.so", "libkvb_transport_mock.so", "libkvb_transport_bad_abi_major.so",
        "libkvb_transport_no_query.so", "libkvb_transport_query_null.so",
        "libkvb_transport_null_required.so", "libkvb_transport_caps_no_rw.so",
        "libkvb_transport_null_optional.so", "libkvb_transport_probe_unavailable.so",
        "libkvb_transport_missing_dep.so"}) {
    EXPECT_NE(std::find(files.begin(), files.end(), f), files.end()) << f;
  }
  auto transports = reg.Loaded(KVB_PLUGIN_TRANSPORT);
  ASSERT_EQ(transports.size(), 1u);
  EXPECT_EQ(transports[0]->name, "mock");
  auto storage = reg.Loaded(KVB_PLUGIN_STORAGE);
  ASSERT_EQ(storage.size(), 1u);
  EXPECT_EQ(storage[0]->name, "mock");
  for (const PluginInfo& p : reg.plugins()) {
    if (p.state != PluginState::kLoaded) {
      EXPECT_HAS(p.reason, p.path);
    }
  }
}

TEST(PluginRegistry, FindReturnsLoadedOrSaysWhyNot) {
  PluginRegistry reg;
  reg.Scan({kTestDir});
  std::string why;
  const PluginInfo* mock = reg.Find(KVB_PLUGIN_TRANSPORT, "mock", &why);
  ASSERT_NE(mock, nullptr);
  EXPECT_EQ(mock->kind, KVB_PLUGIN_TRANSPORT);
  const PluginInfo* storage = reg.Find(KVB_PLUGIN_STORAGE, "mock");
  ASSERT_NE(storage, nullptr);
  EXPECT_EQ(storage->kind, KVB_PLUGIN_STORAGE);

  EXPECT_EQ(reg.Find(KVB_PLUGIN_TRANSPORT, "null_optional", &why), nullptr);
  EXPECT_HAS(why, "optional slot 'get_stats' is NULL");
  EXPECT_EQ(reg.Find(KVB_PLUGIN_TRANSPORT, "probe_unavailable", &why), nullptr);
  EXPECT_HAS(why, "no such device");
  // Refused before a name could be read: found by the file naming convention.
  EXPECT_EQ(reg.Find(KVB_PLUGIN_TRANSPORT, "missing_dep", &why), nullptr);
  EXPECT_HAS(why, "cannot open shared object file");
  EXPECT_EQ(reg.Find(KVB_PLUGIN_STORAGE, "missing_dep", &why), nullptr);
  EXPECT_HAS(why, "no storage plugin named 'missing_dep'");

  EXPECT_EQ(reg.Find(KVB_PLUGIN_TRANSPORT, "nope", &why), nullptr);
  EXPECT_HAS(why, "no transport plugin named 'nope' found in " + kTestDir);
  EXPECT_EQ(reg.Find(KVB_PLUGIN_TRANSPORT, "nope"), nullptr);  // why_not is optional
}

TEST(PluginRegistry, DuplicateNameFirstFoundWins) {
  TempDir dir;
  fs::copy_file(TestPlugin("libkvb_transport_mock.so"), dir.path() + "/libkvb_transport_mock.so");
  PluginRegistry reg;
  reg.Scan({kTestDir, dir.path()});
  const std::string first = TestPlugin("libkvb_transport_mock.so");
  const std::string second = dir.path() + "/libkvb_transport_mock.so";
  const PluginInfo* winner = reg.Find(KVB_PLUGIN_TRANSPORT, "mock");
  ASSERT_NE(winner, nullptr);
  EXPECT_EQ(winner->path, first);
  const PluginInfo* dup = nullptr;
  for (const PluginInfo& p : reg.plugins()) {
    if (p.path == second) dup = &p;
  }
  ASSERT_NE(dup, nullptr);
  EXPECT_EQ(dup->state, PluginState::kRefused);
  EXPECT_HAS(dup->reason, second);
  EXPECT_HAS(dup->reason, "duplicate of " + first);
  EXPECT_EQ(reg.Loaded(KVB_PLUGIN_TRANSPORT).size(), 1u);
  // Same name, other kind: not a duplicate.
  EXPECT_NE(reg.Find(KVB_PLUGIN_STORAGE, "mock"), nullptr);
}

TEST(PluginRegistry, SameFileThroughSymlinkIsLoadedOnce) {
  TempDir dir;
  const std::string link = dir.path() + "/again";
  fs::create_directory_symlink(kTestDir, link);
  PluginRegistry reg;
  reg.Scan({kTestDir, link});
  size_t mocks = 0;
  for (const PluginInfo& p : reg.plugins()) {
    if (fs::path(p.path).filename() == "libkvb_transport_mock.so") ++mocks;
  }
  EXPECT_EQ(mocks, 1u);
}

TEST(PluginRegistry, MovedRegistryKeepsPluginsLoaded) {
  PluginRegistry a;
  a.LoadFile(TestPlugin("libkvb_transport_mock.so"));
  PluginRegistry b(std::move(a));
  const PluginInfo* mock = b.Find(KVB_PLUGIN_TRANSPORT, "mock");
  ASSERT_NE(mock, nullptr);
  EXPECT_STREQ(mock->descriptor->name, "mock");  // still mapped
  PluginRegistry c;
  c = std::move(b);
  ASSERT_NE(c.Find(KVB_PLUGIN_TRANSPORT, "mock"), nullptr);
  EXPECT_STREQ(c.Find(KVB_PLUGIN_TRANSPORT, "mock")->descriptor->name, "mock");
}

TEST(PluginRegistry, DefaultSearchPathOrder) {
  ScopedEnv env("KVBRIDGE_PLUGIN_PATH", "/env/a::/env/b");
  auto dirs = PluginRegistry::DefaultSearchPath("/extra/x:/extra/y:");
  ASSERT_EQ(dirs.size(), 7u);
  EXPECT_EQ(dirs[0], "/extra/x");
  EXPECT_EQ(dirs[1], "/extra/y");
  EXPECT_EQ(dirs[2], "/env/a");
  EXPECT_EQ(dirs[3], "/env/b");
  // The loader of this binary (it links the static kvbridge_core) lives in the build tree,
  // so the build tree's plugins are searched.
  EXPECT_EQ(dirs[4], KVBRIDGE_PLUGIN_BUILD_DIR);
  // The install directories sit next to the module holding the loader (libkvbridge.so in an
  // install; this test binary here): <libdir>/plugins (the Python package) and
  // <libdir>/kvbridge/plugins (`cmake --install`).
  EXPECT_EQ(fs::path(dirs[5]), fs::path(KVBRIDGE_TEST_BIN_DIR) / "plugins");
  EXPECT_EQ(fs::path(dirs[6]), fs::path(KVBRIDGE_TEST_BIN_DIR) / "kvbridge" / "plugins");
}

TEST(PluginRegistry, DefaultSearchPathWithoutEnvOrExtra) {
  ScopedEnv env("KVBRIDGE_PLUGIN_PATH", nullptr);
  auto dirs = PluginRegistry::DefaultSearchPath("");
  ASSERT_EQ(dirs.size(), 3u);
  EXPECT_EQ(dirs[0], KVBRIDGE_PLUGIN_BUILD_DIR);
}

// --- ValidateDescriptor on hand-made descriptors ---------------------------------------------

kvb_status_t ProbeOk(char* reason, uint32_t len) {
  kvb_copy_message(reason, len, "");
  return KVB_OK;
}

// A descriptor that passes, which each test then breaks in one way. The ops tables only need
// non-NULL slots here; nothing is called.
class ValidateDescriptorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    void (*any)() = +[] {};
    std::memset(&tops_, 0, sizeof(tops_));
    auto* tslots = reinterpret_cast<void (**)()>(reinterpret_cast<char*>(&tops_) +
                                                 offsetof(kvb_transport_ops_t, create));
    for (size_t i = 0; i < (sizeof(tops_) - offsetof(kvb_transport_ops_t, create)) / sizeof(any);
         ++i) {
      tslots[i] = any;
    }
    tops_.struct_size = sizeof(tops_);
    std::memset(&sops_, 0, sizeof(sops_));
    auto* sslots = reinterpret_cast<void (**)()>(reinterpret_cast<char*>(&sops_) +
                                                 offsetof(kvb_storage_ops_t, create));
    for (size_t i = 0; i < (sizeof(sops_) - offsetof(kvb_storage_ops_t, create)) / sizeof(any);
         ++i) {
      sslots[i] = any;
    }
    sops_.struct_size = sizeof(sops_);
    desc_ = kvb_plugin_descriptor_t{sizeof(kvb_plugin_descriptor_t),
                                    KVB_ABI_MAJOR,
                                    KVB_ABI_MINOR,
                                    "good_one",
                                    "1",
                                    KVB_PLUGIN_TRANSPORT,
                                    0,
                                    KVB_TCAP_READ | KVB_TCAP_HOST_MEM,
                                    ProbeOk,
                                    &tops_};
  }
  Status Check() { return ValidateDescriptor(&desc_, "libkvb_x.so"); }
  void UseStorage(uint64_t caps) {
    desc_.kind = KVB_PLUGIN_STORAGE;
    desc_.caps = caps;
    desc_.ops = &sops_;
  }

  kvb_transport_ops_t tops_;
  kvb_storage_ops_t sops_;
  kvb_plugin_descriptor_t desc_;
};

TEST_F(ValidateDescriptorTest, GoodTransportAndStoragePass) {
  EXPECT_TRUE(Check().ok()) << Check().ToString();
  UseStorage(KVB_SCAP_POOL | KVB_SCAP_OBJECTS);
  EXPECT_TRUE(Check().ok()) << Check().ToString();
}

TEST_F(ValidateDescriptorTest, MajorMismatchNamesBothVersions) {
  desc_.abi_major = 3;
  Status st = Check();
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_HAS(st.message(), "libkvb_x.so: ABI major 3, host speaks 1");
}

TEST_F(ValidateDescriptorTest, NewerMinorAndLargerStructsAreAccepted) {
  desc_.abi_minor = 7;
  desc_.caps |= uint64_t{1} << 40;  // a capability bit this host does not know
  EXPECT_TRUE(Check().ok()) << Check().ToString();
}

TEST_F(ValidateDescriptorTest, TooSmallStructsAreRefused) {
  desc_.struct_size = offsetof(kvb_plugin_descriptor_t, probe);
  EXPECT_HAS(Check().message(), "descriptor struct_size");
  desc_.struct_size = 2;
  EXPECT_HAS(Check().message(), "too small to hold the ABI version");
  desc_.struct_size = sizeof(desc_);
  tops_.struct_size = offsetof(kvb_transport_ops_t, get_stats);
  EXPECT_HAS(Check().message(), "transport ops struct_size");
}

// ABI 1.3's instance_caps: a NULL slot is refused in a table long enough to hold it, and never
// looked at in a 1.2 table (which ends at get_stats).
TEST_F(ValidateDescriptorTest, InstanceCapsSlotIsCheckedOnlyInA13Table) {
  tops_.instance_caps = nullptr;
  EXPECT_HAS(Check().message(), "optional slot 'instance_caps' is NULL");
  tops_.struct_size = offsetof(kvb_transport_ops_t, instance_caps);
  EXPECT_TRUE(Check().ok()) << Check().ToString();
  EXPECT_FALSE(TransportHasInstanceCaps(tops_));
  tops_.struct_size = sizeof(tops_);
  EXPECT_TRUE(TransportHasInstanceCaps(tops_));
}

TEST_F(ValidateDescriptorTest, NameMustBeLowercaseIdentifier) {
  for (const char* bad : {"", "Tcp", "my-plugin", "a b"}) {
    desc_.name = bad;
    EXPECT_HAS(Check().message(), "[a-z0-9_]");
  }
  desc_.name = nullptr;
  EXPECT_FALSE(Check().ok());
  desc_.name = "tcp_2";
  EXPECT_TRUE(Check().ok());
}

TEST_F(ValidateDescriptorTest, UnknownKindNullOpsNullProbe) {
  desc_.kind = 9;
  EXPECT_HAS(Check().message(), "unknown plugin kind 9");
  desc_.kind = KVB_PLUGIN_TRANSPORT;
  desc_.ops = nullptr;
  EXPECT_HAS(Check().message(), "ops table is NULL");
  desc_.ops = &tops_;
  desc_.probe = nullptr;
  EXPECT_HAS(Check().message(), "probe is NULL");
}

TEST_F(ValidateDescriptorTest, TransportNeedsMemoryKind) {
  desc_.caps = KVB_TCAP_WRITE;
  EXPECT_HAS(Check().message(), "neither HOST_MEM nor CUDA_MEM");
  desc_.caps = KVB_TCAP_WRITE | KVB_TCAP_CUDA_MEM;
  EXPECT_TRUE(Check().ok());
}

TEST_F(ValidateDescriptorTest, StorageCapsDecideWhichSlotsAreRequired) {
  UseStorage(0);
  EXPECT_HAS(Check().message(), "neither POOL nor OBJECTS");
  UseStorage(KVB_SCAP_POOL);
  auto alloc = sops_.alloc;
  sops_.alloc = nullptr;
  EXPECT_HAS(Check().message(), "libkvb_x.so: required slot 'alloc' is NULL");
  UseStorage(KVB_SCAP_OBJECTS);
  EXPECT_HAS(Check().message(), "optional slot 'alloc' is NULL (point it to an unsupported stub)");
  sops_.alloc = alloc;
  EXPECT_TRUE(Check().ok());
  sops_.get = nullptr;
  EXPECT_HAS(Check().message(), "required slot 'get' is NULL");
}

TEST_F(ValidateDescriptorTest, StorageOpsOfAbi1_0AreAcceptedWithoutTheMetaSlots) {
  UseStorage(KVB_SCAP_OBJECTS);
  // A plugin built against 1.0 hands a table that ends after for_each; what lies beyond is not
  // its memory, so the loader must not look at it (NULL here stands for "anything").
  sops_.struct_size = offsetof(kvb_storage_ops_t, for_each) + sizeof(sops_.for_each);
  sops_.put_meta = nullptr;
  sops_.for_each_meta = nullptr;
  EXPECT_TRUE(Check().ok()) << Check().ToString();
  EXPECT_FALSE(StorageHasMetaOps(sops_));
  // One byte short of 1.0 is still refused.
  sops_.struct_size -= 1;
  EXPECT_HAS(Check().message(), "storage ops struct_size");
}

TEST_F(ValidateDescriptorTest, StorageOpsOfAbi1_1MustFillTheMetaSlots) {
  UseStorage(KVB_SCAP_OBJECTS);
  EXPECT_TRUE(StorageHasMetaOps(sops_));
  sops_.put_meta = nullptr;
  EXPECT_HAS(Check().message(),
             "libkvb_x.so: optional slot 'put_meta' is NULL (point it to an unsupported stub)");
  sops_.put_meta = kvb_storage_put_meta_unsupported;
  sops_.for_each_meta = nullptr;
  EXPECT_HAS(Check().message(), "optional slot 'for_each_meta' is NULL");
  sops_.for_each_meta = kvb_storage_for_each_meta_unsupported;
  EXPECT_TRUE(Check().ok()) << Check().ToString();
  // A table that covers put_meta but not for_each_meta is not a 1.1 table: neither is used.
  sops_.struct_size = offsetof(kvb_storage_ops_t, for_each_meta);
  sops_.put_meta = nullptr;
  EXPECT_FALSE(StorageHasMetaOps(sops_));
  EXPECT_TRUE(Check().ok()) << Check().ToString();
}

// --- The out-of-tree examples (examples/transport_plugin, examples/transport_plugin_c) ----------

// Run by the CTest tests "example_transport_plugin" (C++ on the SDK) and
// "example_transport_plugin_c" (plain C), which build one example out of tree and name the
// result in KVBRIDGE_EXAMPLE_PLUGIN and its plugin name in KVBRIDGE_EXAMPLE_PLUGIN_NAME.
TEST(ExamplePlugin, LoadsThroughRegistryAndMovesBytes) {
  const char* path = getenv("KVBRIDGE_EXAMPLE_PLUGIN");
  const char* name = getenv("KVBRIDGE_EXAMPLE_PLUGIN_NAME");
  if (path == nullptr || name == nullptr) {
    GTEST_SKIP() << "KVBRIDGE_EXAMPLE_PLUGIN(_NAME) is unset; `ctest -R example_transport_plugin` "
                    "builds the examples out of tree and runs this test";
  }
  PluginRegistry reg;
  const PluginInfo& info = reg.LoadFile(path);
  ASSERT_EQ(info.state, PluginState::kLoaded) << info.reason;
  EXPECT_EQ(info.name, name);
  EXPECT_EQ(info.caps, KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_HOST_MEM);
  const kvb_transport_ops_t* ops = info.transport_ops();
  ASSERT_NE(ops, nullptr);

  HostServices host(std::map<std::string, std::string>{});
  kvb_transport_params_t params{sizeof(params), "ex", 77, nullptr, nullptr};
  kvb_transport_t* t = nullptr;
  char err[256] = "";
  ASSERT_EQ(ops->create(host.table(), &params, &t, err, sizeof(err)), KVB_OK) << err;
  std::vector<uint8_t> src(4096, 0xab), dst(4096, 0);
  kvb_region_t r1{sizeof(kvb_region_t), KVB_MEM_HOST, 1, src.data(), src.size(), -1};
  kvb_region_t r2{sizeof(kvb_region_t), KVB_MEM_HOST, 2, dst.data(), dst.size(), -1};
  uint32_t rkey_len = 0;
  ASSERT_EQ(ops->register_memory(t, &r1, nullptr, 0, &rkey_len), KVB_OK);
  ASSERT_EQ(ops->register_memory(t, &r2, nullptr, 0, &rkey_len), KVB_OK);
  char ep[128];
  ASSERT_GT(ops->get_endpoints(t, ep, sizeof(ep)), 0);
  kvb_peer_info_t self{sizeof(kvb_peer_info_t),   "ex", 77, ep, nullptr, 0,
                       sizeof(kvb_peer_segment_t)};
  kvb_tpeer_t* peer = nullptr;
  ASSERT_EQ(ops->add_peer(t, &self, &peer, err, sizeof(err)), KVB_OK) << err;
  kvb_xfer_op_t op{KVB_OP_WRITE, 0, 1, src.data(), 100, 2, 10, nullptr};
  kvb_treq_t* req = nullptr;
  ASSERT_EQ(ops->post(t, peer, &op, sizeof(op), 1, nullptr, &req, err, sizeof(err)), KVB_OK);
  kvb_status_t op_st = KVB_IN_PROGRESS;
  EXPECT_EQ(ops->poll(t, req, &op_st, 1, err, sizeof(err)), KVB_OK);
  EXPECT_EQ(op_st, KVB_OK);
  ops->release(t, req);
  EXPECT_EQ(dst[9], 0);
  EXPECT_EQ(dst[10], 0xab);
  EXPECT_EQ(dst[109], 0xab);
  EXPECT_EQ(dst[110], 0);
  op.remote_offset = 4000;  // 4000 + 100 > 4096
  ASSERT_EQ(ops->post(t, peer, &op, sizeof(op), 1, nullptr, &req, err, sizeof(err)), KVB_OK);
  EXPECT_EQ(ops->poll(t, req, &op_st, 1, err, sizeof(err)), KVB_ERR_OUT_OF_BOUNDS);
  EXPECT_EQ(op_st, KVB_ERR_OUT_OF_BOUNDS);
  ops->release(t, req);
  // A malformed op refuses the whole post, with the plugin's reason in err.
  op.length = 0;
  req = nullptr;
  EXPECT_EQ(ops->post(t, peer, &op, sizeof(op), 1, nullptr, &req, err, sizeof(err)),
            KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(req, nullptr);
  EXPECT_NE(std::string(err).find(name), std::string::npos) << err;
  // Another incarnation of this process: STALE_PEER, not one byte moved.
  kvb_peer_info_t old_self = self;
  old_self.incarnation = 76;
  kvb_tpeer_t* stale = nullptr;
  ASSERT_EQ(ops->add_peer(t, &old_self, &stale, err, sizeof(err)), KVB_OK) << err;
  op = kvb_xfer_op_t{KVB_OP_WRITE, 0, 1, src.data(), 100, 2, 500, nullptr};
  ASSERT_EQ(ops->post(t, stale, &op, sizeof(op), 1, nullptr, &req, err, sizeof(err)), KVB_OK);
  EXPECT_EQ(ops->poll(t, req, &op_st, 1, err, sizeof(err)), KVB_ERR_STALE_PEER);
  ops->release(t, req);
  EXPECT_EQ(dst[500], 0);
  EXPECT_EQ(ops->deregister_memory(t, 2), KVB_OK);
  EXPECT_EQ(ops->deregister_memory(t, 2), KVB_ERR_NOT_FOUND);
  ops->remove_peer(t, stale);
  ops->remove_peer(t, peer);
  ops->destroy(t);
}

}  // namespace
}  // namespace kvbridge::core

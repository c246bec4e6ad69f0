// The storage half of the plugin SDK (kvbridge/plugin/sdk/storage.hpp), driven through the ops
// table it generates: caps derived from which members a class has (POOL, OBJECTS, and the ABI
// 1.1 meta slots from Put's meta parameter), the other slots the ABI's UNSUPPORTED stubs and a
// table the loader accepts, exceptions as INTERNAL with their text, argument checks before the
// class is called, versioned output structs written only as far as the host's struct_size, and
// ABI 1.0 params read without their 1.1 fields.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/plugin_loader.h"
#include "kvbridge/plugin/sdk/storage.hpp"
#include "tests/sdk/sdk_test_util.h"

namespace kvbridge::plugin::sdk {
namespace {

using testing::FakeHost;

struct Record {
  bool throw_usage = false;
  int puts = 0;
  std::string last_meta;
  StorageParams params;
  std::map<std::string, std::pair<uint64_t, std::string>> objects;  // key -> (length, meta)
};
Record g_rec;

// Members every test class has.
template <typename Self>
class Base {
 public:
  static constexpr const char* kVersion = "1";
  static Result<std::unique_ptr<Self>> Create(Host, const StorageParams& p) {
    g_rec.params = p;
    return std::make_unique<Self>();
  }
  Status Usage(kvb_storage_usage_t& u) {
    if (g_rec.throw_usage) throw std::logic_error("usage blew up");
    u.capacity_bytes = 100;
    u.used_bytes = 10;
    u.object_count = 1;
    return Status();
  }
};

class PoolOnly : public Base<PoolOnly> {
 public:
  static constexpr const char* kName = "pool_only";
  Result<sdk::Segment> Segment() { return sdk::Segment{buf_, sizeof(buf_)}; }
  Result<uint64_t> Alloc(uint64_t n) {
    if (n > sizeof(buf_)) return Status(KVB_ERR_NO_SPACE, "no room for " + std::to_string(n));
    return uint64_t{16};
  }
  Status Free(uint64_t off) { return off == 16 ? Status() : Status(KVB_ERR_NOT_FOUND); }

 private:
  uint8_t buf_[64];
};

// OBJECTS without metadata: put_meta and for_each_meta are stubs.
class ObjectsPlain : public Base<ObjectsPlain> {
 public:
  static constexpr const char* kName = "objects_plain";
  Status Put(Bytes key, IoVecs iov) {
    ++g_rec.puts;
    uint64_t n = 0;
    for (const auto& v : iov) n += v.length;
    g_rec.objects[std::string(AsStringView(key))] = {n, ""};
    return Status();
  }
  Status Get(Bytes key, IoVecs, uint64_t& length) {
    auto it = g_rec.objects.find(std::string(AsStringView(key)));
    if (it == g_rec.objects.end()) return Status(KVB_ERR_NOT_FOUND);
    length = it->second.first;
    return Status(KVB_ERR_INVALID_ARGUMENT, "too small");
  }
  Status Remove(Bytes key) {
    return g_rec.objects.erase(std::string(AsStringView(key))) ? Status()
                                                               : Status(KVB_ERR_NOT_FOUND);
  }
  Status ForEach(const ObjectVisitor& visit) {
    for (const auto& [k, v] : g_rec.objects) {
      visit(Bytes(reinterpret_cast<const uint8_t*>(k.data()), k.size()), v.first,
            Bytes(reinterpret_cast<const uint8_t*>(v.second.data()), v.second.size()));
    }
    return Status();
  }
};

// OBJECTS with metadata, persistent.
class ObjectsMeta : public ObjectsPlain {
 public:
  static constexpr const char* kName = "objects_meta";
  static constexpr bool kPersistent = true;
  static Result<std::unique_ptr<ObjectsMeta>> Create(Host, const StorageParams&) {
    return std::make_unique<ObjectsMeta>();
  }
  Status Put(Bytes key, IoVecs iov, Bytes meta) {
    ++g_rec.puts;
    g_rec.last_meta = std::string(AsStringView(meta));
    uint64_t n = 0;
    for (const auto& v : iov) n += v.length;
    g_rec.objects[std::string(AsStringView(key))] = {n, g_rec.last_meta};
    return Status();
  }
};

// Both shapes.
class Both : public PoolOnly {
 public:
  static constexpr const char* kName = "both";
  static Result<std::unique_ptr<Both>> Create(Host, const StorageParams&) {
    return std::make_unique<Both>();
  }
  Status Put(Bytes, IoVecs) { return Status(); }
  Status Get(Bytes, IoVecs, uint64_t&) { return Status(); }
  Status Remove(Bytes) { return Status(); }
  Status ForEach(const ObjectVisitor&) { return Status(); }
};

template <typename P>
const kvb_storage_ops_t* OpsOf() {
  return static_cast<const kvb_storage_ops_t*>(
      StoragePluginQuery<P>(KVB_ABI_MAJOR, KVB_ABI_MINOR)->ops);
}

template <typename P>
class Made {
 public:
  explicit Made(const kvb_host_services_t* host) : ops_(OpsOf<P>()) {
    kvb_storage_params_t params{.struct_size = sizeof(params),
                                .node_id = "n1",
                                .capacity_bytes = 100,
                                .path = nullptr,
                                .on_evict = nullptr,
                                .on_evict_user = nullptr};
    char err[256] = "";
    EXPECT_EQ(ops_->create(host, &params, &s_, err, sizeof(err)), KVB_OK) << err;
  }
  ~Made() { ops_->destroy(s_); }
  const kvb_storage_ops_t* ops() const { return ops_; }
  kvb_storage_t* get() const { return s_; }

 private:
  const kvb_storage_ops_t* ops_;
  kvb_storage_t* s_ = nullptr;
};

class SdkStorage : public ::testing::Test {
 protected:
  void SetUp() override { g_rec = Record(); }
  FakeHost fake_;
};

const uint8_t kKey[] = {'k', '1'};

TEST_F(SdkStorage, CapsFollowTheMembersAndTheLoaderAcceptsEachTable) {
  EXPECT_EQ(StoragePluginQuery<PoolOnly>(1, 0)->caps, KVB_SCAP_POOL);
  EXPECT_EQ(StoragePluginQuery<ObjectsPlain>(1, 0)->caps, KVB_SCAP_OBJECTS);
  EXPECT_EQ(StoragePluginQuery<ObjectsMeta>(1, 0)->caps, KVB_SCAP_OBJECTS | KVB_SCAP_PERSISTENT);
  EXPECT_EQ(StoragePluginQuery<Both>(1, 0)->caps, KVB_SCAP_POOL | KVB_SCAP_OBJECTS);
  for (const kvb_plugin_descriptor_t* d :
       {StoragePluginQuery<PoolOnly>(1, 2), StoragePluginQuery<ObjectsPlain>(1, 2),
        StoragePluginQuery<ObjectsMeta>(1, 2), StoragePluginQuery<Both>(1, 2)}) {
    EXPECT_EQ(d->kind, KVB_PLUGIN_STORAGE);
    auto st = core::ValidateDescriptor(d, std::string("libkvb_storage_") + d->name + ".so");
    EXPECT_TRUE(st.ok()) << st.ToString();
    EXPECT_TRUE(core::StorageHasMetaOps(*static_cast<const kvb_storage_ops_t*>(d->ops)));
  }
  EXPECT_EQ(StoragePluginQuery<PoolOnly>(2, 0), nullptr);
}

TEST_F(SdkStorage, SlotsOfAShapeNotOfferedAnswerUnsupported) {
  uint8_t byte = 7;
  kvb_iovec_t iov{&byte, 1};
  uint64_t len = 0, off = 0;
  void* addr = nullptr;
  {
    Made<PoolOnly> m(fake_.table());
    const kvb_storage_ops_t* ops = m.ops();
    EXPECT_EQ(ops->put(m.get(), kKey, 2, &iov, 1), KVB_ERR_UNSUPPORTED);
    EXPECT_EQ(ops->get(m.get(), kKey, 2, &iov, 1, &len), KVB_ERR_UNSUPPORTED);
    EXPECT_EQ(ops->remove(m.get(), kKey, 2), KVB_ERR_UNSUPPORTED);
    EXPECT_EQ(ops->put_meta(m.get(), kKey, 2, &iov, 1, nullptr, 0), KVB_ERR_UNSUPPORTED);
    // The real POOL ops.
    ASSERT_EQ(ops->get_segment(m.get(), &addr, &len), KVB_OK);
    EXPECT_NE(addr, nullptr);
    EXPECT_EQ(len, 64u);
    EXPECT_EQ(ops->alloc(m.get(), 8, &off), KVB_OK);
    EXPECT_EQ(off, 16u);
    EXPECT_EQ(ops->alloc(m.get(), 1000, &off), KVB_ERR_NO_SPACE);
    EXPECT_HAS(fake_.AllLogs(), "alloc: no room for 1000");
    EXPECT_EQ(ops->free(m.get(), 16), KVB_OK);
    EXPECT_EQ(ops->free(m.get(), 17), KVB_ERR_NOT_FOUND);
    EXPECT_EQ(ops->get_segment(m.get(), nullptr, &len), KVB_ERR_INVALID_ARGUMENT);
  }
  Made<ObjectsPlain> m(fake_.table());
  const kvb_storage_ops_t* ops = m.ops();
  EXPECT_EQ(ops->get_segment(m.get(), &addr, &len), KVB_ERR_UNSUPPORTED);
  EXPECT_EQ(ops->alloc(m.get(), 8, &off), KVB_ERR_UNSUPPORTED);
  EXPECT_EQ(ops->free(m.get(), 0), KVB_ERR_UNSUPPORTED);
  // No meta parameter on Put: the 1.1 slots are stubs, the 1.0 ones real.
  EXPECT_EQ(ops->put_meta(m.get(), kKey, 2, &iov, 1, nullptr, 0), KVB_ERR_UNSUPPORTED);
  EXPECT_EQ(ops->for_each_meta(
                m.get(), [](void*, const uint8_t*, uint32_t, uint64_t, const uint8_t*, uint32_t) {},
                nullptr),
            KVB_ERR_UNSUPPORTED);
  EXPECT_EQ(ops->put(m.get(), kKey, 2, &iov, 1), KVB_OK);
  EXPECT_EQ(g_rec.puts, 1);
  // get hands back the length even when it fails (the iov is too small).
  EXPECT_EQ(ops->get(m.get(), kKey, 2, &iov, 1, &len), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(len, 1u);
  std::vector<std::string> seen;
  EXPECT_EQ(ops->for_each(
                m.get(),
                [](void* u, const uint8_t* k, uint32_t n, uint64_t) {
                  static_cast<std::vector<std::string>*>(u)->emplace_back(
                      reinterpret_cast<const char*>(k), n);
                },
                &seen),
            KVB_OK);
  EXPECT_EQ(seen, std::vector<std::string>({"k1"}));
  EXPECT_EQ(ops->remove(m.get(), kKey, 2), KVB_OK);
  EXPECT_EQ(ops->remove(m.get(), kKey, 2), KVB_ERR_NOT_FOUND);
}

TEST_F(SdkStorage, MetaSlotsAreRealWhenPutTakesMeta) {
  Made<ObjectsMeta> m(fake_.table());
  const kvb_storage_ops_t* ops = m.ops();
  uint8_t byte = 7;
  kvb_iovec_t iov{&byte, 1};
  const uint8_t meta[] = {'v', '3'};
  ASSERT_EQ(ops->put_meta(m.get(), kKey, 2, &iov, 1, meta, 2), KVB_OK);
  EXPECT_EQ(g_rec.last_meta, "v3");
  ASSERT_EQ(ops->put(m.get(), reinterpret_cast<const uint8_t*>("k2"), 2, &iov, 1), KVB_OK);
  EXPECT_EQ(g_rec.last_meta, "") << "plain put passes an empty blob";
  std::map<std::string, std::string> seen;
  ASSERT_EQ(ops->for_each_meta(
                m.get(),
                [](void* u, const uint8_t* k, uint32_t n, uint64_t, const uint8_t* m, uint32_t mn) {
                  (*static_cast<std::map<std::string, std::string>*>(
                      u))[std::string(reinterpret_cast<const char*>(k), n)] =
                      std::string(reinterpret_cast<const char*>(m), mn);
                },
                &seen),
            KVB_OK);
  EXPECT_EQ(seen, (std::map<std::string, std::string>{{"k1", "v3"}, {"k2", ""}}));

  // Checked before the class is called: an over-long blob, NULL key, iov, meta or visitor.
  g_rec.puts = 0;
  std::vector<uint8_t> big(KVB_STORAGE_META_MAX + 1, 1);
  EXPECT_EQ(ops->put_meta(m.get(), kKey, 2, &iov, 1, big.data(), big.size()),
            KVB_ERR_INVALID_ARGUMENT);
  EXPECT_HAS(fake_.AllLogs(), "metadata of 257 bytes is over KVB_STORAGE_META_MAX (256)");
  EXPECT_EQ(ops->put_meta(m.get(), kKey, 2, &iov, 1, nullptr, 3), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ops->put(m.get(), nullptr, 2, &iov, 1), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ops->put(m.get(), kKey, 2, nullptr, 1), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ops->remove(m.get(), nullptr, 0), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(ops->for_each(m.get(), nullptr, nullptr), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(g_rec.puts, 0) << "the class was called with a refused argument";
  EXPECT_HAS(fake_.AllLogs(), "objects_meta: put: key is NULL");
}

TEST_F(SdkStorage, UsageIsWrittenOnlyAsFarAsTheHostsStructSize) {
  Made<PoolOnly> m(fake_.table());
  kvb_storage_usage_t full{};
  full.struct_size = sizeof(full);
  ASSERT_EQ(m.ops()->usage(m.get(), &full), KVB_OK);
  EXPECT_EQ(full.capacity_bytes, 100u);
  EXPECT_EQ(full.object_count, 1u);
  struct {
    kvb_storage_usage_t u;
  } small;
  std::memset(&small, 0xee, sizeof(small));
  small.u.struct_size = offsetof(kvb_storage_usage_t, used_bytes);
  ASSERT_EQ(m.ops()->usage(m.get(), &small.u), KVB_OK);
  EXPECT_EQ(small.u.capacity_bytes, 100u);
  EXPECT_EQ(small.u.used_bytes, 0xeeeeeeeeeeeeeeeeu) << "wrote past struct_size";
  EXPECT_EQ(small.u.struct_size, offsetof(kvb_storage_usage_t, used_bytes));
  EXPECT_EQ(m.ops()->usage(m.get(), nullptr), KVB_ERR_INVALID_ARGUMENT);
}

TEST_F(SdkStorage, AnExceptionIsInternalWithItsTextInTheLog) {
  Made<PoolOnly> m(fake_.table());
  g_rec.throw_usage = true;
  kvb_storage_usage_t u{};
  u.struct_size = sizeof(u);
  EXPECT_EQ(m.ops()->usage(m.get(), &u), KVB_ERR_INTERNAL);
  EXPECT_HAS(fake_.AllLogs(), "pool_only: internal error in usage: usage blew up");
  ASSERT_FALSE(fake_.logs.empty());
  EXPECT_EQ(fake_.logs.back().level, KVB_LOG_ERROR);
}

TEST_F(SdkStorage, Abi1_0ParamsReadWithoutTheirOnEvictFields) {
  struct {
    kvb_storage_params_t params;
  } padded;
  std::memset(&padded, 0xab, sizeof(padded));
  padded.params.struct_size = offsetof(kvb_storage_params_t, path) + sizeof(padded.params.path);
  padded.params.node_id = "n1";
  padded.params.capacity_bytes = 5;
  padded.params.path = "/p";
  kvb_storage_t* s = nullptr;
  char err[128] = "";
  const kvb_storage_ops_t* ops = OpsOf<PoolOnly>();
  ASSERT_EQ(ops->create(fake_.table(), &padded.params, &s, err, sizeof(err)), KVB_OK) << err;
  EXPECT_EQ(g_rec.params.node_id, "n1");
  EXPECT_EQ(g_rec.params.capacity_bytes, 5u);
  EXPECT_STREQ(g_rec.params.path, "/p");
  EXPECT_EQ(g_rec.params.on_evict, nullptr) << "read on_evict beyond struct_size";
  EXPECT_EQ(g_rec.params.on_evict_user, nullptr);
  g_rec.params.Evicted(Bytes(kKey, 2));  // no callback: a no-op
  ops->destroy(s);

  // A 1.1 host's callback is handed through.
  int evicted = 0;
  kvb_storage_params_t p11{
      .struct_size = sizeof(p11),
      .node_id = "n1",
      .capacity_bytes = 5,
      .path = nullptr,
      .on_evict = [](void* u, const uint8_t*,
                     uint32_t n) { *static_cast<int*>(u) += static_cast<int>(n); },
      .on_evict_user = &evicted};
  ASSERT_EQ(ops->create(fake_.table(), &p11, &s, err, sizeof(err)), KVB_OK) << err;
  g_rec.params.Evicted(Bytes(kKey, 2));
  EXPECT_EQ(evicted, 2);
  ops->destroy(s);
}

}  // namespace
}  // namespace kvbridge::plugin::sdk

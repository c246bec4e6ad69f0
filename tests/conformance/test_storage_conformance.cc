// One behaviour suite for every storage plugin (docs/plugin-abi.md): each test runs once per
// storage plugin, loaded through the real loader and driven through core::StorageInstance, the
// one wrapper of a kvb_storage_ops_t table (the codes it maps back here are the plugin's). POOL
// tests skip for plugins that do not declare KVB_SCAP_POOL, OBJECTS tests for those
// that do not declare KVB_SCAP_OBJECTS. File-backed plugins (ssd) get a fresh directory per
// instance in params.path. The DramPlugin tests at the end pin what only the dram plugin promises
// (2 MiB rounding, its configuration keys, its log lines, prefault); the ssd plugin's own tests
// are in tests/ssd/.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/host_services.h"
#include "core/plugin_host.h"

namespace kvbridge::core {
namespace {

constexpr uint64_t kCapacity = 8u << 20;  // a multiple of 2 MiB, so dram does not round it
constexpr uint64_t kPage = 4096;          // allocation sizes below are multiples of this, so
                                          // any alignment up to 4096 rounds nothing

PluginHost& Plugins() {
  static const std::shared_ptr<PluginHost> host =
      PluginHost::Acquire({KVBRIDGE_PLUGIN_BUILD_DIR, KVBRIDGE_TEST_PLUGIN_BUILD_DIR});
  return *host;
}

kvb_status_t Code(const Status& st) { return static_cast<kvb_status_t>(st.code()); }

// A host-services table whose config comes from core::HostServices and whose log lines are
// also kept, so tests can read what a plugin said.
class TestHost {
 public:
  explicit TestHost(std::map<std::string, std::string> config)
      : inner_(std::move(config), std::nullopt,
               [this](int32_t level, const char* plugin, const char* msg) {
                 Record(level, plugin, msg);
               }) {}
  const kvb_host_services_t* table() const { return inner_.table(); }
  std::vector<std::string> lines() const {
    std::lock_guard<std::mutex> lk(mu_);
    return lines_;
  }
  bool Logged(const std::string& needle) const {
    for (const auto& l : lines()) {
      if (l.find(needle) != std::string::npos) return true;
    }
    return false;
  }

 private:
  void Record(int32_t level, const char* plugin, const char* msg) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      lines_.push_back(std::string(plugin) + ": " + msg);
    }
    if (level >= KVB_LOG_WARN) std::fprintf(stderr, "[%s] %s\n", plugin, msg);
  }

  HostServices inner_;  // a storage plugin's host: no identity, the auth services unavailable
  mutable std::mutex mu_;
  std::vector<std::string> lines_;
};

using Instance = StorageInstance;  // one plugin instance, destroyed with the object

// The plugin's codes for the POOL and OBJECTS calls, through the wrapper.
kvb_status_t Alloc(Instance& inst, uint64_t length, uint64_t* offset) {
  Result<uint64_t> r = inst.Alloc(length);
  if (r.ok()) *offset = r.value();
  return Code(r.status());
}
kvb_status_t Free(Instance& inst, uint64_t offset) { return Code(inst.Free(offset)); }
kvb_status_t Remove(Instance& inst, const std::string& key) { return Code(inst.Remove(key)); }

struct PluginCase {
  std::string plugin;  // the descriptor name
  std::string label;   // the test name suffix
  std::map<std::string, std::string> config;
  bool file_backed = false;  // needs a directory in params.path
};

void PrintTo(const PluginCase& c, std::ostream* os) { *os << c.label; }

std::string CaseLabel(const ::testing::TestParamInfo<PluginCase>& info) { return info.param.label; }

const PluginInfo* FindStorage(const std::string& name, std::string* why) {
  return Plugins().registry().Find(KVB_PLUGIN_STORAGE, name, why);
}

// Deterministic bytes for (seed, index).
uint8_t Pattern(uint64_t seed, uint64_t i) {
  return static_cast<uint8_t>((i * 131 + (i >> 12) * 7 + seed * 29) & 0xff);
}

class StorageConformance : public ::testing::TestWithParam<PluginCase> {
 protected:
  void SetUp() override {
    std::string why;
    info_ = FindStorage(GetParam().plugin, &why);
    ASSERT_NE(info_, nullptr) << "storage plugin '" << GetParam().plugin << "': " << why;
    host_ = std::make_unique<TestHost>(GetParam().config);
    if (GetParam().file_backed) {
      std::string tmpl = (std::filesystem::temp_directory_path() / "kvb_storage_XXXXXX").string();
      ASSERT_NE(mkdtemp(tmpl.data()), nullptr) << std::strerror(errno);
      root_ = tmpl;
    }
  }

  void TearDown() override {
    if (!root_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(root_, ec);
    }
  }

  bool Has(uint64_t cap) const { return (info_->caps & cap) != 0; }

  // The params of the next instance; file-backed plugins get a directory of their own in path.
  StorageConfig Config(uint64_t capacity) {
    StorageConfig c;
    c.node_id = "conformance";
    c.capacity_bytes = capacity;
    if (!root_.empty()) c.path = root_ + "/instance-" + std::to_string(next_path_++);
    c.services = host_->table();
    return c;
  }

  std::unique_ptr<Instance> Make(uint64_t capacity) {
    auto s = Plugins().CreateStorage(*info_, Config(capacity));
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }

  StorageUsage Usage(const Instance& inst) {
    Result<StorageUsage> u = inst.Usage();
    EXPECT_TRUE(u.ok()) << u.status().ToString();
    return u.ok() ? u.value() : StorageUsage{};
  }

  uint8_t* Segment(const Instance& inst, uint64_t* length) {
    Result<Instance::Segment> seg = inst.GetSegment();
    EXPECT_TRUE(seg.ok()) << seg.status().ToString();
    if (!seg.ok()) return nullptr;
    *length = seg.value().length;
    return static_cast<uint8_t*>(seg.value().addr);
  }

  // Allocates `length`-byte ranges until NO_SPACE; any other failure fails the test.
  std::vector<uint64_t> FillWith(Instance& inst, uint64_t length) {
    std::vector<uint64_t> offsets;
    for (;;) {
      uint64_t off = 0;
      const kvb_status_t st = Alloc(inst, length, &off);
      if (st == KVB_ERR_NO_SPACE) break;
      EXPECT_EQ(st, KVB_OK);
      if (st != KVB_OK) break;
      offsets.push_back(off);
      if (offsets.size() > kCapacity / length) {
        ADD_FAILURE() << "more " << length << "-byte allocations than fit in the capacity";
        break;
      }
    }
    return offsets;
  }

  kvb_status_t Put(Instance& inst, const std::string& key, const std::vector<uint8_t>& v) {
    kvb_iovec_t iov{const_cast<uint8_t*>(v.data()), v.size()};
    return Code(inst.Put(key, {&iov, 1}));
  }

  kvb_status_t Get(Instance& inst, const std::string& key, std::vector<uint8_t>* out) {
    uint64_t length = 0;
    kvb_iovec_t iov{out->data(), out->size()};
    const kvb_status_t st = Code(inst.Get(key, {&iov, 1}, &length));
    if (st == KVB_OK) out->resize(length);
    return st;
  }

  const PluginInfo* info_ = nullptr;
  std::unique_ptr<TestHost> host_;  // outlives the instances a test creates
  std::string root_;                // file-backed plugins: this test's directory
  int next_path_ = 0;
};

#define REQUIRE_CAP(cap)                                                                   \
  if (!Has(cap)) {                                                                         \
    GTEST_SKIP() << "storage plugin '" << GetParam().plugin << "' does not declare " #cap; \
  }

// --- every plugin ------------------------------------------------------------------------

TEST_P(StorageConformance, CreateWithZeroCapacityFailsWithAMessage) {
  auto s = Plugins().CreateStorage(*info_, Config(0));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(Code(s.status()), KVB_ERR_INVALID_ARGUMENT) << s.status().ToString();
  const std::string prefix = "storage plugin '" + info_->name + "': ";
  EXPECT_GT(s.status().message().size(), prefix.size()) << "no message";
  EXPECT_NE(s.status().message().find("capacity"), std::string::npos) << s.status().ToString();
}

TEST_P(StorageConformance, FreshInstanceIsEmpty) {
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  const auto u = Usage(*inst);
  EXPECT_GE(u.capacity_bytes, kCapacity);
  EXPECT_EQ(u.used_bytes, 0u);
  EXPECT_EQ(u.object_count, 0u);
}

TEST_P(StorageConformance, UndeclaredShapesAnswerUnsupported) {
  if (Has(KVB_SCAP_POOL) && Has(KVB_SCAP_OBJECTS)) GTEST_SKIP() << "declares both shapes";
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  if (!Has(KVB_SCAP_POOL)) {
    uint64_t off = 0;
    EXPECT_EQ(Code(inst->GetSegment().status()), KVB_ERR_UNSUPPORTED);
    EXPECT_EQ(Alloc(*inst, 64, &off), KVB_ERR_UNSUPPORTED);
    EXPECT_EQ(Free(*inst, 0), KVB_ERR_UNSUPPORTED);
  }
  if (!Has(KVB_SCAP_OBJECTS)) {
    uint8_t byte = 0;
    kvb_iovec_t iov{&byte, 1};
    EXPECT_EQ(Code(inst->Put("k", {&iov, 1})), KVB_ERR_UNSUPPORTED);
    EXPECT_EQ(Code(inst->Get("k", {&iov, 1})), KVB_ERR_UNSUPPORTED);
    EXPECT_EQ(Remove(*inst, "k"), KVB_ERR_UNSUPPORTED);
    EXPECT_EQ(Code(inst->ForEach([](std::string_view, uint64_t) {})), KVB_ERR_UNSUPPORTED);
  }
}

TEST_P(StorageConformance, CreateTakesAbi1_0Params) {
  // A 1.0 host's params end after `path`; the plugin must not read on_evict beyond them. The
  // wrapper fills what follows with garbage where a 1.1 host would have put the callback.
  StorageConfig config = Config(kCapacity);
  config.params_struct_size = offsetof(kvb_storage_params_t, path) + sizeof(const char*);
  auto s = Plugins().CreateStorage(*info_, config);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  Instance& inst = *s.value();
  EXPECT_EQ(Usage(inst).used_bytes, 0u);
  if (Has(KVB_SCAP_OBJECTS)) {
    EXPECT_EQ(Put(inst, "k", std::vector<uint8_t>(100, 1)), KVB_OK);
  }
}

// --- POOL --------------------------------------------------------------------------------

TEST_P(StorageConformance, SegmentIsWritableAcrossItsWholeLength) {
  REQUIRE_CAP(KVB_SCAP_POOL);
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  uint64_t length = 0;
  uint8_t* seg = Segment(*inst, &length);
  ASSERT_NE(seg, nullptr);
  EXPECT_EQ(length, Usage(*inst).capacity_bytes) << "the segment is the whole capacity";
  for (uint64_t i = 0; i < length; ++i) seg[i] = Pattern(1, i);
  for (uint64_t i = 0; i < length; ++i) {
    ASSERT_EQ(seg[i], Pattern(1, i)) << "byte " << i << " did not keep what was written";
  }
  uint64_t length_again = 0;
  uint8_t* again = Segment(*inst, &length_again);
  EXPECT_EQ(again, seg) << "the segment must not move";
  EXPECT_EQ(length_again, length);
}

TEST_P(StorageConformance, AllocationsNeverOverlapAndLieInsideTheSegment) {
  REQUIRE_CAP(KVB_SCAP_POOL);
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  uint64_t seg_len = 0;
  uint8_t* seg = Segment(*inst, &seg_len);
  std::mt19937_64 rng(7);
  struct Range {
    uint64_t length;
    uint8_t tag;
  };
  std::map<uint64_t, Range> live;  // offset -> requested length and the byte written there
  uint64_t requested = 0;
  for (;;) {
    const uint64_t len = 1 + rng() % (rng() % 8 == 0 ? 256 * 1024 : 5000);
    uint64_t off = 0;
    const kvb_status_t st = Alloc(*inst, len, &off);
    if (st == KVB_ERR_NO_SPACE) break;
    ASSERT_EQ(st, KVB_OK);
    ASSERT_LE(off, seg_len);
    ASSERT_LE(len, seg_len - off) << "allocation runs past the segment";
    const auto tag = static_cast<uint8_t>(1 + live.size() % 251);
    ASSERT_TRUE(live.emplace(off, Range{len, tag}).second)
        << "offset " << off << " handed out twice";
    std::memset(seg + off, tag, len);
    requested += len;
  }
  ASSERT_GT(live.size(), 10u);
  uint64_t end = 0;
  for (const auto& [off, r] : live) {
    ASSERT_GE(off, end) << "allocation at " << off << " overlaps the one before it";
    end = off + r.length;
    // Nothing written through a later allocation landed in this one.
    ASSERT_TRUE(std::all_of(seg + off, seg + off + r.length, [&](uint8_t b) { return b == r.tag; }))
        << "bytes of the allocation at " << off << " were overwritten";
  }
  EXPECT_GE(Usage(*inst).used_bytes, requested) << "used_bytes counts less than was handed out";
}

TEST_P(StorageConformance, NoSpaceWhenFullAndNothingChanges) {
  REQUIRE_CAP(KVB_SCAP_POOL);
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  const uint64_t capacity = Usage(*inst).capacity_bytes;
  uint64_t off = 12345;
  EXPECT_EQ(Alloc(*inst, capacity + 1, &off), KVB_ERR_NO_SPACE);
  EXPECT_EQ(off, 12345u) << "a failed alloc wrote its offset";
  EXPECT_EQ(Usage(*inst).used_bytes, 0u);

  constexpr uint64_t kChunk = 64 * 1024;
  const auto offsets = FillWith(*inst, kChunk);
  EXPECT_EQ(offsets.size(), capacity / kChunk) << "the whole capacity is allocatable";
  const auto full = Usage(*inst);
  EXPECT_EQ(full.used_bytes, capacity);
  for (uint64_t len : {uint64_t{1}, kChunk, capacity}) {
    EXPECT_EQ(Alloc(*inst, len, &off), KVB_ERR_NO_SPACE) << "length " << len;
  }
  const auto after = Usage(*inst);
  EXPECT_EQ(after.used_bytes, full.used_bytes);
  EXPECT_EQ(after.object_count, full.object_count);
}

TEST_P(StorageConformance, FreeThenReallocWorks) {
  REQUIRE_CAP(KVB_SCAP_POOL);
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  constexpr uint64_t kChunk = 64 * 1024;
  const auto offsets = FillWith(*inst, kChunk);
  ASSERT_GT(offsets.size(), 4u);
  const uint64_t victim = offsets[offsets.size() / 2];
  ASSERT_EQ(Free(*inst, victim), KVB_OK);
  EXPECT_EQ(Usage(*inst).used_bytes, Usage(*inst).capacity_bytes - kChunk);
  uint64_t off = 0;
  ASSERT_EQ(Alloc(*inst, kChunk, &off), KVB_OK);
  EXPECT_EQ(off, victim) << "the freed range is the only free space";

  // Freeing everything gives the whole capacity back as one range.
  for (uint64_t o : offsets) ASSERT_EQ(Free(*inst, o), KVB_OK);
  EXPECT_EQ(Usage(*inst).used_bytes, 0u);
  const uint64_t capacity = Usage(*inst).capacity_bytes;
  ASSERT_EQ(Alloc(*inst, capacity, &off), KVB_OK);
  EXPECT_EQ(off, 0u);
  EXPECT_EQ(Free(*inst, off), KVB_OK);
}

TEST_P(StorageConformance, FreeOfANeverAllocatedOffsetIsAnErrorAndChangesNothing) {
  REQUIRE_CAP(KVB_SCAP_POOL);
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  uint64_t a = 0, b = 0;
  ASSERT_EQ(Alloc(*inst, 4 * kPage, &a), KVB_OK);
  ASSERT_EQ(Alloc(*inst, 4 * kPage, &b), KVB_OK);
  ASSERT_EQ(Free(*inst, b), KVB_OK);
  const auto before = Usage(*inst);
  const uint64_t capacity = before.capacity_bytes;
  for (uint64_t bad : {a + 64, a + kPage, b, capacity - 64, capacity, ~uint64_t{0}}) {
    EXPECT_EQ(Free(*inst, bad), KVB_ERR_NOT_FOUND) << "free(" << bad << ")";
  }
  const auto after = Usage(*inst);
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  EXPECT_EQ(after.object_count, before.object_count);
  EXPECT_EQ(Free(*inst, a), KVB_OK) << "the live allocation is untouched";
  EXPECT_EQ(Free(*inst, a), KVB_ERR_NOT_FOUND) << "double free";
  EXPECT_EQ(Usage(*inst).used_bytes, 0u);
}

TEST_P(StorageConformance, UsageIsExact) {
  REQUIRE_CAP(KVB_SCAP_POOL);
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  // object_count counts live pool allocations only for pool-only plugins: storage.h does not
  // say how a plugin with both shapes counts them (the mock counts stored objects alone).
  const bool counts_allocations = !Has(KVB_SCAP_OBJECTS);
  const uint64_t capacity = Usage(*inst).capacity_bytes;
  std::vector<std::pair<uint64_t, uint64_t>> live;
  uint64_t sum = 0;
  for (uint64_t pages : {1, 3, 16, 2, 7, 1, 32}) {
    uint64_t off = 0;
    ASSERT_EQ(Alloc(*inst, pages * kPage, &off), KVB_OK);
    live.emplace_back(off, pages * kPage);
    sum += pages * kPage;
    const auto u = Usage(*inst);
    EXPECT_EQ(u.used_bytes, sum);
    if (counts_allocations) {
      EXPECT_EQ(u.object_count, live.size());
    }
    EXPECT_EQ(u.capacity_bytes, capacity) << "capacity must not move";
  }
  for (size_t i = 0; i < live.size(); i += 2) {
    ASSERT_EQ(Free(*inst, live[i].first), KVB_OK);
    sum -= live[i].second;
    EXPECT_EQ(Usage(*inst).used_bytes, sum);
  }
  for (size_t i = 1; i < live.size(); i += 2) ASSERT_EQ(Free(*inst, live[i].first), KVB_OK);
  const auto u = Usage(*inst);
  EXPECT_EQ(u.used_bytes, 0u);
  EXPECT_EQ(u.object_count, 0u);
}

TEST_P(StorageConformance, ConcurrentAllocAndFreeKeepUsageConsistent) {
  REQUIRE_CAP(KVB_SCAP_POOL);
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  uint64_t seg_len = 0;
  uint8_t* seg = Segment(*inst, &seg_len);
  const uint64_t capacity = Usage(*inst).capacity_bytes;
  constexpr int kThreads = 4;
  constexpr size_t kMaxLivePerThread = 24;
  struct Live {
    uint64_t offset, length;
    uint8_t tag;
  };
  std::vector<std::vector<Live>> live(kThreads);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> errors{0}, overlaps{0}, allocs{0}, no_space{0};

  auto worker = [&](int t) {
    std::mt19937_64 rng(100 + t);
    uint32_t seq = 0;
    auto& mine = live[t];
    for (uint64_t iter = 0; !stop.load(std::memory_order_relaxed); ++iter) {
      if (mine.size() < kMaxLivePerThread && (mine.empty() || rng() % 3 != 0)) {
        const uint64_t len = kPage * (1 + rng() % 16);
        uint64_t off = 0;
        const kvb_status_t st = Alloc(*inst, len, &off);
        if (st == KVB_ERR_NO_SPACE) {
          ++no_space;
        } else if (st != KVB_OK || off > seg_len || len > seg_len - off) {
          ++errors;
        } else {
          const auto tag = static_cast<uint8_t>((t << 6) | (1 + seq++ % 63));
          std::memset(seg + off, tag, len);
          mine.push_back({off, len, tag});
          ++allocs;
        }
      } else if (!mine.empty()) {
        const size_t i = rng() % mine.size();
        const Live l = mine[i];
        // Another thread's allocation overlapping this one would have overwritten the tag.
        if (std::any_of(seg + l.offset, seg + l.offset + l.length,
                        [&](uint8_t b) { return b != l.tag; })) {
          ++overlaps;
        }
        if (Free(*inst, l.offset) != KVB_OK) ++errors;
        mine[i] = mine.back();
        mine.pop_back();
      }
      if (iter % 64 == 0) {
        Result<StorageUsage> r = inst->Usage();
        const StorageUsage u = r.ok() ? r.value() : StorageUsage{};
        if (!r.ok() || u.used_bytes > capacity || u.used_bytes % kPage != 0 ||
            u.capacity_bytes != capacity) {
          ++errors;
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  stop = true;
  for (auto& th : threads) th.join();

  EXPECT_EQ(errors.load(), 0u);
  EXPECT_EQ(overlaps.load(), 0u) << "two live allocations shared bytes";
  EXPECT_GT(allocs.load(), 100u) << "the threads hardly ran";
  uint64_t sum = 0;
  size_t count = 0;
  for (const auto& mine : live) {
    for (const Live& l : mine) sum += l.length;
    count += mine.size();
  }
  auto u = Usage(*inst);
  EXPECT_EQ(u.used_bytes, sum);
  if (!Has(KVB_SCAP_OBJECTS)) {
    EXPECT_EQ(u.object_count, count);
  }
  for (const auto& mine : live) {
    for (const Live& l : mine) EXPECT_EQ(Free(*inst, l.offset), KVB_OK);
  }
  u = Usage(*inst);
  EXPECT_EQ(u.used_bytes, 0u);
  EXPECT_EQ(u.object_count, 0u);
}

// --- OBJECTS -----------------------------------------------------------------------------

TEST_P(StorageConformance, PutGetRoundTripWithSeveralIovecs) {
  REQUIRE_CAP(KVB_SCAP_OBJECTS);
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  std::vector<uint8_t> a(100), b(1), c(5000);
  for (size_t i = 0; i < a.size(); ++i) a[i] = Pattern(1, i);
  b[0] = 0xab;
  for (size_t i = 0; i < c.size(); ++i) c[i] = Pattern(3, i);
  const kvb_iovec_t in[] = {{a.data(), a.size()}, {b.data(), b.size()}, {c.data(), c.size()}};
  const std::string key = "page/0001";
  ASSERT_EQ(Code(inst->Put(key, in)), KVB_OK);

  std::vector<uint8_t> expect;
  expect.insert(expect.end(), a.begin(), a.end());
  expect.insert(expect.end(), b.begin(), b.end());
  expect.insert(expect.end(), c.begin(), c.end());

  // Read back into differently cut iovecs, with room to spare in the last one.
  std::vector<uint8_t> x(7, 0xee), y(3000, 0xee), z(3000, 0xee);
  const kvb_iovec_t out[] = {{x.data(), x.size()}, {y.data(), y.size()}, {z.data(), z.size()}};
  uint64_t length = 0;
  ASSERT_EQ(Code(inst->Get(key, out, &length)), KVB_OK);
  ASSERT_EQ(length, expect.size());
  std::vector<uint8_t> got;
  got.insert(got.end(), x.begin(), x.end());
  got.insert(got.end(), y.begin(), y.end());
  got.insert(got.end(), z.begin(), z.end());
  EXPECT_TRUE(std::equal(expect.begin(), expect.end(), got.begin())) << "bytes differ";
  EXPECT_TRUE(std::all_of(got.begin() + expect.size(), got.end(), [](uint8_t v) {
    return v == 0xee;
  })) << "get wrote past the object";
  const auto u = Usage(*inst);
  EXPECT_EQ(u.object_count, 1u);
  EXPECT_GE(u.used_bytes, expect.size());
}

TEST_P(StorageConformance, GetIntoTooSmallIovecsIsInvalidArgumentAndCopiesNothing) {
  REQUIRE_CAP(KVB_SCAP_OBJECTS);
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  std::vector<uint8_t> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = Pattern(9, i);
  ASSERT_EQ(Put(*inst, "k", v), KVB_OK);
  std::vector<uint8_t> p(500, 0xee), q(499, 0xee);
  const kvb_iovec_t out[] = {{p.data(), p.size()}, {q.data(), q.size()}};
  uint64_t length = 0;
  EXPECT_EQ(Code(inst->Get("k", out, &length)), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(length, v.size()) << "the size comes back with a too-small buffer";
  auto untouched = [](const std::vector<uint8_t>& buf) {
    return std::all_of(buf.begin(), buf.end(), [](uint8_t b) { return b == 0xee; });
  };
  EXPECT_TRUE(untouched(p) && untouched(q)) << "a refused get copied bytes";

  std::vector<uint8_t> none(16);
  EXPECT_EQ(Get(*inst, "absent", &none), KVB_ERR_NOT_FOUND);
}

TEST_P(StorageConformance, PutOfAnExistingKeyIsAlreadyExistsAndKeepsTheOriginal) {
  REQUIRE_CAP(KVB_SCAP_OBJECTS);
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  const std::vector<uint8_t> first(300, 0x11), second(600, 0x22);
  ASSERT_EQ(Put(*inst, "dup", first), KVB_OK);
  const auto before = Usage(*inst);
  EXPECT_EQ(Put(*inst, "dup", second), KVB_ERR_ALREADY_EXISTS);
  const auto after = Usage(*inst);
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  EXPECT_EQ(after.object_count, before.object_count);
  std::vector<uint8_t> got(1024);
  ASSERT_EQ(Get(*inst, "dup", &got), KVB_OK);
  EXPECT_EQ(got, first);
}

TEST_P(StorageConformance, RemoveDeletesTheObject) {
  REQUIRE_CAP(KVB_SCAP_OBJECTS);
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  const auto empty = Usage(*inst);
  ASSERT_EQ(Put(*inst, "gone", std::vector<uint8_t>(4096, 7)), KVB_OK);
  ASSERT_EQ(Put(*inst, "kept", std::vector<uint8_t>(100, 8)), KVB_OK);
  EXPECT_EQ(Remove(*inst, "gone"), KVB_OK);
  std::vector<uint8_t> got(8192);
  EXPECT_EQ(Get(*inst, "gone", &got), KVB_ERR_NOT_FOUND);
  EXPECT_EQ(Remove(*inst, "gone"), KVB_ERR_NOT_FOUND);
  EXPECT_EQ(Usage(*inst).object_count, empty.object_count + 1);
  ASSERT_EQ(Get(*inst, "kept", &got), KVB_OK);
  EXPECT_EQ(got, std::vector<uint8_t>(100, 8));
  EXPECT_EQ(Remove(*inst, "kept"), KVB_OK);
  const auto u = Usage(*inst);
  EXPECT_EQ(u.used_bytes, empty.used_bytes);
  EXPECT_EQ(u.object_count, empty.object_count);
  EXPECT_EQ(Put(*inst, "gone", std::vector<uint8_t>(10, 9)), KVB_OK) << "the key is free again";
}

TEST_P(StorageConformance, ForEachListsEverything) {
  REQUIRE_CAP(KVB_SCAP_OBJECTS);
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  std::map<std::string, uint64_t> expect;
  for (int i = 0; i < 50; ++i) {
    std::string key = "obj-" + std::to_string(i);
    if (i % 10 == 0) key.push_back('\0');  // keys are bytes, not C strings
    const uint64_t len = 1 + static_cast<uint64_t>(i) * 37;
    ASSERT_EQ(Put(*inst, key, std::vector<uint8_t>(len, static_cast<uint8_t>(i))), KVB_OK);
    expect[key] = len;
  }
  std::map<std::string, uint64_t> seen;
  int calls = 0;
  ASSERT_EQ(Code(inst->ForEach([&](std::string_view key, uint64_t length) {
              ++calls;
              seen[std::string(key)] = length;
            })),
            KVB_OK);
  EXPECT_EQ(calls, 50) << "each object exactly once";
  EXPECT_EQ(seen, expect);
  EXPECT_EQ(Usage(*inst).object_count, 50u);
}

TEST_P(StorageConformance, PutBeyondCapacityIsNoSpaceAndLeavesNoObject) {
  REQUIRE_CAP(KVB_SCAP_OBJECTS);
  constexpr uint64_t kSmall = 2u << 20;
  auto inst = Make(kSmall);
  ASSERT_NE(inst, nullptr);
  const uint64_t capacity = Usage(*inst).capacity_bytes;
  const std::vector<uint8_t> chunk(256 * 1024, 0x5a);
  int stored = 0;
  kvb_status_t st = KVB_OK;
  while (stored <= static_cast<int>(capacity / chunk.size())) {
    st = Put(*inst, "fill-" + std::to_string(stored), chunk);
    if (st != KVB_OK) break;
    ++stored;
  }
  EXPECT_EQ(st, KVB_ERR_NO_SPACE) << "capacity is a bound";
  EXPECT_GE(stored, 1);
  EXPECT_LE(static_cast<uint64_t>(stored) * chunk.size(), capacity);
  const auto before = Usage(*inst);
  EXPECT_LE(before.used_bytes, capacity);
  EXPECT_EQ(Put(*inst, "one-too-many", chunk), KVB_ERR_NO_SPACE);
  const auto after = Usage(*inst);
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  EXPECT_EQ(after.object_count, static_cast<uint64_t>(stored));
  std::vector<uint8_t> got(chunk.size());
  EXPECT_EQ(Get(*inst, "one-too-many", &got), KVB_ERR_NOT_FOUND) << "a failed put is visible";
  ASSERT_EQ(Remove(*inst, "fill-0"), KVB_OK);
  EXPECT_EQ(Put(*inst, "one-too-many", chunk), KVB_OK) << "space comes back after remove";
}

TEST_P(StorageConformance, PutMetaKeepsTheMetadataWithTheObject) {
  REQUIRE_CAP(KVB_SCAP_OBJECTS);
  auto inst = Make(kCapacity);
  ASSERT_NE(inst, nullptr);
  if (!inst->has_meta()) GTEST_SKIP() << "an ABI 1.0 ops table: no put_meta";
  auto put_meta = [&](const std::string& key, const std::vector<uint8_t>& v,
                      const std::vector<uint8_t>& meta) {
    kvb_iovec_t iov{const_cast<uint8_t*>(v.data()), v.size()};
    return Code(inst->PutMeta(
        key, {&iov, 1}, std::string_view(reinterpret_cast<const char*>(meta.data()), meta.size())));
  };
  std::vector<uint8_t> full(KVB_STORAGE_META_MAX), one = {0x42};
  for (size_t i = 0; i < full.size(); ++i) full[i] = Pattern(5, i);
  const std::vector<uint8_t> data(3000, 0x33);
  const auto before = Usage(*inst);
  EXPECT_EQ(put_meta("too-long", data, std::vector<uint8_t>(KVB_STORAGE_META_MAX + 1, 1)),
            KVB_ERR_INVALID_ARGUMENT);
  const auto after_refused = Usage(*inst);
  EXPECT_EQ(after_refused.used_bytes, before.used_bytes);
  EXPECT_EQ(after_refused.object_count, before.object_count);
  ASSERT_EQ(put_meta("full", data, full), KVB_OK);
  ASSERT_EQ(put_meta("one", data, one), KVB_OK);
  ASSERT_EQ(put_meta("none", data, {}), KVB_OK);
  ASSERT_EQ(Put(*inst, "plain", data), KVB_OK);
  EXPECT_EQ(put_meta("full", data, one), KVB_ERR_ALREADY_EXISTS);

  using Seen = std::map<std::string, std::pair<uint64_t, std::vector<uint8_t>>>;
  Seen seen;
  auto list = [&] {
    seen.clear();
    return Code(
        inst->ForEachMeta([&](std::string_view key, uint64_t length, std::string_view meta) {
          seen[std::string(key)] = {length, std::vector<uint8_t>(meta.begin(), meta.end())};
        }));
  };
  ASSERT_EQ(list(), KVB_OK);
  ASSERT_EQ(seen.size(), 4u);
  EXPECT_EQ(seen["full"].second, full);
  EXPECT_EQ(seen["one"].second, one);
  EXPECT_TRUE(seen["none"].second.empty());
  EXPECT_TRUE(seen["plain"].second.empty()) << "a plain put has no metadata";
  for (const auto& [key, v] : seen) EXPECT_EQ(v.first, data.size()) << key;
  std::vector<uint8_t> got(4096);
  ASSERT_EQ(Get(*inst, "full", &got), KVB_OK);
  EXPECT_EQ(got, data) << "metadata must not leak into the object's bytes";
  ASSERT_EQ(Remove(*inst, "full"), KVB_OK);
  ASSERT_EQ(list(), KVB_OK);
  EXPECT_EQ(seen.count("full"), 0u);
  EXPECT_EQ(seen.size(), 3u);
}

INSTANTIATE_TEST_SUITE_P(
    Plugins, StorageConformance,
    ::testing::Values(
        PluginCase{"dram", "dram", {}},
        PluginCase{"dram",
                   "dram_small_pages_prefaulted",
                   {{"dram.hugepages", "off"}, {"dram.prefault", "1"}, {"dram.alignment", "4096"}}},
        PluginCase{"mock", "mock", {}}, PluginCase{"ssd", "ssd", {}, true},
        PluginCase{"ssd",
                   "ssd_sync_small_inflight",
                   {{"ssd.io", "sync"}, {"ssd.max_inflight_bytes", "1048576"}},
                   true}),
    CaseLabel);

// --- what only the dram plugin promises ----------------------------------------------------

class DramPlugin : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    const PluginInfo* info = FindStorage("dram", &why);
    ASSERT_NE(info, nullptr) << why;
    info_ = info;
    EXPECT_EQ(info->caps & KVB_SCAP_KNOWN_MASK, KVB_SCAP_POOL);
  }

  // Creates with `config`; returns the status, the instance (on OK) and the message.
  kvb_status_t Create(const std::map<std::string, std::string>& config, uint64_t capacity,
                      std::unique_ptr<Instance>* inst, std::string* err = nullptr) {
    inst->reset();  // before the host it logs through
    host_ = std::make_unique<TestHost>(config);
    StorageConfig c;
    c.node_id = "dram-test";
    c.capacity_bytes = capacity;
    c.services = host_->table();
    auto s = Plugins().CreateStorage(*info_, c);
    if (err != nullptr) *err = s.status().message();
    if (s.ok()) *inst = std::move(s).value();
    return Code(s.status());
  }

  const PluginInfo* info_ = nullptr;
  std::unique_ptr<TestHost> host_;  // outlives the instances a test creates after it
};

uint64_t FreeHugePages() {
  std::ifstream in("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages");
  uint64_t n = 0;
  return (in >> n) ? n : 0;
}

TEST_F(DramPlugin, CapacityIsRoundedUpTo2MiBAndTheSegmentIs2MiBAligned) {
  std::unique_ptr<Instance> inst;
  ASSERT_EQ(Create({}, (3u << 20) + 1, &inst), KVB_OK);
  Result<StorageUsage> u = inst->Usage();
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u.value().capacity_bytes, 4u << 20);
  Result<Instance::Segment> seg = inst->GetSegment();
  ASSERT_TRUE(seg.ok()) << seg.status().ToString();
  void* addr = seg.value().addr;
  const uint64_t len = seg.value().length;
  EXPECT_EQ(len, 4u << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(addr) % (2u << 20), 0u);
}

TEST_F(DramPlugin, AbsurdCapacityIsInvalidArgumentWithAMessage) {
  std::unique_ptr<Instance> inst;
  std::string err;
  EXPECT_EQ(Create({}, ~uint64_t{0}, &inst, &err), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_NE(err.find("physical memory"), std::string::npos) << err;
  EXPECT_EQ(Create({}, uint64_t{1} << 62, &inst, &err), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(inst, nullptr);
}

TEST_F(DramPlugin, MalformedConfigIsInvalidArgumentNamingTheKey) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"dram.hugepages", "sometimes"}, {"dram.hugepages", ""},
      {"dram.alignment", "0"},         {"dram.alignment", "48"},
      {"dram.alignment", "4194304"},   {"dram.alignment", "-64"},
      {"dram.alignment", "64k"},       {"dram.prefault", "yes"},
      {"dram.prefault", "2"},          {"dram.alignment", std::string(200, '6')}};
  for (const auto& [key, value] : bad) {
    SCOPED_TRACE(key + "=" + value);
    std::unique_ptr<Instance> inst;
    std::string err;
    EXPECT_EQ(Create({{key, value}}, 2u << 20, &inst, &err), KVB_ERR_INVALID_ARGUMENT);
    EXPECT_NE(err.find(key), std::string::npos) << err;
  }
}

TEST_F(DramPlugin, AlignmentConfigRoundsEveryAllocation) {
  std::unique_ptr<Instance> inst;
  ASSERT_EQ(Create({{"dram.alignment", "4096"}}, 2u << 20, &inst), KVB_OK);
  uint64_t a = 0, b = 0;
  ASSERT_EQ(Alloc(*inst, 1, &a), KVB_OK);
  ASSERT_EQ(Alloc(*inst, 4097, &b), KVB_OK);
  EXPECT_EQ(a % 4096, 0u);
  EXPECT_EQ(b % 4096, 0u);
  Result<StorageUsage> u = inst->Usage();
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u.value().used_bytes, 3u * 4096);
  EXPECT_EQ(u.value().object_count, 2u);

  ASSERT_EQ(Create({}, 2u << 20, &inst), KVB_OK);  // default: 64
  ASSERT_EQ(Alloc(*inst, 1, &a), KVB_OK);
  ASSERT_EQ(Alloc(*inst, 1, &b), KVB_OK);
  EXPECT_EQ(b - a, 64u);
}

TEST_F(DramPlugin, LogsWhichPagesItGotAndWhy) {
  std::unique_ptr<Instance> inst;
  ASSERT_EQ(Create({{"dram.hugepages", "off"}}, 2u << 20, &inst), KVB_OK);
  EXPECT_TRUE(host_->Logged("normal pages")) << ::testing::PrintToString(host_->lines());
  EXPECT_TRUE(host_->Logged("dram.hugepages=off")) << ::testing::PrintToString(host_->lines());

  inst.reset();
  ASSERT_EQ(Create({}, 2u << 20, &inst), KVB_OK);
  EXPECT_TRUE(host_->Logged("on 2 MiB huge pages (MAP_HUGETLB)") ||
              (host_->Logged("normal pages") && host_->Logged("MAP_HUGETLB failed")))
      << ::testing::PrintToString(host_->lines());
}

TEST_F(DramPlugin, HugepagesOnIsAnErrorWithoutHugePages) {
  constexpr uint64_t kBytes = 4u << 20;
  const uint64_t free_pages = FreeHugePages();
  std::unique_ptr<Instance> inst;
  std::string err;
  const kvb_status_t st = Create({{"dram.hugepages", "on"}}, kBytes, &inst, &err);
  if (free_pages == 0) {
    EXPECT_EQ(st, KVB_ERR_UNAVAILABLE);
    EXPECT_NE(err.find("dram.hugepages=on"), std::string::npos) << err;
    EXPECT_NE(err.find("MAP_HUGETLB"), std::string::npos) << err;
  } else if (free_pages >= kBytes / (2u << 20) + 8) {
    EXPECT_EQ(st, KVB_OK) << err;
    EXPECT_TRUE(host_->Logged("huge pages (MAP_HUGETLB)"));
  } else {
    GTEST_SKIP() << "only " << free_pages << " free huge pages; others may take them";
  }
}

TEST_F(DramPlugin, PrefaultMakesEveryPageResident) {
  constexpr uint64_t kBytes = 8u << 20;
  std::unique_ptr<Instance> inst;
  ASSERT_EQ(Create({{"dram.prefault", "1"}}, kBytes, &inst), KVB_OK);
  EXPECT_TRUE(host_->Logged("prefaulted")) << ::testing::PrintToString(host_->lines());
  Result<Instance::Segment> seg = inst->GetSegment();
  ASSERT_TRUE(seg.ok()) << seg.status().ToString();
  void* addr = seg.value().addr;
  const uint64_t len = seg.value().length;
  const long page = sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> resident(len / static_cast<uint64_t>(page));
  ASSERT_EQ(mincore(addr, len, resident.data()), 0) << std::strerror(errno);
  const auto count =
      std::count_if(resident.begin(), resident.end(), [](unsigned char r) { return (r & 1) != 0; });
  EXPECT_EQ(static_cast<size_t>(count), resident.size()) << "pages not resident after prefault";
}

// A file under /dev/shm (or the temp dir), of `bytes`, removed with the object.
class SharedFile {
 public:
  explicit SharedFile(uint64_t bytes) {
    const std::string dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : ::testing::TempDir();
    path_ = dir + "/kvb-dram-file-" + std::to_string(getpid()) + "-" + std::to_string(++next_);
    const int fd = open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    EXPECT_GE(fd, 0) << path_ << ": " << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0) << std::strerror(errno);
    close(fd);
  }
  ~SharedFile() { unlink(path_.c_str()); }
  const std::string& path() const { return path_; }
  std::string Read(uint64_t offset, size_t n) const {
    std::string out(n, '\0');
    const int fd = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    EXPECT_EQ(pread(fd, out.data(), n, static_cast<off_t>(offset)), static_cast<ssize_t>(n));
    close(fd);
    return out;
  }

 private:
  static inline int next_ = 0;
  std::string path_;
};

// dram.file: the segment is the file's bytes from dram.file_offset, exactly the capacity (no
// 2 MiB rounding), shared: what is written into the segment is in the file, where another
// process mapping it sees it.
TEST_F(DramPlugin, FileSegmentIsTheFilesBytesShared) {
  SharedFile file(8u << 20);
  constexpr uint64_t kOffset = 1u << 20, kBytes = (3u << 20) + 4096;
  std::unique_ptr<Instance> inst;
  std::string err;
  ASSERT_EQ(Create({{"dram.file", file.path()}, {"dram.file_offset", std::to_string(kOffset)}},
                   kBytes, &inst, &err),
            KVB_OK)
      << err;
  EXPECT_TRUE(host_->Logged("on file " + file.path())) << ::testing::PrintToString(host_->lines());
  Result<Instance::Segment> seg = inst->GetSegment();
  ASSERT_TRUE(seg.ok()) << seg.status().ToString();
  EXPECT_EQ(seg.value().length, kBytes);
  Result<StorageUsage> u = inst->Usage();
  ASSERT_TRUE(u.ok()) << u.status().ToString();
  EXPECT_EQ(u.value().capacity_bytes, kBytes);
  uint64_t off = 0;
  ASSERT_EQ(Alloc(*inst, 100, &off), KVB_OK);
  auto* base = static_cast<char*>(seg.value().addr);
  std::memcpy(base + off, "through the segment", 19);
  EXPECT_EQ(file.Read(kOffset + off, 19), "through the segment");
  std::memcpy(base + kBytes - 4, "last", 4);
  EXPECT_EQ(file.Read(kOffset + kBytes - 4, 4), "last");
  inst.reset();  // unmapped; the file and its bytes stay
  EXPECT_EQ(file.Read(kOffset + off, 19), "through the segment");
}

// Prefaulting a file segment makes its pages resident without changing what the file holds
// (it may be another process's memory).
TEST_F(DramPlugin, PrefaultedFileSegmentKeepsTheFilesBytes) {
  SharedFile file(4u << 20);
  const std::string mark = "written by another process";
  {
    const int fd = open(file.path().c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    for (uint64_t at : {uint64_t{0}, uint64_t{4096}, uint64_t{(2u << 20) - 64}}) {
      ASSERT_EQ(pwrite(fd, mark.data(), mark.size(), static_cast<off_t>(at)),
                static_cast<ssize_t>(mark.size()));
    }
    close(fd);
  }
  std::unique_ptr<Instance> inst;
  std::string err;
  ASSERT_EQ(Create({{"dram.file", file.path()}, {"dram.prefault", "1"}}, 2u << 20, &inst, &err),
            KVB_OK)
      << err;
  EXPECT_TRUE(host_->Logged("prefaulted")) << ::testing::PrintToString(host_->lines());
  inst.reset();
  for (uint64_t at : {uint64_t{0}, uint64_t{4096}, uint64_t{(2u << 20) - 64}}) {
    EXPECT_EQ(file.Read(at, mark.size()), mark) << "at " << at;
  }
}

TEST_F(DramPlugin, FileSegmentErrorsNameTheFileAndWhatIsWrong) {
  SharedFile file(4u << 20);
  struct Case {
    std::map<std::string, std::string> config;
    uint64_t bytes;
    kvb_status_t want;
    std::string says;
  };
  const long page = sysconf(_SC_PAGESIZE);
  const Case cases[] = {
      {{{"dram.file", file.path() + ".missing"}}, 1u << 20, KVB_ERR_NOT_FOUND, "cannot be opened"},
      {{{"dram.file", file.path()}}, 5u << 20, KVB_ERR_INVALID_ARGUMENT, "has 4194304 bytes"},
      {{{"dram.file", file.path()}, {"dram.file_offset", std::to_string(3u << 20)}},
       2u << 20,
       KVB_ERR_INVALID_ARGUMENT,
       "needs 5242880"},
      {{{"dram.file", file.path()}, {"dram.file_offset", std::to_string(page + 1)}},
       1u << 20,
       KVB_ERR_INVALID_ARGUMENT,
       "dram.file_offset must be a multiple of the page size"},
      {{{"dram.file_offset", "0"}}, 1u << 20, KVB_ERR_INVALID_ARGUMENT, "dram.file is not"},
      {{{"dram.file", "/dev/shm"}}, 1u << 20, KVB_ERR_INVALID_ARGUMENT, "not a regular file"},
      {{{"dram.file", file.path()}, {"dram.hugepages", "on"}},
       1u << 20,
       KVB_ERR_INVALID_ARGUMENT,
       "cannot be honoured"},
  };
  for (const Case& c : cases) {
    std::unique_ptr<Instance> inst;
    std::string err;
    EXPECT_EQ(Create(c.config, c.bytes, &inst, &err), c.want) << err;
    EXPECT_NE(err.find(c.says), std::string::npos) << err;
    EXPECT_EQ(inst, nullptr);
  }
}

}  // namespace
}  // namespace kvbridge::core

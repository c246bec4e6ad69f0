// verbs::MrCache (plugins/transport_verbs/verbs_mr_cache.h) over a fake Registrar that records
// every call: hits and misses, rounding, kinds and devices, overlap (union), Invalidate, LRU
// eviction and over-limit acquires, registrar failures, stats per RegPath, MrRef moves, the
// destructor, and Acquire/release/Invalidate from several threads.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "verbs_mr_cache.h"

namespace kvbridge::verbs {
namespace {

namespace sdk = kvbridge::plugin::sdk;

class FakeRegistrar : public Registrar {
 public:
  struct Call {
    uint64_t addr, len;
    bool device;
    int device_id;
  };

  sdk::Result<MrKeys> Register(uint64_t addr, uint64_t len, bool device, int device_id) override {
    std::lock_guard<std::mutex> lock(mu_);
    registers_.push_back({addr, len, device, device_id});
    if (fail_) {
      sdk::Status st = std::move(*fail_);
      fail_.reset();
      return st;
    }
    MrKeys k;
    k.lkey = next_key_++;
    k.rkey = k.lkey + 1000000;
    k.path = device ? device_path_ : RegPath::kHost;
    k.handle = next_handle_++;
    deregistered_[k.handle] = 0;
    return k;
  }

  void Deregister(const MrKeys& k) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++deregistered_[k.handle];
    order_.push_back(k.lkey);
  }

  void FailNext(kvb_status_t code, std::string message) {
    std::lock_guard<std::mutex> lock(mu_);
    fail_ = sdk::Status(code, std::move(message));
  }
  void SetDevicePath(RegPath p) {
    std::lock_guard<std::mutex> lock(mu_);
    device_path_ = p;
  }

  std::vector<Call> registers() const {
    std::lock_guard<std::mutex> lock(mu_);
    return registers_;
  }
  size_t register_count() const { return registers().size(); }
  // How many times the MR with this lkey was deregistered (handles and lkeys go together).
  int deregs(uint32_t lkey) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = deregistered_.find(lkey - 99);
    return it == deregistered_.end() ? -1 : it->second;
  }
  std::vector<uint32_t> dereg_order() const {
    std::lock_guard<std::mutex> lock(mu_);
    return order_;
  }
  // handle -> times deregistered, for every successful registration.
  std::map<uint64_t, int> all() const {
    std::lock_guard<std::mutex> lock(mu_);
    return deregistered_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<Call> registers_;
  std::map<uint64_t, int> deregistered_;
  std::vector<uint32_t> order_;
  std::optional<sdk::Status> fail_;
  RegPath device_path_ = RegPath::kDmaBuf;
  uint32_t next_key_ = 100;  // lkey = handle + 99
  uint64_t next_handle_ = 1;
};

constexpr uint64_t kPage = 4096;
constexpr uint64_t kGran = 65536;
constexpr uint64_t kBase = 0x7f0000000000;  // page- and granularity-aligned

MrRef Get(MrCache& c, uint64_t addr, uint64_t len, bool device = false, int dev = 0) {
  auto r = c.Acquire(addr, len, device, dev);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(r).value() : MrRef();
}

TEST(MrCache, SecondAcquireInsideACachedMrIsAHitAndDoesNotRegister) {
  FakeRegistrar reg;
  MrCache cache(reg, {});
  MrRef a = Get(cache, kBase + 100, 200);
  MrRef b = Get(cache, kBase + 500, 1000);
  ASSERT_EQ(reg.register_count(), 1u);
  EXPECT_EQ(a.lkey(), b.lkey());
  EXPECT_EQ(a.rkey(), 100u + 1000000);
  a.Release();
  MrRef c = Get(cache, kBase, kPage);  // the whole page, after one reference went
  EXPECT_EQ(c.lkey(), b.lkey());
  EXPECT_EQ(reg.register_count(), 1u);
  const MrCacheStats s = cache.Stats();
  EXPECT_EQ(s.hits, 2u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.bytes, kPage);
}

TEST(MrCache, RoundsHostToPagesAndDeviceToGranularity) {
  FakeRegistrar reg;
  MrCache cache(reg, {});
  MrRef a = Get(cache, kBase + 0x1234, 0x100);
  MrRef b = Get(cache, kBase + 0x10fff, 2);  // straddles two pages
  MrRef d = Get(cache, kBase + 0x30001, 10, true, 0);
  const auto calls = reg.registers();
  ASSERT_EQ(calls.size(), 3u);
  EXPECT_EQ(calls[0].addr, kBase + 0x1000);
  EXPECT_EQ(calls[0].len, kPage);
  EXPECT_EQ(calls[1].addr, kBase + 0x10000);
  EXPECT_EQ(calls[1].len, 2 * kPage);
  EXPECT_EQ(calls[2].addr, kBase + 0x30000);
  EXPECT_EQ(calls[2].len, kGran);
  EXPECT_TRUE(calls[2].device);
  EXPECT_EQ(a.addr(), kBase + 0x1000);
  EXPECT_EQ(a.len(), kPage);
  EXPECT_EQ(d.addr(), kBase + 0x30000);
  EXPECT_EQ(d.len(), kGran);
  EXPECT_EQ(cache.Stats().bytes, 3 * kPage + kGran);

  FakeRegistrar reg2;
  MrCache custom(reg2, {.host_page = 8192, .device_granularity = 2 << 20});
  MrRef h = Get(custom, kBase + 8192 + 1, 1);
  MrRef g = Get(custom, kBase + (2 << 20) + 5, 1, true, 0);
  EXPECT_EQ(h.addr(), kBase + 8192);
  EXPECT_EQ(h.len(), 8192u);
  EXPECT_EQ(g.addr(), kBase + (2 << 20));
  EXPECT_EQ(g.len(), uint64_t{2} << 20);
}

TEST(MrCache, HostAndDeviceAtTheSameAddressAndDifferentDevicesAreDifferentEntries) {
  FakeRegistrar reg;
  MrCache cache(reg, {});
  MrRef h = Get(cache, kBase, kPage, false, 0);
  MrRef d0 = Get(cache, kBase, kPage, true, 0);
  MrRef d1 = Get(cache, kBase, kPage, true, 1);
  ASSERT_EQ(reg.register_count(), 3u);
  EXPECT_NE(h.lkey(), d0.lkey());
  EXPECT_NE(d0.lkey(), d1.lkey());
  EXPECT_EQ(reg.registers()[2].device_id, 1);
  // Hits stay with their own kind and device; device_id means nothing for host memory.
  EXPECT_EQ(Get(cache, kBase + 8, 8, true, 1).lkey(), d1.lkey());
  EXPECT_EQ(Get(cache, kBase + 8, 8, true, 0).lkey(), d0.lkey());
  EXPECT_EQ(Get(cache, kBase + 8, 8, false, 7).lkey(), h.lkey());
  EXPECT_EQ(reg.register_count(), 3u);
  EXPECT_EQ(cache.Stats().entries, 3u);
}

TEST(MrCache, InvalidateOfAnUnusedMrDeregistersAtOnceAndALaterAcquireRegistersAnew) {
  FakeRegistrar reg;
  MrCache cache(reg, {});
  uint32_t old_key = Get(cache, kBase, 100).lkey();  // released at the end of the statement
  EXPECT_EQ(reg.deregs(old_key), 0);
  cache.Invalidate(kBase + 50, 1);  // one byte inside is enough
  EXPECT_EQ(reg.deregs(old_key), 1);
  EXPECT_EQ(cache.Stats().invalidations, 1u);
  EXPECT_EQ(cache.Stats().entries, 0u);
  MrRef again = Get(cache, kBase, 100);
  EXPECT_NE(again.lkey(), old_key);
  EXPECT_EQ(reg.register_count(), 2u);
}

TEST(MrCache, InvalidateOfAnMrInUseDeregistersAfterItsLastReleaseAndNeverHandsItOutAgain) {
  FakeRegistrar reg;
  MrCache cache(reg, {});
  MrRef a = Get(cache, kBase, 100);
  MrRef b = Get(cache, kBase, 100);
  const uint32_t old_key = a.lkey();
  cache.Invalidate(kBase, kPage);
  EXPECT_EQ(reg.deregs(old_key), 0);
  EXPECT_EQ(a.lkey(), old_key);  // the references held stay valid
  MrRef fresh = Get(cache, kBase, 100);
  EXPECT_NE(fresh.lkey(), old_key);
  EXPECT_EQ(reg.register_count(), 2u);
  EXPECT_EQ(cache.Stats().entries, 2u);
  a.Release();
  EXPECT_EQ(reg.deregs(old_key), 0);
  b.Release();
  EXPECT_EQ(reg.deregs(old_key), 1);
  EXPECT_EQ(cache.Stats().entries, 1u);
  EXPECT_EQ(cache.Stats().invalidations, 1u);
  EXPECT_EQ(reg.deregs(fresh.lkey()), 0);
}

TEST(MrCache, InvalidateTouchesOnlyOverlappingMrsOfEveryKind) {
  FakeRegistrar reg;
  MrCache cache(reg, {});
  const uint32_t left = Get(cache, kBase, kPage).lkey();
  const uint32_t mid_host = Get(cache, kBase + kGran, kPage).lkey();
  const uint32_t mid_dev = Get(cache, kBase + kGran, kPage, true, 3).lkey();
  const uint32_t right = Get(cache, kBase + 4 * kGran, kPage).lkey();
  cache.Invalidate(kBase + kGran + 10, kPage);
  EXPECT_EQ(reg.deregs(left), 0);
  EXPECT_EQ(reg.deregs(mid_host), 1);
  EXPECT_EQ(reg.deregs(mid_dev), 1);
  EXPECT_EQ(reg.deregs(right), 0);
  cache.Invalidate(kBase + kPage, kGran - kPage);  // between the MRs: nothing
  cache.Invalidate(kBase, 0);
  EXPECT_EQ(cache.Stats().invalidations, 2u);
  EXPECT_EQ(cache.Stats().entries, 2u);
}

TEST(MrCache, OverlappingRangeRegistersTheUnionAndTheOldMrsGoWhenUnused) {
  FakeRegistrar reg;
  MrCache cache(reg, {});
  MrRef a = Get(cache, kBase, 2 * kPage);                          // pages 0-1, held
  const uint32_t b_key = Get(cache, kBase + 3 * kPage, 1).lkey();  // page 3, unused
  MrRef u = Get(cache, kBase + kPage, 3 * kPage);                  // pages 1-3
  auto calls = reg.registers();
  ASSERT_EQ(calls.size(), 3u);
  EXPECT_EQ(calls[2].addr, kBase);
  EXPECT_EQ(calls[2].len, 4 * kPage);
  EXPECT_EQ(u.addr(), kBase);
  EXPECT_EQ(u.len(), 4 * kPage);
  EXPECT_EQ(reg.deregs(b_key), 1);     // unused: dropped at once
  EXPECT_EQ(reg.deregs(a.lkey()), 0);  // in use: stays
  EXPECT_EQ(cache.Stats().superseded, 2u);
  EXPECT_EQ(cache.Stats().entries, 2u);
  // The union serves the old ranges now.
  EXPECT_EQ(Get(cache, kBase, kPage).lkey(), u.lkey());
  const uint32_t a_key = a.lkey();
  a.Release();
  EXPECT_EQ(reg.deregs(a_key), 1);
  EXPECT_EQ(cache.Stats().entries, 1u);
  EXPECT_EQ(cache.Stats().bytes, 4 * kPage);
  EXPECT_EQ(reg.register_count(), 3u);
}

TEST(MrCache, EvictsTheLeastRecentlyUsedUnusedMrOverMaxEntries) {
  FakeRegistrar reg;
  MrCache cache(reg, {.max_entries = 2});
  const uint32_t a = Get(cache, kBase, 1).lkey();
  const uint32_t b = Get(cache, kBase + kGran, 1).lkey();
  EXPECT_EQ(Get(cache, kBase, 1).lkey(), a);  // a is now more recent than b
  const uint32_t c = Get(cache, kBase + 2 * kGran, 1).lkey();
  EXPECT_EQ(reg.deregs(b), 1);
  EXPECT_EQ(reg.deregs(a), 0);
  EXPECT_EQ(reg.deregs(c), 0);
  EXPECT_EQ(Get(cache, kBase, 1).lkey(), a);  // still cached
  EXPECT_EQ(reg.register_count(), 3u);
  const MrCacheStats s = cache.Stats();
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(s.over_limit_acquires, 0u);
}

TEST(MrCache, EvictsOverMaxBytesButNeverAnMrInUse) {
  FakeRegistrar reg;
  MrCache cache(reg, {.max_bytes = 3 * kPage});
  MrRef held = Get(cache, kBase, 2 * kPage);  // least recently used, but in use
  const uint32_t b = Get(cache, kBase + kGran, 1).lkey();
  const uint32_t c = Get(cache, kBase + 2 * kGran, 1).lkey();  // 4 pages: b goes
  EXPECT_EQ(reg.deregs(b), 1);
  EXPECT_EQ(reg.deregs(held.lkey()), 0);
  EXPECT_EQ(reg.deregs(c), 0);
  EXPECT_EQ(reg.dereg_order(), std::vector<uint32_t>{b});
  EXPECT_EQ(cache.Stats().bytes, 3 * kPage);
  EXPECT_EQ(cache.Stats().evictions, 1u);
}

TEST(MrCache, AcquireOverTheLimitWithEverythingInUseSucceedsAndIsCounted) {
  FakeRegistrar reg;
  MrCache cache(reg, {.max_entries = 1});
  MrRef a = Get(cache, kBase, 1);
  MrRef b = Get(cache, kBase + kGran, 1);
  ASSERT_TRUE(b);
  MrCacheStats s = cache.Stats();
  EXPECT_EQ(s.over_limit_acquires, 1u);
  EXPECT_EQ(s.entries, 2u);
  EXPECT_EQ(s.evictions, 0u);
  EXPECT_EQ(reg.deregs(a.lkey()), 0);
  const uint32_t b_key = b.lkey();
  b.Release();  // over the limit and unused: evicted
  EXPECT_EQ(reg.deregs(b_key), 1);
  const uint32_t a_key = a.lkey();
  a.Release();  // within the limit: kept
  EXPECT_EQ(reg.deregs(a_key), 0);
  s = cache.Stats();
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.over_limit_acquires, 1u);
}

TEST(MrCache, RegistrarFailureCachesNothingAndNamesTheRange) {
  FakeRegistrar reg;
  MrCache cache(reg, {});
  reg.FailNext(KVB_ERR_UNSUPPORTED, "no dma-buf, no peermem, staging disabled");
  auto r = cache.Acquire(kBase + 0x10010, 16, true, 2);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), KVB_ERR_UNSUPPORTED);
  const std::string m = r.status().message();
  EXPECT_NE(m.find("[0x7f0000010000, 0x7f0000020000)"), std::string::npos) << m;
  EXPECT_NE(m.find("device 2 memory"), std::string::npos) << m;
  EXPECT_NE(m.find("no dma-buf, no peermem, staging disabled"), std::string::npos) << m;
  MrCacheStats s = cache.Stats();
  EXPECT_EQ(s.entries, 0u);
  EXPECT_EQ(s.registration_failures, 1u);
  EXPECT_EQ(s.registered(RegPath::kDmaBuf), 0u);
  MrRef ok = Get(cache, kBase + 0x10010, 16, true, 2);  // nothing was cached: registers again
  EXPECT_EQ(reg.register_count(), 2u);
  EXPECT_EQ(cache.Stats().entries, 1u);

  // A failed union leaves the MRs it would have replaced in place.
  reg.FailNext(KVB_ERR_NO_SPACE, "out of MRs");
  auto u = cache.Acquire(kBase + 0x10000, 2 * kGran, true, 2);
  ASSERT_FALSE(u.ok());
  EXPECT_EQ(u.status().code(), KVB_ERR_NO_SPACE);
  EXPECT_EQ(reg.deregs(ok.lkey()), 0);
  EXPECT_EQ(Get(cache, kBase + 0x10000, 8, true, 2).lkey(), ok.lkey());
  EXPECT_EQ(cache.Stats().superseded, 0u);
}

TEST(MrCache, ZeroAddressZeroLengthAndWrappingRangesAreInvalid) {
  FakeRegistrar reg;
  MrCache cache(reg, {});
  auto zero_len = cache.Acquire(kBase, 0, false, 0);
  auto zero_addr = cache.Acquire(0, 16, true, 1);
  auto wraps = cache.Acquire(UINT64_MAX - 10, 100, false, 0);
  auto rounds_past = cache.Acquire(UINT64_MAX - 10, 5, false, 0);
  for (auto* r : {&zero_len, &zero_addr, &wraps, &rounds_past}) {
    ASSERT_FALSE(r->ok());
    EXPECT_EQ(r->status().code(), KVB_ERR_INVALID_ARGUMENT) << r->status().message();
  }
  EXPECT_NE(zero_len.status().message().find("length 0"), std::string::npos);
  EXPECT_NE(zero_addr.status().message().find("address 0"), std::string::npos);
  EXPECT_NE(zero_addr.status().message().find("device 1"), std::string::npos);
  EXPECT_EQ(reg.register_count(), 0u);
  EXPECT_EQ(cache.Stats().misses, 0u);
}

TEST(MrCache, StatsCountRegistrationsPerPath) {
  FakeRegistrar reg;
  MrCache cache(reg, {});
  Get(cache, kBase, 1);
  Get(cache, kBase + kGran, 1);
  reg.SetDevicePath(RegPath::kDmaBuf);
  MrRef d = Get(cache, kBase, 1, true, 0);
  EXPECT_EQ(d.path(), RegPath::kDmaBuf);
  reg.SetDevicePath(RegPath::kPeerMem);
  Get(cache, kBase, 1, true, 1);
  Get(cache, kBase + kGran, 1, true, 1);
  reg.SetDevicePath(RegPath::kHostStaging);
  MrRef s3 = Get(cache, kBase, 1, true, 3);
  EXPECT_EQ(s3.path(), RegPath::kHostStaging);
  const MrCacheStats s = cache.Stats();
  EXPECT_EQ(s.registered(RegPath::kHost), 2u);
  EXPECT_EQ(s.registered(RegPath::kDmaBuf), 1u);
  EXPECT_EQ(s.registered(RegPath::kPeerMem), 2u);
  EXPECT_EQ(s.registered(RegPath::kHostStaging), 1u);
  EXPECT_EQ(s.misses, 6u);
  EXPECT_EQ(s.hits, 0u);
  EXPECT_STREQ(RegPathName(RegPath::kHost), "host");
  EXPECT_STREQ(RegPathName(RegPath::kDmaBuf), "dmabuf");
  EXPECT_STREQ(RegPathName(RegPath::kPeerMem), "peermem");
  EXPECT_STREQ(RegPathName(RegPath::kHostStaging), "host_staging");
}

TEST(MrCache, MrRefMovesItsReferenceAndReleasesItOnce) {
  FakeRegistrar reg;
  MrCache cache(reg, {.max_entries = 0});  // every unused MR is evicted: releases show
  MrRef a = Get(cache, kBase, 1);
  const uint32_t key = a.lkey();
  MrRef b(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move)
  ASSERT_TRUE(b);
  EXPECT_EQ(b.lkey(), key);
  MrRef c;
  c = std::move(b);
  EXPECT_EQ(reg.deregs(key), 0);
  MrRef other = Get(cache, kBase + kGran, 1);
  const uint32_t other_key = other.lkey();
  c = std::move(other);  // releases the first MR
  EXPECT_EQ(reg.deregs(key), 1);
  EXPECT_EQ(c.lkey(), other_key);
  c.Release();
  c.Release();
  EXPECT_EQ(reg.deregs(other_key), 1);
  EXPECT_EQ(cache.Stats().entries, 0u);
}

TEST(MrCache, DestructorDeregistersWhatIsLeft) {
  FakeRegistrar reg;
  {
    MrCache cache(reg, {});
    Get(cache, kBase, 1);
    Get(cache, kBase + kGran, 1, true, 0);
    cache.Invalidate(kBase, 1);
    EXPECT_EQ(cache.Stats().entries, 1u);
  }
  const auto all = reg.all();
  ASSERT_EQ(all.size(), 2u);
  for (const auto& [handle, n] : all) EXPECT_EQ(n, 1) << "handle " << handle;
}

TEST(MrCache, ConcurrentAcquireReleaseInvalidateDeregistersEveryMrExactlyOnce) {
  FakeRegistrar reg;
  constexpr int kThreads = 4;
  constexpr int kIters = 10000;
  uint64_t acquired = 0;
  {
    MrCache cache(reg, {.max_entries = 6, .host_page = kPage, .device_granularity = kGran});
    std::vector<std::thread> threads;
    std::vector<uint64_t> counts(kThreads, 0);
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(1234 + t);
        std::vector<MrRef> held;
        for (int i = 0; i < kIters; ++i) {
          const uint64_t addr = kBase + (rng() % 16) * kPage + rng() % 100;
          const uint64_t len = 1 + rng() % (3 * kPage);
          const bool device = rng() % 4 == 0;
          const uint32_t op = rng() % 10;
          if (op == 0) {
            cache.Invalidate(addr, len);
          } else if (op == 1 && !held.empty()) {
            held.erase(held.begin() + static_cast<long>(rng() % held.size()));
          } else {
            auto r = cache.Acquire(addr, len, device, static_cast<int>(rng() % 2));
            ASSERT_TRUE(r.ok()) << r.status().message();
            ASSERT_LE(r->addr(), addr);
            ASSERT_GE(r->addr() + r->len(), addr + len);
            ++counts[t];
            if (held.size() < 8) held.push_back(std::move(r).value());
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    for (uint64_t n : counts) acquired += n;
    const MrCacheStats s = cache.Stats();
    EXPECT_EQ(s.hits + s.misses, acquired);
    EXPECT_GT(s.hits, 0u);
    EXPECT_GT(s.invalidations, 0u);
    EXPECT_GT(s.evictions, 0u);
    EXPECT_GT(s.superseded, 0u);
    EXPECT_LE(s.entries, 6u);  // nothing is held any more
  }
  const auto all = reg.all();
  EXPECT_GT(all.size(), 10u);
  int wrong = 0;
  for (const auto& [handle, n] : all) wrong += n != 1;
  EXPECT_EQ(wrong, 0);
  EXPECT_EQ(reg.dereg_order().size(), all.size());
}

}  // namespace
}  // namespace kvbridge::verbs

// The counters behind StoreClient::stats(): relaxed atomics a call adds to as it returns, read
// into a StoreClientStats without a lock. Thread-safe.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

#include "kvbridge/status.h"
#include "kvbridge/store.h"

namespace kvbridge::store {

class ClientCounters {
 public:
  using Clock = std::chrono::steady_clock;

  // One call of `op` over `keys` keys that took `took`.
  void Call(StoreOp op, size_t keys, Clock::duration took) {
    Op& o = ops_[static_cast<size_t>(op)];
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(took).count();
    const double seconds = static_cast<double>(ns) / 1e9;
    const auto& bounds = StoreOpStats::kLatencyBounds;
    const size_t bucket = std::lower_bound(bounds.begin(), bounds.end(), seconds) - bounds.begin();
    Add(o.calls, 1);
    Add(o.keys, keys);
    Add(o.latency_ns, static_cast<uint64_t>(std::max<int64_t>(ns, 0)));
    Add(o.latency_buckets[bucket], 1);
  }
  // `keys` keys of `op` that failed with `code`.
  void Error(StoreOp op, StatusCode code, uint64_t keys = 1) {
    auto c = static_cast<int32_t>(code);
    if (c < 0 || c >= kCodes) c = static_cast<int32_t>(StatusCode::kInternal);  // not ours
    Add(ops_[static_cast<size_t>(op)].errors[c], keys);
  }
  // The outcomes of one call's keys, added once per call rather than per key: the counters
  // are shared by every thread of the client.
  void GetHits(uint64_t dram, uint64_t ssd, uint64_t bytes) {
    Add(get_hits_dram_, dram);
    Add(get_hits_ssd_, ssd);
    Add(bytes_read_, bytes);
  }
  void GetMisses(uint64_t keys) { Add(get_misses_, keys); }
  void PutsStored(uint64_t keys, uint64_t bytes) {
    Add(puts_stored_, keys);
    Add(bytes_written_, bytes);
  }
  void PutsExisting(uint64_t keys) { Add(puts_existing_, keys); }
  void Removed(uint64_t keys) { Add(removes_, keys); }
  void GetsWithoutMaster(uint64_t keys) { Add(gets_without_master_, keys); }

  StoreClientStats Snapshot() const {
    StoreClientStats s;
    for (size_t i = 0; i < kStoreOpCount; ++i) {
      const Op& o = ops_[i];
      StoreOpStats& out = s.ops[i];
      out.calls = Load(o.calls);
      out.keys = Load(o.keys);
      out.latency_ns = Load(o.latency_ns);
      for (size_t b = 0; b < out.latency_buckets.size(); ++b) {
        out.latency_buckets[b] = Load(o.latency_buckets[b]);
      }
      for (int32_t c = 0; c < kCodes; ++c) {
        if (const uint64_t n = Load(o.errors[c]); n != 0) {
          out.errors.emplace_back(static_cast<StatusCode>(c), n);
        }
      }
    }
    s.get_hits_dram = Load(get_hits_dram_);
    s.get_hits_ssd = Load(get_hits_ssd_);
    s.get_misses = Load(get_misses_);
    s.bytes_read = Load(bytes_read_);
    s.puts_stored = Load(puts_stored_);
    s.bytes_written = Load(bytes_written_);
    s.puts_existing = Load(puts_existing_);
    s.removes = Load(removes_);
    s.gets_without_master = Load(gets_without_master_);
    return s;
  }

  void Reset() {
    for (Op& o : ops_) {
      for (auto* a : {&o.calls, &o.keys, &o.latency_ns}) a->store(0, std::memory_order_relaxed);
      for (auto& a : o.latency_buckets) a.store(0, std::memory_order_relaxed);
      for (auto& a : o.errors) a.store(0, std::memory_order_relaxed);
    }
    for (auto* a : {&get_hits_dram_, &get_hits_ssd_, &get_misses_, &bytes_read_, &puts_stored_,
                    &bytes_written_, &puts_existing_, &removes_, &gets_without_master_}) {
      a->store(0, std::memory_order_relaxed);
    }
  }

 private:
  using Counter = std::atomic<uint64_t>;
  // Status codes are small (kvb_status_t); one slot per code up to this.
  static constexpr int32_t kCodes = 32;
  struct Op {
    Counter calls{0}, keys{0}, latency_ns{0};
    std::array<Counter, StoreOpStats::kLatencyBuckets> latency_buckets{};
    std::array<Counter, kCodes> errors{};
  };

  static void Add(Counter& c, uint64_t n) {
    if (n != 0) c.fetch_add(n, std::memory_order_relaxed);
  }
  static uint64_t Load(const Counter& c) { return c.load(std::memory_order_relaxed); }

  std::array<Op, kStoreOpCount> ops_{};
  Counter get_hits_dram_{0}, get_hits_ssd_{0}, get_misses_{0}, bytes_read_{0};
  Counter puts_stored_{0}, bytes_written_{0}, puts_existing_{0}, removes_{0};
  Counter gets_without_master_{0};
};

}  // namespace kvbridge::store

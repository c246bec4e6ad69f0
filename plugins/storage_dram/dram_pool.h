// kvbridge::dram::DramPool: the dram storage plugin's backend. One anonymous mapping (the
// segment the host registers with its transports) and a RangeAllocator over it.
//
// The segment is on 2 MiB huge pages when the kernel has them reserved (MAP_HUGETLB), else on
// normal pages, 2 MiB-aligned, with transparent huge pages requested (MADV_HUGEPAGE). Its
// length is the requested capacity rounded up to 2 MiB.
//
// With dram.file set, the segment is instead that file's bytes from dram.file_offset, mapped
// shared (MAP_SHARED): memory another process can map too (a /dev/shm file, Mooncake's
// mount_segment). Its length is then exactly the requested capacity, which the file must hold.
//
// Thread-safety: Alloc, Free, Usage and Segment may be called concurrently (one mutex guards
// the allocator; it is never held across a call into the host). The destructor (the ABI's
// destroy) must not race with anything.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "kvbridge/plugin/storage.h"
#include "util/range_allocator.h"

namespace kvbridge::dram {

inline constexpr uint64_t kHugePageBytes = 2u << 20;

// Every dram.* configuration key; see README.md.
struct Config {
  enum class HugePages { kAuto, kOn, kOff };
  HugePages huge_pages = HugePages::kAuto;  // "on": no huge pages is an error
  uint64_t alignment = 64;                  // every allocation starts and ends on it
  bool prefault = false;                    // touch every page at create
  std::string file;                         // non-empty: the segment is this file, shared
  uint64_t file_offset = 0;                 // where in it, a multiple of the page size
};

// Reads the dram.* keys through host->config_get; unset keys keep their defaults. Returns false
// with a message naming the key when a value is malformed or out of range.
bool LoadConfig(const kvb_host_services_t* host, Config* out, std::string* err);

class DramPool {
 public:
  // Validates params and configuration, maps and (optionally) prefaults the segment, and logs
  // through host which kind of pages it got and why. On failure returns the code and a
  // one-line reason in *err; *out is untouched.
  static kvb_status_t Create(const kvb_host_services_t* host, const kvb_storage_params_t* params,
                             std::unique_ptr<DramPool>* out, std::string* err);
  ~DramPool();
  DramPool(const DramPool&) = delete;
  DramPool& operator=(const DramPool&) = delete;

  void* segment() const { return base_; }
  uint64_t segment_bytes() const { return bytes_; }
  bool huge_pages() const { return huge_pages_; }

  // INVALID_ARGUMENT for length 0, NO_SPACE when no free range is large enough (nothing
  // changes).
  kvb_status_t Alloc(uint64_t length, uint64_t* offset);
  // NOT_FOUND when no allocation starts at offset (nothing changes).
  kvb_status_t Free(uint64_t offset);
  // capacity = segment bytes, used = allocated bytes (rounded to the alignment),
  // object_count = live allocations.
  kvb_status_t Usage(kvb_storage_usage_t* out);

 private:
  DramPool(void* base, uint64_t bytes, bool huge_pages, uint64_t alignment);

  void* const base_;
  const uint64_t bytes_;
  const bool huge_pages_;
  std::mutex mu_;
  util::RangeAllocator allocator_;  // guarded by mu_
};

}  // namespace kvbridge::dram

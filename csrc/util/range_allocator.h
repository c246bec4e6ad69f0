// RangeAllocator: hands out [offset, offset+length) ranges of a fixed-size space (a registered
// memory segment). Best fit over the free ranges, so large holes survive small requests; a
// freed range merges with free neighbours at once, so fragmentation never outlives the
// allocations that caused it. Every allocation is rounded up to `alignment`.
//
// The master uses one per storage segment (it places replicas); the DRAM plugin uses one for
// node-local needs. Reserve() rebuilds state from an inventory after a restart.
//
// Not thread-safe: callers serialize (the master under its table lock).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

namespace kvbridge::util {

class RangeAllocator {
 public:
  // REQUIRES: alignment is a power of two > 0.
  explicit RangeAllocator(uint64_t capacity, uint64_t alignment = 64);

  // An aligned range of at least `length` bytes (length > 0), or nullopt if no free range is
  // large enough.
  std::optional<uint64_t> Allocate(uint64_t length);
  // Frees the allocation that starts at `offset`; returns its (rounded) length, or 0 if no
  // allocation starts there (nothing changes).
  uint64_t Free(uint64_t offset);
  // Marks [offset, offset+length) allocated, as if Allocate had returned it. False (nothing
  // changes) if any byte of it is not free, it is misaligned, or it runs past capacity.
  bool Reserve(uint64_t offset, uint64_t length);
  // Reserves every free byte of [offset, offset+length) (offset and length aligned), as
  // allocations of their own; returns them (offset, length), to Free one by one later.
  std::vector<std::pair<uint64_t, uint64_t>> ReserveFreeWithin(uint64_t offset, uint64_t length);

  uint64_t capacity() const { return capacity_; }
  uint64_t used_bytes() const { return used_; }
  uint64_t free_bytes() const { return capacity_ - used_; }
  uint64_t largest_free() const;
  size_t allocation_count() const { return allocated_.size(); }
  // Length of the allocation starting at offset, or 0.
  uint64_t AllocationLength(uint64_t offset) const;

 private:
  uint64_t RoundUp(uint64_t n) const { return (n + alignment_ - 1) & ~(alignment_ - 1); }
  void InsertFree(uint64_t offset, uint64_t length);
  void EraseFree(std::map<uint64_t, uint64_t>::iterator it);

  const uint64_t capacity_;
  const uint64_t alignment_;
  uint64_t used_ = 0;
  std::map<uint64_t, uint64_t> free_by_offset_;  // offset -> length
  // (length, offset), so best fit is one lower_bound, ties go to the lowest offset, and a
  // free range is erased in O(log n) however many ranges share its length.
  std::set<std::pair<uint64_t, uint64_t>> free_by_length_;
  std::map<uint64_t, uint64_t> allocated_;  // offset -> length
};

}  // namespace kvbridge::util

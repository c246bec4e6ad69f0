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
  //
  // track_allocations = false keeps only the free ranges, not a record per allocation (which
  // is most of the allocator's memory when it holds millions of small ranges: about 64 bytes
  // each). The caller then frees with Free(offset, length), saying the length it allocated,
  // and asks IsAllocated instead of AllocationLength (which answers 0). The master uses it:
  // its replicas know their ranges.
  explicit RangeAllocator(uint64_t capacity, uint64_t alignment = 64,
                          bool track_allocations = true);

  // An aligned range of at least `length` bytes (length > 0), or nullopt if no free range is
  // large enough.
  std::optional<uint64_t> Allocate(uint64_t length);
  // Frees the allocation that starts at `offset`; returns its (rounded) length, or 0 if no
  // allocation starts there (nothing changes).
  uint64_t Free(uint64_t offset);
  // Frees the allocation [offset, offset + length) (length as allocated; it is rounded up as
  // Allocate rounds it); returns the rounded length, or 0 if that is not an allocation (nothing
  // changes). Tracking allocations, the allocation at `offset` must have this length; without,
  // the range must be aligned, inside the capacity and have no free byte.
  uint64_t Free(uint64_t offset, uint64_t length);
  // No byte of [offset, offset + RoundUp(length)) is free and it lies inside the capacity (the
  // range is allocated, as one allocation or several).
  bool IsAllocated(uint64_t offset, uint64_t length) const;
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
  size_t allocation_count() const { return allocations_; }
  bool tracks_allocations() const { return track_; }
  // Length of the allocation starting at offset, or 0 (always 0 without tracking).
  uint64_t AllocationLength(uint64_t offset) const;

 private:
  uint64_t RoundUp(uint64_t n) const { return (n + alignment_ - 1) & ~(alignment_ - 1); }
  void InsertFree(uint64_t offset, uint64_t length);
  void EraseFree(std::map<uint64_t, uint64_t>::iterator it);
  void ReleaseRange(uint64_t offset, uint64_t length);

  const uint64_t capacity_;
  const uint64_t alignment_;
  const bool track_;
  uint64_t used_ = 0;
  size_t allocations_ = 0;
  std::map<uint64_t, uint64_t> free_by_offset_;  // offset -> length
  // (length, offset), so best fit is one lower_bound, ties go to the lowest offset, and a
  // free range is erased in O(log n) however many ranges share its length.
  std::set<std::pair<uint64_t, uint64_t>> free_by_length_;
  std::map<uint64_t, uint64_t> allocated_;  // offset -> length (only with track_)
};

}  // namespace kvbridge::util

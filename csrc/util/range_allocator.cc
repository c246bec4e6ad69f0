#include "util/range_allocator.h"

#include <algorithm>
#include <iterator>
#include <limits>
#include <stdexcept>

namespace kvbridge::util {

// Invariant: every free range and every allocation starts at a multiple of alignment_ (offset 0
// does, and every allocation is a multiple of alignment_ long), free ranges never touch each
// other (they merge on insert) and free + allocated ranges tile [0, capacity_) exactly. Only the
// last free range may have a length that is not a multiple of alignment_ (a ragged capacity).

RangeAllocator::RangeAllocator(uint64_t capacity, uint64_t alignment, bool track_allocations)
    : capacity_(capacity), alignment_(alignment), track_(track_allocations) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    throw std::invalid_argument("RangeAllocator: alignment must be a power of two > 0");
  }
  if (capacity_ > 0) InsertFree(0, capacity_);
}

void RangeAllocator::InsertFree(uint64_t offset, uint64_t length) {
  free_by_offset_.emplace(offset, length);
  free_by_length_.emplace(length, offset);
}

void RangeAllocator::EraseFree(std::map<uint64_t, uint64_t>::iterator it) {
  free_by_length_.erase({it->second, it->first});
  free_by_offset_.erase(it);
}

std::optional<uint64_t> RangeAllocator::Allocate(uint64_t length) {
  // The last test keeps RoundUp from wrapping around.
  if (length == 0 || length > capacity_ ||
      length > std::numeric_limits<uint64_t>::max() - (alignment_ - 1)) {
    return std::nullopt;
  }
  const uint64_t need = RoundUp(length);
  auto fit = free_by_length_.lower_bound({need, 0});
  if (fit == free_by_length_.end()) return std::nullopt;
  const auto [hole_length, offset] = *fit;
  EraseFree(free_by_offset_.find(offset));
  if (hole_length > need) InsertFree(offset + need, hole_length - need);
  if (track_) allocated_.emplace(offset, need);
  used_ += need;
  ++allocations_;
  return offset;
}

uint64_t RangeAllocator::Free(uint64_t offset) {
  auto a = allocated_.find(offset);
  if (a == allocated_.end()) return 0;
  const uint64_t length = a->second;
  allocated_.erase(a);
  ReleaseRange(offset, length);
  return length;
}

uint64_t RangeAllocator::Free(uint64_t offset, uint64_t length) {
  if (track_) {
    auto a = allocated_.find(offset);
    if (a == allocated_.end() || length == 0 || a->second != RoundUp(length)) return 0;
    return Free(offset);
  }
  if (!IsAllocated(offset, length)) return 0;
  const uint64_t need = RoundUp(length);
  ReleaseRange(offset, need);
  return need;
}

bool RangeAllocator::IsAllocated(uint64_t offset, uint64_t length) const {
  if (length == 0 || offset % alignment_ != 0 || offset >= capacity_ ||
      length > capacity_ - offset) {
    return false;
  }
  const uint64_t need = RoundUp(length);
  if (need < length || need > capacity_ - offset) return false;
  // The first free range ending after `offset` must start at or after the range's end.
  auto next = free_by_offset_.upper_bound(offset);
  if (next != free_by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > offset) return false;
  }
  return next == free_by_offset_.end() || next->first >= offset + need;
}

// Returns [offset, offset + length) (an allocation's whole range) to the free ranges.
void RangeAllocator::ReleaseRange(uint64_t offset, uint64_t length) {
  used_ -= length;
  --allocations_;

  uint64_t start = offset;
  uint64_t end = offset + length;
  auto next = free_by_offset_.lower_bound(offset);
  if (next != free_by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      EraseFree(prev);
    }
  }
  if (next != free_by_offset_.end() && next->first == end) {
    end += next->second;
    EraseFree(next);
  }
  InsertFree(start, end - start);
}

bool RangeAllocator::Reserve(uint64_t offset, uint64_t length) {
  if (length == 0 || offset % alignment_ != 0 || offset >= capacity_ ||
      length > capacity_ - offset) {
    return false;
  }
  const uint64_t need = RoundUp(length);
  if (need < length || need > capacity_ - offset) return false;  // need < length: it wrapped
  const uint64_t end = offset + need;

  // The free range holding `offset` is the last one starting at or before it.
  auto hole = free_by_offset_.upper_bound(offset);
  if (hole == free_by_offset_.begin()) return false;
  hole = std::prev(hole);
  const uint64_t hole_start = hole->first;
  const uint64_t hole_end = hole->first + hole->second;
  if (hole_end < end) return false;  // also covers a hole that ends before `offset`

  EraseFree(hole);
  if (hole_start < offset) InsertFree(hole_start, offset - hole_start);
  if (end < hole_end) InsertFree(end, hole_end - end);
  if (track_) allocated_.emplace(offset, need);
  used_ += need;
  ++allocations_;
  return true;
}

std::vector<std::pair<uint64_t, uint64_t>> RangeAllocator::ReserveFreeWithin(uint64_t offset,
                                                                             uint64_t length) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  const uint64_t end = std::min(capacity_, offset + length);
  auto it = free_by_offset_.upper_bound(offset);
  if (it != free_by_offset_.begin()) it = std::prev(it);
  // Collect first: Reserve changes the map.
  std::vector<std::pair<uint64_t, uint64_t>> pieces;
  for (; it != free_by_offset_.end() && it->first < end; ++it) {
    const uint64_t from = std::max(it->first, offset), to = std::min(it->first + it->second, end);
    if (from < to) pieces.emplace_back(from, to - from);
  }
  for (const auto& [from, len] : pieces) {
    if (Reserve(from, len)) out.emplace_back(from, len);
  }
  return out;
}

uint64_t RangeAllocator::largest_free() const {
  return free_by_length_.empty() ? 0 : free_by_length_.rbegin()->first;
}

uint64_t RangeAllocator::AllocationLength(uint64_t offset) const {
  auto a = allocated_.find(offset);
  return a == allocated_.end() ? 0 : a->second;
}

}  // namespace kvbridge::util

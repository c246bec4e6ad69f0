// RangeAllocator (csrc/util/range_allocator.h): best fit, alignment, coalescing, Reserve's
// refusals, and a long random run checked byte by byte against a trivial model.
#include <gtest/gtest.h>

#include <cstdint>
#include <iterator>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "util/range_allocator.h"

namespace kvbridge::util {
namespace {

TEST(RangeAllocator, StartsAsOneFreeRange) {
  RangeAllocator a(1 << 20);
  EXPECT_EQ(a.capacity(), 1u << 20);
  EXPECT_EQ(a.used_bytes(), 0u);
  EXPECT_EQ(a.free_bytes(), 1u << 20);
  EXPECT_EQ(a.largest_free(), 1u << 20);
  EXPECT_EQ(a.allocation_count(), 0u);
}

TEST(RangeAllocator, ZeroLengthAndZeroCapacity) {
  RangeAllocator a(4096);
  EXPECT_EQ(a.Allocate(0), std::nullopt);
  EXPECT_FALSE(a.Reserve(0, 0));
  RangeAllocator empty(0);
  EXPECT_EQ(empty.Allocate(1), std::nullopt);
  EXPECT_EQ(empty.largest_free(), 0u);
}

TEST(RangeAllocator, RejectsAlignmentThatIsNotAPowerOfTwo) {
  EXPECT_THROW(RangeAllocator(4096, 0), std::invalid_argument);
  EXPECT_THROW(RangeAllocator(4096, 48), std::invalid_argument);
  EXPECT_NO_THROW(RangeAllocator(4096, 1));
}

TEST(RangeAllocator, RoundsEveryAllocationUpToTheAlignment) {
  RangeAllocator a(1 << 20, 256);
  auto x = a.Allocate(1);
  auto y = a.Allocate(257);
  auto z = a.Allocate(256);
  ASSERT_TRUE(x && y && z);
  for (uint64_t off : {*x, *y, *z}) EXPECT_EQ(off % 256, 0u) << off;
  EXPECT_EQ(a.AllocationLength(*x), 256u);
  EXPECT_EQ(a.AllocationLength(*y), 512u);
  EXPECT_EQ(a.AllocationLength(*z), 256u);
  EXPECT_EQ(a.used_bytes(), 1024u);
  EXPECT_EQ(a.Free(*y), 512u);  // Free returns the rounded length
}

TEST(RangeAllocator, BestFitPicksTheSmallestHoleThatFits) {
  // Holes of 3, 1 and 2 units (in that address order), separated by live allocations.
  constexpr uint64_t kU = 64;
  RangeAllocator a(64 * kU, kU);
  std::vector<uint64_t> off;
  for (uint64_t len : {3, 1, 1, 1, 2, 1}) off.push_back(*a.Allocate(len * kU));
  ASSERT_EQ(a.Free(off[0]), 3 * kU);  // hole [0, 3)
  ASSERT_EQ(a.Free(off[2]), 1 * kU);  // hole [4, 5)
  ASSERT_EQ(a.Free(off[4]), 2 * kU);  // hole [6, 8); the tail [9, 64) stays free too

  EXPECT_EQ(a.Allocate(2 * kU), 6 * kU) << "the 2-unit hole is the best fit";
  EXPECT_EQ(a.Allocate(1 * kU), 4 * kU) << "the 1-unit hole is the best fit";
  EXPECT_EQ(a.Allocate(1 * kU), 0u) << "now the 3-unit hole is the smallest that fits";
  EXPECT_EQ(a.Allocate(4 * kU), 9 * kU) << "only the tail holds 4 units";
}

TEST(RangeAllocator, EqualHolesGoLowestOffsetFirst) {
  constexpr uint64_t kU = 64;
  RangeAllocator a(16 * kU, kU);
  std::vector<uint64_t> off;
  for (int i = 0; i < 16; ++i) off.push_back(*a.Allocate(kU));
  for (int i : {11, 3, 7}) a.Free(off[i]);
  EXPECT_EQ(a.Allocate(kU), 3 * kU);
  EXPECT_EQ(a.Allocate(kU), 7 * kU);
  EXPECT_EQ(a.Allocate(kU), 11 * kU);
}

TEST(RangeAllocator, LargeHolesSurviveSmallRequests) {
  RangeAllocator a(1 << 20, 64);
  const uint64_t small_hole = *a.Allocate(128);
  const uint64_t barrier = *a.Allocate(64);
  a.Free(small_hole);
  for (int i = 0; i < 2; ++i) EXPECT_LT(*a.Allocate(64), barrier);
  EXPECT_EQ(a.largest_free(), (1u << 20) - 192);
}

TEST(RangeAllocator, FreeCoalescesWithTheLeftNeighbour) {
  RangeAllocator a(4096, 64);
  auto x = *a.Allocate(1024), y = *a.Allocate(1024), z = *a.Allocate(1024);
  a.Free(x);
  a.Free(y);  // merges into [0, 2048)
  EXPECT_EQ(a.largest_free(), 2048u);
  EXPECT_EQ(a.Allocate(2048), 0u);
  (void)z;
}

TEST(RangeAllocator, FreeCoalescesWithTheRightNeighbour) {
  RangeAllocator a(4096, 64);
  auto x = *a.Allocate(1024), y = *a.Allocate(1024), z = *a.Allocate(2048);
  a.Free(y);
  a.Free(x);  // merges with [1024, 2048)
  EXPECT_EQ(a.largest_free(), 2048u);
  EXPECT_EQ(a.Allocate(2048), 0u);
  (void)z;
}

TEST(RangeAllocator, FreeCoalescesBothSidesAtOnce) {
  RangeAllocator a(4096, 64);
  auto x = *a.Allocate(1024), y = *a.Allocate(1024), z = *a.Allocate(1024);
  auto w = *a.Allocate(1024);
  a.Free(x);
  a.Free(z);
  EXPECT_EQ(a.largest_free(), 1024u);
  a.Free(y);  // joins [0, 1024) and [2048, 3072) into one
  EXPECT_EQ(a.largest_free(), 3072u);
  a.Free(w);
  EXPECT_EQ(a.largest_free(), 4096u);
  EXPECT_EQ(a.used_bytes(), 0u);
}

TEST(RangeAllocator, ExhaustionReturnsNulloptAndChangesNothing) {
  RangeAllocator a(4096, 64);
  EXPECT_EQ(a.Allocate(4097), std::nullopt);
  for (int i = 0; i < 64; ++i) ASSERT_TRUE(a.Allocate(64).has_value()) << i;
  EXPECT_EQ(a.free_bytes(), 0u);
  EXPECT_EQ(a.Allocate(1), std::nullopt);
  EXPECT_EQ(a.allocation_count(), 64u);
  EXPECT_EQ(a.used_bytes(), 4096u);

  // Enough bytes in total but no single hole large enough: still nullopt.
  a.Free(0);
  a.Free(128);
  EXPECT_EQ(a.free_bytes(), 128u);
  EXPECT_EQ(a.Allocate(128), std::nullopt);
  EXPECT_EQ(a.allocation_count(), 62u);
  EXPECT_EQ(a.Allocate(UINT64_MAX), std::nullopt);
}

TEST(RangeAllocator, FreeOfAnUnknownOffsetChangesNothing) {
  RangeAllocator a(4096, 64);
  const uint64_t x = *a.Allocate(256);
  EXPECT_EQ(a.Free(x + 64), 0u) << "inside an allocation, not its start";
  EXPECT_EQ(a.Free(1024), 0u) << "a free range";
  EXPECT_EQ(a.Free(1u << 30), 0u) << "past capacity";
  EXPECT_EQ(a.used_bytes(), 256u);
  EXPECT_EQ(a.allocation_count(), 1u);
  EXPECT_EQ(a.largest_free(), 4096u - 256);
  EXPECT_EQ(a.Free(x), 256u);
  EXPECT_EQ(a.Free(x), 0u) << "double free";
  EXPECT_EQ(a.largest_free(), 4096u);
}

TEST(RangeAllocator, ReserveMarksARangeAsAllocated) {
  RangeAllocator a(4096, 64);
  ASSERT_TRUE(a.Reserve(1024, 100));  // rounded to 128, as Allocate would
  EXPECT_EQ(a.AllocationLength(1024), 128u);
  EXPECT_EQ(a.used_bytes(), 128u);
  EXPECT_EQ(a.largest_free(), 4096u - 1152);
  ASSERT_TRUE(a.Reserve(0, 64));     // at the start of a hole
  ASSERT_TRUE(a.Reserve(4032, 64));  // at the very end
  EXPECT_EQ(a.allocation_count(), 3u);
  EXPECT_EQ(a.Free(1024), 128u);  // a reserved range frees like an allocated one
  EXPECT_EQ(a.Free(0), 64u);
  EXPECT_EQ(a.Free(4032), 64u);
  EXPECT_EQ(a.largest_free(), 4096u);
}

TEST(RangeAllocator, ReserveRefusesWhatIsNotFreeAlignedAndInside) {
  RangeAllocator a(4096, 64);
  ASSERT_TRUE(a.Reserve(1024, 1024));
  const auto before_used = a.used_bytes();
  const auto before_largest = a.largest_free();

  EXPECT_FALSE(a.Reserve(1024, 64)) << "same start";
  EXPECT_FALSE(a.Reserve(1536, 64)) << "inside";
  EXPECT_FALSE(a.Reserve(960, 128)) << "overlaps the start";
  EXPECT_FALSE(a.Reserve(1984, 128)) << "overlaps the end";
  EXPECT_FALSE(a.Reserve(0, 4096)) << "covers it";
  EXPECT_FALSE(a.Reserve(32, 64)) << "misaligned";
  EXPECT_FALSE(a.Reserve(4032, 128)) << "runs past capacity";
  EXPECT_FALSE(a.Reserve(4096, 64)) << "starts at capacity";
  EXPECT_FALSE(a.Reserve(64, UINT64_MAX)) << "huge length";
  EXPECT_FALSE(a.Reserve(UINT64_MAX - 63, 64)) << "offset near the top";

  EXPECT_EQ(a.used_bytes(), before_used);
  EXPECT_EQ(a.largest_free(), before_largest);
  EXPECT_EQ(a.allocation_count(), 1u);
  EXPECT_TRUE(a.Reserve(2048, 64)) << "right after it is free";
  EXPECT_TRUE(a.Reserve(960, 64)) << "right before it is free";
}

TEST(RangeAllocator, RaggedCapacityUsesTheTail) {
  RangeAllocator a(1000, 64);  // 15 full units and a 40-byte tail
  for (int i = 0; i < 15; ++i) ASSERT_TRUE(a.Allocate(64).has_value());
  EXPECT_EQ(a.free_bytes(), 40u);
  EXPECT_EQ(a.Allocate(40), std::nullopt) << "rounds to 64, which does not fit";
  EXPECT_FALSE(a.Reserve(960, 40));
  for (uint64_t off = 0; off < 960; off += 64) ASSERT_EQ(a.Free(off), 64u);
  EXPECT_EQ(a.largest_free(), 1000u);
}

// Many random Allocate/Free/Reserve calls, each checked against a byte map of the space.
TEST(RangeAllocator, RandomOperationsMatchAByteModel) {
  constexpr uint64_t kCapacity = 64 * 1024;
  constexpr uint64_t kAlign = 64;
  constexpr int kOps = 50000;
  RangeAllocator a(kCapacity, kAlign);
  std::vector<uint8_t> owned(kCapacity, 0);  // 1 where a live allocation covers the byte
  std::map<uint64_t, uint64_t> live;         // offset -> rounded length
  uint64_t model_used = 0;
  std::mt19937_64 rng(20240607);

  auto range_is_free = [&](uint64_t off, uint64_t len) {
    for (uint64_t i = off; i < off + len; ++i) {
      if (owned[i]) return false;
    }
    return true;
  };
  auto mark = [&](uint64_t off, uint64_t len, uint8_t v) {
    for (uint64_t i = off; i < off + len; ++i) owned[i] = v;
  };

  for (int step = 0; step < kOps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const int what = static_cast<int>(rng() % 10);
    if (what < 5) {
      const uint64_t len = 1 + rng() % (rng() % 4 == 0 ? 8192 : 700);
      const uint64_t rounded = (len + kAlign - 1) / kAlign * kAlign;
      const uint64_t largest = a.largest_free();
      auto off = a.Allocate(len);
      if (!off) {
        ASSERT_LT(largest, rounded) << "refused although a hole was large enough";
        continue;
      }
      ASSERT_EQ(*off % kAlign, 0u);
      ASSERT_LE(*off + rounded, kCapacity);
      ASSERT_TRUE(range_is_free(*off, rounded)) << "overlaps a live allocation at " << *off;
      mark(*off, rounded, 1);
      live.emplace(*off, rounded);
      model_used += rounded;
    } else if (what < 9) {
      if (live.empty()) continue;
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      ASSERT_EQ(a.Free(it->first), it->second);
      mark(it->first, it->second, 0);
      model_used -= it->second;
      live.erase(it);
    } else if (rng() % 2 == 0) {
      const uint64_t off = (rng() % (kCapacity / kAlign)) * kAlign;
      const uint64_t len = 1 + rng() % 2048;
      const uint64_t rounded = (len + kAlign - 1) / kAlign * kAlign;
      const bool fits = off + rounded <= kCapacity && range_is_free(off, rounded);
      ASSERT_EQ(a.Reserve(off, len), fits) << "Reserve(" << off << ", " << len << ")";
      if (fits) {
        mark(off, rounded, 1);
        live.emplace(off, rounded);
        model_used += rounded;
      }
    } else {
      // Free at a random offset: an error unless it is the start of a live allocation.
      const uint64_t off = rng() % kCapacity;
      auto it = live.find(off);
      const uint64_t expect = it == live.end() ? 0 : it->second;
      ASSERT_EQ(a.Free(off), expect);
      if (it != live.end()) {
        mark(off, expect, 0);
        model_used -= expect;
        live.erase(it);
      }
    }
    ASSERT_EQ(a.used_bytes(), model_used);
    ASSERT_EQ(a.free_bytes(), kCapacity - model_used);
    ASSERT_EQ(a.allocation_count(), live.size());
  }

  // Every live allocation is where the model says, then freeing all leaves one full range.
  for (const auto& [off, len] : live) ASSERT_EQ(a.AllocationLength(off), len);
  for (const auto& [off, len] : live) ASSERT_EQ(a.Free(off), len);
  EXPECT_EQ(a.used_bytes(), 0u);
  EXPECT_EQ(a.allocation_count(), 0u);
  EXPECT_EQ(a.largest_free(), kCapacity);
  EXPECT_EQ(a.Allocate(kCapacity), 0u);
}

// Without tracking (the master's mode) the allocator keeps only free ranges: frees name their
// length, a free of a range with a free byte is refused, and IsAllocated answers from the free
// ranges. Checked against the same byte model.
TEST(RangeAllocator, UntrackedFreesByLengthAndMatchesAByteModel) {
  constexpr uint64_t kCapacity = 64 * 1024;
  constexpr uint64_t kAlign = 64;
  RangeAllocator a(kCapacity, kAlign, /*track_allocations=*/false);
  EXPECT_FALSE(a.tracks_allocations());
  std::vector<uint8_t> owned(kCapacity, 0);
  std::map<uint64_t, uint64_t> live;  // offset -> rounded length
  uint64_t model_used = 0;
  std::mt19937_64 rng(22);
  auto all_owned = [&](uint64_t off, uint64_t len) {
    if (off % kAlign != 0 || off >= kCapacity || len == 0 || len > kCapacity - off) return false;
    for (uint64_t i = off; i < off + len; ++i) {
      if (!owned[i]) return false;
    }
    return true;
  };
  for (int step = 0; step < 30000; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const int what = static_cast<int>(rng() % 10);
    if (what < 5) {
      const uint64_t len = 1 + rng() % 700;
      const uint64_t rounded = (len + kAlign - 1) / kAlign * kAlign;
      auto off = a.Allocate(len);
      if (!off) continue;
      for (uint64_t i = *off; i < *off + rounded; ++i) {
        ASSERT_EQ(owned[i], 0) << "overlaps a live allocation at " << *off;
        owned[i] = 1;
      }
      live.emplace(*off, rounded);
      model_used += rounded;
      ASSERT_EQ(a.AllocationLength(*off), 0u) << "not tracked";
    } else if (what < 8) {
      if (live.empty()) continue;
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      // The length as allocated (not rounded) frees the rounded range.
      const uint64_t asked = it->second - rng() % kAlign;
      ASSERT_TRUE(a.IsAllocated(it->first, asked));
      ASSERT_EQ(a.Free(it->first, asked), it->second);
      for (uint64_t i = it->first; i < it->first + it->second; ++i) owned[i] = 0;
      model_used -= it->second;
      live.erase(it);
    } else {
      // A range anywhere: IsAllocated and a refused free when any byte of it is free.
      const uint64_t off = (rng() % (kCapacity / kAlign + 1)) * kAlign;
      const uint64_t len = 1 + rng() % 1024;
      const uint64_t rounded = (len + kAlign - 1) / kAlign * kAlign;
      const bool allocated = all_owned(off, rounded);
      ASSERT_EQ(a.IsAllocated(off, len), allocated) << off << " + " << len;
      if (!allocated) {
        ASSERT_EQ(a.Free(off, len), 0u);
      }
    }
    ASSERT_EQ(a.used_bytes(), model_used);
    ASSERT_EQ(a.allocation_count(), live.size());
  }
  for (const auto& [off, len] : live) ASSERT_EQ(a.Free(off, len), len);
  EXPECT_EQ(a.used_bytes(), 0u);
  EXPECT_EQ(a.allocation_count(), 0u);
  EXPECT_EQ(a.largest_free(), kCapacity);
  EXPECT_EQ(a.Free(0, 64), 0u) << "all free";
}

// Tracking, Free(offset, length) frees only the allocation of that length.
TEST(RangeAllocator, TrackedFreeWithALengthChecksIt) {
  RangeAllocator a(4096, 64);
  const uint64_t x = *a.Allocate(100);  // 128 bytes
  EXPECT_EQ(a.Free(x, 200), 0u);
  EXPECT_EQ(a.Free(x, 0), 0u);
  EXPECT_TRUE(a.IsAllocated(x, 128));
  EXPECT_EQ(a.Free(x, 100), 128u);
  EXPECT_FALSE(a.IsAllocated(x, 64));
  EXPECT_EQ(a.allocation_count(), 0u);
}

}  // namespace
}  // namespace kvbridge::util

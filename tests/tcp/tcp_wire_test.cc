// The tcp wire codec on its own: frame round trips, and thousands of random and mutated frames
// through the decoders and CheckRequest, with guard bytes around the region to catch any
// accepted range that would reach outside it. (The handshake is the host's:
// tests/unit/test_peer_auth.cc.)
#include "tcp_wire.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace kvbridge::tcp::wire {
namespace {

constexpr uint64_t kMaxFrame = 1 << 20;

TEST(TcpWire, FrameRoundTrips) {
  RequestHeader q{kRequestMagic, KVB_OP_WRITE, 0, 7, 8, 9, 10};
  uint8_t qb[kRequestHeaderBytes];
  EncodeRequestHeader(q, qb);
  RequestHeader q2;
  ASSERT_TRUE(DecodeRequestHeader(qb, sizeof(qb), &q2));
  EXPECT_EQ(std::memcmp(&q, &q2, sizeof(q)), 0);
  EXPECT_FALSE(DecodeRequestHeader(qb, sizeof(qb) - 1, &q2));

  ResponseHeader s{kResponseMagic, KVB_ERR_OUT_OF_BOUNDS, 77, 0};
  uint8_t sb[kResponseHeaderBytes];
  EncodeResponseHeader(s, sb);
  ResponseHeader s2;
  ASSERT_TRUE(DecodeResponseHeader(sb, sizeof(sb), &s2));
  EXPECT_EQ(s2.status, s.status);
  EXPECT_EQ(s2.request_id, 77u);
}

TEST(TcpWire, CheckRequestBoundaries) {
  uint8_t mem[100];
  RegionRef region{mem, sizeof(mem)};
  auto check = [&](uint16_t opcode, uint64_t off, uint64_t len, const RegionRef* r = nullptr) {
    RequestHeader h{kRequestMagic, opcode, 0, 1, 5, off, len};
    return CheckRequest(h, r, kMaxFrame).status;
  };
  EXPECT_EQ(check(KVB_OP_READ, 0, 100, &region), KVB_OK);
  EXPECT_EQ(check(KVB_OP_WRITE, 99, 1, &region), KVB_OK);
  EXPECT_EQ(check(KVB_OP_WRITE, 100, 1, &region), KVB_ERR_OUT_OF_BOUNDS);
  EXPECT_EQ(check(KVB_OP_WRITE, 0, 101, &region), KVB_ERR_OUT_OF_BOUNDS);
  EXPECT_EQ(check(KVB_OP_WRITE, 101, 1, &region), KVB_ERR_OUT_OF_BOUNDS);
  EXPECT_EQ(check(KVB_OP_WRITE, UINT64_MAX, 1, &region), KVB_ERR_OUT_OF_BOUNDS);
  EXPECT_EQ(check(KVB_OP_WRITE, UINT64_MAX - 5, 10, &region), KVB_ERR_OUT_OF_BOUNDS);
  EXPECT_EQ(check(KVB_OP_READ, 50, kMaxFrame + 1, &region), KVB_ERR_PROTOCOL);
  EXPECT_EQ(check(KVB_OP_READ, 0, 0, &region), KVB_ERR_PROTOCOL);
  EXPECT_EQ(check(3, 0, 1, &region), KVB_ERR_PROTOCOL);
  EXPECT_EQ(check(KVB_OP_READ, 0, 1, nullptr), KVB_ERR_NOT_REGISTERED);
  // Malformed beats unregistered: a bad frame closes the connection whatever it names.
  EXPECT_EQ(check(KVB_OP_READ, 0, kMaxFrame + 1, nullptr), KVB_ERR_PROTOCOL);
  RequestHeader bad{kRequestMagic ^ 1, KVB_OP_READ, 0, 1, 5, 0, 1};
  EXPECT_EQ(CheckRequest(bad, &region, kMaxFrame).status, KVB_ERR_PROTOCOL);
  RequestHeader flagged{kRequestMagic, KVB_OP_READ, 4, 1, 5, 0, 1};
  EXPECT_EQ(CheckRequest(flagged, &region, kMaxFrame).status, KVB_ERR_PROTOCOL);
}

// Thousands of random and mutated request headers against a small region table; every
// accepted request is "served" (memset for WRITE, a read for READ) and the guard bytes around
// each region must stay intact.
TEST(TcpWire, FuzzRequestsNeverReachOutsideARegion) {
  constexpr size_t kGuard = 256;
  const uint64_t sizes[] = {1, 4096, 65537};
  struct Table {
    std::vector<uint8_t> mem;
    RegionRef ref;
  };
  std::vector<Table> regions;
  for (uint64_t len : sizes) {
    Table t;
    t.mem.assign(len + 2 * kGuard, 0xA5);
    t.ref = {t.mem.data() + kGuard, len};
    regions.push_back(std::move(t));
  }
  std::mt19937_64 rng(20261129);
  const uint64_t interesting[] = {0,
                                  1,
                                  2,
                                  4095,
                                  4096,
                                  4097,
                                  65536,
                                  65537,
                                  65538,
                                  kMaxFrame,
                                  kMaxFrame + 1,
                                  UINT32_MAX,
                                  1ull << 32,
                                  UINT64_MAX,
                                  UINT64_MAX - 1,
                                  UINT64_MAX - 4095,
                                  1ull << 63};
  auto pick = [&] {
    switch (rng() % 4) {
      case 0:
        return interesting[rng() % std::size(interesting)];
      case 1:
        return rng() % 70000;
      case 2:
        return interesting[rng() % std::size(interesting)] - rng() % 3;
      default:
        return rng();
    }
  };
  int accepted = 0, refused = 0, malformed = 0;
  for (int iter = 0; iter < 200000; ++iter) {
    uint8_t buf[kRequestHeaderBytes];
    RequestHeader base{
        kRequestMagic, static_cast<uint16_t>(1 + rng() % 2), 0, rng(), rng() % 4, pick(), pick()};
    EncodeRequestHeader(base, buf);
    size_t len = sizeof(buf);
    switch (rng() % 5) {
      case 0:  // bit flips
        for (int k = 0, n = 1 + static_cast<int>(rng() % 4); k < n; ++k) {
          buf[rng() % sizeof(buf)] ^= static_cast<uint8_t>(1u << (rng() % 8));
        }
        break;
      case 1:  // random bytes
        for (auto& b : buf) b = static_cast<uint8_t>(rng());
        break;
      case 2:  // truncation
        len = rng() % sizeof(buf);
        break;
      default:  // length/offset fiddling only
        break;
    }
    std::vector<uint8_t> exact(buf, buf + len);  // decoder may read only these bytes
    RequestHeader h;
    if (!DecodeRequestHeader(exact.data(), exact.size(), &h)) {
      ASSERT_LT(len, kRequestHeaderBytes);
      continue;
    }
    const RegionRef* region = h.segment_id < regions.size() ? &regions[h.segment_id].ref : nullptr;
    const RequestCheck c = CheckRequest(h, region, kMaxFrame);
    if (c.status == KVB_OK) {
      ++accepted;
      ASSERT_NE(region, nullptr);
      ASSERT_EQ(h.magic, kRequestMagic);
      ASSERT_TRUE(h.opcode == KVB_OP_READ || h.opcode == KVB_OP_WRITE);
      ASSERT_GT(h.length, 0u);
      ASSERT_LE(h.length, kMaxFrame);
      ASSERT_LE(static_cast<unsigned __int128>(h.offset) + h.length, region->length);
      if (h.opcode == KVB_OP_WRITE) {
        std::memset(region->base + h.offset, 0x3C, static_cast<size_t>(h.length));
      } else {
        volatile uint8_t sink = region->base[h.offset + h.length - 1];
        (void)sink;
      }
    } else if (c.status == KVB_ERR_PROTOCOL) {
      ++malformed;
    } else {
      ++refused;
      ASSERT_TRUE(c.status == KVB_ERR_NOT_REGISTERED || c.status == KVB_ERR_OUT_OF_BOUNDS);
      // Refused with a sane length: the server drains at most max_frame_bytes.
      ASSERT_LE(h.length, kMaxFrame);
    }
  }
  for (const auto& t : regions) {
    for (size_t i = 0; i < kGuard; ++i) {
      ASSERT_EQ(t.mem[i], 0xA5) << "guard byte before the region was written";
      ASSERT_EQ(t.mem[kGuard + t.ref.length + i], 0xA5) << "guard byte after the region";
    }
  }
  EXPECT_GT(accepted, 1000);
  EXPECT_GT(refused, 1000);
  EXPECT_GT(malformed, 1000);
}

}  // namespace
}  // namespace kvbridge::tcp::wire

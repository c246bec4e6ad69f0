// Unit tests of the core's value types: Status, descriptors, circuit breaker, host services.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/circuit_breaker.h"
#include "core/descriptor.h"
#include "core/host_services.h"
#include "kvbridge/options.h"
#include "kvbridge/plugin/transport.h"
#include "kvbridge/status.h"
#include "util/checksum.h"
#include "util/clock.h"
#include "util/worker_pool.h"

namespace kvbridge {
namespace {

TEST(Status, OkIsFreeAndNamed) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_EQ(s.message(), "");
}

TEST(Status, CodesMapOneToOneOntoAbi) {
  for (int32_t c = 0; c < KVB_STATUS_CODE_COUNT; ++c) {
    Status s = Status::FromAbi(c, "m");
    EXPECT_EQ(static_cast<int32_t>(s.code()), c);
    EXPECT_EQ(StatusCodeName(s.code()).find("UNKNOWN("), std::string::npos)
        << c;  // the fallback name
  }
  Status unknown = Status::FromAbi(999, "boom");
  EXPECT_EQ(unknown.code(), StatusCode::kInternal);
  EXPECT_NE(unknown.message().find("999"), std::string::npos);
}

TEST(Status, ToStringAndContext) {
  Status s = Status::StalePeer("incarnation changed");
  EXPECT_TRUE(s.IsStalePeer());
  EXPECT_EQ(s.ToString(), "STALE_PEER: incarnation changed");
  Status c = s.WithContext("peer b");
  EXPECT_EQ(c.code(), StatusCode::kStalePeer);
  EXPECT_EQ(c.message(), "peer b: incarnation changed");
  Status copy = c;
  EXPECT_EQ(copy.ToString(), c.ToString());
}

TEST(Status, OriginIsKeptByCopiesAndContext) {
  Status plain = Status::PeerUnreachable("connection refused");
  EXPECT_EQ(plain.origin(), StatusOrigin::kUnspecified);
  Status m = plain.WithOrigin(StatusOrigin::kMaster);
  EXPECT_EQ(m.origin(), StatusOrigin::kMaster);
  EXPECT_EQ(m.ToString(), plain.ToString());              // same code and message
  EXPECT_EQ(plain.origin(), StatusOrigin::kUnspecified);  // the original is unchanged
  Status c = m.WithContext("GetReplicas");
  EXPECT_EQ(c.origin(), StatusOrigin::kMaster);
  Status copy;
  copy = c;
  EXPECT_EQ(copy.origin(), StatusOrigin::kMaster);
  Status moved = std::move(copy);
  EXPECT_EQ(moved.origin(), StatusOrigin::kMaster);
  EXPECT_EQ(moved.WithOrigin(StatusOrigin::kStorageNode).origin(), StatusOrigin::kStorageNode);
  // OK has no origin and stays OK.
  EXPECT_TRUE(Status::OK().WithOrigin(StatusOrigin::kMaster).ok());
  EXPECT_EQ(Status::OK().WithOrigin(StatusOrigin::kMaster).origin(), StatusOrigin::kUnspecified);
  EXPECT_STREQ(StatusOriginName(StatusOrigin::kMaster), "master");
  EXPECT_STREQ(StatusOriginName(StatusOrigin::kStorageNode), "storage_node");
  EXPECT_STREQ(StatusOriginName(StatusOrigin::kUnspecified), "");
}

TEST(Result, HoldsValueOrError) {
  Result<int> ok(7);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok.value(), 7);
  Result<int> bad(Status::NotFound("x"));
  EXPECT_FALSE(bad.ok());
  EXPECT_TRUE(bad.status().IsNotFound());
  Result<int> misuse(Status::OK());
  EXPECT_FALSE(misuse.ok());
  EXPECT_EQ(misuse.status().code(), StatusCode::kInternal);
}

core::Descriptor SampleDescriptor() {
  core::Descriptor d;
  d.node_id = "prefill-0";
  d.incarnation = 0x1234567890abcdefull;
  d.transports = {{"tcp", "10.0.0.1:4000,10.0.1.1:4000"}, {"ucx", "blob"}};
  core::SegmentDesc s;
  s.id = 3;
  s.length = 1 << 20;
  s.rkeys["ucx"] = std::string("\x00\x01\x02", 3);
  d.segments.push_back(s);
  return d;
}

TEST(Descriptor, RoundTrips) {
  core::Descriptor d = SampleDescriptor();
  auto back = core::DecodeDescriptor(core::EncodeDescriptor(d));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->node_id, d.node_id);
  EXPECT_EQ(back->incarnation, d.incarnation);
  ASSERT_EQ(back->transports.size(), 2u);
  EXPECT_EQ(back->transports[0].endpoints, "10.0.0.1:4000,10.0.1.1:4000");
  ASSERT_EQ(back->segments.size(), 1u);
  EXPECT_EQ(back->segments[0].length, 1u << 20);
  EXPECT_EQ(back->segments[0].rkeys.at("ucx"), std::string("\x00\x01\x02", 3));
}

TEST(Descriptor, RejectsEveryTruncationAndCorruption) {
  const std::string blob = core::EncodeDescriptor(SampleDescriptor());
  for (size_t n = 0; n < blob.size(); ++n) {
    auto r = core::DecodeDescriptor(std::string_view(blob).substr(0, n));
    EXPECT_FALSE(r.ok()) << "prefix of " << n << " bytes accepted";
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  std::mt19937 rng(42);
  for (int i = 0; i < 2000; ++i) {
    std::string m = blob;
    m[rng() % m.size()] ^= static_cast<char>(1 + rng() % 255);
    auto r = core::DecodeDescriptor(m);
    EXPECT_FALSE(r.ok()) << "corrupted descriptor accepted at iteration " << i;
  }
  EXPECT_NE(core::DecodeDescriptor("garbage-garbage").status().message().find("malformed"),
            std::string::npos);
}

TEST(Descriptor, VersionThreeCarriesHostKeyCapsAndDeviceIds) {
  core::Descriptor d = SampleDescriptor();
  d.host_key = "boot.1.2";
  d.transports[0].caps = KVB_TCAP_READ | KVB_TCAP_WRITE | KVB_TCAP_LOCAL_SHM;
  d.segments[0].mem_kind = KVB_MEM_CUDA;
  d.segments[0].device_id = 3;
  auto back = core::DecodeDescriptor(core::EncodeDescriptor(d));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->host_key, "boot.1.2");
  EXPECT_EQ(back->transports[0].caps, d.transports[0].caps);
  EXPECT_EQ(back->transports[1].caps, 0u);
  EXPECT_EQ(back->segments[0].mem_kind, static_cast<uint32_t>(KVB_MEM_CUDA));
  EXPECT_EQ(back->segments[0].device_id, 3);
  EXPECT_FALSE(back->sealed);
}

// With a cluster token a descriptor is sealed (HMAC-SHA256 under the token): a holder of the
// same token takes it, another token or none in the blob is UNAUTHENTICATED, and a change to
// any byte is caught even when the tamperer recomputes the CRC.
TEST(Descriptor, SealedUnderTheClusterToken) {
  const std::string sealed = core::EncodeDescriptor(SampleDescriptor(), "token-1");
  auto ok = core::DecodeDescriptor(sealed, "token-1");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_TRUE(ok->sealed);
  EXPECT_EQ(ok->node_id, "prefill-0");

  auto other = core::DecodeDescriptor(sealed, "token-2");
  EXPECT_EQ(other.status().code(), StatusCode::kUnauthenticated);
  EXPECT_NE(other.status().message().find("different cluster token"), std::string::npos)
      << other.status().ToString();

  auto unsealed = core::DecodeDescriptor(core::EncodeDescriptor(SampleDescriptor()), "token-1");
  EXPECT_EQ(unsealed.status().code(), StatusCode::kUnauthenticated);
  EXPECT_NE(unsealed.status().message().find("not sealed"), std::string::npos)
      << unsealed.status().ToString();

  // Without a token the seal cannot be checked; the contents still decode.
  auto no_token = core::DecodeDescriptor(sealed);
  ASSERT_TRUE(no_token.ok()) << no_token.status().ToString();
  EXPECT_TRUE(no_token->sealed);

  // Every single-byte change of the sealed part, with the CRC made right again.
  const size_t body = sealed.size() - 4;
  int caught = 0;
  for (size_t i = 8; i < body; ++i) {  // past magic, version and flags
    std::string m = sealed.substr(0, body);
    m[i] ^= 0x01;
    const uint32_t crc = util::Crc32c(m.data(), m.size());
    m.append(reinterpret_cast<const char*>(&crc), 4);
    auto r = core::DecodeDescriptor(m, "token-1");
    EXPECT_FALSE(r.ok()) << "a change at byte " << i << " was accepted";
    if (r.status().code() == StatusCode::kUnauthenticated) ++caught;
  }
  EXPECT_GT(caught, 0) << "no change was caught by the seal itself";
}

TEST(Checksum, KnownVector) {
  // CRC-32C of "123456789" is 0xE3069283 (RFC 3720 check value).
  EXPECT_EQ(util::Crc32c("123456789", 9), 0xE3069283u);
  uint32_t part = util::Crc32c("12345", 5);
  EXPECT_EQ(util::Crc32c("6789", 4, part), 0xE3069283u);
  EXPECT_EQ(util::Crc32cPortableForTest("123456789", 9), 0xE3069283u);
}

TEST(Checksum, HardwareAndTableAgreeOnEveryLengthAndAlignment) {
  std::mt19937 rng(7);
  std::string data((1 << 20) + 64, '\0');
  for (auto& c : data) c = static_cast<char>(rng());
  for (size_t off = 0; off < 9; ++off) {
    // Past 3 KiB the hardware path runs three interleaved lanes and combines them.
    for (size_t len :
         {0, 1, 7, 8, 9, 63, 64, 65, 1000, 3071, 3072, 3073, 4096, 6144, 15377, 65536, 1 << 20}) {
      EXPECT_EQ(util::Crc32c(data.data() + off, len, 123),
                util::Crc32cPortableForTest(data.data() + off, len, 123))
          << "off " << off << " len " << len;
    }
  }
}

// Each implementation this CPU runs (util::Crc32cImplementationsForTest: the 512-bit
// carry-less-multiply folding where the CPU has VPCLMULQDQ, the CRC32 instruction, the table)
// gives the table's value at every length around its block sizes (16, 64, 256, 512 bytes),
// every alignment, from any starting CRC.
TEST(Checksum, EveryImplementationAgreesWithTheTable) {
  const std::vector<std::string> impls = util::Crc32cImplementationsForTest();
  std::printf("CRC-32C implementations here: ");
  for (const auto& name : impls) std::printf("%s ", name.c_str());
  std::printf("(Crc32c uses %s)\n", util::Crc32cImplementation());
  ASSERT_FALSE(impls.empty());
  EXPECT_EQ(impls.front(), util::Crc32cImplementation());
  EXPECT_EQ(util::Crc32cWithForTest("no-such-implementation", "x", 1), 0u);
  std::mt19937 rng(13);
  std::string data((1 << 20) + 4096, '\0');
  for (auto& c : data) c = static_cast<char>(rng());
  std::vector<size_t> lengths;
  for (size_t len = 0; len <= 1100; ++len) lengths.push_back(len);
  for (size_t len : {2047, 2048, 2049, 4095, 4096, 4097, 65535, 65536, 65537, 1 << 20}) {
    lengths.push_back(len);
  }
  for (const auto& name : impls) {
    for (size_t off : {0, 1, 3, 8, 63}) {
      for (size_t len : lengths) {
        const uint32_t start = static_cast<uint32_t>(rng());
        const uint32_t want = util::Crc32cPortableForTest(data.data() + off, len, start);
        const uint32_t got = util::Crc32cWithForTest(name, data.data() + off, len, start);
        if (got != want) {
          ADD_FAILURE() << name << ": off " << off << " len " << len << " start " << start << ": "
                        << got << " != " << want;
          return;
        }
      }
    }
    EXPECT_EQ(util::Crc32cWithForTest(name, "123456789", 9), 0xE3069283u) << name;
  }
}

// CopyCrc32c, by each implementation and both kinds of stores: the destination holds exactly
// the source's bytes (none written before or after it), and the CRC is the table's over them,
// at every length around the blocks (256 bytes a fold, 512 the least fused length) and every
// alignment of either side (a streaming copy aligns its destination to 64 bytes first).
TEST(Checksum, FusedCopyCopiesExactlyAndChecksumsWhatItCopied) {
  std::mt19937 rng(17);
  std::string src((1 << 20) + 4096, '\0');
  for (auto& c : src) c = static_cast<char>(rng());
  std::vector<size_t> lengths;
  for (size_t len = 0; len <= 1100; len += 7) lengths.push_back(len);
  for (size_t len : {255, 256, 511, 512, 513, 767, 768, 4096, 65535, 65536, 65600, 1 << 20}) {
    lengths.push_back(len);
  }
  constexpr char kGuard = 0x5a;
  std::string dst(src.size() + 256, kGuard);
  for (const auto& name : util::Crc32cImplementationsForTest()) {
    for (auto stores : {util::CopyStores::kCached, util::CopyStores::kStreaming}) {
      for (auto [src_off, dst_off] : {std::pair<size_t, size_t>{0, 0},
                                      {0, 64},
                                      {1, 0},
                                      {0, 1},
                                      {3, 61},
                                      {63, 17},
                                      {32, 96}}) {
        for (size_t len : lengths) {
          const uint32_t start = static_cast<uint32_t>(rng());
          char* d = dst.data() + 64 + dst_off;
          const char* s = src.data() + src_off;
          const uint32_t got = util::CopyCrc32cWithForTest(name, d, s, len, start, stores);
          const uint32_t want = util::Crc32cPortableForTest(s, len, start);
          const bool copied = std::memcmp(d, s, len) == 0;
          const bool guarded = d[-1] == kGuard && d[len] == kGuard;
          std::memset(d, kGuard, len);  // the next case's guard bytes
          if (got != want || !copied || !guarded) {
            ADD_FAILURE() << name << (stores == util::CopyStores::kStreaming ? " streaming" : "")
                          << ": src+" << src_off << " dst+" << dst_off << " len " << len
                          << (got != want ? ": wrong CRC" : "") << (copied ? "" : ": bytes differ")
                          << (guarded ? "" : ": wrote outside the destination");
            return;
          }
        }
      }
    }
  }
  std::string out(9, '\0');
  EXPECT_EQ(util::CopyCrc32c(out.data(), "123456789", 9), 0xE3069283u);
  EXPECT_EQ(out, "123456789");
  EXPECT_EQ(util::CopyCrc32cWithForTest("no-such-implementation", out.data(), "x", 1, 0,
                                        util::CopyStores::kCached),
            0u);
}

// Crc32cCombine(Crc32c(A), Crc32c(B), |B|) is Crc32c(A||B), for every split of buffers up to
// a few MiB, empty parts included.
TEST(Checksum, CombinedPartsEqualTheWhole) {
  std::mt19937 rng(11);
  std::string data((3 << 20) + 5, '\0');
  for (auto& c : data) c = static_cast<char>(rng());
  for (size_t len : {size_t{0}, size_t{1}, size_t{9}, size_t{4096}, size_t{1} << 20, data.size()}) {
    const uint32_t whole = util::Crc32c(data.data(), len);
    for (size_t cut : {size_t{0}, len / 3, len / 2, len > 0 ? len - 1 : 0, len}) {
      const uint32_t a = util::Crc32c(data.data(), cut);
      const uint32_t b = util::Crc32c(data.data() + cut, len - cut);
      EXPECT_EQ(util::Crc32cCombine(a, b, len - cut), whole) << "len " << len << " cut " << cut;
    }
  }
  // Many parts joined left to right, as the engine joins a copy's 256 KiB pieces.
  uint32_t joined = 0;
  for (size_t at = 0; at < data.size(); at += 262144) {
    const size_t n = std::min<size_t>(262144, data.size() - at);
    joined = util::Crc32cCombine(joined, util::Crc32c(data.data() + at, n), n);
  }
  EXPECT_EQ(joined, util::Crc32c(data.data(), data.size()));
}

// WorkerPool::Run calls every index exactly once, across the caller and the helpers; a Run that
// finds the helpers busy with another does its work alone; one thread runs inline.
TEST(WorkerPool, EveryIndexOnceAndConcurrentRunsDoNotWait) {
  for (unsigned threads : {1u, 2u, 4u}) {
    util::WorkerPool pool(threads);
    EXPECT_EQ(pool.threads(), threads);
    for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{1000}}) {
      std::vector<std::atomic<int>> seen(n);
      std::mutex mu;
      std::set<std::thread::id> ids;
      pool.Run(n, [&](size_t i) {
        seen[i].fetch_add(1);
        std::lock_guard<std::mutex> lock(mu);
        ids.insert(std::this_thread::get_id());
      });
      for (size_t i = 0; i < n; ++i) EXPECT_EQ(seen[i].load(), 1) << "index " << i;
      EXPECT_LE(ids.size(), threads);
      if (threads == 1) EXPECT_TRUE(n == 0 || ids == std::set{std::this_thread::get_id()});
    }
  }
  // Two Runs at once: the second, finding the helpers taken, runs on its own thread only, and
  // neither waits for the other (the first is held until the second has finished).
  util::WorkerPool pool(3);
  std::atomic<bool> second_done{false};
  std::atomic<int> first_calls{0};
  std::thread first([&] {
    pool.Run(4, [&](size_t) {
      first_calls.fetch_add(1);
      while (!second_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    });
  });
  while (first_calls.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::set<std::thread::id> second_ids;
  pool.Run(50, [&](size_t) { second_ids.insert(std::this_thread::get_id()); });
  EXPECT_EQ(second_ids, std::set{std::this_thread::get_id()});
  second_done = true;
  first.join();
  EXPECT_EQ(first_calls.load(), 4);
  EXPECT_GE(util::WorkerPool::DefaultThreads(), 1u);
  EXPECT_LE(util::WorkerPool::DefaultThreads(), 4u);
}

TEST(CircuitBreaker, OpensAfterThresholdAndProbes) {
  core::CircuitBreaker::Config cfg;
  cfg.failure_threshold = 3;
  cfg.backoff_ms = 100;
  cfg.max_backoff_ms = 400;
  core::CircuitBreaker b(cfg);
  uint64_t t = 1'000'000'000;
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(b.Allow(t));
    b.RecordFailure(t);
  }
  EXPECT_EQ(b.state(t), BreakerState::kClosed);
  b.RecordFailure(t);
  EXPECT_EQ(b.state(t), BreakerState::kOpen);
  EXPECT_FALSE(b.Allow(t + util::MsToNs(50)));
  // Backoff elapsed: exactly one probe passes.
  uint64_t t2 = t + util::MsToNs(101);
  EXPECT_TRUE(b.Allow(t2));
  EXPECT_FALSE(b.Allow(t2));
  // Failed probe: re-opened with doubled backoff.
  b.RecordFailure(t2);
  EXPECT_FALSE(b.Allow(t2 + util::MsToNs(150)));
  EXPECT_TRUE(b.Allow(t2 + util::MsToNs(201)));
  b.RecordSuccess();
  EXPECT_EQ(b.state(t2), BreakerState::kClosed);
  EXPECT_EQ(b.consecutive_failures(), 0u);
  EXPECT_TRUE(b.Allow(t2));
}

TEST(CircuitBreaker, BackoffIsCapped) {
  core::CircuitBreaker::Config cfg;
  cfg.failure_threshold = 1;
  cfg.backoff_ms = 100;
  cfg.max_backoff_ms = 250;
  core::CircuitBreaker b(cfg);
  uint64_t t = 1'000'000'000;
  b.RecordFailure(t);
  for (int i = 0; i < 5; ++i) {
    t += util::MsToNs(300);
    ASSERT_TRUE(b.Allow(t));
    b.RecordFailure(t);
  }
  EXPECT_EQ(b.retry_in_ns(t), util::MsToNs(250));
}

TEST(CircuitBreaker, ZeroThresholdNeverOpens) {
  core::CircuitBreaker::Config cfg;
  cfg.failure_threshold = 0;
  core::CircuitBreaker b(cfg);
  for (int i = 0; i < 100; ++i) b.RecordFailure(1);
  EXPECT_TRUE(b.Allow(2));
}

TEST(HostServices, ConfigThenEnvironment) {
  setenv("KVBRIDGE_TCP_LANES_PER_PEER", "9", 1);
  setenv("KVBRIDGE_TCP_SLICE_BYTES", "4096", 1);
  core::HostServices host(std::map<std::string, std::string>{{"tcp.lanes_per_peer", "2"}});
  EXPECT_EQ(core::HostServices::EnvName("tcp.lanes_per_peer"), "KVBRIDGE_TCP_LANES_PER_PEER");
  EXPECT_EQ(host.Get("tcp.lanes_per_peer").value(), "2");  // explicit wins
  EXPECT_EQ(host.Get("tcp.slice_bytes").value(), "4096");  // env fills the rest
  EXPECT_FALSE(host.Get("tcp.nothing").has_value());
  const kvb_host_services_t* t = host.table();
  char buf[8];
  EXPECT_EQ(t->config_get(t->host_ctx, "tcp.slice_bytes", buf, sizeof(buf)), 4);
  EXPECT_STREQ(buf, "4096");
  EXPECT_EQ(t->config_get(t->host_ctx, "tcp.slice_bytes", buf, 3), -2);
  EXPECT_EQ(t->config_get(t->host_ctx, "tcp.nothing", buf, sizeof(buf)), -1);
  EXPECT_GT(t->now_ns(t->host_ctx), 0u);
  unsetenv("KVBRIDGE_TCP_LANES_PER_PEER");
  unsetenv("KVBRIDGE_TCP_SLICE_BYTES");
}

TEST(EngineOptions, FromEnvReadsVariablesAndIgnoresGarbage) {
  setenv("KVBRIDGE_NODE_ID", "decode-3", 1);
  setenv("KVBRIDGE_TRANSPORTS", "tcp,,ucx", 1);
  setenv("KVBRIDGE_DEADLINE_MS", "1500", 1);
  setenv("KVBRIDGE_PROGRESS_TIMEOUT_MS", "12x", 1);
  EngineOptions o = EngineOptions::FromEnv();
  EXPECT_EQ(o.node_id, "decode-3");
  EXPECT_EQ(o.transports, (std::vector<std::string>{"tcp", "ucx"}));
  EXPECT_EQ(o.default_deadline_ms, 1500u);
  EXPECT_EQ(o.progress_timeout_ms, EngineOptions{}.progress_timeout_ms);
  unsetenv("KVBRIDGE_NODE_ID");
  unsetenv("KVBRIDGE_TRANSPORTS");
  unsetenv("KVBRIDGE_DEADLINE_MS");
  unsetenv("KVBRIDGE_PROGRESS_TIMEOUT_MS");
}

}  // namespace
}  // namespace kvbridge

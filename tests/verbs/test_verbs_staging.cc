// VerbsStaging.*: host staging of CUDA memory in the verbs transport
// (plugins/transport_verbs/verbs_transport.h, docs/transports/verbs.md "Host staging"): two
// instances over the LoopbackFabric (tests/verbs/loopback_fabric.h) with the real side channel
// and host services, where the fabric has no GPUDirect path, and the fake CUDA driver
// (tests/fakes/fake_cuda.cc) behind the host's device services. Its device memory is guarded
// (any CPU access by kvbridge faults) and its copies really move bytes on a worker thread, with
// latency and injected errors on demand. What is shown: bytes of device memory written and read
// through bounce buffers (more slices than buffers), the region kept out of the descriptor, the
// caps and refusals, a failed copy failing only its op, cancel and deadline waiting for a copy
// before they return, a rail failing mid-transfer, the ring's MRs going with its peer, and
// remove_peer and destroy waiting for the copies of a failed request.
// With KVBTEST_REAL_CUDA=1 (benchmarks/gpu_check.sh, stage verbs-staging) the tests that only
// move and check bytes run on real device memory and the real driver's copies; those that need
// the fake's knobs skip.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tests/gpu/fake_cuda_env.h"
#include "tests/gpu/test_memory.h"
#include "tests/verbs/verbs_nodes.h"

namespace kvbridge::verbs {
namespace {

namespace sdk = kvbridge::plugin::sdk;
using kvbridge::testing::Fake;
using kvbridge::testing::FakeCopyRecord;
using kvbridge::testing::RealCuda;
using kvbridge::testing::TestMemory;
using testing::Node;
using testing::NowNs;

constexpr size_t kKiB = 1024;
constexpr int kCudaErrorIllegalAddress = 700;

class VerbsStagingTest : public testing::VerbsTransportTest {
 protected:
  void SetUp() override {
    if (RealCuda()) {
      std::string why;
      if (kvbridge::testing::Real(&why) == nullptr) {
        if (kvbridge::testing::GpuRequired()) FAIL() << "KVBRIDGE_REQUIRE_GPU is set: " << why;
        GTEST_SKIP() << "no usable CUDA driver: " << why;
      }
      return;
    }
    Fake().set_latency_us(0);
    Fake().clear_copy_log();
  }
  void TearDown() override {
    if (RealCuda()) return;
    Fake().set_latency_us(0);
    Fake().fail_next_copy(0);
    Fake().fail_next_copy_to_host(0);
  }

  // 64 KiB work requests and bounce buffers, four per peer.
  static std::map<std::string, std::string> Config(std::map<std::string, std::string> more = {}) {
    std::map<std::string, std::string> c = {{"verbs.max_wr_bytes", "65536"},
                                            {"verbs.staging_buffer_bytes", "65536"},
                                            {"verbs.staging_buffers", "4"}};
    for (auto& [k, v] : more) c[k] = v;
    return c;
  }

  static std::unique_ptr<TestMemory> DeviceMemory(size_t len) {
    return std::make_unique<TestMemory>(MemoryKind::kCuda, len, 0);
  }

  // Node a (NICs `a_nics`) with `len` bytes of fake device memory, holding Pattern(len, seed),
  // registered as segment 1 (staged); node b (NICs `b_nics`) with `len` zeroed host bytes as
  // segment 9; a's peer b. `peer` stays null when a step failed (the failure is reported).
  struct Pair {
    std::unique_ptr<Node> a, b;
    std::unique_ptr<TestMemory> dev;
    std::vector<uint8_t> src, remote;
    Peer* peer = nullptr;
  };
  Pair Setup(size_t len, uint8_t seed, const std::map<std::string, std::string>& cfg = Config(),
             const std::vector<std::string>& a_nics = {"a0"},
             const std::vector<std::string>& b_nics = {"b0"}) {
    Pair x;
    x.a = Make({"node-a", 11, a_nics, "", cfg});
    x.b = Make({"node-b", 22, b_nics, "", cfg});
    if (!x.a || !x.b) return x;
    x.dev = DeviceMemory(len);
    x.src = Pattern(len, seed);
    x.dev->Put(0, x.src.data(), len);
    x.remote.assign(len, 0);
    const sdk::Status st = TryRegister(*x.a, 1, x.dev->data(), len, KVB_MEM_CUDA, 0);
    if (!st.ok()) {
      ADD_FAILURE() << st.message();
      return x;
    }
    Register(*x.b, 9, x.remote.data(), len);
    x.peer = AddPeer(*x.a, *x.b);
    return x;
  }

  // Every copy the fake driver logged since clear_copy_log() had ended by `by_ns`, when `what`.
  static void ExpectCopiesEndedBy(uint64_t by_ns, const std::string& what) {
    std::vector<FakeCopyRecord> log(16);
    log.resize(Fake().copy_log(log.data(), log.size()));
    ASSERT_FALSE(log.empty()) << "no copy was logged";
    for (const FakeCopyRecord& c : log) {
      EXPECT_NE(c.end_ns, 0u) << "a copy still ran when " << what;
      EXPECT_LE(c.end_ns, by_ns) << "a copy ended after " << what;
    }
  }

  // With every device copy taking `copy_ms`, posts `opcode` over all of x's device memory (with
  // `deadline_ns`, 0 for none) and returns the request once its first copy started; null (the
  // failure reported) otherwise. The copy log starts with that post.
  static Request* PostUnderSlowCopies(Pair& x, uint32_t opcode, uint32_t copy_ms,
                                      uint64_t deadline_ns) {
    Fake().set_latency_us(copy_ms * 1000);
    Fake().clear_copy_log();
    Request* r = nullptr;
    const sdk::Status st =
        Post(*x.a, x.peer, {Op(opcode, 1, x.dev->data(), x.dev->size(), 9, 0)}, deadline_ns, 0, &r);
    if (!st.ok()) {
      ADD_FAILURE() << st.message();
      return nullptr;
    }
    std::vector<FakeCopyRecord> log(16);
    if (!testing::Eventually([&] { return Fake().copy_log(log.data(), log.size()) > 0; })) {
      ADD_FAILURE() << "no device copy started";
      return nullptr;
    }
    return r;
  }

  // Zeroes all of x's device memory and READs segment 9 back into it: OK once it holds x.src.
  sdk::Status ReadAllBack(Pair& x) {
    x.dev->Zero();
    const sdk::Status st =
        Transfer(*x.a, x.peer, {Op(KVB_OP_READ, 1, x.dev->data(), x.dev->size(), 9, 0)});
    if (st.ok() && x.dev->Get(0, x.dev->size()) != x.src) {
      return sdk::Status(KVB_ERR_INTERNAL, "test: the bytes read back differ");
    }
    return st;
  }
};

TEST_F(VerbsStagingTest, DeviceBytesMoveThroughBounceBuffersBothWays) {
  constexpr size_t kLen = 1 << 20;  // 16 slices through 4 bounce buffers
  Pair x = Setup(kLen, 3);
  ASSERT_NE(x.peer, nullptr);
  auto& [a, b, dev, src, remote, peer] = x;
  EXPECT_NE(a->t->InstanceCaps() & KVB_TCAP_CUDA_MEM, 0u) << "staging takes CUDA memory";
  EXPECT_EQ(a->t->InstanceCaps() & KVB_TCAP_CUDA_DIRECT, 0u) << "but copies it";
  EXPECT_EQ(a->local_only.count(1), 1u) << "a staged region's key was not kept local";
  EXPECT_EQ(a->segments.count(1), 0u);
  EXPECT_EQ(a->t->Counters().registrations[static_cast<size_t>(RegPath::kHostStaging)], 1u);
  EXPECT_TRUE(a->Logged("host staging")) << a->AllLogs();

  const size_t mrs_before = fabric_.LiveMrs("a0");
  sdk::Status st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, dev->data(), kLen, 9, 0)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(remote, src);
  EXPECT_EQ(fabric_.LiveMrs("a0"), mrs_before + 1) << "one MR for the peer's staging ring";

  // Read back into another part of the device memory, unaligned, from an offset.
  dev->Zero();
  constexpr size_t kOff = 4096 + 100, kReadLen = 300 * kKiB + 7;
  st = Transfer(*a, peer, {Op(KVB_OP_READ, 1, dev->data() + kOff, kReadLen, 9, 512)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(dev->Get(kOff, kReadLen),
            std::vector<uint8_t>(src.begin() + 512, src.begin() + 512 + kReadLen));
  EXPECT_EQ(dev->Get(0, kOff), std::vector<uint8_t>(kOff, 0)) << "bytes before the op moved";
  const VerbsCounters c = a->t->Counters();
  EXPECT_EQ(c.staging_rings, 1u);
  EXPECT_EQ(c.staging_copies, 16u + 5u) << "16 slices in, 5 out";
  EXPECT_EQ(c.staging_copy_failures, 0u);
  if (!RealCuda()) {
    std::vector<FakeCopyRecord> log(64);
    log.resize(Fake().copy_log(log.data(), log.size()));
    EXPECT_EQ(log.size(), 21u) << "every staged byte crossed by one device copy";
  }
  kvb_transport_stats_t stats{};
  ASSERT_TRUE(a->t->Stats(stats).ok());
  EXPECT_EQ(stats.device_regions_staged, 1u);
  EXPECT_EQ(stats.device_regions_direct, 0u);
  EXPECT_EQ(stats.device_bytes_staged, kLen + kReadLen);
}

TEST_F(VerbsStagingTest, PeersDoNotSeeAStagedRegion) {
  auto a = Make({"node-a", 11, {"a0"}, "", Config()});
  auto b = Make({"node-b", 22, {"b0"}, "", Config()});
  ASSERT_TRUE(a && b);
  TestMemory dev(MemoryKind::kCuda, 256 * kKiB, 0);
  dev.Zero();
  std::vector<uint8_t> mine(256 * kKiB, 5);
  ASSERT_TRUE(TryRegister(*a, 1, dev.data(), dev.size(), KVB_MEM_CUDA, 0).ok());
  Register(*b, 9, mine.data(), mine.size());
  // B learns A's descriptor as the engine publishes it: without segment 1.
  Peer* to_a = AddPeer(*b, *a);
  const sdk::Status st = Transfer(*b, to_a, {Op(KVB_OP_WRITE, 9, mine.data(), 4096, 1, 0)});
  EXPECT_EQ(st.code(), KVB_ERR_NOT_REGISTERED) << st.message();
  EXPECT_HAS(st.message(), "segment 1 is not registered");
  EXPECT_EQ(dev.Get(0, 4096), std::vector<uint8_t>(4096, 0));
}

TEST_F(VerbsStagingTest, StagingOffOrAnOldHostIsANamedRefusal) {
  auto off = Make({"node-off", 11, {"a0"}, "", Config({{"verbs.host_staging", "0"}})});
  ASSERT_TRUE(off);
  EXPECT_EQ(off->t->InstanceCaps() & (KVB_TCAP_CUDA_MEM | KVB_TCAP_CUDA_DIRECT), 0u);
  TestMemory dev(MemoryKind::kCuda, 64 * kKiB, 0);
  sdk::Status st = TryRegister(*off, 1, dev.data(), dev.size(), KVB_MEM_CUDA, 0);
  EXPECT_EQ(st.code(), KVB_ERR_UNSUPPORTED);
  EXPECT_HAS(st.message(), "verbs.host_staging=0");
  EXPECT_HAS(st.message(), "neither dma-buf nor nvidia-peermem");

  // A host of ABI 1.4 hands a region without reg_flags: it could not keep the key local.
  auto on = Make({"node-on", 12, {"a0"}, "", Config()});
  ASSERT_TRUE(on);
  kvb_region_t r{sizeof(r), KVB_MEM_CUDA, 2, dev.data(), dev.size(), 0, nullptr};
  r.struct_size = offsetof(kvb_region_t, reg_flags);
  std::vector<uint8_t> key(1024);
  uint32_t key_len = 0;
  sdk::RkeyBuffer buf(key.data(), static_cast<uint32_t>(key.size()), &key_len);
  st = on->t->RegisterMemory(sdk::Region::From(&r), buf);
  EXPECT_EQ(st.code(), KVB_ERR_UNSUPPORTED);
  EXPECT_HAS(st.message(), "ABI 1.5");
  EXPECT_EQ(on->t->Counters().registrations[static_cast<size_t>(RegPath::kHostStaging)], 0u);
}

TEST_F(VerbsStagingTest, AFailedCopyFailsOnlyItsOpAndLeaksNoBuffer) {
  if (RealCuda()) GTEST_SKIP() << "needs the fake CUDA driver's injected copy errors";
  constexpr size_t kLen = 512 * kKiB;  // 8 slices: every buffer of the ring, twice
  Pair x = Setup(kLen, 7);
  ASSERT_NE(x.peer, nullptr);
  auto& [a, b, dev, src, remote, peer] = x;

  // A WRITE whose device-to-host copy fails.
  Fake().fail_next_copy_to_host(kCudaErrorIllegalAddress);
  sdk::Status st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, dev->data(), kLen, 9, 0)});
  EXPECT_EQ(st.code(), KVB_ERR_IO) << st.message();
  EXPECT_HAS(st.message(), "staging");
  EXPECT_HAS(st.message(), "ILLEGAL_ADDRESS");
  EXPECT_EQ(a->t->Counters().staging_copy_failures, 1u);

  // A READ whose host-to-device copy fails: the op fails, the device memory keeps its bytes
  // for that slice.
  Fake().fail_next_copy(kCudaErrorIllegalAddress);
  std::fill(remote.begin(), remote.end(), 0xab);
  st = Transfer(*a, peer, {Op(KVB_OP_READ, 1, dev->data(), 64 * kKiB, 9, 0)});
  EXPECT_EQ(st.code(), KVB_ERR_IO) << st.message();
  EXPECT_HAS(st.message(), "into CUDA device 0 memory");
  EXPECT_EQ(a->t->Counters().staging_copy_failures, 2u);
  EXPECT_EQ(dev->Get(0, 64 * kKiB), std::vector<uint8_t>(src.begin(), src.begin() + 64 * kKiB));

  // Every buffer came back: more ops than buffers still go through, both ways.
  EXPECT_EQ(a->t->Counters().staging_buffers_busy, 0u);
  std::fill(remote.begin(), remote.end(), 0);
  for (int i = 0; i < 3; ++i) {
    st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, dev->data(), kLen, 9, 0)});
    ASSERT_TRUE(st.ok()) << st.message();
  }
  EXPECT_EQ(remote, src);
  st = ReadAllBack(x);
  EXPECT_TRUE(st.ok()) << st.message();
}

TEST_F(VerbsStagingTest, CancelWaitsForARunningCopyAndNoCopyRunsAfterIt) {
  if (RealCuda()) GTEST_SKIP() << "needs the fake CUDA driver's copy latency and copy log";
  Pair x = Setup(256 * kKiB, 1);
  ASSERT_NE(x.peer, nullptr);
  auto& [a, b, dev, src, remote, peer] = x;
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, dev->data(), 4096, 9, 0)}).ok());

  Fake().set_latency_us(300 * 1000);
  Fake().clear_copy_log();
  Request* r = nullptr;
  ASSERT_TRUE(Post(*a, peer, {Op(KVB_OP_WRITE, 1, dev->data(), dev->size(), 9, 0)}, 0, 0, &r).ok());
  std::vector<FakeCopyRecord> log(16);
  ASSERT_TRUE(testing::Eventually([&] { return Fake().copy_log(log.data(), log.size()) > 0; }));
  a->t->Cancel(r);
  const uint64_t cancelled = NowNs();
  EXPECT_EQ(a->t->Poll(r, {}).code(), KVB_ERR_CANCELLED);
  a->t->Release(r);
  ExpectCopiesEndedBy(cancelled, "cancel returned");
  EXPECT_EQ(std::vector<uint8_t>(remote.begin() + 4096, remote.end()),
            std::vector<uint8_t>(remote.size() - 4096, 0))
      << "a cancelled WRITE landed";
}

TEST_F(VerbsStagingTest, ASlowCopyEndsDeadlineExceeded) {
  if (RealCuda()) GTEST_SKIP() << "needs the fake CUDA driver's copy latency";
  Pair x = Setup(128 * kKiB, 1);
  ASSERT_NE(x.peer, nullptr);
  auto& [a, b, dev, src, remote, peer] = x;
  Fake().set_latency_us(400 * 1000);
  const uint64_t deadline = NowNs() + 100 * 1000000ull;
  const sdk::Status st =
      Transfer(*a, peer, {Op(KVB_OP_READ, 1, dev->data(), dev->size(), 9, 0)}, deadline);
  EXPECT_EQ(st.code(), KVB_ERR_DEADLINE_EXCEEDED) << st.message();
  Fake().set_latency_us(0);
  // The peer is fine afterwards.
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_READ, 1, dev->data(), dev->size(), 9, 0)}).ok());
}

// A request that fails (here its deadline) while its device copies run becomes final only once
// they ended, and nobody waits for them under the transport's lock: another peer's transfer
// completes meanwhile, and so does a second request to the same peer's host memory.
TEST_F(VerbsStagingTest, ARunningCopyOfAFailedRequestHoldsOnlyThatRequest) {
  if (RealCuda()) GTEST_SKIP() << "needs the fake CUDA driver's copy latency and copy log";
  Pair x = Setup(128 * kKiB, 1);
  ASSERT_NE(x.peer, nullptr);
  auto& [a, b, dev, src, remote, peer] = x;
  auto c = Make({"node-c", 33, {"c0"}, "", Config()});
  ASSERT_TRUE(c);
  std::vector<uint8_t> c_mem(64 * kKiB, 0);
  Register(*c, 9, c_mem.data(), c_mem.size());
  Peer* to_c = AddPeer(*a, *c);
  ASSERT_NE(to_c, nullptr);
  std::vector<uint8_t> host(64 * kKiB, 0x5c);
  Register(*a, 2, host.data(), host.size());
  ASSERT_TRUE(Transfer(*a, to_c, {Op(KVB_OP_WRITE, 2, host.data(), 4096, 9, 0)}).ok());
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, dev->data(), 4096, 9, 0)}).ok());

  Request* r = PostUnderSlowCopies(x, KVB_OP_WRITE, 800, NowNs() + 100 * 1000000ull);
  ASSERT_NE(r, nullptr);
  std::this_thread::sleep_for(std::chrono::milliseconds(150));  // past the deadline
  // The instance is not held: host transfers to c and to b complete while the copies run.
  const uint64_t t1 = NowNs();
  EXPECT_TRUE(Transfer(*a, to_c, {Op(KVB_OP_WRITE, 2, host.data(), host.size(), 9, 0)}).ok());
  EXPECT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 2, host.data(), 4096, 9, 8192)}).ok());
  EXPECT_LT(NowNs() - t1, 300 * 1000000ull) << "a transfer waited for another request's copy";
  EXPECT_EQ(c_mem, host);
  EXPECT_EQ(a->t->Poll(r, {}).code(), KVB_IN_PROGRESS) << "final while its copies still ran";
  const sdk::Status st = Wait(*a, r);
  const uint64_t final_ns = NowNs();
  EXPECT_EQ(st.code(), KVB_ERR_DEADLINE_EXCEEDED) << st.message();
  ExpectCopiesEndedBy(final_ns, "the request was final");
  Fake().set_latency_us(0);
  // Its bounce buffers came back, and the peer's staged transfers go on.
  EXPECT_EQ(a->t->Counters().staging_buffers_busy, 0u);
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, dev->data(), dev->size(), 9, 0)}).ok());
  EXPECT_EQ(std::vector<uint8_t>(remote.begin(), remote.begin() + dev->size()), src);
}

TEST_F(VerbsStagingTest, ARailFailingMidTransferRetriesFromTheSameBounceBuffers) {
  const auto cfg = Config({{"verbs.stripe_min_bytes", "65536"},
                           {"verbs.max_outstanding_wr", "2"},
                           {"verbs.rail_retry_ms", "0"},
                           {"verbs.staging_buffers", "8"}});
  constexpr size_t kLen = 1 << 20;
  Pair x = Setup(kLen, 11, cfg, {"a0", "a1"}, {"b0", "b1"});
  ASSERT_NE(x.peer, nullptr);
  auto& [a, b, dev, src, remote, peer] = x;
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, dev->data(), 4096, 9, 0)}).ok());
  std::fill(remote.begin(), remote.end(), 0);
  fabric_.FailNextWrs("a0", WcStatus::kRetryExcErr);
  sdk::Status st = Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, dev->data(), kLen, 9, 0)});
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(remote, src);
  const VerbsCounters c = a->t->Counters();
  EXPECT_GE(c.rails_failed, 1u);
  EXPECT_GE(c.wrs_retried, 1u);
  EXPECT_EQ(c.staging_copies, 1u + 16u) << "a retried slice was copied from the device again";

  // Now the other rail fails under a READ (a0 has come back: rail_retry_ms 0).
  fabric_.FailNextWrs("a1", WcStatus::kRetryExcErr);
  st = ReadAllBack(x);
  EXPECT_TRUE(st.ok()) << st.message();
}

// The first staged op to a peer makes its ring; pinned memory the host refuses fails that post
// (nothing queued), naming the keys that size the ring, and the peer's host-memory ops go on.
TEST_F(VerbsStagingTest, ARingThatCannotBeAllocatedFailsThePostNamingItsKeys) {
  if (RealCuda()) GTEST_SKIP() << "would ask the real driver for 2 TiB of pinned memory";
  const auto cfg =
      Config({{"verbs.staging_buffer_bytes", "2147483648"}, {"verbs.staging_buffers", "1024"}});
  Pair x = Setup(64 * kKiB, 1, cfg);
  ASSERT_NE(x.peer, nullptr);
  auto& [a, b, dev, src, remote, peer] = x;
  Request* r = nullptr;
  const sdk::Status st = Post(*a, peer, {Op(KVB_OP_WRITE, 1, dev->data(), 4096, 9, 0)}, 0, 0, &r);
  ASSERT_FALSE(st.ok());
  EXPECT_HAS(st.message(), "verbs.staging_buffers x verbs.staging_buffer_bytes");
  EXPECT_HAS(st.message(), "2199023255552 bytes of pinned memory");
  EXPECT_EQ(a->t->Counters().staging_rings, 0u);
  std::vector<uint8_t> host(4096, 3);
  Register(*a, 2, host.data(), host.size());
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 2, host.data(), 4096, 9, 0)}).ok());
  EXPECT_EQ(remote[0], 3);
}

// A device the driver refuses a copy queue on fails each op that needs one, naming the device
// and the CUDA error, for a WRITE (copy in) and a READ (copy out); their buffers come back.
TEST_F(VerbsStagingTest, ACopyQueueThatCannotBeMadeFailsTheOpNamingTheDevice) {
  if (RealCuda()) GTEST_SKIP() << "needs the fake driver's device count";
  Pair x = Setup(64 * kKiB, 1);
  ASSERT_NE(x.peer, nullptr);
  auto& [a, b, dev, src, remote, peer] = x;
  // The same memory registered as device 7's: the fake driver has two devices.
  ASSERT_TRUE(TryRegister(*a, 2, dev->data(), dev->size(), KVB_MEM_CUDA, 7).ok());
  for (uint32_t opcode : {KVB_OP_WRITE, KVB_OP_READ}) {
    const sdk::Status st = Transfer(*a, peer, {Op(opcode, 2, dev->data(), dev->size(), 9, 0)});
    EXPECT_FALSE(st.ok()) << opcode;
    EXPECT_HAS(st.message(), "CUDA device 7");
    EXPECT_HAS(st.message(), "INVALID_DEVICE");
  }
  EXPECT_EQ(remote, std::vector<uint8_t>(remote.size(), 0)) << "a failed WRITE landed";
  // Their buffers are free again: a WRITE from device 0 goes through.
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, dev->data(), dev->size(), 9, 0)}).ok());
  EXPECT_EQ(remote, src);
}

TEST_F(VerbsStagingTest, TheRingGoesWithItsPeer) {
  Pair x = Setup(128 * kKiB, 1);
  ASSERT_NE(x.peer, nullptr);
  auto& [a, b, dev, src, remote, peer] = x;
  const size_t mrs = fabric_.LiveMrs("a0");
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_WRITE, 1, dev->data(), dev->size(), 9, 0)}).ok());
  EXPECT_EQ(fabric_.LiveMrs("a0"), mrs + 1);
  a->t->RemovePeer(peer);
  EXPECT_EQ(fabric_.LiveMrs("a0"), mrs) << "the ring's MR outlived its peer";
  // A new peer gets a new ring, and deregistering the staged region is clean.
  peer = AddPeer(*a, *x.b);
  ASSERT_TRUE(Transfer(*a, peer, {Op(KVB_OP_READ, 1, dev->data(), dev->size(), 9, 0)}).ok());
  EXPECT_EQ(a->t->Counters().staging_rings, 2u);
  EXPECT_TRUE(a->t->DeregisterMemory(1).ok());
  const sdk::Status st = Transfer(*a, peer, {Op(KVB_OP_READ, 1, dev->data(), 4096, 9, 0)});
  EXPECT_EQ(st.code(), KVB_ERR_NOT_REGISTERED) << st.message();
}

// Removing a peer while a failed request's device copies run (a READ's, buffer -> device):
// remove_peer returns once they ended (the ring and its copy queues go with the peer), with the
// request final and its ring's MR gone.
TEST_F(VerbsStagingTest, RemovingAPeerWaitsForItsFailedRequestsCopies) {
  if (RealCuda()) GTEST_SKIP() << "needs the fake CUDA driver's copy latency and copy log";
  Pair x = Setup(128 * kKiB, 1);
  ASSERT_NE(x.peer, nullptr);
  auto& [a, b, dev, src, remote, peer] = x;
  const size_t mrs = fabric_.LiveMrs("a0");
  Request* r = PostUnderSlowCopies(x, KVB_OP_READ, 400, NowNs() + 50 * 1000000ull);
  ASSERT_NE(r, nullptr);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // failed, copies running
  EXPECT_EQ(a->t->Poll(r, {}).code(), KVB_IN_PROGRESS);
  a->t->RemovePeer(peer);
  const uint64_t removed = NowNs();
  ExpectCopiesEndedBy(removed, "remove_peer returned");
  EXPECT_EQ(a->t->Poll(r, {}).code(), KVB_ERR_DEADLINE_EXCEEDED);
  a->t->Release(r);
  EXPECT_EQ(fabric_.LiveMrs("a0"), mrs) << "the ring's MR outlived its peer";
  Fake().set_latency_us(0);
}

// Destroying the transport while a request's device copies run (a WRITE's, device -> buffer,
// never released by its caller): destroy fails the request and returns only once the copies
// ended, freeing the request and the ring's MR with the instance.
TEST_F(VerbsStagingTest, DestroyingTheTransportWaitsForRunningCopies) {
  if (RealCuda()) GTEST_SKIP() << "needs the fake CUDA driver's copy latency and copy log";
  Pair x = Setup(128 * kKiB, 1);
  ASSERT_NE(x.peer, nullptr);
  auto& [a, b, dev, src, remote, peer] = x;
  const size_t mrs_before_ring = fabric_.LiveMrs("a0");
  Request* r = PostUnderSlowCopies(x, KVB_OP_WRITE, 400, 0);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(a->t->Poll(r, {}).code(), KVB_IN_PROGRESS);
  EXPECT_EQ(fabric_.LiveMrs("a0"), mrs_before_ring + 1) << "no ring was made";
  a->t.reset();
  ExpectCopiesEndedBy(NowNs(), "destroy returned");
  EXPECT_EQ(fabric_.LiveMrs("a0"), 0u) << "an MR outlived its transport";
  EXPECT_EQ(std::vector<uint8_t>(remote.begin(), remote.begin() + dev->size()),
            std::vector<uint8_t>(dev->size(), 0))
      << "a slice was sent after destroy failed its request";
  Fake().set_latency_us(0);
}

}  // namespace
}  // namespace kvbridge::verbs

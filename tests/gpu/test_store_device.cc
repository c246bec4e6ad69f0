// StoreDevice.*: the store client with CUDA buffers (kvbridge/store.h RegisterBuffer(kCuda),
// docs/store.md "Device buffers") in an embedded cluster, against the fake CUDA driver
// (tests/fakes/fake_cuda.cc) with guarded device memory: the "device" pages are PROT_NONE at
// the addresses kvbridge sees, so a CPU read or write of them by kvbridge (a checksum taken in
// place, a memcpy) kills the test; only the driver's copies reach the bytes. The tests check
// bytes through the fake's read-write view of the same pages.
// StoreDeviceNoDriver.*: without a loadable driver, a CUDA buffer is a named UNAVAILABLE.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvbridge/store.h"
#include "tests/common/test_util.h"
#include "tests/gpu/fake_cuda_env.h"

namespace kvbridge {
namespace {

using testing::Buffer;
using testing::Fake;
using testing::Must;
using testing::PatternByte;

#define EXPECT_HAS(s, sub) EXPECT_NE(std::string(s).find(sub), std::string::npos) << (s)

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;

using DevMem = testing::FakeDeviceMemory;

void Fill(uint8_t* p, uint64_t seed, size_t len) {
  for (size_t i = 0; i < len; ++i) p[i] = PatternByte(seed, i);
}
// The first i in [0, len) where p[i] is not PatternByte(seed, pattern_off + i); len if none.
size_t FirstBad(const uint8_t* p, uint64_t seed, size_t len, size_t pattern_off = 0) {
  for (size_t i = 0; i < len; ++i) {
    if (p[i] != PatternByte(seed, pattern_off + i)) return i;
  }
  return len;
}

EmbeddedClusterOptions SmallCluster(uint32_t replicas) {
  EmbeddedClusterOptions o;
  o.nodes = 2;
  o.dram_bytes_per_node = 64 * kMiB;
  o.replica_num = replicas;
  o.node_id_prefix = "devstore";
  o.engine.transports = {"tcp"};
  o.engine.progress_timeout_ms = 2000;
  return o;
}

class StoreDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing::IsSelfChild()) GTEST_SKIP() << "runs in the parent only";
    if (testing::RealCuda()) GTEST_SKIP() << "needs the fake CUDA driver (KVBTEST_REAL_CUDA=1)";
  }
  void TearDown() override {
    if (testing::IsSelfChild() || testing::RealCuda()) return;
    Fake().fail_next_copy(0);
    Fake().fail_next_copy_to_host(0);
  }
  void Start(uint32_t replicas = 1) {
    cluster_ = Must(EmbeddedCluster::Start(SmallCluster(replicas)));
  }
  StoreClient& client() { return cluster_->client(); }
  uint64_t BadReplicas() {
    return Must(QueryClusterStatus(cluster_->master_address())).bad_replicas_total;
  }
  std::unique_ptr<EmbeddedCluster> cluster_;
};

// The guard works: a CPU read of guarded fake device memory kills the process (so the tests
// below would crash if kvbridge read device memory on the CPU).
TEST(StoreDeviceGuard, CpuAccessToDeviceMemoryFaults) {
  if (testing::IsSelfChild() || testing::RealCuda()) GTEST_SKIP() << "fake driver, parent only";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  DevMem dev(4096, 0);
  dev.view()[0] = 42;
  EXPECT_DEATH(
      {
        volatile uint8_t x = *static_cast<volatile uint8_t*>(dev.data());
        (void)x;
      },
      "");
  EXPECT_EQ(dev.view()[0], 42);
}

// Objects put from CUDA buffers (on both fake devices, one split over device and host memory,
// one larger than a half of the bounce buffer) come back byte for byte into other CUDA buffers
// and into host memory.
TEST_F(StoreDevice, PutFromDeviceGetIntoDeviceAndHost) {
  Start(/*replicas=*/2);
  StoreClient& c = client();
  const size_t cap = 12 * kMiB;
  DevMem src0(cap, 0), src1(kMiB, 1), dst(cap, 1);
  Buffer host_src(kMiB), host_dst(cap);
  ASSERT_TRUE(c.RegisterBuffer(src0.data(), cap, MemoryKind::kCuda, -1).ok());  // the pointer's
  ASSERT_TRUE(c.RegisterBuffer(src1.data(), kMiB, MemoryKind::kCuda, 1).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), cap, MemoryKind::kCuda).ok());
  ASSERT_TRUE(c.RegisterBuffer(host_src.data(), kMiB).ok());
  ASSERT_TRUE(c.RegisterBuffer(host_dst.data(), cap).ok());

  // key: (buffers, seed); the object is its buffers' bytes concatenated.
  const std::vector<std::string> keys = {"one-byte", "page", "large", "mixed"};
  const uint64_t large = 5 * kMiB + 7;  // more than one 4 MiB half of the bounce buffer
  Fill(src0.view(), 1, cap);
  Fill(src1.view(), 2, kMiB);
  host_src.Fill(3);
  const std::vector<std::vector<BufferRef>> put = {
      {BufferRef{src0.data(), 1}},
      {BufferRef{src0.data() + 64 * kKiB, 64 * kKiB}},
      {BufferRef{src0.data() + kMiB, large}},
      {BufferRef{src0.data() + 100, 100 * kKiB}, BufferRef{host_src.data(), 50 * kKiB},
       BufferRef{src1.data() + 3, 30 * kKiB + 1}}};
  std::vector<uint8_t> want_mixed;  // the "mixed" object's bytes
  want_mixed.insert(want_mixed.end(), src0.view() + 100, src0.view() + 100 + 100 * kKiB);
  want_mixed.insert(want_mixed.end(), host_src.data(), host_src.data() + 50 * kKiB);
  want_mixed.insert(want_mixed.end(), src1.view() + 3, src1.view() + 3 + 30 * kKiB + 1);

  const uint64_t copies = Fake().copies();
  std::vector<Status> st = c.BatchPutFrom(keys, put);
  for (size_t i = 0; i < keys.size(); ++i)
    ASSERT_TRUE(st[i].ok()) << keys[i] << ": " << st[i].ToString();
  EXPECT_GT(Fake().copies(), copies) << "the device bytes went through the driver";

  auto check = [&](uint8_t* base, const char* what) {
    SCOPED_TRACE(what);
    EXPECT_EQ(base[0], src0.view()[0]);
    EXPECT_EQ(std::memcmp(base + kMiB, src0.view() + 64 * kKiB, 64 * kKiB), 0);
    EXPECT_EQ(std::memcmp(base + 2 * kMiB, src0.view() + kMiB, large), 0);
    EXPECT_EQ(std::memcmp(base + 8 * kMiB, want_mixed.data(), want_mixed.size()), 0);
  };
  auto get_into = [&](uint8_t* base) {
    const std::vector<std::vector<BufferRef>> get = {{BufferRef{base, kMiB}},
                                                     {BufferRef{base + kMiB, kMiB}},
                                                     {BufferRef{base + 2 * kMiB, 6 * kMiB}},
                                                     {BufferRef{base + 8 * kMiB, 4 * kMiB}}};
    return c.BatchGetInto(keys, get);
  };
  std::vector<Result<uint64_t>> got = get_into(dst.data());
  const std::vector<uint64_t> sizes = {1, 64 * kKiB, large, want_mixed.size()};
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << keys[i] << ": " << got[i].status().ToString();
    EXPECT_EQ(got[i].value(), sizes[i]);
  }
  check(dst.view(), "into device memory");
  got = get_into(host_dst.data());
  for (size_t i = 0; i < keys.size(); ++i) ASSERT_TRUE(got[i].ok()) << got[i].status().ToString();
  check(host_dst.data(), "into host memory");
  EXPECT_EQ(BadReplicas(), 0u);
}

TEST_F(StoreDevice, HostPutIntoDevice) {
  Start();
  StoreClient& c = client();
  Buffer src(2 * kMiB);
  DevMem dst(2 * kMiB, 0);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size(), MemoryKind::kCuda, 0).ok());
  src.Fill(7);
  const std::vector<std::string> keys = {"h0", "h1"};
  ASSERT_TRUE(c.Put("h-small", "tiny value").ok());
  std::vector<Status> st = c.BatchPutFrom(
      keys, std::vector<std::vector<BufferRef>>{{BufferRef{src.data(), kMiB}},
                                                {BufferRef{src.data() + kMiB, kMiB - 1}}});
  for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.ToString();
  std::vector<Result<uint64_t>> got =
      c.BatchGetInto(keys, std::vector<std::vector<BufferRef>>{{BufferRef{dst.data() + kMiB, kMiB}},
                                                               {BufferRef{dst.data(), kMiB}}});
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  ASSERT_TRUE(got[1].ok()) << got[1].status().ToString();
  EXPECT_EQ(FirstBad(dst.view() + kMiB, 7, kMiB), kMiB);
  EXPECT_EQ(FirstBad(dst.view(), 7, kMiB - 1, kMiB), kMiB - 1);
  std::string k = "h-small";
  got = c.BatchGetInto(std::span(&k, 1),
                       std::vector<std::vector<BufferRef>>{{BufferRef{dst.data(), 100}}});
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  EXPECT_EQ(std::memcmp(dst.view(), "tiny value", 10), 0);
}

// The first device-to-host copy of a put is the checksum copy of its first key's bytes (the
// transfer starts only after the checksums): that key fails IO_ERROR naming the CUDA error and
// is not stored; the other key of the batch is.
TEST_F(StoreDevice, FailedChecksumCopyFailsOnlyThatPut) {
  Start();
  StoreClient& c = client();
  DevMem src(2 * kMiB, 0);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size(), MemoryKind::kCuda).ok());
  Fill(src.view(), 11, src.size());
  const std::vector<std::string> keys = {"bad", "good"};
  const std::vector<std::vector<BufferRef>> bufs = {{BufferRef{src.data(), kMiB}},
                                                    {BufferRef{src.data() + kMiB, kMiB}}};
  Fake().fail_next_copy_to_host(700);  // CUDA_ERROR_ILLEGAL_ADDRESS
  std::vector<Status> st = c.BatchPutFrom(keys, bufs);
  EXPECT_EQ(st[0].code(), StatusCode::kIoError) << st[0].ToString();
  EXPECT_HAS(st[0].message(), "ILLEGAL_ADDRESS");
  EXPECT_HAS(st[0].message(), "bounce buffer");
  EXPECT_HAS(st[0].message(), "not stored");
  EXPECT_TRUE(st[1].ok()) << st[1].ToString();
  EXPECT_EQ(Must(c.BatchExists(keys)), (std::vector<bool>{false, true}));
  const ClusterStatus cs = Must(QueryClusterStatus(cluster_->master_address()));
  EXPECT_EQ(cs.objects, 1u);
  EXPECT_EQ(cs.pending_puts, 0u) << "the failed key's put was not ended";
  // Nothing is stuck: the key goes in on the next try and reads back right.
  st = c.BatchPutFrom(keys, bufs);
  for (const Status& s : st) ASSERT_TRUE(s.ok()) << s.ToString();
  Buffer back(kMiB);
  ASSERT_TRUE(c.RegisterBuffer(back.data(), back.size()).ok());
  std::string k = "bad";
  auto got = c.BatchGetInto(std::span(&k, 1),
                            std::vector<std::vector<BufferRef>>{{BufferRef{back.data(), kMiB}}});
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  EXPECT_TRUE(back.Matches(11, 0, kMiB, 0));
}

// Gets into CUDA buffers. A failed checksum copy (device to host) fails that key alone, with
// the CUDA error, and is not held against the replica. A failed copy of the transfer itself
// (tcp's staging into the device) fails the key with IO_ERROR, also without reporting the
// replica. Both keys read fine afterwards.
TEST_F(StoreDevice, FailedCopiesOfAGetFailOnlyThatKey) {
  Start();
  StoreClient& c = client();
  Buffer src(2 * kMiB);
  DevMem dst(2 * kMiB, 1);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size(), MemoryKind::kCuda, 1).ok());
  src.Fill(13);
  const std::vector<std::string> keys = {"k0", "k1"};
  for (const Status& s : c.BatchPutFrom(
           keys, std::vector<std::vector<BufferRef>>{{BufferRef{src.data(), kMiB}},
                                                     {BufferRef{src.data() + kMiB, kMiB}}})) {
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  const std::vector<std::vector<BufferRef>> into = {{BufferRef{dst.data(), kMiB}},
                                                    {BufferRef{dst.data() + kMiB, kMiB}}};
  Fake().fail_next_copy_to_host(700);  // the checksum copy of k0's bytes
  std::vector<Result<uint64_t>> got = c.BatchGetInto(keys, into);
  ASSERT_FALSE(got[0].ok());
  EXPECT_EQ(got[0].status().code(), StatusCode::kIoError) << got[0].status().ToString();
  EXPECT_HAS(got[0].status().message(), "ILLEGAL_ADDRESS");
  EXPECT_HAS(got[0].status().message(), "bounce buffer");
  ASSERT_TRUE(got[1].ok()) << got[1].status().ToString();
  EXPECT_EQ(FirstBad(dst.view() + kMiB, 13, kMiB, kMiB), kMiB);

  Fake().fail_next_copy(700);  // the first copy of the get: tcp's staging into the device
  got = c.BatchGetInto(keys, into);
  const int failed = !got[0].ok() + !got[1].ok();
  EXPECT_EQ(failed, 1);
  for (const auto& r : got) {
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kIoError) << r.status().ToString();
    }
  }
  EXPECT_EQ(BadReplicas(), 0u) << "a failed local copy was reported against the replica";
  std::memset(dst.view(), 0, dst.size());
  got = c.BatchGetInto(keys, into);
  for (const auto& r : got) ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(FirstBad(dst.view(), 13, 2 * kMiB), 2 * kMiB);
}

// A replica scribbled over after the put: a get into a CUDA buffer still catches it
// (checksum mismatch, the replica reported), as a get into host memory does.
TEST_F(StoreDevice, ChecksumMismatchIsCaughtForDeviceBuffers) {
  Start();
  StoreClient& c = client();
  DevMem src(kMiB, 0), dst(kMiB, 0);
  Buffer junk(kMiB);
  ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size(), MemoryKind::kCuda).ok());
  ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size(), MemoryKind::kCuda).ok());
  ASSERT_TRUE(c.RegisterBuffer(junk.data(), junk.size()).ok());
  Fill(src.view(), 17, kMiB);
  std::string k = "victim";
  ASSERT_TRUE(c.BatchPutFrom(std::span(&k, 1),
                             std::vector<std::vector<BufferRef>>{{BufferRef{src.data(), kMiB}}})[0]
                  .ok());
  auto info = c.BatchGetReplicaInfo(std::span(&k, 1));
  ASSERT_TRUE(info[0].ok()) << info[0].status().ToString();
  ASSERT_EQ(info[0]->size(), 1u);
  const ReplicaInfo r = info[0]->front();
  // Another writer's bytes land on the replica (through the client's own engine, which knows
  // the node since the put).
  junk.Fill(99);
  TransferOp op{OpCode::kWrite, junk.data(), kMiB, r.node.node_id, r.segment_id, r.offset};
  ASSERT_TRUE(c.engine().Transfer(std::span(&op, 1)).ok());
  auto got = c.BatchGetInto(std::span(&k, 1),
                            std::vector<std::vector<BufferRef>>{{BufferRef{dst.data(), kMiB}}});
  ASSERT_FALSE(got[0].ok());
  EXPECT_EQ(got[0].status().code(), StatusCode::kIoError) << got[0].status().ToString();
  EXPECT_HAS(got[0].status().message(), "checksum mismatch");
  EXPECT_EQ(BadReplicas(), 1u);
}

// Registration of CUDA buffers goes through the engine's memory-kind checks.
TEST_F(StoreDevice, RegistrationChecksTheKind) {
  Start();
  StoreClient& c = client();
  Buffer host(64 * kKiB);
  DevMem dev(64 * kKiB, 1);
  Status st = c.RegisterBuffer(host.data(), host.size(), MemoryKind::kCuda, 0);
  EXPECT_EQ(st.code(), StatusCode::kUnknownMemory) << st.ToString();
  st = c.RegisterBuffer(dev.data(), dev.size(), MemoryKind::kCuda, 0);  // it is device 1's
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  st = c.RegisterBuffer(dev.data(), dev.size());  // device memory as host memory
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_HAS(st.message(), "kCuda");
  st = c.RegisterBuffer(host.data(), host.size(), static_cast<MemoryKind>(7));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_HAS(st.message(), "unknown memory kind 7");
  // None of them was kept: both register fine as what they are, once.
  EXPECT_TRUE(c.RegisterBuffer(host.data(), host.size()).ok());
  EXPECT_TRUE(c.RegisterBuffer(dev.data(), dev.size(), MemoryKind::kCuda, 1).ok());
  EXPECT_EQ(c.RegisterBuffer(dev.data(), dev.size(), MemoryKind::kCuda).code(),
            StatusCode::kAlreadyExists);
  EXPECT_TRUE(c.UnregisterBuffer(dev.data()).ok());
  EXPECT_TRUE(c.UnregisterBuffer(host.data()).ok());
  // kDetect registers each as what it is; the device buffer then takes a put and a get.
  EXPECT_TRUE(c.RegisterBuffer(host.data(), host.size(), MemoryKind::kDetect).ok());
  EXPECT_TRUE(c.RegisterBuffer(dev.data(), dev.size(), MemoryKind::kDetect).ok());
  EXPECT_EQ(c.RegisterBuffer(dev.data(), dev.size(), MemoryKind::kCuda, 1).code(),
            StatusCode::kAlreadyExists);
  Fill(dev.view(), 11, 4096);
  const std::vector<std::string> keys = {"detected"};
  const std::vector<std::vector<BufferRef>> from = {{BufferRef{dev.data(), 4096}}};
  std::vector<Status> put = c.BatchPutFrom(keys, from);
  ASSERT_TRUE(put[0].ok()) << put[0].ToString();
  const std::vector<std::vector<BufferRef>> into = {{BufferRef{host.data(), 4096}}};
  std::vector<Result<uint64_t>> got = c.BatchGetInto(keys, into);
  ASSERT_TRUE(got[0].ok()) << got[0].status().ToString();
  EXPECT_EQ(std::memcmp(host.data(), dev.view(), 4096), 0);
}

// Without a driver: registering a CUDA buffer is UNAVAILABLE naming the driver and why it is
// needed; host buffers work as before. Runs in a child whose KVBRIDGE_CUDA_DRIVER names no
// library.
TEST(StoreDeviceNoDriver, CudaBufferNeedsTheDriver) {
  if (!testing::IsSelfChild()) {
    if (testing::RealCuda()) GTEST_SKIP() << "KVBTEST_REAL_CUDA=1";
    std::string out;
    EXPECT_EQ(testing::RunSelf("StoreDeviceNoDriver.CudaBufferNeedsTheDriver",
                               {{"KVBRIDGE_CUDA_DRIVER", "/nonexistent/libcuda.so.1"}}, &out),
              0)
        << out;
    return;
  }
  auto cluster = Must(EmbeddedCluster::Start(SmallCluster(1)));
  StoreClient& c = cluster->client();
  Buffer m(64 * kKiB);
  const Status st = c.RegisterBuffer(m.data(), m.size(), MemoryKind::kCuda, 0);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  EXPECT_HAS(st.message(), "CUDA device buffer needs the CUDA driver");
  EXPECT_HAS(st.message(), "/nonexistent/libcuda.so.1");
  ASSERT_TRUE(c.RegisterBuffer(m.data(), m.size()).ok());
  m.Fill(5);
  std::string k = "host";
  ASSERT_TRUE(c.BatchPutFrom(std::span(&k, 1), std::vector<std::vector<BufferRef>>{{BufferRef{
                                                   m.data(), m.size()}}})[0]
                  .ok());
  EXPECT_EQ(Must(c.Get("host")).size(), m.size());
}

}  // namespace
}  // namespace kvbridge

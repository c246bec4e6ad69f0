// TcpDevice.*: CUDA regions through the tcp transport's pinned staging (plugins/transport_tcp,
// README.md "Device memory"), end to end through two engines on loopback, against the fake CUDA
// driver (tests/fakes/fake_cuda.cc): its "device memory" is host memory it tracks, guarded
// (PROT_NONE where kvbridge sees it, so a CPU access by kvbridge faults), and its copies really
// move bytes, on a worker thread per stream, with latency, stalls and injected errors on
// demand, and a log of every copy (when queued, started, ended). Real-GPU runs:
// benchmarks/gpu_check.sh (KVBRIDGE_REQUIRE_GPU=1).
// TcpDeviceNoDriver.*: with no loadable driver, CUDA memory stays a named UNSUPPORTED.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/cuda_driver.h"
#include "core/descriptor.h"
#include "kvbridge/engine.h"
#include "kvbridge/plugin/transport.h"
#include "tests/common/test_util.h"
#include "tests/gpu/fake_cuda_env.h"
#include "tests/gpu/test_memory.h"

namespace kvbridge {
namespace {

using testing::Fake;
using testing::FakeCopyRecord;
using testing::GuardedAlloc;
using testing::LoopbackOptions;
using testing::Must;
using testing::PatternByte;

#define EXPECT_HAS(s, sub) EXPECT_NE(std::string(s).find(sub), std::string::npos) << (s)

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kStage = 64 * kKiB;  // tcp.staging_slice_bytes in these tests

uint64_t SteadyNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

using testing::GpuRequired;
using testing::Real;
using testing::RealDriver;
using Mem = testing::TestMemory;

using DevMem = testing::FakeDeviceMemory;

void Fill(uint8_t* p, uint64_t seed, size_t len) {
  for (size_t i = 0; i < len; ++i) p[i] = PatternByte(seed, i);
}

std::vector<FakeCopyRecord> CopyLog() {
  std::vector<FakeCopyRecord> log(Fake().copy_log(nullptr, 0));
  log.resize(Fake().copy_log(log.data(), log.size()));
  return log;
}
// Copies of the log whose source (src) or destination (dst) lies in [p, p + len).
std::vector<FakeCopyRecord> CopiesTouching(const uint8_t* p, size_t len, bool src) {
  const auto lo = reinterpret_cast<uint64_t>(p);
  std::vector<FakeCopyRecord> out;
  for (const auto& r : CopyLog()) {
    const uint64_t a = src ? r.src : r.dst;
    if (a >= lo && a < lo + len) out.push_back(r);
  }
  std::sort(out.begin(), out.end(), [&](const auto& x, const auto& y) {
    return (src ? x.src : x.dst) < (src ? y.src : y.dst);
  });
  return out;
}

EngineOptions Options(const std::string& node, std::map<std::string, std::string> extra = {}) {
  EngineOptions o = LoopbackOptions("tcp", node);
  o.plugin_config["tcp.staging_slice_bytes"] = std::to_string(kStage);
  o.plugin_config["tcp.staging_buffers"] = "4";
  for (auto& [k, v] : extra) o.plugin_config[k] = v;
  return o;
}

class TcpDevice : public ::testing::Test {
 public:
  Status Xfer(OpCode op, void* local, uint64_t len, SegmentId seg, uint64_t off,
              uint32_t deadline_ms = 20000) {
    return a_->Transfer(std::vector{TransferOp{op, local, len, "dev-b", seg, off}},
                        SubmitOptions{deadline_ms, 0});
  }

 protected:
  void SetUp() override {
    if (testing::IsSelfChild()) GTEST_SKIP() << "runs in the parent only";
    if (testing::RealCuda()) GTEST_SKIP() << "needs the fake CUDA driver (KVBTEST_REAL_CUDA=1)";
    Fake().set_latency_us(0);
    Fake().set_stall(0);
  }
  void TearDown() override {
    if (testing::IsSelfChild() || testing::RealCuda()) return;
    Fake().set_latency_us(0);
    Fake().set_stall(0);
    Fake().fail_next_copy(0);
  }
  // Engines a and b; `extra` goes to both.
  void Start(std::map<std::string, std::string> extra = {}) {
    a_ = Must(TransferEngine::Create(Options("dev-a", extra)));
    b_ = Must(TransferEngine::Create(Options("dev-b", extra)));
  }
  SegmentId RegA(void* p, size_t n, MemoryKind k) { return Must(a_->RegisterMemory(p, n, k, 0)); }
  SegmentId RegB(void* p, size_t n, MemoryKind k) { return Must(b_->RegisterMemory(p, n, k, 0)); }
  void Connect() { Must(a_->AddPeer(b_->LocalDescriptor())); }

  std::unique_ptr<TransferEngine> a_, b_;
};

// TcpDeviceData.*: moving and verifying bytes, nothing that needs the fake's knobs; with
// KVBTEST_REAL_CUDA=1 they run on real device memory (benchmarks/gpu_check.sh), failing rather
// than skipping without a GPU when KVBRIDGE_REQUIRE_GPU=1.
class TcpDeviceData : public TcpDevice {
 protected:
  void SetUp() override {
    if (testing::IsSelfChild()) GTEST_SKIP() << "runs in the parent only";
    if (testing::RealCuda()) {
      std::string why;
      if (Real(&why) == nullptr) {
        if (GpuRequired()) FAIL() << "KVBRIDGE_REQUIRE_GPU is set: " << why;
        GTEST_SKIP() << "no usable CUDA driver: " << why;
      }
    }
  }
  void TearDown() override {}
  SegmentId Reg(TransferEngine& e, const Mem& m) {
    return Must(e.RegisterMemory(m.data(), m.size(), m.kind(), m.device()));
  }
  // The device for b's memory: 1 where there is a second one (the fake has two).
  int OtherDevice() const {
    std::string why;
    return !testing::RealCuda() ? 1 : Real(&why)->devices > 1 ? 1 : 0;
  }
  // WRITE local -> remote and READ it back, at every size of kSizes.
  void RoundTrip(Mem& local, Mem& remote, SegmentId seg, const char* what);
};

// Sizes from one byte to several MiB, none a multiple of the staging slice except one.
const std::vector<uint64_t> kSizes = {1, 4095, kStage - 1, kStage, kStage + 1, 3 * kMiB + 12345};

void TcpDeviceData::RoundTrip(Mem& local, Mem& remote, SegmentId seg, const char* what) {
  for (uint64_t n : kSizes) {
    SCOPED_TRACE(std::string(what) + ", " + std::to_string(n) + " bytes");
    const uint64_t seed = n * 7 + 1;
    local.Fill(seed, 0, n);
    remote.Zero();
    ASSERT_TRUE(Xfer(OpCode::kWrite, local.data(), n, seg, 0).ok());
    EXPECT_EQ(remote.FirstBad(seed, 0, n), n);
    EXPECT_EQ(remote.Get(n, 1)[0], 0) << "wrote past the op";
    local.Zero();
    remote.Fill(seed + 1, 0, n);
    ASSERT_TRUE(Xfer(OpCode::kRead, local.data(), n, seg, 0).ok());
    EXPECT_EQ(local.FirstBad(seed + 1, 0, n), n);
    EXPECT_EQ(local.Get(n, 1)[0], 0) << "read past the op";
  }
}

TEST_F(TcpDeviceData, DeviceToHostAndBack) {
  Start();
  const size_t cap = 4 * kMiB;
  Mem dev(MemoryKind::kCuda, cap), host(MemoryKind::kHost, cap);
  Reg(*a_, dev);
  const SegmentId seg = Reg(*b_, host);
  Connect();
  const uint64_t copies = testing::RealCuda() ? 0 : Fake().copies();
  RoundTrip(dev, host, seg, "local device, remote host");
  if (!testing::RealCuda()) {
    EXPECT_GT(Fake().copies(), copies + 2 * kSizes.size()) << "the bytes went through the driver";
  }
  // The stats say how: one staged region here, every byte of it copied, nothing on b's side.
  uint64_t moved = 0;
  for (uint64_t n : kSizes) moved += 2 * n;
  const TransportStats sa = Must(a_->GetTransportStats("tcp"));
  EXPECT_EQ(sa.device_regions_staged, 1u);
  EXPECT_EQ(sa.device_regions_direct, 0u);
  EXPECT_GE(sa.device_bytes_staged, moved);
  EXPECT_EQ(Must(b_->GetTransportStats("tcp")).device_bytes_staged, 0u);
}

TEST_F(TcpDeviceData, HostToRemoteDeviceAndBack) {
  Start();
  const size_t cap = 4 * kMiB;
  Mem host(MemoryKind::kHost, cap), dev(MemoryKind::kCuda, cap, OtherDevice());
  Reg(*a_, host);
  const SegmentId seg = Reg(*b_, dev);
  Connect();
  RoundTrip(host, dev, seg, "local host, remote device");
  // The serving side stages: its copies count there.
  uint64_t moved = 0;
  for (uint64_t n : kSizes) moved += 2 * n;
  EXPECT_EQ(Must(a_->GetTransportStats("tcp")).device_bytes_staged, 0u);
  const TransportStats sb = Must(b_->GetTransportStats("tcp"));
  EXPECT_EQ(sb.device_regions_staged, 1u);
  EXPECT_GE(sb.device_bytes_staged, moved);
}

TEST_F(TcpDeviceData, DeviceToDevice) {
  Start();
  const size_t cap = 4 * kMiB;
  Mem local(MemoryKind::kCuda, cap), remote(MemoryKind::kCuda, cap, OtherDevice());
  Reg(*a_, local);
  const SegmentId seg = Reg(*b_, remote);
  Connect();
  RoundTrip(local, remote, seg, "device to device");
}

#ifdef KVBTEST_HAVE_UCX
// With transports {tcp, ucx}: a ucx instance whose UCX moves CUDA memory here declares CUDA_MEM
// and CUDA_DIRECT (ABI 1.3 instance caps), takes device regions and carries their ops although
// tcp is preferred; one whose UCX cannot (Debian's, or any UCX on a machine without a GPU, so
// always against the fake driver) declares neither, holds no key for device regions, and their
// ops are staged over tcp. Host regions are registered with both either way.
TEST_F(TcpDeviceData, DeviceMemoryGoesDirectOverUcxWhereItCanElseStagedOverTcp) {
  auto opts = [](const std::string& node) {
    EngineOptions o = Options(node);
    o.transports = {"tcp", "ucx"};
    return o;
  };
  auto a = TransferEngine::Create(opts("dev-a"));
  if (!a.ok()) GTEST_SKIP() << "tcp + ucx not usable here: " << a.status().ToString();
  a_ = std::move(a).value();
  b_ = Must(TransferEngine::Create(opts("dev-b")));
  const core::Descriptor before = Must(core::DecodeDescriptor(a_->LocalDescriptor()));
  uint64_t ucx_caps = 0;
  for (const auto& t : before.transports) {
    if (t.name == "ucx") ucx_caps = t.caps;
  }
  ASSERT_NE(ucx_caps & KVB_TCAP_HOST_MEM, 0u);
  const bool direct = (ucx_caps & KVB_TCAP_CUDA_MEM) != 0;
  EXPECT_EQ(direct, (ucx_caps & KVB_TCAP_CUDA_DIRECT) != 0);
  if (!testing::RealCuda()) {
    EXPECT_FALSE(direct) << "UCX saw the fake driver's memory as CUDA";
  }
  // benchmarks/gpu_check.sh, stage ucx-device: a CUDA-enabled UCX on a GPU must take the region.
  const char* need = std::getenv("KVBTEST_REQUIRE_UCX_CUDA");
  if (need != nullptr && std::string(need) == "1") {
    ASSERT_TRUE(direct) << "KVBTEST_REQUIRE_UCX_CUDA=1 but the ucx instance has no CUDA_MEM "
                           "(caps 0x"
                        << std::hex << ucx_caps << ")";
  }

  const size_t cap = 4 * kMiB;
  Mem dev(MemoryKind::kCuda, cap), host(MemoryKind::kHost, cap);
  const SegmentId dev_seg = Reg(*a_, dev);
  const SegmentId host_seg = Reg(*b_, host);
  for (const auto& s : Must(core::DecodeDescriptor(a_->LocalDescriptor())).segments) {
    if (s.id != dev_seg) continue;
    EXPECT_EQ(s.rkeys.count("ucx"), direct ? 1u : 0u);
    EXPECT_EQ(s.rkeys.count("tcp"), 1u);
  }
  for (const auto& s : Must(core::DecodeDescriptor(b_->LocalDescriptor())).segments) {
    if (s.id == host_seg) EXPECT_EQ(s.rkeys.size(), 2u) << "host memory is on both transports";
  }
  Connect();
  RoundTrip(dev, host, host_seg, direct ? "device over ucx" : "device staged over tcp");
  const std::optional<PeerHealth> h = a_->GetPeerHealth("dev-b");
  ASSERT_TRUE(h.has_value());
  ASSERT_EQ(h->paths.size(), 2u);
  for (const PathHealth& p : h->paths) {
    const bool carrier = (p.transport == "ucx") == direct;
    EXPECT_EQ(p.ops_ok > 0, carrier) << p.transport << " carried " << p.ops_ok << " ops";
    EXPECT_EQ(p.ops_failed, 0u) << p.transport;
  }
}
#endif

TEST_F(TcpDeviceData, ManyOpsPerBatch) {
  Start();
  const size_t cap = 8 * kMiB;
  Mem local(MemoryKind::kCuda, cap), remote(MemoryKind::kCuda, cap);
  Mem host_remote(MemoryKind::kHost, cap);
  Reg(*a_, local);
  const SegmentId dseg = Reg(*b_, remote);
  const SegmentId hseg = Reg(*b_, host_remote);
  Connect();
  // 300 ops of assorted sizes, each to its own place, alternately to device and host memory.
  std::vector<std::pair<uint64_t, uint64_t>> spans;  // (offset, length)
  uint64_t off = 0;
  for (int i = 0; off < cap / 2 && i < 300; ++i) {
    const uint64_t n = std::min<uint64_t>(1 + (i * 7919) % (3 * kStage), cap / 2 - off);
    spans.push_back({off, n});
    off += n;
  }
  local.Fill(42, 0, cap / 2);
  remote.Zero();
  std::vector<TransferOp> ops;
  for (size_t i = 0; i < spans.size(); ++i) {
    auto [o, n] = spans[i];
    ops.push_back({OpCode::kWrite, local.data() + o, n, "dev-b", i % 2 ? hseg : dseg, o});
  }
  BatchResult r = a_->Wait(Must(a_->Submit(ops, SubmitOptions{30000, 0})));
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  const std::vector<uint8_t> want = local.Get(0, off);
  const std::vector<uint8_t> dev_got = remote.Get(0, off);
  const std::vector<uint8_t> host_got = host_remote.Get(0, off);
  for (size_t i = 0; i < spans.size(); ++i) {
    auto [o, n] = spans[i];
    const std::vector<uint8_t>& got = i % 2 ? host_got : dev_got;
    ASSERT_EQ(std::memcmp(got.data() + o, want.data() + o, n), 0) << "op " << i;
  }
  // And back, as READs into the other half of local device memory.
  ops.clear();
  for (size_t i = 0; i < spans.size(); ++i) {
    auto [o, n] = spans[i];
    ops.push_back({OpCode::kRead, local.data() + cap / 2 + o, n, "dev-b", i % 2 ? hseg : dseg, o});
  }
  r = a_->Wait(Must(a_->Submit(ops, SubmitOptions{30000, 0})));
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(local.Get(cap / 2, off), want);
}

// A device copy that fails ends its op with IO naming the CUDA error; the other ops of the
// batch, and later batches, are untouched.
TEST_F(TcpDevice, FailedLocalCopyFailsOnlyItsOp) {
  Start({{"tcp.lanes_per_peer", "1"}});
  const size_t cap = kMiB;
  DevMem local(cap);
  testing::Buffer remote(cap);
  RegA(local.data(), cap, MemoryKind::kCuda);
  const SegmentId seg = RegB(remote.data(), cap, MemoryKind::kHost);
  Connect();
  Fill(local.view(), 5, cap);
  Fake().fail_next_copy(700);  // CUDA_ERROR_ILLEGAL_ADDRESS: the first copy queued fails
  std::vector<TransferOp> ops;
  for (int i = 0; i < 4; ++i) {
    ops.push_back({OpCode::kWrite, local.data() + i * kStage, kStage, "dev-b", seg, i * kStage});
  }
  BatchResult r = a_->Wait(Must(a_->Submit(ops, SubmitOptions{10000, 0})));
  EXPECT_EQ(r.status.code(), StatusCode::kIoError) << r.status.ToString();
  EXPECT_HAS(r.status.message(), "ILLEGAL_ADDRESS");
  EXPECT_HAS(r.status.message(), "device -> staging");
  int failed = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (!r.op_status[i].ok()) {
      ++failed;
      EXPECT_EQ(r.op_status[i].code(), StatusCode::kIoError);
      continue;
    }
    EXPECT_EQ(std::memcmp(remote.data() + i * kStage, local.view() + i * kStage, kStage), 0);
  }
  EXPECT_EQ(failed, 1);
  // READ side: the pinned -> device copy fails.
  Fake().fail_next_copy(700);
  EXPECT_EQ(Xfer(OpCode::kRead, local.data(), kStage, seg, 0).code(), StatusCode::kIoError);
  // Nothing else was lost: the same lane carries the next transfers.
  std::memset(remote.data(), 0, cap);
  ASSERT_TRUE(Xfer(OpCode::kWrite, local.data(), cap, seg, 0).ok());
  EXPECT_EQ(std::memcmp(remote.data(), local.view(), cap), 0);
}

TEST_F(TcpDevice, FailedRemoteCopyIsANamedError) {
  Start();
  const size_t cap = kMiB;
  testing::Buffer local(cap);
  DevMem remote(cap);
  RegA(local.data(), cap, MemoryKind::kHost);
  const SegmentId seg = RegB(remote.data(), cap, MemoryKind::kCuda);
  Connect();
  local.Fill(9);
  Fake().fail_next_copy(700);  // the server's pinned -> device copy
  Status st = Xfer(OpCode::kWrite, local.data(), 3 * kStage + 5, seg, 0);
  EXPECT_EQ(st.code(), StatusCode::kIoError) << st.ToString();
  EXPECT_HAS(st.message(), "could not copy");
  Fake().fail_next_copy(700);  // the server's device -> pinned copy
  st = Xfer(OpCode::kRead, local.data(), 1000, seg, 0);
  EXPECT_EQ(st.code(), StatusCode::kIoError) << st.ToString();
  // The connection stays usable.
  ASSERT_TRUE(Xfer(OpCode::kWrite, local.data(), cap, seg, 0).ok());
  EXPECT_EQ(std::memcmp(remote.view(), local.data(), cap), 0);
}

// Deregistering a device region whose WRITE is being staged cancels the transfer and returns
// only once no copy touches the region: with the copy held (stalled), it waits.
TEST_F(TcpDevice, DeregisterWaitsForACopyInFlight) {
  Start({{"tcp.lanes_per_peer", "1"}});
  const size_t cap = kMiB;
  auto local = std::make_unique<DevMem>(cap);
  testing::Buffer remote(cap);
  const SegmentId lseg = RegA(local->data(), cap, MemoryKind::kCuda);
  const SegmentId seg = RegB(remote.data(), cap, MemoryKind::kHost);
  Connect();
  Fake().clear_copy_log();
  Fake().set_stall(1);
  const BatchId id = Must(
      a_->Submit(std::vector{TransferOp{OpCode::kWrite, local->data(), cap, "dev-b", seg, 0}}));
  const uint64_t until = SteadyNs() + 5000 * 1000000ull;
  while (CopiesTouching(local->data(), cap, true).empty() && SteadyNs() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_FALSE(CopiesTouching(local->data(), cap, true).empty()) << "no staging copy started";
  std::atomic<uint64_t> returned_ns{0};
  std::thread dereg([&] {
    EXPECT_TRUE(a_->DeregisterMemory(lseg).ok());
    returned_ns.store(SteadyNs());
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  EXPECT_EQ(returned_ns.load(), 0u) << "DeregisterMemory returned while a copy read the region";
  Fake().set_stall(0);
  dereg.join();
  for (const auto& c : CopiesTouching(local->data(), cap, true)) {
    EXPECT_NE(c.end_ns, 0u);
    EXPECT_LE(c.end_ns, returned_ns.load()) << "a copy ended after DeregisterMemory returned";
  }
  const BatchResult r = a_->Wait(id);
  EXPECT_EQ(r.status.code(), StatusCode::kCancelled) << r.status.ToString();
  local.reset();  // safe now
  // The engine goes on working.
  testing::Buffer host(cap);
  RegA(host.data(), cap, MemoryKind::kHost);
  host.Fill(3);
  ASSERT_TRUE(Xfer(OpCode::kWrite, host.data(), cap, seg, 0).ok());
  EXPECT_TRUE(host.Matches(3, 0, cap, 0));
}

// A deadline passing while a READ's pinned -> device copies are held ends the batch by its
// deadline... once the copies let go of the memory; the lane stays usable.
TEST_F(TcpDevice, DeadlineWhileStaging) {
  Start({{"tcp.lanes_per_peer", "1"}});
  const size_t cap = kMiB;
  DevMem local(cap);
  testing::Buffer remote(cap);
  RegA(local.data(), cap, MemoryKind::kCuda);
  const SegmentId seg = RegB(remote.data(), cap, MemoryKind::kHost);
  Connect();
  Fake().set_latency_us(100 * 1000);  // 100 ms per copy: 16 slices cannot make 300 ms
  const uint64_t t0 = SteadyNs();
  const Status st = Xfer(OpCode::kRead, local.data(), cap, seg, 0, 300);
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
  EXPECT_LT(SteadyNs() - t0, 1500 * 1000000ull);
  Fake().set_latency_us(0);
  remote.Fill(8);
  ASSERT_TRUE(Xfer(OpCode::kRead, local.data(), cap, seg, 0).ok());
  EXPECT_EQ(std::memcmp(local.view(), remote.data(), cap), 0);
}

// The peer's engine (and its tcp instance) is destroyed in the middle of a device-to-device
// transfer: the transfer ends with a named error, nothing hangs or crashes, and the engine
// keeps working with another peer.
TEST_F(TcpDevice, PeerDestroyedMidTransfer) {
  Start();
  const size_t cap = 8 * kMiB;
  DevMem local(cap);
  auto remote = std::make_unique<DevMem>(cap);
  RegA(local.data(), cap, MemoryKind::kCuda);
  const SegmentId seg = RegB(remote->data(), cap, MemoryKind::kCuda);
  Connect();
  Fill(local.view(), 11, cap);
  Fake().set_latency_us(2000);  // 128 slices x 2 ms on each side: the transfer takes a while
  const BatchId id =
      Must(a_->Submit(std::vector{TransferOp{OpCode::kWrite, local.data(), cap, "dev-b", seg, 0}},
                      SubmitOptions{20000, 0}));
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  b_.reset();  // its server threads wait for their copies, then go
  remote.reset();
  const BatchResult r = a_->Wait(id);
  EXPECT_FALSE(r.status.ok());
  EXPECT_TRUE(r.status.code() == StatusCode::kPeerUnreachable ||
              r.status.code() == StatusCode::kProgressTimeout)
      << r.status.ToString();
  Fake().set_latency_us(0);
  auto c = Must(TransferEngine::Create(Options("dev-b")));  // a new incarnation
  DevMem other(cap);
  const SegmentId cseg = Must(c->RegisterMemory(other.data(), cap, MemoryKind::kCuda, 0));
  Must(a_->AddPeer(c->LocalDescriptor()));
  ASSERT_TRUE(Xfer(OpCode::kWrite, local.data(), cap, cseg, 0).ok());
  EXPECT_EQ(std::memcmp(other.view(), local.view(), cap), 0);
}

// WRITE from device memory: while slice k is on the wire, the copy of slice k+1 is already
// queued and running. The copy of slice k+1 is queued before the copy of slice k ends (so before
// slice k can be sent), and slice k's bytes land in the peer's memory before the copy of slice
// k+1 ends (copies take 60 ms each here).
TEST_F(TcpDevice, WriteStagingOverlapsCopiesWithTheWire) {
  Start({{"tcp.lanes_per_peer", "1"}});
  const size_t n = 6;
  const size_t cap = n * kStage;
  DevMem local(cap);
  testing::Buffer remote(cap);
  RegA(local.data(), cap, MemoryKind::kCuda);
  const SegmentId seg = RegB(remote.data(), cap, MemoryKind::kHost);
  Connect();
  for (size_t i = 0; i < cap; ++i) local.view()[i] = static_cast<uint8_t>(1 + i % 251);
  std::memset(remote.data(), 0, cap);
  std::vector<uint64_t> landed(n, 0);
  std::atomic<bool> stop{false};
  std::thread watch([&] {  // when the last byte of each slice reaches the peer's memory
    while (!stop.load()) {
      for (size_t k = 0; k < n; ++k) {
        if (landed[k] == 0 &&
            std::atomic_ref<uint8_t>(remote.data()[(k + 1) * kStage - 1]).load() != 0) {
          landed[k] = SteadyNs();
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });
  Fake().clear_copy_log();
  Fake().set_latency_us(60 * 1000);  // the watcher sees each slice land, even under load
  const Status st = Xfer(OpCode::kWrite, local.data(), cap, seg, 0);
  stop.store(true);
  watch.join();
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_EQ(std::memcmp(remote.data(), local.view(), cap), 0);
  const auto copies = CopiesTouching(local.data(), cap, /*src=*/true);
  ASSERT_EQ(copies.size(), n);
  for (size_t k = 0; k + 1 < n; ++k) {
    SCOPED_TRACE("slice " + std::to_string(k));
    ASSERT_NE(landed[k], 0u);
    EXPECT_LT(copies[k + 1].queued_ns, copies[k].end_ns) << "copy k+1 queued after copy k ended";
    EXPECT_LT(copies[k].end_ns, landed[k]);  // the slice's bytes went out after its copy
    EXPECT_LT(landed[k], copies[k + 1].end_ns) << "slice k waited for copy k+1";
  }
}

// READ into device memory: the payload of slice k+1 is received while slice k's pinned ->
// device copy runs, so that copy is queued before the previous one ends.
TEST_F(TcpDevice, ReadStagingOverlapsCopiesWithTheWire) {
  Start({{"tcp.lanes_per_peer", "1"}});
  const size_t n = 6;
  const size_t cap = n * kStage;
  DevMem local(cap);
  testing::Buffer remote(cap);
  RegA(local.data(), cap, MemoryKind::kCuda);
  const SegmentId seg = RegB(remote.data(), cap, MemoryKind::kHost);
  Connect();
  remote.Fill(21);
  Fake().clear_copy_log();
  Fake().set_latency_us(60 * 1000);  // long enough for the next slice to arrive under load
  const Status st = Xfer(OpCode::kRead, local.data(), cap, seg, 0);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_EQ(std::memcmp(local.view(), remote.data(), cap), 0);
  const auto copies = CopiesTouching(local.data(), cap, /*src=*/false);
  ASSERT_EQ(copies.size(), n);
  for (size_t k = 0; k + 1 < n; ++k) {
    EXPECT_LT(copies[k + 1].queued_ns, copies[k].end_ns)
        << "slice " << k + 1 << " was received only after slice " << k << "'s copy ended";
  }
}

// The serving side: a WRITE into its device memory is received a staging buffer at a time,
// each buffer's copy running while the next is received.
TEST_F(TcpDevice, ServerStagingOverlapsCopiesWithTheWire) {
  Start({{"tcp.lanes_per_peer", "1"}});
  const size_t n = 8;
  const size_t cap = n * kStage;  // one 512 KiB slice on the wire, 8 staging chunks on b
  testing::Buffer local(cap);
  DevMem remote(cap);
  RegA(local.data(), cap, MemoryKind::kHost);
  const SegmentId seg = RegB(remote.data(), cap, MemoryKind::kCuda);
  Connect();
  local.Fill(33);
  Fake().clear_copy_log();
  Fake().set_latency_us(60 * 1000);  // long enough for the next slice to arrive under load
  const Status st = Xfer(OpCode::kWrite, local.data(), cap, seg, 0);
  ASSERT_TRUE(st.ok()) << st.ToString();
  ASSERT_EQ(std::memcmp(remote.view(), local.data(), cap), 0);
  const auto copies = CopiesTouching(remote.data(), cap, /*src=*/false);
  ASSERT_EQ(copies.size(), n);
  for (size_t k = 0; k + 1 < n; ++k) {
    EXPECT_LT(copies[k + 1].queued_ns, copies[k].end_ns)
        << "chunk " << k + 1 << " was received only after chunk " << k << "'s copy ended";
  }
}

// With tcp taking CUDA memory and a driver present, the engine checks the memory is what kCuda
// says before tcp sees it (core/memory_kinds.h), and keeps the pointer's device for -1.
TEST_F(TcpDevice, EngineChecksCudaMemoryBeforeTcpSeesIt) {
  Start();
  testing::Buffer host(65536);
  auto r = a_->RegisterMemory(host.data(), host.size(), MemoryKind::kCuda, 0);
  EXPECT_EQ(r.status().code(), StatusCode::kUnknownMemory) << r.status().ToString();
  DevMem dev(65536, 1);
  r = a_->RegisterMemory(dev.data(), dev.size(), MemoryKind::kCuda, 0);  // it is device 1's
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
  const SegmentId seg = Must(a_->RegisterMemory(dev.data(), dev.size(), MemoryKind::kCuda, -1));
  // Registered on device 1 (-1: the pointer's): b reads it back through a's staging.
  Fill(dev.view(), 77, dev.size());
  testing::Buffer back(65536);
  Must(b_->RegisterMemory(back.data(), back.size()));
  Must(b_->AddPeer(a_->LocalDescriptor()));
  ASSERT_TRUE(
      b_->Transfer(std::vector{TransferOp{OpCode::kRead, back.data(), 65536, "dev-a", seg, 0}})
          .ok());
  EXPECT_EQ(std::memcmp(back.data(), dev.view(), 65536), 0);
}

TEST_F(TcpDevice, BadStagingOptionsAreNamed) {
  auto r = TransferEngine::Create(Options("dev-x", {{"tcp.staging_buffers", "1"}}));
  ASSERT_FALSE(r.ok());
  EXPECT_HAS(r.status().message(), "tcp.staging_buffers");
  r = TransferEngine::Create(Options("dev-x", {{"tcp.staging_slice_bytes", "12"}}));
  ASSERT_FALSE(r.ok());
  EXPECT_HAS(r.status().message(), "tcp.staging_slice_bytes");
}

// Without a driver (the normal state of a machine without a GPU), tcp does not take CUDA
// memory: registering it is UNSUPPORTED naming CUDA and the missing library, as before tcp
// staged device memory. Runs in a child whose KVBRIDGE_CUDA_DRIVER names no library.
TEST(TcpDeviceNoDriver, CudaMemoryStaysUnsupported) {
  if (!testing::IsSelfChild()) {
    std::string out;
    EXPECT_EQ(testing::RunSelf("TcpDeviceNoDriver.CudaMemoryStaysUnsupported",
                               {{"KVBRIDGE_CUDA_DRIVER", "/nonexistent/libcuda.so.1"}}, &out),
              0)
        << out;
    return;
  }
  auto e = Must(TransferEngine::Create(LoopbackOptions("tcp", "no-driver")));
  testing::Buffer m(4096);
  auto r = e->RegisterMemory(m.data(), m.size(), MemoryKind::kCuda, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported) << r.status().ToString();
  EXPECT_HAS(r.status().message(), "CUDA memory");
  EXPECT_HAS(r.status().message(), "/nonexistent/libcuda.so.1");
  // Host memory is unaffected.
  EXPECT_TRUE(e->RegisterMemory(m.data(), m.size()).ok());
}

}  // namespace
}  // namespace kvbridge

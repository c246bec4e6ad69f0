// Fault tests of what only the ucx transport does (docs/transports/ucx.md), with real processes
// (tests/fault/peer_main.cc) and real UCX: how a killed peer is noticed (pidfd or UCX's error
// handler), a frozen peer against UCX's one-sided cma, a peer that never answers the hello,
// cancel with RMA issued (force close), revoking the grant of a live writer and of one that is
// gone, the same-host ranking, CUDA caps and ucx.* settings.
// The failures every transport shares (a peer killed under load, deadline, BACKPRESSURE,
// restart -> STALE_PEER, bounds, a wrong token) are tests/conformance's TransportFailures and
// TransportConformance and tests/fault's FaultTest, which run ucx in both endpoint modes too.
// Each UcxFaultTest runs in both modes: "same_host" (ucx.same_host=auto: NONE-mode endpoints
// over shared memory and cma, liveness by pidfd) and "net" (ucx.same_host=off: PEER-mode
// endpoints over tcp with UCX's error handling).
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "core/descriptor.h"
#include "core/plugin_host.h"
#include "core/plugin_loader.h"
#include "kvbridge/engine.h"
#include "tests/common/test_util.h"

namespace kvbridge {
namespace {

using testing::Buffer;
using testing::Must;
using testing::PeerProcess;
using Clock = std::chrono::steady_clock;

constexpr size_t kPeerBytes = 64u << 20;
constexpr uint32_t kProgressMs = 500;
constexpr uint32_t kDeadlineMs = 5000;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

class UcxFaultTest : public ::testing::TestWithParam<std::string> {
 protected:
  bool net() const { return GetParam() == "net"; }

  void SetUp() override {
    // The peers read the same setting from their environment (EngineOptions::FromEnv).
    setenv("KVBRIDGE_UCX_SAME_HOST", net() ? "off" : "auto", 1);
    EngineOptions o = EngineOptions::FromEnv();
    o.node_id = "client";
    o.transports = {"ucx"};
    o.default_deadline_ms = kDeadlineMs;
    o.progress_timeout_ms = kProgressMs;
    o.plugin_config["ucx.progress_timeout_ms"] = std::to_string(kProgressMs);
    o.plugin_config["ucx.connect_timeout_ms"] = "1000";
    auto e = TransferEngine::Create(o);
    if (!e.ok()) GTEST_SKIP() << "ucx transport not usable here: " << e.status().ToString();
    engine_ = std::move(e).value();
    local_ = std::make_unique<Buffer>(kPeerBytes);
    Must(engine_->RegisterMemory(local_->data(), local_->size()));
  }

  std::unique_ptr<PeerProcess> StartPeer(const std::string& node, uint64_t seed,
                                         std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--node-id",   node,
                                     "--transport", "ucx",
                                     "--size",      std::to_string(kPeerBytes),
                                     "--seed",      std::to_string(seed)};
    args.insert(args.end(), extra.begin(), extra.end());
    auto p = PeerProcess::Start(args);
    if (!p) ADD_FAILURE() << "could not start peer " << node;
    return p;
  }

  // `peer` must outlive the op (TransferOp holds a view).
  TransferOp Op(OpCode code, std::string_view peer, size_t off, size_t len) {
    return TransferOp{code, local_->data() + off, len, peer, 1, off};  // the peer's one segment
  }

  Status TransferTimed(const std::vector<TransferOp>& ops, double* ms, uint32_t deadline_ms = 0,
                       uint32_t progress_ms = 0) {
    SubmitOptions so;
    so.deadline_ms = deadline_ms;
    so.progress_timeout_ms = progress_ms;
    const auto t0 = Clock::now();
    BatchResult r = engine_->Wait(Must(engine_->Submit(ops, so)));
    *ms = MsSince(t0);
    return r.status;
  }

  std::unique_ptr<TransferEngine> engine_;
  std::unique_ptr<Buffer> local_;
};

// kill -9: PEER_UNREACHABLE within the progress timeout (same host: the pidfd; net: UCX's
// error handler on the reset connection), never a hang, never a success.
TEST_P(UcxFaultTest, KilledPeerIsUnreachableWithinTheProgressTimeout) {
  auto peer = StartPeer("victim", 1);
  ASSERT_TRUE(peer);
  Must(engine_->AddPeer(peer->descriptor()));
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kRead, "victim", 0, 1 << 20)}).ok());
  peer->Kill();
  double ms = 0;
  Status st = TransferTimed({Op(OpCode::kRead, "victim", 0, 4 << 20)}, &ms);
  EXPECT_EQ(st.code(), StatusCode::kPeerUnreachable) << st.ToString();
  EXPECT_LT(ms, kProgressMs + 300) << st.ToString();
}

// SIGSTOP on a connected peer. UCX 1.13's RMA needs the target to progress in both modes (tcp's
// software RMA; on the same host puts stay pending on the shared-memory lane), so the batch
// fails PROGRESS_TIMEOUT long before its deadline. UCX 1.22 on the same host moves RMA with cma
// (process_vm_writev/readv), truly one-sided: the frozen target's memory is written and read
// without it, so the batch succeeds. Over tcp both versions time out. A healthy peer is served
// meanwhile at its usual pace.
TEST_P(UcxFaultTest, FrozenPeerEndsByTheDeadlineAndOthersAreUnaffected) {
  auto healthy = StartPeer("healthy", 1);
  auto frozen = StartPeer("frozen", 2);
  ASSERT_TRUE(healthy && frozen);
  Must(engine_->AddPeer(healthy->descriptor()));
  Must(engine_->AddPeer(frozen->descriptor()));
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kWrite, "frozen", 0, 16 << 20)}).ok());
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kWrite, "healthy", 0, 1 << 20)}).ok());
  frozen->Signal(SIGSTOP);  // returns once /proc shows the process stopped
  std::atomic<bool> done{false};
  Status frozen_st;
  double frozen_ms = 0;
  std::thread t([&] {
    frozen_st = TransferTimed({Op(OpCode::kWrite, "frozen", 0, 32 << 20),
                               Op(OpCode::kRead, "frozen", 32 << 20, 16 << 20)},
                              &frozen_ms, 3000, kProgressMs);
    done = true;
  });
  int healthy_ok = 0;
  double worst_ms = 0;
  for (int i = 0; i < 50; ++i) {
    double ms = 0;
    if (TransferTimed({Op(OpCode::kWrite, "healthy", 48 << 20, 65536)}, &ms).ok()) ++healthy_ok;
    worst_ms = std::max(worst_ms, ms);
  }
  t.join();
  frozen->Signal(SIGCONT);
  EXPECT_EQ(healthy_ok, 50);
  EXPECT_LT(worst_ms, 250) << "a healthy op waited behind the frozen peer";
  EXPECT_LT(frozen_ms, 3000 + 300) << frozen_st.ToString();
  const unsigned minor = testing::LoadedUcxMinor();
  ASSERT_GE(minor, 13u) << "no libucp loaded after the ucx transport ran";
  const char* plugin_path = getenv("KVBRIDGE_PLUGIN_PATH");
  if (plugin_path != nullptr && strstr(plugin_path, "plugins_ucx_pypi") != nullptr) {
    ASSERT_GE(minor, 22u) << "KVBRIDGE_PLUGIN_PATH selects the PyPI build, yet UCX 1." << minor
                          << " is loaded";
  }
  if (!net() && minor >= 22) {
    EXPECT_TRUE(frozen_st.ok()) << "UCX 1." << minor
                                << " same-host RMA is one-sided (cma): " << frozen_st.ToString();
  } else {
    EXPECT_EQ(frozen_st.code(), StatusCode::kProgressTimeout)
        << "UCX 1." << minor << ": " << frozen_st.ToString();
  }
  EXPECT_LT(frozen_ms, 3 * kProgressMs) << "progress timeout, not the deadline";
}

// A frozen peer never answers the hello: PEER_UNREACHABLE after ucx.connect_timeout_ms, and
// not one byte lands (the hello comes before any RMA).
TEST_P(UcxFaultTest, FrozenPeerNeverHelloedIsUnreachableAndUntouched) {
  auto peer = StartPeer("silent", 3);
  ASSERT_TRUE(peer);
  const std::string crc = peer->Command("CRC");
  Must(engine_->AddPeer(peer->descriptor()));
  peer->Signal(SIGSTOP);
  local_->Fill(9, 0, 1 << 20);
  double ms = 0;
  Status st = TransferTimed({Op(OpCode::kWrite, "silent", 0, 1 << 20)}, &ms);
  EXPECT_EQ(st.code(), StatusCode::kPeerUnreachable) << st.ToString();
  EXPECT_GT(ms, 900);
  EXPECT_LT(ms, 1000 + 400);
  peer->Signal(SIGCONT);
  EXPECT_EQ(peer->Command("CRC"), crc) << "bytes landed before the hello";
}

// Cancel returns promptly and the buffer is the caller's again with RMA issued. Net: even to a
// frozen peer (the PEER-mode endpoint is force-closed). Same host: to a live peer (a NONE-mode
// endpoint may not be force-closed, so cancel waits for its issued slices; with the peer
// frozen that wait lasts until it resumes or exits: docs/transports/ucx.md, known limits).
TEST_P(UcxFaultTest, CancelReturnsPromptlyWithRmaIssued) {
  auto peer = StartPeer("cancelled", 5);
  ASSERT_TRUE(peer);
  Must(engine_->AddPeer(peer->descriptor()));
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kRead, "cancelled", 0, 1 << 20)}).ok());
  if (net()) peer->Signal(SIGSTOP);
  SubmitOptions so;
  so.deadline_ms = 20000;
  so.progress_timeout_ms = 10000;
  auto id = Must(engine_->Submit(std::vector{Op(OpCode::kRead, "cancelled", 0, 64 << 20)}, so));
  std::this_thread::sleep_for(std::chrono::milliseconds(net() ? 100 : 5));  // slices issued
  const auto t0 = Clock::now();
  engine_->Cancel(id);
  const double cancel_ms = MsSince(t0);
  std::memset(local_->data(), 0xEE, 64 << 20);
  BatchResult r = engine_->Wait(id);
  if (net()) peer->Signal(SIGCONT);
  EXPECT_LT(cancel_ms, 500) << "cancel blocked";
  EXPECT_TRUE(r.status.ok() || r.status.code() == StatusCode::kCancelled) << r.status.ToString();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  for (size_t i = 0; i < (64u << 20); i += 4093) {
    ASSERT_EQ(local_->data()[i], 0xEE) << "byte " << i << " written after Cancel returned";
  }
  // The peer is still usable afterwards (a fresh endpoint in net mode).
  EXPECT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kRead, "cancelled", 0, 4096)}).ok());
}

// Deregistering a segment revokes the grant of a live holder (the writer) from an endpoint of
// the target's own. That leaves the holder's connection alone: its writes to another segment
// go on over the same connection (no new one, none evicted), and the revoked segment is
// refused, NOT_REGISTERED, with nothing written.
TEST_P(UcxFaultTest, RevokingAGrantLeavesTheHoldersConnectionAlone) {
  Buffer first(1 << 20), second(1 << 20);
  const SegmentId seg1 = Must(engine_->RegisterMemory(first.data(), first.size()));
  const SegmentId seg2 = Must(engine_->RegisterMemory(second.data(), second.size()));
  auto writer = StartPeer("holder", 9);
  ASSERT_TRUE(writer);
  ASSERT_EQ(writer->Command("ADD " + testing::HexEncode(engine_->LocalDescriptor())), "OK");
  ASSERT_EQ(writer->Command("WRITE client " + std::to_string(seg1) + " 4096"), "OK");
  ASSERT_EQ(writer->Command("WRITE client " + std::to_string(seg2) + " 4096"), "OK");
  ASSERT_EQ(writer->Command("CONNS ucx"), "CONNS 1 0");
  const auto t0 = Clock::now();
  ASSERT_TRUE(engine_->DeregisterMemory(seg1).ok());
  EXPECT_LT(MsSince(t0), kProgressMs) << "the live holder's acknowledgement did not come";
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(writer->Command("WRITE client " + std::to_string(seg2) + " 65536"), "OK");
  }
  EXPECT_TRUE(second.Matches(9, 0, 65536, 0));
  std::memset(first.data(), 0, first.size());
  const std::string refused = writer->Command("WRITE client " + std::to_string(seg1) + " 4096");
  EXPECT_NE(refused.find("NOT_REGISTERED"), std::string::npos) << refused;
  EXPECT_EQ(std::count(first.data(), first.data() + first.size(), uint8_t{0}),
            static_cast<ptrdiff_t>(first.size()))
      << "a revoked segment was written";
  EXPECT_EQ(writer->Command("CONNS ucx"), "CONNS 1 0") << "the holder's connection was broken";
  ASSERT_TRUE(engine_->DeregisterMemory(seg2).ok());
}

// Destroying the engine while a peer is frozen and our WRITE to it waits for its completions
// (net: PEER mode; 4 KiB, so the put itself is done and only the flush is outstanding). The
// cancel has nothing to drain, remove_peer closes the endpoint gently, and the peer cannot
// answer: after ucx.cancel_drain_ms the endpoint is force-closed, so destroy returns on time,
// and the peer, resumed, is alive. Same host: NONE-mode endpoints cannot be force-closed, so
// this waits for the peer (docs/transports/ucx.md, Known limits).
TEST_P(UcxFaultTest, DestroyWithAFrozenPeersCompletionsOutstandingReturnsOnTime) {
  if (!net()) GTEST_SKIP() << "same host: closing a frozen peer's endpoint waits for it";
  auto peer = StartPeer("frozen-at-exit", 6);
  ASSERT_TRUE(peer);
  Must(engine_->AddPeer(peer->descriptor()));
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kWrite, "frozen-at-exit", 0, 4096)}).ok());
  peer->Signal(SIGSTOP);
  SubmitOptions so;
  so.deadline_ms = 20000;
  so.progress_timeout_ms = 10000;
  Must(engine_->Submit(std::vector{Op(OpCode::kWrite, "frozen-at-exit", 0, 4096)}, so));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the put is out
  const auto t0 = Clock::now();
  engine_.reset();
  const double ms = MsSince(t0);
  EXPECT_LT(ms, 1500) << "destroy waited on the frozen peer";
  EXPECT_GT(ms, 200) << "the endpoint was not given ucx.cancel_drain_ms to finish";
  peer->Signal(SIGCONT);
  EXPECT_EQ(peer->Command("CRC").rfind("CRC ", 0), 0u) << "the peer did not survive";
}

// A peer reading 64 MiB from us closes its engine mid-read (its cancel lets the GETs it issued
// finish, ucx.cancel_drain_ms, rather than force-closing under our replies), or, on this host,
// is killed mid-read: we, the target, keep serving, and another peer reads from us at once.
// Over tcp (net) a reader killed while our UCX sends it a GET reply aborts this process: UCX's
// software RMA treats a failed reply send as fatal (docs/transports/ucx.md, "Known limits"),
// so net mode has no kill round here.
TEST_P(UcxFaultTest, AReaderKilledMidReadLeavesTheTargetServing) {
  constexpr size_t kLen = 64u << 20;
  Buffer source(kLen);
  source.Fill(5);
  const SegmentId seg = Must(engine_->RegisterMemory(source.data(), source.size()));
  for (int round = 0; round < 4; ++round) {
    auto reader = StartPeer("reader-" + std::to_string(round), 7);
    ASSERT_TRUE(reader);
    ASSERT_EQ(reader->Command("ADD " + testing::HexEncode(engine_->LocalDescriptor())), "OK");
    ASSERT_EQ(reader->Command("READ client " + std::to_string(seg) + " 4096"), "OK");
    // Not waited for: killed, or its engine destroyed, while the 64 MiB READ moves.
    ASSERT_EQ(
        reader->Command("SUBMIT READ client " + std::to_string(seg) + " " + std::to_string(kLen)),
        "OK");
    std::this_thread::sleep_for(std::chrono::milliseconds(5 + 10 * round));
    if (round % 2 == 0 && !net()) {
      reader->Kill();
    } else {
      reader->Command("QUIT", 100);  // no answer: it exits
      EXPECT_EQ(reader->Wait(5000), 0);
    }
  }
  auto other = StartPeer("reader-after", 8);
  ASSERT_TRUE(other);
  ASSERT_EQ(other->Command("ADD " + testing::HexEncode(engine_->LocalDescriptor())), "OK");
  EXPECT_EQ(other->Command("READ client " + std::to_string(seg) + " " + std::to_string(kLen)),
            "OK");
  ASSERT_TRUE(engine_->DeregisterMemory(seg).ok());
}

// A peer that wrote into our memory holds a grant for that segment. Once it is gone (kill -9,
// or its engine closed: its endpoints closed), deregistering the segment returns within about
// the progress timeout (the revocation it can no longer answer), touches no endpoint UCX freed
// with the connection, and the engine serves other peers afterwards.
// In a pid namespace of its own the writer is "another host" to us (its host key differs):
// its death is not seen from here, only through UCX, and the revocation waits out the progress
// timeout.
TEST_P(UcxFaultTest, DeregisteringASegmentWhoseWriterIsGoneReturns) {
  enum class Gone { kKilled, kQuit, kKilledElsewhere };
  for (const Gone how : {Gone::kKilled, Gone::kQuit, Gone::kKilledElsewhere}) {
    const bool kill = how != Gone::kQuit;
    const std::string node = how == Gone::kKilled ? "writer-killed"
                             : how == Gone::kQuit ? "writer-quit"
                                                  : "writer-elsewhere";
    SCOPED_TRACE(node);
    Buffer target(1 << 20);
    const SegmentId seg = Must(engine_->RegisterMemory(target.data(), target.size()));
    std::unique_ptr<PeerProcess> writer;
    if (how == Gone::kKilledElsewhere) {
      // unshare passes SIGKILL on to the writer (--kill-child); it is pid 1 in its namespace.
      writer = PeerProcess::Start({"--node-id", node, "--transport", "ucx", "--size",
                                   std::to_string(kPeerBytes), "--seed", "7"},
                                  {"unshare", "--pid", "--kill-child=SIGKILL"});
    } else {
      writer = StartPeer(node, 7);
    }
    ASSERT_TRUE(writer);
    ASSERT_EQ(writer->Command("ADD " + testing::HexEncode(engine_->LocalDescriptor())), "OK");
    ASSERT_EQ(writer->Command("WRITE client " + std::to_string(seg) + " 65536"), "OK");
    EXPECT_TRUE(target.Matches(7, 0, 65536, 0)) << "the writer's bytes did not land";
    if (kill) {
      writer->Kill();
    } else {
      writer->Command("QUIT", 100);  // no answer: it exits
      EXPECT_EQ(writer->Wait(5000), 0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));  // UCX sees the connection go
    const auto t0 = Clock::now();
    const Status st = engine_->DeregisterMemory(seg);
    EXPECT_TRUE(st.ok()) << st.ToString();
    EXPECT_LT(MsSince(t0), 2 * kProgressMs + 500) << "deregister waited past the progress timeout";
  }
  auto other = StartPeer("after-writers", 3);
  ASSERT_TRUE(other);
  Must(engine_->AddPeer(other->descriptor()));
  const Status st = engine_->Transfer(std::vector{Op(OpCode::kRead, "after-writers", 0, 1 << 20)});
  EXPECT_TRUE(st.ok()) << st.ToString();
  EXPECT_TRUE(local_->Matches(3, 0, 1 << 20, 0));
}

const auto kModes = ::testing::Values("same_host", "net");
auto ModeName = [](const auto& info) { return info.param; };
// Same-host ranking (descriptor version 3): with transports {"tcp", "ucx"}, a peer whose
// descriptor has this process's host key is tried over ucx first (it declares
// KVB_TCAP_LOCAL_SHM); the same peer seen with another host key keeps the local order, tcp first.
TEST(UcxSameHost, APeerOnThisHostIsTriedOverSharedMemoryFirst) {
  auto make = [](const std::string& id) {
    EngineOptions o = testing::LoopbackOptions("tcp", id);
    o.transports = {"tcp", "ucx"};
    return TransferEngine::Create(o);
  };
  auto a = make("rank-a");
  if (!a.ok()) GTEST_SKIP() << "tcp + ucx not usable here: " << a.status().ToString();
  auto far = Must(make("rank-far"));
  auto b = Must(make("rank-b"));
  Buffer mem(1 << 20), remote(1 << 20);
  Must((*a)->RegisterMemory(mem.data(), mem.size()));
  const SegmentId seg = Must(b->RegisterMemory(remote.data(), remote.size()));

  Must((*a)->AddPeer(b->LocalDescriptor()));
  std::optional<PeerHealth> h = (*a)->GetPeerHealth("rank-b");
  ASSERT_TRUE(h && h->paths.size() == 2);
  EXPECT_EQ(h->paths[0].transport, "ucx");
  EXPECT_EQ(h->paths[1].transport, "tcp");
  std::memset(mem.data(), 0x5a, 65536);
  Status st =
      (*a)->Transfer(std::vector{TransferOp{OpCode::kWrite, mem.data(), 65536, "rank-b", seg, 0}});
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(std::memcmp(remote.data(), mem.data(), 65536), 0);
  EXPECT_EQ((*a)->GetPeerHealth("rank-b")->paths[0].ops_ok, 1u) << "the op did not go over ucx";

  core::Descriptor moved = Must(core::DecodeDescriptor(b->LocalDescriptor()));
  moved.host_key = "another-host";
  Must(far->AddPeer(core::EncodeDescriptor(moved)));
  h = far->GetPeerHealth("rank-b");
  ASSERT_TRUE(h && h->paths.size() == 2);
  EXPECT_EQ(h->paths[0].transport, "tcp");
  EXPECT_EQ(h->paths[1].transport, "ucx");
}

// The same-host ranking holds only where ucx reaches the peer through shared memory: with
// ucx.same_host=off, or a ucx.tls without any shared-memory transport, the instance drops
// KVB_TCAP_LOCAL_SHM and a same-host peer keeps the local order (tcp first, the faster path
// then). A tls naming one of them keeps it.
TEST(UcxSameHost, WithoutSharedMemoryUcxIsNotRankedFirst) {
  auto make = [](const std::string& id, const std::string& key, const std::string& value) {
    EngineOptions o = testing::LoopbackOptions("tcp", id);
    o.transports = {"tcp", "ucx"};
    if (!key.empty()) o.plugin_config[key] = value;
    return TransferEngine::Create(o);
  };
  auto b = make("shm-b", "", "");
  if (!b.ok()) GTEST_SKIP() << "tcp + ucx not usable here: " << b.status().ToString();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"ucx.same_host", "off"}, {"ucx.tls", "tcp,self"}, {"ucx.tls", "^sm"}};
  int n = 0;
  for (const auto& [key, value] : cases) {
    auto a = Must(make("shm-a" + std::to_string(n++), key, value));
    Must(a->AddPeer((*b)->LocalDescriptor()));
    const std::optional<PeerHealth> h = a->GetPeerHealth("shm-b");
    ASSERT_TRUE(h && h->paths.size() == 2) << key << "=" << value;
    EXPECT_EQ(h->paths[0].transport, "tcp") << key << "=" << value;
  }
  auto kept = Must(make("shm-a-cma", "ucx.tls", "tcp,cma,self"));
  Must(kept->AddPeer((*b)->LocalDescriptor()));
  EXPECT_EQ(kept->GetPeerHealth("shm-b")->paths.at(0).transport, "ucx");
}

INSTANTIATE_TEST_SUITE_P(Modes, UcxFaultTest, kModes, ModeName);

}  // namespace
}  // namespace kvbridge

namespace kvbridge {
namespace {

// Device memory (ABI 1.3 instance caps): a ucx instance declares CUDA_MEM and CUDA_DIRECT only
// when the loaded UCX lists CUDA among its memory types (a CUDA build on a machine with a GPU);
// elsewhere both are dropped and a CUDA region given to it anyway is UNSUPPORTED (the plugin logs
// the UCX version and what it can move; register_memory carries no message). The engine never
// hands it one: tests/gpu, TcpDeviceData.
TEST(UcxDeviceMemory, WithoutCudaInUcxTheCapsDropItAndARegionIsRefused) {
  auto host = core::PluginHost::Acquire(core::PluginRegistry::DefaultSearchPath(""));
  const core::PluginInfo* ucx = host->registry().Find(KVB_PLUGIN_TRANSPORT, "ucx");
  ASSERT_NE(ucx, nullptr);
  EXPECT_NE(ucx->caps & KVB_TCAP_CUDA_MEM, 0u) << "the descriptor declares what it can do";
  EXPECT_NE(ucx->caps & KVB_TCAP_CUDA_DIRECT, 0u);
  core::TransportConfig config;
  config.node_id = "ucx-dev";
  config.listen = "127.0.0.1:0";
  auto t = Must(host->CreateTransport(*ucx, config));
  if ((t->caps() & KVB_TCAP_CUDA_MEM) != 0) {
    EXPECT_NE(t->caps() & KVB_TCAP_CUDA_DIRECT, 0u);
    GTEST_SKIP() << "this UCX moves CUDA memory here (covered by benchmarks/gpu_check.sh)";
  }
  EXPECT_EQ(t->caps() & KVB_TCAP_CUDA_DIRECT, 0u);
  EXPECT_EQ(t->caps(), ucx->caps & ~(KVB_TCAP_CUDA_MEM | KVB_TCAP_CUDA_DIRECT));
  Buffer mem(1 << 20);
  auto key = t->RegisterMemory(1, mem.data(), mem.size(), KVB_MEM_CUDA, 0);
  ASSERT_FALSE(key.ok());
  EXPECT_EQ(key.status().code(), StatusCode::kUnsupported) << key.status().ToString();
  // Host memory is unaffected.
  Must(t->RegisterMemory(2, mem.data(), mem.size(), KVB_MEM_HOST, -1));
  EXPECT_TRUE(t->DeregisterMemory(2).ok());
}

// A malformed ucx.* setting stops the engine from starting, with the key and value named.
TEST(UcxConfig, MalformedSettingsAreNamed) {
  const std::pair<const char*, const char*> bad[] = {{"ucx.same_host", "sometimes"},
                                                     {"ucx.slice_bytes", "0"},
                                                     {"ucx.connect_timeout_ms", "soon"},
                                                     {"ucx.cancel_drain_ms", "60001"}};
  for (const auto& [key, value] : bad) {
    EngineOptions o = testing::LoopbackOptions("ucx", "cfg");
    o.plugin_config[key] = value;
    auto e = TransferEngine::Create(o);
    ASSERT_FALSE(e.ok()) << key << "=" << value << " was accepted";
    EXPECT_NE(e.status().ToString().find(key), std::string::npos) << e.status().ToString();
    EXPECT_NE(e.status().ToString().find(value), std::string::npos) << e.status().ToString();
  }
}

}  // namespace
}  // namespace kvbridge

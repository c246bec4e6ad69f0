// The transport contract's failure semantics (docs/plugin-abi.md, "Conformance suites"), once
// per transport the build produced (the same generated list as test_transport_conformance.cc).
// The peer is a real process (tests/fault/peer_main.cc, kvb_test_peer, started over the
// transport under test) that the test freezes (SIGSTOP), kills and restarts. The in-process mock
// has no process to freeze: it stands a peer that never answers by its declared fault injection
// (mock.delay_ms, plugins/testing/mock_transport.cc), and a case it cannot express is skipped
// with the reason printed.
//
// Timing bounds are written for a loaded 2-core machine: a failure must come no earlier than
// the timer that causes it (less 20 ms of clock slack) and well before the next timer that
// could end the batch instead (the deadline is 20 s where the progress timeout is tested and
// vice versa), with at least 1 s of scheduling slack on top.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "conformance_transports.inc"  // generated: KVB_CONFORMANCE_TRANSPORTS
#include "core/descriptor.h"
#include "kvbridge/engine.h"
#include "tests/common/test_util.h"

namespace kvbridge {
namespace {

using testing::Buffer;
using testing::Must;
using testing::PeerProcess;
using Clock = std::chrono::steady_clock;

constexpr size_t kPeerBytes = 64u << 20;
constexpr uint64_t kPeerSeed = 7;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// What each transport declares about itself that the cases depend on.
struct Contract {
  bool in_process = false;        // no peer process exists (mock): freeze by injected delay
  std::string queue_bytes_key;    // its per-peer admission bound in bytes ("" = none declared)
  uint64_t connections_per_peer;  // its connection bound per peer (0 = opens no connections)
};

Contract ContractOf(const std::string& param) {
  const std::string t = testing::ParseTransportParam(param).transport;
  if (t == "tcp") return {false, "tcp.max_queued_bytes_per_peer", 4};  // tcp.lanes_per_peer
  if (t == "ucx") return {false, "ucx.max_queued_bytes_per_peer", 1};  // one endpoint per peer
  // verbs: one RC QP per local NIC port and peer (docs/transports/verbs.md, "Rails").
  if (t == "verbs") return {false, "verbs.max_queued_bytes_per_peer", testing::RdmaPorts()};
  if (t == "nccl") return {false, "", 1};  // one communicator and control connection per peer
  return {true, "", 0};                    // mock
}

class TransportFailures : public ::testing::TestWithParam<std::string> {
 protected:
  const std::string& param() const { return GetParam(); }

  // UCX 1.22 moves same-host RMA through cma, reading and writing a stopped process's memory
  // without it, and an RDMA NIC serves verbs without the target's CPU: a frozen peer stalls
  // nothing, so the op must succeed before `bound_ms` (the timer that would otherwise have
  // ended it). True when that case applied and was checked.
  bool EndedOneSided(const Status& st, double ms, double bound_ms) {
    if (!testing::OneSidedRma(param())) return false;
    EXPECT_TRUE(st.ok()) << "one-sided RMA: " << st.ToString();
    EXPECT_LT(ms, bound_ms) << "one-sided RMA waited for the frozen peer";
    std::printf("%s: frozen peer, one-sided RMA -> %s after %.0f ms\n", param().c_str(),
                StatusCodeName(st.code()).c_str(), ms);
    return true;
  }
  std::string transport() const { return testing::ParseTransportParam(param()).transport; }

  // The client engine, with `config` added to the parameter's plugin_config. The peers' own
  // timeouts are the transport's defaults; the client's are passed per batch.
  void MakeClient(const std::map<std::string, std::string>& config = {}) {
    EngineOptions o = testing::ParamLoopbackOptions(param(), "client");
    o.default_deadline_ms = 5000;
    o.progress_timeout_ms = 500;
    o.breaker_failures = 1000;  // the cases count outcomes, not the breaker
    for (const auto& [k, v] : config) o.plugin_config[k] = v;
    if (transport() == "tcp") o.plugin_config["tcp.lanes_per_peer"] = "4";
    auto e = TransferEngine::Create(o);
    if (!e.ok()) GTEST_SKIP() << "transport '" << param() << "': " << e.status().ToString();
    local_ = std::make_unique<Buffer>(kPeerBytes);
    Result<SegmentId> seg = e.value()->RegisterMemory(local_->data(), local_->size());
    if (std::string why = testing::HostMemoryRefused(param(), seg.status()); !why.empty()) {
      GTEST_SKIP() << why;
    }
    Must(std::move(seg));
    client_ = std::move(e).value();
  }

  std::unique_ptr<PeerProcess> StartPeer(const std::string& node, uint16_t port = 0,
                                         uint64_t seed = kPeerSeed) {
    std::vector<std::string> args = testing::PeerTransportArgs(param());
    for (const std::string& a :
         {std::string("--node-id"), node, std::string("--listen"),
          "127.0.0.1:" + std::to_string(port), std::string("--size"), std::to_string(kPeerBytes),
          std::string("--seed"), std::to_string(seed)}) {
      args.push_back(a);
    }
    auto p = PeerProcess::Start(args);
    if (!p) ADD_FAILURE() << "could not start peer " << node << " over " << param();
    return p;
  }

  // The in-process peer the mock stands in for a process with.
  void StartInProcessPeer(const std::string& node) {
    in_proc_peer_ = Must(TransferEngine::Create(testing::ParamLoopbackOptions(param(), node)));
    in_proc_mem_ = std::make_unique<Buffer>(kPeerBytes);
    in_proc_mem_->Fill(kPeerSeed);
    Must(in_proc_peer_->RegisterMemory(in_proc_mem_->data(), in_proc_mem_->size()));
    Must(client_->AddPeer(in_proc_peer_->LocalDescriptor()));
  }

  // `peer` must outlive the op (TransferOp holds a view). Segment 1: the peer's only region.
  TransferOp Op(OpCode code, std::string_view peer, size_t off, size_t len) {
    return TransferOp{code, local_->data() + off, len, peer, 1, off};
  }

  Status Timed(const std::vector<TransferOp>& ops, uint32_t deadline_ms, uint32_t progress_ms,
               double* ms) {
    SubmitOptions so;
    so.deadline_ms = deadline_ms;
    so.progress_timeout_ms = progress_ms;
    const auto t0 = Clock::now();
    BatchResult r = client_->Wait(Must(client_->Submit(ops, so)));
    *ms = MsSince(t0);
    return r.status;
  }

  std::unique_ptr<TransferEngine> client_;
  std::unique_ptr<Buffer> local_;
  std::unique_ptr<TransferEngine> in_proc_peer_;
  std::unique_ptr<Buffer> in_proc_mem_;
};

// A peer that stops serving (SIGSTOP; the mock: a delivery delay of 20 s) with a deadline far
// shorter than the progress timeout: DEADLINE_EXCEEDED, on time.
TEST_P(TransportFailures, DeadlineExceededWhenThePeerStalls) {
  const bool mock = ContractOf(param()).in_process;
  MakeClient(mock ? std::map<std::string, std::string>{{"mock.delay_ms", "20000"}}
                  : std::map<std::string, std::string>{});
  if (!client_) return;
  std::unique_ptr<PeerProcess> peer;
  if (mock) {
    StartInProcessPeer("stalls");
  } else {
    peer = StartPeer("stalls");
    ASSERT_TRUE(peer);
    Must(client_->AddPeer(peer->descriptor()));
    ASSERT_TRUE(client_->Transfer(std::vector{Op(OpCode::kRead, "stalls", 0, 1 << 20)}).ok());
    peer->Signal(SIGSTOP);
  }
  // A watchdog resumes the peer after 5 s, so a transport that waits for the peer instead of
  // its deadline fails this case on the time bound rather than hanging it.
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    for (int i = 0; i < 500 && !done.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!done.load() && peer) peer->Signal(SIGCONT);
  });
  double ms = 0;
  Status st = Timed({Op(OpCode::kRead, "stalls", 0, 4 << 20)}, 300, 20000, &ms);
  done = true;
  watchdog.join();
  if (peer) peer->Signal(SIGCONT);
  if (EndedOneSided(st, ms, 300)) return;
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
  EXPECT_GE(ms, 280) << "ended before its deadline: " << st.ToString();
  EXPECT_LT(ms, 300 + 1500) << "the 300 ms deadline fired late";
  std::printf("%s: deadline 300 ms -> %s after %.0f ms\n", param().c_str(),
              StatusCodeName(st.code()).c_str(), ms);
}

// A peer that stops serving mid-transfer with a 20 s deadline: PROGRESS_TIMEOUT after about the
// 500 ms progress timeout, long before the deadline.
TEST_P(TransportFailures, FrozenPeerIsProgressTimeoutLongBeforeTheDeadline) {
  const bool mock = ContractOf(param()).in_process;
  MakeClient(mock ? std::map<std::string, std::string>{{"mock.delay_ms", "20000"}}
                  : std::map<std::string, std::string>{});
  if (!client_) return;
  std::unique_ptr<PeerProcess> peer;
  if (mock) {
    StartInProcessPeer("frozen");
  } else {
    peer = StartPeer("frozen");
    ASSERT_TRUE(peer);
    Must(client_->AddPeer(peer->descriptor()));
    ASSERT_TRUE(client_->Transfer(std::vector{Op(OpCode::kWrite, "frozen", 0, 16 << 20)}).ok());
    peer->Signal(SIGSTOP);
  }
  double ms = 0;
  Status st = Timed({Op(OpCode::kWrite, "frozen", 0, 48 << 20)}, 20000, 500, &ms);
  if (peer) peer->Signal(SIGCONT);
  if (EndedOneSided(st, ms, 480)) return;
  EXPECT_EQ(st.code(), StatusCode::kProgressTimeout) << st.ToString();
  EXPECT_GE(ms, 480) << "ended before the progress timeout: " << st.ToString();
  EXPECT_LT(ms, 500 + 2500) << "the progress timeout did not fire long before the 20 s deadline";
  std::printf("%s: progress timeout 500 ms, deadline 20 s -> %s after %.0f ms\n", param().c_str(),
              StatusCodeName(st.code()).c_str(), ms);
}

// The transport's per-peer queue bound (its own plugin_config key) set to 1 MiB, the peer
// frozen so nothing drains: a post past the bound is BACKPRESSURE at once, and nothing of it
// was queued: once the peer runs again and the first batch is over, the refused WRITE's bytes
// are not in the peer.
TEST_P(TransportFailures, PastTheQueueBoundIsBackpressureAtOnceAndNothingQueued) {
  const Contract c = ContractOf(param());
  if (c.queue_bytes_key.empty()) {
    if (!c.in_process) {
      MakeClient();  // skips first, with the reason, where the transport cannot run here
      if (!client_) return;
    }
    GTEST_SKIP() << param() << " declares no per-peer admission bound in bytes"
                 << (c.in_process ? " (plugins/testing/mock_transport.cc queues every post; "
                                    "BACKPRESSURE only as an injected fault)"
                                  : " (nccl bounds ops per peer: kvb_nccl_tests, tests/nccl)");
  }
  MakeClient({{c.queue_bytes_key, std::to_string(1 << 20)}});
  if (!client_) return;
  auto peer = StartPeer("bounded");
  ASSERT_TRUE(peer);
  Must(client_->AddPeer(peer->descriptor()));
  peer->Signal(SIGSTOP);
  SubmitOptions so;
  so.deadline_ms = 10000;
  so.progress_timeout_ms = 8000;
  local_->Fill(11, 0, 1 << 20);
  const BatchId first =
      Must(client_->Submit(std::vector{Op(OpCode::kWrite, "bounded", 0, 1 << 20)}, so));
  const size_t refused_off = 8 << 20;
  local_->Fill(12, refused_off, 4096);
  const auto t0 = Clock::now();
  BatchResult second = client_->Wait(
      Must(client_->Submit(std::vector{Op(OpCode::kWrite, "bounded", refused_off, 4096)}, so)));
  const double ms = MsSince(t0);
  EXPECT_EQ(second.status.code(), StatusCode::kBackpressure) << second.status.ToString();
  EXPECT_LT(ms, 250) << "BACKPRESSURE must be answered at post, not after waiting";
  client_->Cancel(first);
  peer->Signal(SIGCONT);
  client_->Wait(first);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // anything queued would land now
  std::memset(local_->data() + refused_off, 0, 4096);
  ASSERT_TRUE(client_->Transfer(std::vector{Op(OpCode::kRead, "bounded", refused_off, 4096)}).ok());
  EXPECT_TRUE(local_->Matches(kPeerSeed, refused_off, 4096, refused_off))
      << "the refused WRITE was queued after all: its bytes are in the peer";
  // The bound is per queue, not a wedge: with the queue empty a post is admitted again.
  EXPECT_TRUE(client_->Transfer(std::vector{Op(OpCode::kWrite, "bounded", 0, 4096)}).ok());
  std::printf("%s: %s=1 MiB, second post -> %s after %.1f ms\n", param().c_str(),
              c.queue_bytes_key.c_str(), StatusCodeName(second.status.code()).c_str(), ms);
}

// 16 submitter threads over three peers: connections open never exceed the transport's bound
// per peer, connections are reused (opened at most twice the bound), and nothing fails.
TEST_P(TransportFailures, ManySubmittersStayWithinTheConnectionBound) {
  const Contract c = ContractOf(param());
  if (c.in_process) {
    GTEST_SKIP() << param()
                 << " opens no connections (in-process copies, plugins/testing/mock_transport.cc)";
  }
  MakeClient();
  if (!client_) return;
  constexpr int kPeers = 3, kThreads = 16;
  const std::string names[kPeers] = {"fan-0", "fan-1", "fan-2"};
  std::vector<std::unique_ptr<PeerProcess>> peers;
  for (const auto& n : names) {
    peers.push_back(StartPeer(n));
    ASSERT_TRUE(peers.back());
    Must(client_->AddPeer(peers.back()->descriptor()));
  }
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> ok_ops{0}, failed_ops{0};
  std::vector<std::thread> threads;
  const size_t area = kPeerBytes / kThreads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      while (!stop.load()) {
        std::vector<TransferOp> ops;
        const int n = 1 + rng() % 4;
        for (int i = 0; i < n; ++i) {
          const size_t len = 4096u << (rng() % 7);  // 4 KiB .. 256 KiB
          const size_t off = t * area + rng() % (area - len);
          ops.push_back(
              Op(rng() % 2 ? OpCode::kRead : OpCode::kWrite, names[rng() % kPeers], off, len));
        }
        BatchResult r = client_->Wait(Must(client_->Submit(ops)));
        (r.status.ok() ? ok_ops : failed_ops) += ops.size();
      }
    });
  }
  uint64_t max_open = 0;
  const auto until = Clock::now() + std::chrono::milliseconds(1500);
  while (Clock::now() < until) {
    max_open = std::max(max_open, Must(client_->GetTransportStats(transport())).connections_open);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  stop = true;
  for (auto& th : threads) th.join();
  const TransportStats st = Must(client_->GetTransportStats(transport()));
  std::printf("%s: %llu ops ok, %llu failed, max connections open %llu, opened %llu (bound %llu)\n",
              param().c_str(), (unsigned long long)ok_ops.load(),
              (unsigned long long)failed_ops.load(), (unsigned long long)max_open,
              (unsigned long long)st.connections_opened,
              (unsigned long long)(kPeers * c.connections_per_peer));
  EXPECT_GT(ok_ops.load(), 100u);
  EXPECT_EQ(failed_ops.load(), 0u);
  EXPECT_GT(max_open, 0u) << "the sampler never saw a connection: the check proves nothing";
  EXPECT_LE(max_open, kPeers * c.connections_per_peer) << "more connections than the bound";
  EXPECT_LE(st.connections_opened, 2 * kPeers * c.connections_per_peer)
      << "connections are not reused";
}

// A peer restarted at the address the client knows (tcp: the same port; ucx: the new process's
// endpoints under the old identity, since a UCX worker address is new in every process; mock:
// a new instance under the same node id, its endpoint "mock:<node>" unchanged): every attempt
// fails, STALE_PEER comes, and not one byte lands in the new process.
TEST_P(TransportFailures, RestartOnTheSameAddressIsStaleWithZeroBytesLanded) {
  MakeClient();
  if (!client_) return;
  local_->Fill(40, 0, 1 << 20);
  if (ContractOf(param()).in_process) {
    StartInProcessPeer("restarts");
    ASSERT_TRUE(client_->Transfer(std::vector{Op(OpCode::kWrite, "restarts", 0, 1 << 20)}).ok());
    in_proc_peer_.reset();
    auto second = Must(TransferEngine::Create(testing::ParamLoopbackOptions(param(), "restarts")));
    Buffer fresh(kPeerBytes);
    fresh.Fill(kPeerSeed + 1);
    Must(second->RegisterMemory(fresh.data(), fresh.size()));
    local_->Fill(41, 0, 1 << 20);
    Status st = client_->Transfer(std::vector{Op(OpCode::kWrite, "restarts", 0, 1 << 20)});
    EXPECT_EQ(st.code(), StatusCode::kStalePeer) << st.ToString();
    EXPECT_TRUE(fresh.Matches(kPeerSeed + 1, 0, fresh.size(), 0))
        << "bytes landed in the new incarnation";
    return;
  }
  const bool same_port = transport() == "tcp";
  const uint16_t port = same_port ? testing::FreePort() : 0;
  auto first = StartPeer("restarts", port, 1);
  ASSERT_TRUE(first);
  const PeerId old_id = Must(client_->AddPeer(first->descriptor()));
  ASSERT_TRUE(client_->Transfer(std::vector{Op(OpCode::kWrite, "restarts", 0, 1 << 20)}).ok());
  first->Kill();
  auto second = StartPeer("restarts", port, 2);
  ASSERT_TRUE(second) << "could not start the second incarnation";
  const std::string crc = second->Command("CRC");
  ASSERT_EQ(crc.rfind("CRC ", 0), 0u) << crc;
  if (!same_port) {
    core::Descriptor d = Must(core::DecodeDescriptor(second->descriptor()));
    ASSERT_NE(d.incarnation, old_id.incarnation);
    d.incarnation = old_id.incarnation;
    AddPeerOptions apo;
    apo.allow_endpoint_change = true;
    Must(client_->AddPeer(core::EncodeDescriptor(d), apo));
  }
  local_->Fill(41, 0, 1 << 20);
  // tcp's first attempt may meet the dying connection (PEER_UNREACHABLE) before it reconnects.
  Status st;
  for (int attempt = 0; attempt < 5; ++attempt) {
    st = client_->Transfer(std::vector{Op(OpCode::kWrite, "restarts", 0, 1 << 20)});
    ASSERT_FALSE(st.ok()) << "a write to the old incarnation succeeded";
    if (st.IsStalePeer()) break;
    EXPECT_TRUE(st.IsPeerUnreachable()) << st.ToString();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(st.code(), StatusCode::kStalePeer) << st.ToString();
  EXPECT_EQ(second->Command("CRC"), crc) << "bytes landed in the restarted process";
  // With its own descriptor the new incarnation is reached, and the write lands.
  Must(client_->AddPeer(second->descriptor()));
  ASSERT_TRUE(client_->Transfer(std::vector{Op(OpCode::kWrite, "restarts", 0, 1 << 20)}).ok());
  EXPECT_NE(second->Command("CRC"), crc) << "the write to the new incarnation did not land";
}

INSTANTIATE_TEST_SUITE_P(Transports, TransportFailures,
                         ::testing::Values(KVB_CONFORMANCE_TRANSPORTS),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace kvbridge

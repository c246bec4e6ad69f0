// Multi-process fault tests of the transfer engine over the TCP transport: peers killed,
// frozen, restarted on the same port or given a wrong token, made to happen with real
// processes on loopback (docs/transfer-engine.md says what each must cost).
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "kvbridge/engine.h"
#include "tests/common/test_util.h"

namespace kvbridge {
namespace {

using testing::Buffer;
using testing::Must;
using testing::PeerProcess;
using Clock = std::chrono::steady_clock;

constexpr size_t kPeerBytes = 64u << 20;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

std::unique_ptr<PeerProcess> StartPeer(const std::string& node, uint16_t port, uint64_t seed) {
  auto p =
      PeerProcess::Start({"--node-id", node, "--listen", "127.0.0.1:" + std::to_string(port),
                          "--size", std::to_string(kPeerBytes), "--seed", std::to_string(seed)});
  if (!p) ADD_FAILURE() << "could not start peer " << node;
  return p;
}

SegmentId FirstSegment(std::string_view) { return 1; }  // the peer registers exactly one

class FaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineOptions o = EngineOptions::FromEnv();
    o.node_id = "client";
    o.transports = {"tcp"};
    o.listen = "127.0.0.1:0";
    o.default_deadline_ms = 5000;
    o.progress_timeout_ms = 500;
    Configure(o);
    engine_ = Must(TransferEngine::Create(o));
    local_ = std::make_unique<Buffer>(kPeerBytes);
    Must(engine_->RegisterMemory(local_->data(), local_->size()));
  }
  virtual void Configure(EngineOptions&) {}

  // `peer` must outlive the op (TransferOp holds a view): a literal or a caller-owned string.
  TransferOp Op(OpCode code, std::string_view peer, size_t off, size_t len) {
    return TransferOp{code, local_->data() + off, len, peer, FirstSegment(peer), off};
  }

  std::unique_ptr<TransferEngine> engine_;
  std::unique_ptr<Buffer> local_;
};

TEST_F(FaultTest, PeerKilledMidTransferFailsFastWithNamedCode) {
  auto peer = StartPeer("victim", 0, 1);
  ASSERT_TRUE(peer);
  Must(engine_->AddPeer(peer->descriptor()));
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kRead, "victim", 0, 1 << 20)}).ok());

  struct Outcome {
    StatusCode code;
    double ms;
  };
  std::vector<Outcome> outcomes;
  std::atomic<bool> stop{false};
  std::thread loader([&] {
    while (!stop.load()) {
      std::vector<TransferOp> ops;
      for (int i = 0; i < 16; ++i)
        ops.push_back(Op(OpCode::kRead, "victim", i * (4u << 20), 4u << 20));
      auto t0 = Clock::now();
      BatchResult r = engine_->Wait(Must(engine_->Submit(ops)));
      outcomes.push_back({r.status.code(), MsSince(t0)});
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  peer->Kill();
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  stop = true;
  loader.join();

  int failed = 0;
  for (const auto& o : outcomes) {
    EXPECT_LE(o.ms, 5000 + 500) << "a batch outlived its deadline";
    if (o.code == StatusCode::kOk) continue;
    ++failed;
    EXPECT_TRUE(o.code == StatusCode::kPeerUnreachable || o.code == StatusCode::kProgressTimeout)
        << StatusCodeName(o.code);
    EXPECT_LT(o.ms, 1500) << "a dead peer must fail in well under the deadline";
  }
  EXPECT_GT(failed, 0) << "the kill did not hit any batch (" << outcomes.size() << " batches)";
  auto health = engine_->GetPeerHealth("victim");
  ASSERT_TRUE(health.has_value());
  EXPECT_GT(health->fast_failed_ops, 0u) << "circuit breaker never opened";
}

TEST_F(FaultTest, FrozenPeerTripsProgressTimeoutLongBeforeDeadline) {
  auto peer = StartPeer("frozen", 0, 1);
  ASSERT_TRUE(peer);
  Must(engine_->AddPeer(peer->descriptor()));
  // Warm up so lanes are connected when the peer freezes.
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kWrite, "frozen", 0, 16u << 20)}).ok());
  peer->Signal(SIGSTOP);
  SubmitOptions so;
  so.deadline_ms = 20000;
  so.progress_timeout_ms = 500;
  auto t0 = Clock::now();
  BatchResult r = engine_->Wait(
      Must(engine_->Submit(std::vector{Op(OpCode::kWrite, "frozen", 0, kPeerBytes)}, so)));
  double ms = MsSince(t0);
  EXPECT_EQ(r.status.code(), StatusCode::kProgressTimeout) << r.status.ToString();
  EXPECT_LT(ms, 4000) << "progress timeout did not fire well before the 20 s deadline";
  // New connections to a frozen process are accepted by its kernel but never answered: the
  // handshake is bounded too.
  t0 = Clock::now();
  r = engine_->Wait(Must(engine_->Submit(std::vector{Op(OpCode::kRead, "frozen", 0, 4096)}, so)));
  EXPECT_FALSE(r.status.ok());
  EXPECT_LT(MsSince(t0), 4000) << r.status.ToString();
  peer->Signal(SIGCONT);
}

// WaitFor: a batch to a frozen peer is still in flight when the wait ends, about on time; it
// stays pending (a later wait collects it), and it is collected once, CANCELLED after Cancel.
TEST_F(FaultTest, WaitForEndsOnTimeAndLeavesTheBatchPending) {
  auto peer = StartPeer("frozen-wait", 0, 1);
  ASSERT_TRUE(peer);
  Must(engine_->AddPeer(peer->descriptor()));
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kRead, "frozen-wait", 0, 4096)}).ok());
  peer->Signal(SIGSTOP);
  SubmitOptions so;
  so.deadline_ms = 20000;
  so.progress_timeout_ms = 10000;
  const BatchId id =
      Must(engine_->Submit(std::vector{Op(OpCode::kRead, "frozen-wait", 0, 1u << 20)}, so));
  auto t0 = Clock::now();
  EXPECT_FALSE(engine_->WaitFor(id, std::chrono::milliseconds(150)).has_value());
  const double waited = MsSince(t0);
  EXPECT_GE(waited, 145);
  EXPECT_LT(waited, 1000) << "WaitFor overslept its timeout";
  EXPECT_FALSE(engine_->WaitFor(id, std::chrono::milliseconds(0)).has_value());
  engine_->Cancel(id);
  std::optional<BatchResult> r = engine_->WaitFor(id, std::chrono::milliseconds(2000));
  ASSERT_TRUE(r.has_value()) << "a cancelled batch did not become final";
  EXPECT_EQ(r->status.code(), StatusCode::kCancelled) << r->status.ToString();
  r = engine_->WaitFor(id, std::chrono::milliseconds(10));
  ASSERT_TRUE(r.has_value());
  EXPECT_EQ(r->status.code(), StatusCode::kNotFound) << "results are returned once";
  peer->Signal(SIGCONT);
  // Done work is collected at once, whatever the timeout (the largest included).
  const BatchId ok = Must(engine_->Submit(std::vector{Op(OpCode::kRead, "frozen-wait", 0, 4096)}));
  r = engine_->WaitFor(ok, std::chrono::nanoseconds::max());
  ASSERT_TRUE(r.has_value());
  EXPECT_TRUE(r->status.ok()) << r->status.ToString();
}

// Deregistering local memory while an outbound WRITE from it is stuck (the peer is frozen,
// the socket buffers full) cancels that transfer: DeregisterMemory returns promptly, the batch
// ends CANCELLED, and once it returned the memory is the caller's again: bytes written into it
// afterwards never reach the peer (checked page by page once the peer runs again).
TEST_F(FaultTest, DeregisterCancelsOutboundTransfersFromTheRegion) {
  auto peer = StartPeer("dereg", 0, 1);
  ASSERT_TRUE(peer);
  Must(engine_->AddPeer(peer->descriptor()));
  Buffer src(kPeerBytes);
  src.Fill(5);
  const SegmentId seg = Must(engine_->RegisterMemory(src.data(), src.size()));
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kRead, "dereg", 0, 4096)}).ok());
  peer->Signal(SIGSTOP);
  SubmitOptions so;
  so.deadline_ms = 30000;
  so.progress_timeout_ms = 20000;
  const BatchId id = Must(engine_->Submit(
      std::vector{TransferOp{OpCode::kWrite, src.data(), src.size(), "dereg", 1, 0}}, so));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // stuck on the full socket
  EXPECT_FALSE(engine_->WaitFor(id, std::chrono::milliseconds(0)).has_value());
  auto t0 = Clock::now();
  ASSERT_TRUE(engine_->DeregisterMemory(seg).ok());
  EXPECT_LT(MsSince(t0), 3000) << "deregister waited for the stuck transfer";
  std::optional<BatchResult> r = engine_->WaitFor(id, std::chrono::milliseconds(2000));
  ASSERT_TRUE(r.has_value()) << "the transfer from the deregistered memory is still running";
  EXPECT_EQ(r->status.code(), StatusCode::kCancelled) << r->status.ToString();
  // The memory is the caller's again: new contents must never reach the peer.
  src.Fill(9);
  EXPECT_TRUE(
      engine_->Submit(std::vector{TransferOp{OpCode::kWrite, src.data(), 4096, "dereg", 1, 0}})
          .status()
          .Is(StatusCode::kNotRegistered));
  peer->Signal(SIGCONT);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kRead, "dereg", 0, kPeerBytes)}).ok());
  // Every byte is the peer's own (seed 1) or what was written before the deregister (seed 5);
  // a page can be half of each where the stuck write stopped.
  size_t written = 0, untouched = 0, foreign = 0;
  for (size_t off = 0; off < kPeerBytes; ++off) {
    const uint8_t b = local_->data()[off];
    if (b == testing::PatternByte(5, off)) {
      ++written;
    } else if (b == testing::PatternByte(1, off)) {
      ++untouched;
    } else if (foreign++ == 0) {
      ADD_FAILURE() << "byte " << off << " was written after DeregisterMemory returned";
    }
  }
  EXPECT_EQ(foreign, 0u);
  EXPECT_GT(untouched, 0u) << "the whole write landed: it was never stuck";
  std::printf("deregistered mid-write: %zu bytes written before, %zu untouched\n", written,
              untouched);
}

// A small batch posted to a lane that sat idle (its poll(2) armed for up to a second) while the
// peer froze: the progress timeout and the deadline still fire on time, not at the next idle
// wake-up.
TEST_F(FaultTest, FrozenPeerFailsABatchOnAnIdleLaneOnTime) {
  auto peer = StartPeer("frozen-idle", 0, 1);
  ASSERT_TRUE(peer);
  Must(engine_->AddPeer(peer->descriptor()));
  // Warms a lane up, lets it park in poll, freezes the peer, then posts one small READ.
  auto frozen_read = [&](const SubmitOptions& so, double* ms) {
    EXPECT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kRead, "frozen-idle", 0, 4096)}).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    peer->Signal(SIGSTOP);
    const auto t0 = Clock::now();
    BatchResult r = engine_->Wait(
        Must(engine_->Submit(std::vector{Op(OpCode::kRead, "frozen-idle", 0, 4096)}, so)));
    *ms = MsSince(t0);
    peer->Signal(SIGCONT);
    return r.status;
  };
  SubmitOptions so;
  so.deadline_ms = 20000;
  so.progress_timeout_ms = 300;
  double ms = 0;
  Status st = frozen_read(so, &ms);
  EXPECT_EQ(st.code(), StatusCode::kProgressTimeout) << st.ToString();
  EXPECT_GE(ms, 250);
  EXPECT_LT(ms, 800) << "the lane slept through the progress timeout";
  // The same with a deadline shorter than everything else (a new lane: the old one was
  // evicted).
  so.deadline_ms = 250;
  so.progress_timeout_ms = 10000;
  st = frozen_read(so, &ms);
  EXPECT_EQ(st.code(), StatusCode::kDeadlineExceeded) << st.ToString();
  EXPECT_LT(ms, 800) << "the lane slept through the deadline";
}

TEST_F(FaultTest, PeerRestartedOnSamePortIsStaleAndNeverWritten) {
  const uint16_t port = testing::FreePort();
  auto first = StartPeer("restarts", port, 1);
  ASSERT_TRUE(first);
  Must(engine_->AddPeer(first->descriptor()));
  local_->Fill(50, 0, 1 << 20);
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kWrite, "restarts", 0, 1 << 20)}).ok());
  first->Kill();

  auto second = StartPeer("restarts", port, 2);
  ASSERT_TRUE(second) << "could not rebind the same port";
  const std::string crc_before = second->Command("CRC");
  ASSERT_EQ(crc_before.rfind("CRC ", 0), 0u);

  // The client still holds the old descriptor: every attempt must fail, ending in STALE_PEER
  // (the first may see the dying connection instead), and nothing may land in `second`.
  local_->Fill(51, 0, 1 << 20);
  bool saw_stale = false;
  for (int attempt = 0; attempt < 5 && !saw_stale; ++attempt) {
    Status st = engine_->Transfer(std::vector{Op(OpCode::kWrite, "restarts", 0, 1 << 20)});
    ASSERT_FALSE(st.ok()) << "a write to the old incarnation succeeded";
    saw_stale = st.IsStalePeer();
    if (!saw_stale) {
      EXPECT_TRUE(st.IsPeerUnreachable()) << st.ToString();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  EXPECT_TRUE(saw_stale);
  // Known-stale peers fail fast without touching the network.
  auto t0 = Clock::now();
  Status again = engine_->Transfer(std::vector{Op(OpCode::kWrite, "restarts", 0, 4096)});
  EXPECT_TRUE(again.IsStalePeer()) << again.ToString();
  EXPECT_LT(MsSince(t0), 50);
  EXPECT_EQ(second->Command("CRC"), crc_before) << "bytes landed in the wrong process";

  // With the new descriptor the same write succeeds, and lands.
  PeerId id = Must(engine_->AddPeer(second->descriptor()));
  auto health = engine_->GetPeerHealth("restarts");
  ASSERT_TRUE(health.has_value());
  EXPECT_EQ(health->id.incarnation, id.incarnation);
  EXPECT_FALSE(health->stale);
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kWrite, "restarts", 0, 1 << 20)}).ok());
  EXPECT_NE(second->Command("CRC"), crc_before);
  std::memset(local_->data(), 0, 1 << 20);
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kRead, "restarts", 0, 1 << 20)}).ok());
  EXPECT_TRUE(local_->Matches(51, 0, 1 << 20, 0));
}

TEST_F(FaultTest, SixteenSubmittersStayWithinLaneBoundWithoutTimeWaitBurst) {
  int seconds = 30;
  if (const char* s = std::getenv("KVB_FAULT_SOAK_SECONDS")) seconds = std::atoi(s);
  const uint16_t port = testing::FreePort();
  auto peer = StartPeer("soak", port, 1);
  ASSERT_TRUE(peer);
  Must(engine_->AddPeer(peer->descriptor()));
  constexpr int kThreads = 16;
  constexpr int kLanes = 4;  // tcp.lanes_per_peer default
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> ok_ops{0}, failed_ops{0};
  std::vector<std::thread> threads;
  const size_t area = kPeerBytes / kThreads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      while (!stop.load()) {
        std::vector<TransferOp> ops;
        const int n = 1 + rng() % 8;
        for (int i = 0; i < n; ++i) {
          size_t len = 4096u << (rng() % 9);  // 4 KiB .. 1 MiB
          size_t off = t * area + (rng() % (area - len));
          ops.push_back(Op(rng() % 2 ? OpCode::kRead : OpCode::kWrite, "soak", off, len));
        }
        BatchResult r = engine_->Wait(Must(engine_->Submit(ops)));
        (r.status.ok() ? ok_ops : failed_ops) += ops.size();
      }
    });
  }
  int max_established = 0, max_time_wait = 0;
  uint64_t max_open = 0;
  auto until = Clock::now() + std::chrono::seconds(seconds);
  while (Clock::now() < until) {
    auto c = testing::CountSocketsToPort(port);
    max_established = std::max(max_established, c.established);
    max_time_wait = std::max(max_time_wait, c.time_wait);
    max_open = std::max(max_open, Must(engine_->GetTransportStats("tcp")).connections_open);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  stop = true;
  for (auto& th : threads) th.join();
  TransportStats st = Must(engine_->GetTransportStats("tcp"));
  std::printf(
      "soak: %llu ops ok, %llu failed, max established %d, max TIME_WAIT %d, "
      "lanes opened %llu\n",
      (unsigned long long)ok_ops.load(), (unsigned long long)failed_ops.load(), max_established,
      max_time_wait, (unsigned long long)st.connections_opened);
  EXPECT_GT(ok_ops.load(), 1000u);
  EXPECT_EQ(failed_ops.load(), 0u);
  EXPECT_LE(max_established, kLanes) << "more sockets than lanes";
  EXPECT_LE(max_open, static_cast<uint64_t>(kLanes));
  EXPECT_LE(max_time_wait, kLanes) << "TIME_WAIT burst";
  EXPECT_LE(st.connections_opened, static_cast<uint64_t>(2 * kLanes)) << "lanes are not reused";
}

// Latency percentiles of `n` sequential 64 KiB writes to `peer`.
std::pair<double, double> MeasureWrites(TransferEngine& e, Buffer& local, const std::string& peer,
                                        int n, int* failures) {
  std::vector<double> lat;
  for (int i = 0; i < n; ++i) {
    auto t0 = Clock::now();
    Status st =
        e.Transfer(std::vector{TransferOp{OpCode::kWrite, local.data(), 64 * 1024, peer, 1, 0}});
    lat.push_back(MsSince(t0));
    if (!st.ok()) ++*failures;
  }
  std::sort(lat.begin(), lat.end());
  return {lat[n / 2], lat[n * 99 / 100]};
}

TEST_F(FaultTest, DeadAndFrozenPeersDoNotSlowHealthyPeer) {
  auto healthy = StartPeer("healthy", 0, 1);
  auto dead = StartPeer("dead", 0, 2);
  auto frozen = StartPeer("frozen2", 0, 3);
  ASSERT_TRUE(healthy && dead && frozen);
  for (auto* p : {healthy.get(), dead.get(), frozen.get()}) Must(engine_->AddPeer(p->descriptor()));
  for (const char* n : {"healthy", "dead", "frozen2"}) {
    ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kWrite, n, 0, 65536)}).ok());
  }
  int failures = 0;
  MeasureWrites(*engine_, *local_, "healthy", 50, &failures);  // warm-up
  auto [p50_base, p99_base] = MeasureWrites(*engine_, *local_, "healthy", 300, &failures);
  ASSERT_EQ(failures, 0);

  dead->Kill();
  frozen->Signal(SIGSTOP);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> bad_ok{0}, bad_failed{0};
  std::vector<std::thread> hammer;
  for (int t = 0; t < 4; ++t) {
    hammer.emplace_back([&, t] {
      const std::string target = t % 2 ? "dead" : "frozen2";
      while (!stop.load()) {
        Status st = engine_->Transfer(std::vector{Op(OpCode::kWrite, target, 1 << 20, 65536)});
        (st.ok() ? bad_ok : bad_failed)++;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  auto [p50, p99] = MeasureWrites(*engine_, *local_, "healthy", 300, &failures);
  stop = true;
  for (auto& th : hammer) th.join();
  frozen->Signal(SIGCONT);
  std::printf(
      "healthy peer 64KiB write: p50 %.3f ms -> %.3f ms, p99 %.3f ms -> %.3f ms "
      "(dead/frozen attempts: %llu failed)\n",
      p50_base, p50, p99_base, p99, (unsigned long long)bad_failed.load());
  EXPECT_EQ(failures, 0) << "ops to the healthy peer failed";
  EXPECT_EQ(bad_ok.load(), 0u);
  EXPECT_GT(bad_failed.load(), 0u);
  // Allow for CPU contention on a 2-core machine, but not for waiting on the bad peers
  // (which would cost their 500 ms progress timeout).
  EXPECT_LT(p50, 2 * p50_base + 1.0);
  EXPECT_LT(p99, 100.0) << "a healthy op waited behind a bad peer";
}

class AuthFaultTest : public FaultTest {
  void Configure(EngineOptions& o) override { o.cluster_token = "right-token"; }
};

TEST_F(AuthFaultTest, PeerWithWrongTokenIsRefused) {
  auto peer = PeerProcess::Start({"--node-id", "intruder", "--listen", "127.0.0.1:0", "--size",
                                  "1048576", "--token", "wrong-token"});
  ASSERT_TRUE(peer);
  Must(engine_->AddPeer(peer->descriptor()));
  const std::string crc = peer->Command("CRC");
  Status st = engine_->Transfer(std::vector{Op(OpCode::kWrite, "intruder", 0, 4096)});
  EXPECT_EQ(st.code(), StatusCode::kUnauthenticated) << st.ToString();
  EXPECT_EQ(peer->Command("CRC"), crc);
}

// Seed 003: a node reachable over several NICs, none of them its "host" address. The peer lives
// in its own network namespace with two veth links; cutting one link (every packet dropped, as
// with a pulled cable) must leave it reachable through the other.
TEST_F(FaultTest, PeerWithTwoNicsStaysReachableWhenOneIsCut) {
  std::string why;
  auto ns = testing::NetNamespace::Create(2, &why);
  if (!ns) GTEST_SKIP() << "network namespaces unavailable: " << why;
  const std::string listen = testing::NetNamespace::RemoteAddress(0) + ":0," +
                             testing::NetNamespace::RemoteAddress(1) + ":0";
  auto peer = PeerProcess::Start({"--node-id", "twonic", "--listen", listen, "--size",
                                  std::to_string(kPeerBytes), "--seed", "4"},
                                 {"ip", "netns", "exec", ns->name()});
  ASSERT_TRUE(peer);
  Must(engine_->AddPeer(peer->descriptor()));
  local_->Fill(60, 0, 1 << 20);
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kWrite, "twonic", 0, 1 << 20)}).ok());

  ASSERT_TRUE(ns->SetLink(0, false));
  auto t0 = Clock::now();
  Status st;
  int attempts = 0;
  SubmitOptions so;
  so.deadline_ms = 3000;
  local_->Fill(61, 0, 1 << 20);
  while (MsSince(t0) < 20000) {
    ++attempts;
    st = engine_->Transfer(std::vector{Op(OpCode::kWrite, "twonic", 0, 1 << 20)}, so);
    if (st.ok()) break;
    EXPECT_TRUE(st.IsPeerUnreachable() || st.Is(StatusCode::kProgressTimeout) ||
                st.IsDeadlineExceeded())
        << st.ToString();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(st.ok()) << "still unreachable through the second NIC after " << attempts
                       << " attempts: " << st.ToString();
  std::printf("first NIC cut: traffic moved to the second after %.0f ms (%d attempts)\n",
              MsSince(t0), attempts);
  std::memset(local_->data(), 0, 1 << 20);
  ASSERT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kRead, "twonic", 0, 1 << 20)}).ok());
  EXPECT_TRUE(local_->Matches(61, 0, 1 << 20, 0));
}

}  // namespace
}  // namespace kvbridge

// Multi-process fault tests of the transfer engine, once per transport the build produced
// (tcp; ucx / ucx_net when the ucx plugin is built; verbs when built; nccl: the list is generated
// by tests/fault/CMakeLists.txt): peers killed, frozen, restarted on the same port or given a
// wrong token, and peers reading or writing our memory that die mid-transfer, made to happen
// with real processes on loopback (docs/transfer-engine.md says
// what each must cost). The peer (peer_main.cc) runs over the same transport and config. Cases
// that are about one transport's mechanics (tcp's lanes and TIME_WAIT, tcp's multi-address
// listen) skip the others with the reason printed.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "core/descriptor.h"
#include "fault_transports.inc"  // generated: KVB_FAULT_TRANSPORTS
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

SegmentId FirstSegment(std::string_view) { return 1; }  // the peer registers exactly one

// The parameter: "tcp", "ucx" (ucx.same_host=auto), "ucx_net" (ucx.same_host=off), "verbs" or
// "nccl".
class FaultTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const testing::TransportParam p = testing::ParseTransportParam(GetParam());
    transport_ = p.transport;
    EngineOptions o = EngineOptions::FromEnv();
    o.node_id = "client";
    o.transports = {transport_};
    o.listen = "127.0.0.1:0";
    o.default_deadline_ms = 5000;
    o.progress_timeout_ms = 500;
    for (const auto& [k, v] : p.config) o.plugin_config[k] = v;
    if (transport_ == "ucx") o.plugin_config["ucx.connect_timeout_ms"] = "1000";
    Configure(o);
    auto e = TransferEngine::Create(o);
    if (!e.ok()) GTEST_SKIP() << "transport '" << GetParam() << "': " << e.status().ToString();
    local_ = std::make_unique<Buffer>(kPeerBytes);
    Result<SegmentId> seg = e.value()->RegisterMemory(local_->data(), local_->size());
    if (std::string why = testing::HostMemoryRefused(GetParam(), seg.status()); !why.empty()) {
      GTEST_SKIP() << why;
    }
    Must(std::move(seg));
    engine_ = std::move(e).value();
  }
  virtual void Configure(EngineOptions&) {}

  bool tcp() const { return transport_ == "tcp"; }

  // Cases that cancel, or deregister memory of, a request with RMA in flight to a frozen peer:
  // on ucx's same-host (NONE-mode) endpoints both wait until the peer resumes or exits, a
  // documented limit (docs/transports/ucx.md, "Known limits": such endpoints cannot be
  // force-closed), so those cases cannot end on time there and are skipped.
  bool SkipIfCancelWaitsForFrozenPeer() const { return GetParam() == "ucx"; }

  // Cases about a frozen peer stalling transfers, for transports whose RMA needs no CPU on the
  // target (verbs: the NIC serves it), where a frozen peer stalls nothing. What those cases
  // check is tested there on its own terms: TransportFailures (tests/conformance) expects such
  // ops to succeed, and tests/verbs stalls a QP on a fault-injecting fabric.
  bool SkipIfFrozenPeerStallsNothing() const { return testing::OneSidedRma(GetParam()); }
  std::string FrozenPeerStallsNothing() const {
    return GetParam() + ": RMA needs no CPU on the target, so a frozen peer stalls nothing";
  }
  static constexpr const char* kCancelWaitsForFrozenPeer =
      "ucx same-host (NONE-mode) endpoints: cancel and deregister_memory of a request with RMA "
      "in flight to a frozen peer wait until it resumes (docs/transports/ucx.md, Known limits)";

  // A peer process over this test's transport and config; `port` 0 = any.
  std::unique_ptr<PeerProcess> StartPeer(const std::string& node, uint16_t port, uint64_t seed,
                                         const std::vector<std::string>& extra = {},
                                         size_t size = kPeerBytes) {
    std::vector<std::string> args = testing::PeerTransportArgs(GetParam());
    for (const std::string& a :
         {std::string("--node-id"), node, std::string("--listen"),
          "127.0.0.1:" + std::to_string(port), std::string("--size"), std::to_string(size),
          std::string("--seed"), std::to_string(seed)}) {
      args.push_back(a);
    }
    args.insert(args.end(), extra.begin(), extra.end());
    auto p = PeerProcess::Start(args);
    if (!p) ADD_FAILURE() << "could not start peer " << node << " over " << GetParam();
    return p;
  }

  // `peer` must outlive the op (TransferOp holds a view): a literal or a caller-owned string.
  TransferOp Op(OpCode code, std::string_view peer, size_t off, size_t len) {
    return TransferOp{code, local_->data() + off, len, peer, FirstSegment(peer), off};
  }

  std::string transport_;
  std::unique_ptr<TransferEngine> engine_;
  std::unique_ptr<Buffer> local_;
};

TEST_P(FaultTest, PeerKilledMidTransferFailsFastWithNamedCode) {
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

// The other way round: we are the target, and peers reading or writing 64 MiB of our memory
// die mid-transfer, killed or closing their engine with the batch in flight. We keep serving:
// a fresh peer reads and writes all of it, and the region deregisters on time. Two UCX faults
// take the kill rounds out where they apply (docs/transports/ucx.md, "Known limits"): over tcp
// (ucx_net) UCX's software RMA can abort a target whose initiator dies while it sends reply
// data, and on one host UCX 1.13's shared-memory transports stop serving every peer once one
// dies mid-transfer (1.22 moves RMA with cma, without the target). A closing initiator lets
// its operations finish first (ucx.cancel_drain_ms), which both do test.
TEST_P(FaultTest, InitiatorsDyingMidTransferLeaveTheTargetServing) {
  constexpr size_t kLen = 64u << 20;
  Buffer region(kLen);
  region.Fill(21);
  const SegmentId seg = Must(engine_->RegisterMemory(region.data(), region.size()));
  const std::string desc = "ADD " + testing::HexEncode(engine_->LocalDescriptor());
  std::string no_kills;
  if (GetParam() == "ucx_net") {
    no_kills = "UCX's software RMA over tcp";
  } else if (GetParam() == "ucx" && testing::LoadedUcxMinor() < 22) {
    no_kills = "UCX 1." + std::to_string(testing::LoadedUcxMinor()) + "'s shared memory";
  }
  const bool kills = no_kills.empty();
  if (!kills)
    std::printf("%s: closing initiators only (%s, see above)\n", GetParam().c_str(),
                no_kills.c_str());
  int round = 0;
  for (const char* op : {"READ", "WRITE"}) {
    for (const bool kill : {false, true}) {
      if (kill && !kills) continue;
      SCOPED_TRACE(std::string(op) + (kill ? ", killed" : ", engine closed"));
      auto peer = StartPeer("initiator-" + std::to_string(round), 0, 30 + round);
      ASSERT_TRUE(peer);
      ASSERT_EQ(peer->Command(desc), "OK");
      const std::string what = std::string(op) + " client " + std::to_string(seg) + " ";
      ASSERT_EQ(peer->Command(what + "4096"), "OK");  // connected
      ASSERT_EQ(peer->Command("SUBMIT " + what + std::to_string(kLen)), "OK");
      std::this_thread::sleep_for(std::chrono::milliseconds(10 + 5 * round));
      if (kill) {
        peer->Kill();
      } else {
        peer->Command("QUIT", 100);  // no answer: it exits
        EXPECT_EQ(peer->Wait(10000), 0) << "the initiator did not exit cleanly";
      }
      ++round;
    }
  }
  auto fresh = StartPeer("initiator-after", 0, 40);
  ASSERT_TRUE(fresh);
  ASSERT_EQ(fresh->Command(desc), "OK");
  region.Fill(22);
  ASSERT_EQ(fresh->Command("READ client " + std::to_string(seg) + " " + std::to_string(kLen)),
            "OK");
  ASSERT_EQ(fresh->Command("WRITE client " + std::to_string(seg) + " " + std::to_string(kLen)),
            "OK");
  EXPECT_TRUE(region.Matches(22, 0, kLen, 0)) << "the fresh peer's write did not land whole";
  const auto t0 = Clock::now();
  EXPECT_TRUE(engine_->DeregisterMemory(seg).ok());
  EXPECT_LT(MsSince(t0), 3000) << "deregister waited on a dead initiator";
}

TEST_P(FaultTest, FrozenPeerTripsProgressTimeoutLongBeforeDeadline) {
  if (SkipIfFrozenPeerStallsNothing()) GTEST_SKIP() << FrozenPeerStallsNothing();
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
TEST_P(FaultTest, WaitForEndsOnTimeAndLeavesTheBatchPending) {
  if (SkipIfCancelWaitsForFrozenPeer()) GTEST_SKIP() << kCancelWaitsForFrozenPeer;
  if (SkipIfFrozenPeerStallsNothing()) GTEST_SKIP() << FrozenPeerStallsNothing();
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
TEST_P(FaultTest, DeregisterCancelsOutboundTransfersFromTheRegion) {
  if (SkipIfCancelWaitsForFrozenPeer()) GTEST_SKIP() << kCancelWaitsForFrozenPeer;
  if (SkipIfFrozenPeerStallsNothing()) GTEST_SKIP() << FrozenPeerStallsNothing();
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
TEST_P(FaultTest, FrozenPeerFailsABatchOnAnIdleLaneOnTime) {
  if (SkipIfFrozenPeerStallsNothing()) GTEST_SKIP() << FrozenPeerStallsNothing();
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

// tcp only: a restarted tcp peer is reached again at its old host:port. (A UCX worker address
// is new in every process, so ucx never reaches a restarted peer at the address it knew; the
// contract case TransportFailures.RestartOnTheSameAddressIsStaleWithZeroBytesLanded in
// tests/conformance replays the new process's endpoints under the old identity instead.)
TEST_P(FaultTest, PeerRestartedOnSamePortIsStaleAndNeverWritten) {
  if (!tcp()) {
    GTEST_SKIP() << GetParam()
                 << ": its endpoints are per process (a UCX worker address, a side channel on a "
                    "port of its own), never reused by a restart; see "
                    "TransportFailures.RestartOnTheSameAddressIsStaleWithZeroBytesLanded";
  }
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
  // Known-stale peers fail fast without touching the network: no connection is opened, and
  // the answer comes far sooner than any network timer could end it (connect 1000 ms, progress
  // 500 ms). 250 ms: a loaded 2-core machine once took 58 ms for this in-memory refusal, so a
  // 50 ms bound flaked; half the progress timeout still tells a refusal from a wait.
  const uint64_t opened_before = Must(engine_->GetTransportStats("tcp")).connections_opened;
  auto t0 = Clock::now();
  Status again = engine_->Transfer(std::vector{Op(OpCode::kWrite, "restarts", 0, 4096)});
  const double stale_ms = MsSince(t0);
  EXPECT_TRUE(again.IsStalePeer()) << again.ToString();
  EXPECT_LT(stale_ms, 250) << "a known-stale peer must be refused without waiting";
  EXPECT_EQ(Must(engine_->GetTransportStats("tcp")).connections_opened, opened_before)
      << "a known-stale peer was connected to";
  std::printf("known-stale refusal: %.2f ms\n", stale_ms);
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

// tcp only: lanes, sockets and TIME_WAIT are tcp's (the connection bound of every transport
// is TransportFailures.ManySubmittersStayWithinTheConnectionBound in tests/conformance).
TEST_P(FaultTest, SixteenSubmittersStayWithinLaneBoundWithoutTimeWaitBurst) {
  if (!tcp()) {
    GTEST_SKIP() << GetParam() << ": lanes per peer and TIME_WAIT sockets are tcp's mechanics";
  }
  int seconds = 10;  // KVB_FAULT_SOAK_SECONDS=N for a longer soak
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

TEST_P(FaultTest, DeadAndFrozenPeersDoNotSlowHealthyPeer) {
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
  // Where a frozen peer stalls nothing (one-sided RMA), only the dead one is a bad peer.
  const bool freeze = !SkipIfFrozenPeerStallsNothing();
  if (freeze) frozen->Signal(SIGSTOP);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> bad_ok{0}, bad_failed{0};
  std::vector<std::thread> hammer;
  for (int t = 0; t < 4; ++t) {
    hammer.emplace_back([&, t] {
      const std::string target = t % 2 || !freeze ? "dead" : "frozen2";
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
  // (which would cost their 500 ms progress timeout): 20 ms of slack tells the two apart. A
  // 1 ms slack failed when builds shared the machine (p50 0.04 -> 2.4 ms, nothing waiting on
  // the bad peers). ucx adds its idle-poll quantum: its progress threads (ours and the peer's)
  // sleep up to ucx.idle_poll_ms (1 ms) once idle, so an op's latency sits at ~0.05 ms or
  // ~1.8 ms depending on whether other traffic (here, the hammering of the bad peers) keeps
  // them spinning; measured baselines swing between the two.
  const double slack_ms = tcp() ? 20.0 : 20.0 + 2 * 1.0;
  EXPECT_LT(p50, 2 * p50_base + slack_ms);
  EXPECT_LT(p99, 100.0) << "a healthy op waited behind a bad peer";
}

class AuthFaultTest : public FaultTest {
  void Configure(EngineOptions& o) override { o.cluster_token = "right-token"; }
};

TEST_P(AuthFaultTest, PeerWithWrongTokenIsRefused) {
  auto peer = StartPeer("intruder", 0, 1, {"--token", "wrong-token"}, 1 << 20);
  ASSERT_TRUE(peer);
  // Its descriptor is sealed under its own token: refused before any connection.
  Result<PeerId> added = engine_->AddPeer(peer->descriptor());
  EXPECT_EQ(added.status().code(), StatusCode::kUnauthenticated) << added.status().ToString();
  // Re-sealed under this engine's token (a relay holding the token vouches for a process that
  // lacks it), the descriptor is taken, and the transport's own handshake refuses the peer.
  core::Descriptor d = Must(core::DecodeDescriptor(peer->descriptor()));
  Must(engine_->AddPeer(core::EncodeDescriptor(d, "right-token")));
  const std::string crc = peer->Command("CRC");
  Status st = engine_->Transfer(std::vector{Op(OpCode::kWrite, "intruder", 0, 4096)});
  EXPECT_EQ(st.code(), StatusCode::kUnauthenticated) << st.ToString();
  EXPECT_EQ(peer->Command("CRC"), crc);
  // A peer holding the right token is served.
  auto friendly = StartPeer("friend", 0, 2, {"--token", "right-token"}, 1 << 20);
  ASSERT_TRUE(friendly);
  Must(engine_->AddPeer(friendly->descriptor()));
  EXPECT_TRUE(engine_->Transfer(std::vector{Op(OpCode::kWrite, "friend", 0, 4096)}).ok());
}

// Seed 003: a node reachable over several NICs, none of them its "host" address. The peer lives
// in its own network namespace with two veth links; cutting one link (every packet dropped, as
// with a pulled cable) must leave it reachable through the other.
TEST_P(FaultTest, PeerWithTwoNicsStaysReachableWhenOneIsCut) {
  if (!tcp()) {
    GTEST_SKIP() << GetParam()
                 << ": a listen list of several host:port endpoints is tcp's; ucx publishes one "
                    "worker address, verbs its NICs' GIDs (multi-path across transports: "
                    "tests/multipath_net; verbs rails: tests/verbs)";
  }
  std::string why;
  auto ns = testing::NetNamespace::Create(2, &why);
  if (!ns) GTEST_SKIP() << "network namespaces unavailable: " << why;
  const std::string listen = ns->RemoteAddress(0) + ":0," + ns->RemoteAddress(1) + ":0";
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

INSTANTIATE_TEST_SUITE_P(Transports, FaultTest, ::testing::Values(KVB_FAULT_TRANSPORTS),
                         [](const auto& info) { return info.param; });
INSTANTIATE_TEST_SUITE_P(Transports, AuthFaultTest, ::testing::Values(KVB_FAULT_TRANSPORTS),
                         [](const auto& info) { return info.param; });

// Says which known transports this build left out of the list above, and why.
TEST(FaultTransportList, TransportsNotBuiltAreNamed) {
  if (std::string(KVB_FAULT_NOT_BUILT).empty()) return;
  GTEST_SKIP() << KVB_FAULT_NOT_BUILT;
}

}  // namespace
}  // namespace kvbridge

// Path failover across two real transports (docs/transfer-engine.md, "Several transports per
// peer"): a peer process reachable over tcp and over ucx with ucx.same_host=off (UCX's own tcp
// transport), both engines with transports = {"tcp", "ucx"} and path_failover on. The peer lives
// in a network namespace behind a veth pair; while several threads keep WRITE+READ batches
// going, an nftables rule inside the namespace drops every packet to the tcp plugin's port (the
// preferred path dies, as with a firewall change; UCX's connections use other ports). No
// operation may fail and every byte read back must be the one written. The tcp unit-level
// version with mock transports is tests/unit/test_multipath.cc.
//
// Needs root, iproute2 (`ip netns`), nft and the ucx plugin; otherwise skipped with the reason.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/descriptor.h"
#include "kvbridge/engine.h"
#include "tests/common/test_util.h"

namespace kvbridge {
namespace {

using testing::Buffer;
using testing::Must;
using testing::NetNamespace;
using testing::PeerProcess;
using Clock = std::chrono::steady_clock;

constexpr size_t kPeerBytes = 32u << 20;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

TEST(FailoverNet, TcpCutUnderLoadFailsOverToUcxWithNoFailedOp) {
#ifndef KVB_FAILOVER_HAVE_UCX
  GTEST_SKIP() << "the ucx transport plugin is not built (plugins/transport_ucx/CMakeLists.txt)";
#else
  if (system("nft --version >/dev/null 2>&1") != 0) GTEST_SKIP() << "nft is not installed";
  std::string why;
  auto ns = NetNamespace::Create(1, &why);
  if (!ns) GTEST_SKIP() << "network namespaces unavailable: " << why;
  if (!ns->Exec("nft add table inet kvbfail")) {
    GTEST_SKIP() << "nft cannot add a table inside namespace " << ns->name();
  }
  // UCX's tcp transport would also offer lo; pin each side to its end of the veth pair, the
  // only link between the two.
  const std::string here_dev = "kvh" + std::to_string(getpid() % 100000) + "_0";
  const std::string there_dev = "kvr" + std::to_string(getpid() % 100000) + "_0";
  setenv("UCX_NET_DEVICES", here_dev.c_str(), 1);

  const uint16_t port = 20000 + getpid() % 20000;  // inside the namespace: nothing else listens
  auto peer = PeerProcess::Start(
      {"--node-id", "twopath", "--transport", "tcp,ucx", "--config", "ucx.same_host=off",
       "--config", "ucx.connect_timeout_ms=2000", "--listen",
       ns->RemoteAddress(0) + ":" + std::to_string(port), "--size", std::to_string(kPeerBytes),
       "--seed", "3"},
      {"ip", "netns", "exec", ns->name(), "env", "UCX_NET_DEVICES=" + there_dev});
  ASSERT_TRUE(peer) << "the peer did not start in namespace " << ns->name();

  EngineOptions o = testing::LoopbackOptions("tcp", "client");
  o.transports = {"tcp", "ucx"};
  o.path_failover = true;
  o.default_deadline_ms = 15000;
  o.progress_timeout_ms = 500;
  o.plugin_config["ucx.same_host"] = "off";
  o.plugin_config["ucx.connect_timeout_ms"] = "2000";
  o.plugin_config["tcp.connect_timeout_ms"] = "500";
  auto engine = Must(TransferEngine::Create(o));
  Buffer local(kPeerBytes);
  Must(engine->RegisterMemory(local.data(), local.size()));
  // The namespace stands for another machine, but its process shares this one's boot, IPC and
  // pid namespaces, hence its host key: with that key the engine would try ucx first
  // (KVB_TCAP_LOCAL_SHM). Give it another machine's key, as it would have there.
  core::Descriptor d = Must(core::DecodeDescriptor(peer->descriptor()));
  d.host_key = "another-machine";
  Must(engine->AddPeer(core::EncodeDescriptor(d)));
  auto health = engine->GetPeerHealth("twopath");
  ASSERT_TRUE(health.has_value());
  ASSERT_EQ(health->paths.size(), 2u) << "the peer is not reachable over both transports";
  ASSERT_EQ(health->paths[0].transport, "tcp");
  ASSERT_EQ(health->paths[1].transport, "ucx");

  // Each thread owns a disjoint quarter: WRITE a fresh pattern, READ it back into the upper
  // half of its quarter, compare.
  constexpr int kThreads = 4;
  const size_t quarter = kPeerBytes / kThreads, half = quarter / 2;
  constexpr size_t kOp = 256 * 1024;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> batches{0}, failed{0}, wrong{0}, moved{0};
  std::mutex first_error_mu;
  std::string first_error;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const size_t base = t * quarter;
      for (uint64_t seed = 100 + t * 100000; !stop.load(); ++seed) {
        local.Fill(seed, base, half);
        std::vector<TransferOp> writes, reads;
        for (size_t off = 0; off < half; off += kOp) {
          writes.push_back(
              {OpCode::kWrite, local.data() + base + off, kOp, "twopath", 1, base + off});
          reads.push_back(
              {OpCode::kRead, local.data() + base + half + off, kOp, "twopath", 1, base + off});
        }
        for (auto* ops : {&writes, &reads}) {
          BatchResult r = engine->Wait(Must(engine->Submit(*ops)));
          ++batches;
          if (!r.op_path_history.empty()) ++moved;
          if (!r.status.ok()) {
            ++failed;
            std::lock_guard<std::mutex> lk(first_error_mu);
            if (first_error.empty()) first_error = r.status.ToString();
          }
        }
        if (!local.Matches(seed, base + half, half, base)) ++wrong;
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  const TransportStats tcp_before = Must(engine->GetTransportStats("tcp"));
  const TransportStats ucx_before = Must(engine->GetTransportStats("ucx"));
  const uint64_t batches_before = batches.load();
  const auto cut = Clock::now();
  ASSERT_TRUE(ns->Exec("nft add chain inet kvbfail in '{ type filter hook input priority 0; }'") &&
              ns->Exec("nft add rule inet kvbfail in tcp dport " + std::to_string(port) + " drop"))
      << "could not install the drop rule";
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  stop = true;
  for (auto& th : threads) th.join();
  const TransportStats tcp_after = Must(engine->GetTransportStats("tcp"));
  const TransportStats ucx_after = Must(engine->GetTransportStats("ucx"));
  std::printf(
      "failover: %llu batches (%llu before the cut), %llu failed, %llu with ops moved, %llu "
      "read back wrong; tcp bytes %llu -> %llu, ucx bytes %llu -> %llu over %.0f ms after the "
      "cut\n",
      (unsigned long long)batches.load(), (unsigned long long)batches_before,
      (unsigned long long)failed.load(), (unsigned long long)moved.load(),
      (unsigned long long)wrong.load(),
      (unsigned long long)(tcp_before.bytes_written + tcp_before.bytes_read),
      (unsigned long long)(tcp_after.bytes_written + tcp_after.bytes_read),
      (unsigned long long)(ucx_before.bytes_written + ucx_before.bytes_read),
      (unsigned long long)(ucx_after.bytes_written + ucx_after.bytes_read), MsSince(cut));
  EXPECT_EQ(failed.load(), 0u) << "first failure: " << first_error;
  EXPECT_EQ(wrong.load(), 0u) << "bytes read back differ from the bytes written";
  EXPECT_GT(batches_before, 0u) << "no load before the cut";
  EXPECT_GT(tcp_before.bytes_written + tcp_before.bytes_read, 0u)
      << "tcp, the preferred path, carried nothing before the cut";
  EXPECT_GT(batches.load(), batches_before + 4) << "the load stopped after the cut";
  EXPECT_GT(moved.load(), 0u) << "no op failed over: the cut did not hit the load";
  EXPECT_GT(ucx_after.bytes_written + ucx_after.bytes_read,
            ucx_before.bytes_written + ucx_before.bytes_read)
      << "ucx carried nothing after the cut";
  // After the cut, a whole-region WRITE and READ back through the path that is left.
  local.Fill(7, 0, half);
  ASSERT_TRUE(
      engine->Transfer(std::vector{TransferOp{OpCode::kWrite, local.data(), half, "twopath", 1, 0}})
          .ok());
  std::memset(local.data() + half, 0, half);
  ASSERT_TRUE(engine
                  ->Transfer(std::vector{
                      TransferOp{OpCode::kRead, local.data() + half, half, "twopath", 1, 0}})
                  .ok());
  EXPECT_TRUE(local.Matches(7, half, half, 0));
#endif
}

}  // namespace
}  // namespace kvbridge

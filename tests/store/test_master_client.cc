// MasterClient (csrc/store/master_client.h) against a real `kvbridge master` process on
// loopback: the master is killed (-9) and restarted on the same port, or started with a
// cluster token the client lacks, and each test checks what the client's call then does
// (its deadline, the error naming the address and the RPC, what is retried and what not).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "store/master_client.h"
#include "tests/common/test_util.h"
#include "tests/store/master_client_fixture.h"
#include "tests/store/store_procs.h"

namespace kvbridge {
namespace {

using testing::ChildProcess;
using Clock = std::chrono::steady_clock;

int64_t MsSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

using MasterClientTest = testing::MasterClientFixture;

// The master killed: a retryable call keeps trying until its deadline, then fails naming the
// RPC and the address, as a master failure; a call that is not retried fails at once.
TEST_F(MasterClientTest, MasterDownFailsByTheDeadlineNamingAddressAndRpc) {
  StartMaster();
  auto client = Client(/*rpc_timeout_ms=*/1500);
  ASSERT_TRUE(client->Exists(keys_).ok());
  master_->Kill();

  const uint64_t before = client->attempts();
  const auto start = Clock::now();
  Result<std::vector<bool>> exists = client->Exists(keys_);
  const int64_t took = MsSince(start);
  ASSERT_FALSE(exists.ok());
  const Status& st = exists.status();
  std::printf("master down: %s after %lld ms\n", st.ToString().c_str(),
              static_cast<long long>(took));
  EXPECT_TRUE(st.IsPeerUnreachable() || st.IsDeadlineExceeded()) << st.ToString();
  EXPECT_EQ(st.origin(), StatusOrigin::kMaster) << st.ToString();
  EXPECT_NE(st.message().find("Exists"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find(address_), std::string::npos) << st.ToString();
  EXPECT_GT(client->attempts() - before, 1u) << "UNAVAILABLE is retried";
  // Retried until (about) the deadline, never past it.
  EXPECT_GE(took, 1000) << st.ToString();
  EXPECT_LT(took, 1500 + 1000) << st.ToString();

  // Remove changes state: sent once, failed at once.
  const uint64_t before_remove = client->attempts();
  const auto start_remove = Clock::now();
  Result<std::vector<Status>> removed = client->Remove(keys_);
  ASSERT_FALSE(removed.ok());
  EXPECT_EQ(client->attempts() - before_remove, 1u);
  EXPECT_LT(MsSince(start_remove), 1000) << removed.status().ToString();
  EXPECT_NE(removed.status().message().find("Remove"), std::string::npos);
  EXPECT_NE(removed.status().message().find(address_), std::string::npos);
}

// A master restarted on the same port is reached again by the same client: a call made while
// it is down succeeds once it is back, within the call's total deadline.
TEST_F(MasterClientTest, MasterRestartedOnTheSamePortIsReachedAgain) {
  StartMaster();
  auto client = Client(/*rpc_timeout_ms=*/10000);
  ASSERT_TRUE(client->Stats().ok());
  master_->Kill();
  // Fails once, so the channel has seen the master gone before the call under test.
  ASSERT_FALSE(client->Remove(keys_).ok());

  std::thread restart([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
    StartMaster();
  });
  const uint64_t before = client->attempts();
  const auto start = Clock::now();
  Result<ClusterStatus> stats = client->Stats();
  const int64_t took = MsSince(start);
  restart.join();
  std::printf("master restarted: Stats answered after %lld ms, %llu attempts\n",
              static_cast<long long>(took),
              static_cast<unsigned long long>(client->attempts() - before));
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_GE(took, 700) << "answered before the master was back?";
  EXPECT_GT(client->attempts() - before, 1u);
  EXPECT_TRUE(client->Exists(keys_).ok());
}

// A caller without the master's token, or with another one, is refused with UNAUTHENTICATED,
// named as such, and not asked again (a retry cannot fix a token).
TEST_F(MasterClientTest, WrongTokenIsRefusedAndNotRetried) {
  const std::string token = "the-master-client-test-token";
  StartMaster(token);
  for (const std::string& wrong : {std::string(), std::string("another-token")}) {
    auto client = Client(/*rpc_timeout_ms=*/3000, wrong);
    const auto start = Clock::now();
    Result<std::vector<bool>> exists = client->Exists(keys_);
    ASSERT_FALSE(exists.ok()) << "token '" << wrong << "'";
    EXPECT_EQ(exists.status().code(), StatusCode::kUnauthenticated) << exists.status().ToString();
    EXPECT_EQ(exists.status().origin(), StatusOrigin::kMaster);
    EXPECT_NE(exists.status().message().find(address_), std::string::npos)
        << exists.status().ToString();
    EXPECT_EQ(client->attempts(), 1u) << "UNAUTHENTICATED was retried";
    EXPECT_LT(MsSince(start), 1000);
  }
  EXPECT_TRUE(Client(3000, token)->Exists(keys_).ok());
}

// The retry policy is one table: the idempotent reads are retried, nothing that changes state.
TEST(MasterRetryTable, RetriesTheIdempotentReadsOnly) {
  using store::MasterClient;
  namespace m = store::method;
  for (auto read : {m::kGetReplicas, m::kExists, m::kGetNodeDescriptors, m::kStats}) {
    EXPECT_TRUE(MasterClient::Retryable(read)) << read;
  }
  for (auto once : {m::kPutStart, m::kPutEnd, m::kRemove, m::kRemoveAll, m::kRemoveByRegex,
                    m::kReportBadReplica, m::kRegisterNode, m::kRegisterNodeStream, m::kHeartbeat,
                    m::kTaskDone, m::kDemoteDone, m::kDrain, m::kDeregister, m::kCommit}) {
    EXPECT_FALSE(MasterClient::Retryable(once)) << once;
  }
}

// A node's MasterClient sends heartbeats on a TCP connection of its own (so a slow call on
// the main channel cannot hold one up behind it): one call on each channel makes two
// connections to the master. Heartbeats are not retried by the client (the node's heartbeat
// loop is their retry); after the master is killed and restarted they reach it again.
TEST_F(MasterClientTest, HeartbeatHasItsOwnConnection) {
  StartMaster();
  auto client = Client(/*rpc_timeout_ms=*/3000, "", /*heartbeat_channel=*/true);
  const PeerId node{"not-registered", 42};
  ASSERT_TRUE(client->Exists(keys_).ok());
  // An unknown node: the master answers NOT_FOUND (a node would register again).
  Result<store::HeartbeatAnswer> beat = client->Heartbeat(node, 0);
  EXPECT_TRUE(beat.status().IsNotFound()) << beat.status().ToString();
  EXPECT_EQ(testing::CountSocketsToPort(port_).established, 2)
      << "the heartbeat shares the main channel's connection";

  master_->Kill();
  beat = client->Heartbeat(node, 0);
  EXPECT_FALSE(beat.ok());
  EXPECT_NE(beat.status().message().find("Heartbeat"), std::string::npos);
  EXPECT_NE(beat.status().message().find(address_), std::string::npos);
  StartMaster();
  const auto until = Clock::now() + std::chrono::seconds(5);
  do {
    beat = client->Heartbeat(node, 0);  // not retried by the client: the loop asks again
  } while (!beat.status().IsNotFound() && Clock::now() < until);
  EXPECT_TRUE(beat.status().IsNotFound()) << beat.status().ToString();
  EXPECT_TRUE(client->Exists(keys_).ok());
}

}  // namespace
}  // namespace kvbridge

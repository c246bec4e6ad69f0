// sdk::Host (kvbridge/plugin/sdk/common.hpp): logging under the plugin's name, typed
// configuration whose errors name the key and the value, and the ABI 1.2 identity and handshake
// services, which answer UNSUPPORTED on an older host's shorter table.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kvbridge/plugin/sdk/common.hpp"
#include "tests/sdk/sdk_test_util.h"

namespace kvbridge::plugin::sdk {
namespace {

using testing::FakeHost;

TEST(SdkHost, LogsUnderThePluginsNameWithFormatting) {
  FakeHost fake;
  Host host(fake.table(), "myplug");
  host.Log(KVB_LOG_WARN, "lane %d of %s closed", 3, "peer-a");
  ASSERT_EQ(fake.logs.size(), 1u);
  EXPECT_EQ(fake.logs[0].level, KVB_LOG_WARN);
  EXPECT_EQ(fake.logs[0].plugin, "myplug");
  EXPECT_EQ(fake.logs[0].msg, "lane 3 of peer-a closed");
  EXPECT_EQ(host.NowNs(), 12345u);
}

TEST(SdkHost, ConfigParsesTypesAndDefaults) {
  FakeHost fake;
  fake.config = {{"p.lanes", "17"},
                 {"p.ratio", "0.25"},
                 {"p.on", "on"},
                 {"p.off", "false"},
                 {"p.name", "abc"},
                 {"p.neg", "-5"},
                 {"p.long", std::string(1000, 'x')}};
  Host host(fake.table(), "p");
  EXPECT_EQ(*host.Config<uint32_t>("p.lanes", 4, 1, 64), 17u);
  EXPECT_EQ(*host.Config<uint32_t>("p.unset", 4, 1, 64), 4u);
  EXPECT_DOUBLE_EQ(*host.Config<double>("p.ratio", 1.0, 0.0, 1.0), 0.25);
  EXPECT_EQ(*host.Config<int>("p.neg", 0, -10, 10), -5);
  EXPECT_TRUE(*host.Config<bool>("p.on", false));
  EXPECT_FALSE(*host.Config<bool>("p.off", true));
  EXPECT_TRUE(*host.Config<bool>("p.unset", true));
  EXPECT_EQ(*host.Config<std::string>("p.name", "d"), "abc");
  EXPECT_EQ(*host.Config<std::string>("p.unset", "d"), "d");
  // Longer than the first buffer the SDK tries: it asks again with more room.
  EXPECT_EQ(*host.Config<std::string>("p.long", ""), std::string(1000, 'x'));
}

TEST(SdkHost, ConfigErrorsNameTheKeyAndTheValue) {
  FakeHost fake;
  fake.config = {{"p.lanes", "abc"},  {"p.zero", "0"},
                 {"p.neg", "-1"},     {"p.big", "99999999999999999999"},
                 {"p.flag", "maybe"}, {"p.tail", "12x"}};
  Host host(fake.table(), "p");
  auto bad = host.Config<uint32_t>("p.lanes", 4, 1, 64);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), KVB_ERR_INVALID_ARGUMENT);
  EXPECT_HAS(bad.status().message(), "p.lanes");
  EXPECT_HAS(bad.status().message(), "'abc'");
  EXPECT_HAS(bad.status().message(), "not an unsigned integer");

  auto range = host.Config<uint32_t>("p.zero", 4, 1, 64);
  ASSERT_FALSE(range.ok());
  EXPECT_HAS(range.status().message(), "p.zero: '0' is out of range [1, 64]");

  auto neg = host.Config<uint64_t>("p.neg", 4);
  ASSERT_FALSE(neg.ok());
  EXPECT_HAS(neg.status().message(), "p.neg: '-1'");

  auto big = host.Config<uint64_t>("p.big", 4);
  ASSERT_FALSE(big.ok());
  EXPECT_HAS(big.status().message(), "'99999999999999999999' is not an unsigned integer that fits");

  auto tail = host.Config<int>("p.tail", 4);
  ASSERT_FALSE(tail.ok());
  EXPECT_HAS(tail.status().message(), "p.tail: '12x' is not an integer");

  auto flag = host.Config<bool>("p.flag", false);
  ASSERT_FALSE(flag.ok());
  EXPECT_HAS(flag.status().message(), "p.flag: 'maybe' is not a boolean");
}

TEST(SdkHost, IdentityOnAnAbi1_2Host) {
  FakeHost fake;
  Host host(fake.table(), "p");
  EXPECT_EQ(*host.NodeId(), "n1");
  EXPECT_EQ(*host.Incarnation(), 99u);
}

TEST(SdkHost, Abi1_2ServicesAnswerUnsupportedOnAnAbi1_1Table) {
  FakeHost fake;
  fake.ShrinkToAbi1_1();  // the 1.2 pointers are still set beyond struct_size: never read
  fake.config = {{"p.lanes", "8"}};
  Host host(fake.table(), "p");
  auto node = host.NodeId();
  ASSERT_FALSE(node.ok());
  EXPECT_EQ(node.status().code(), KVB_ERR_UNSUPPORTED);
  EXPECT_HAS(node.status().message(), "'node_id'");
  auto inc = host.Incarnation();
  ASSERT_FALSE(inc.ok());
  EXPECT_EQ(inc.status().code(), KVB_ERR_UNSUPPORTED);
  auto auth = host.BeginAuth(KVB_AUTH_CLIENT, "n2", 7);
  ASSERT_FALSE(auth.ok());
  EXPECT_EQ(auth.status().code(), KVB_ERR_UNSUPPORTED);
  EXPECT_HAS(auth.status().message(), "older than ABI 1.2");
  EXPECT_TRUE(fake.auth_transport.empty()) << "auth_begin was called beyond struct_size";
  // The 1.0 services still work.
  EXPECT_EQ(*host.Config<uint32_t>("p.lanes", 4), 8u);
  host.Log(KVB_LOG_INFO, "still logs");
  EXPECT_EQ(fake.logs.size(), 1u);
}

TEST(SdkHost, NullServicesAnswerUnsupportedAndOlderTablesDegrade) {
  FakeHost fake;
  fake.mutable_table().node_id = nullptr;
  fake.mutable_table().auth_step = nullptr;
  Host host(fake.table(), "p");
  EXPECT_EQ(host.NodeId().status().code(), KVB_ERR_UNSUPPORTED);
  EXPECT_EQ(host.BeginAuth(KVB_AUTH_SERVER).status().code(), KVB_ERR_UNSUPPORTED);
  EXPECT_EQ(*host.Incarnation(), 99u);

  // No table at all: nothing is logged, keys read as unset, the clock still runs.
  Host none(nullptr, "p");
  none.Log(KVB_LOG_ERROR, "dropped");
  EXPECT_EQ(*none.Config<uint32_t>("p.lanes", 4), 4u);
  EXPECT_GT(none.NowNs(), 0u);
  EXPECT_EQ(none.NodeId().status().code(), KVB_ERR_UNSUPPORTED);
}

TEST(SdkHost, AuthSessionRunsTheHandshakeAndEndsItOnce) {
  FakeHost fake;
  Host host(fake.table(), "myplug");
  {
    auto session = host.BeginAuth(KVB_AUTH_CLIENT, "n2", 7);
    ASSERT_TRUE(session.ok()) << session.status().message();
    EXPECT_EQ(fake.auth_transport, "myplug");  // proofs are labelled with the plugin's name
    EXPECT_EQ(fake.auth_role, KVB_AUTH_CLIENT);
    EXPECT_EQ(fake.auth_expected, "n2");
    EXPECT_EQ(fake.auth_expected_inc, 7u);

    std::vector<uint8_t> out;
    Status st = session->Step({}, &out);  // the client's first call: in = NULL
    EXPECT_EQ(st.code(), KVB_IN_PROGRESS);
    EXPECT_EQ(std::string(out.begin(), out.end()), "step1");
    ASSERT_EQ(fake.steps_in.size(), 1u);
    EXPECT_TRUE(fake.steps_in[0].empty());

    const uint8_t msg[] = {2, 'h', 'i'};
    EXPECT_EQ(*session->Need(Bytes(msg, 0)), 1u);
    EXPECT_EQ(*session->Need(Bytes(msg, 1)), 3u);
    const uint8_t junk[] = {0xff};
    EXPECT_EQ(session->Need(Bytes(junk, 1)).status().code(), KVB_ERR_PROTOCOL);

    st = session->Step(Bytes(msg, 3), &out);
    EXPECT_TRUE(st.ok()) << st.message();
    EXPECT_EQ(std::string(out.begin(), out.end()), "step2");
    EXPECT_EQ(fake.steps_in[1], std::vector<uint8_t>(msg, msg + 3));
    auto peer = session->Peer();
    ASSERT_TRUE(peer.ok());
    EXPECT_EQ(peer->node_id, "n2");
    EXPECT_EQ(peer->incarnation, 7u);

    st = session->Step(Bytes(msg, 3), &out);
    EXPECT_EQ(st.code(), KVB_ERR_STALE_PEER);
    EXPECT_EQ(st.message(), "peer n2 is incarnation 8, not 7");

    AuthSession moved = std::move(*session);  // ownership moves; still one auth_end
    EXPECT_EQ(fake.auth_ends, 0);
  }
  EXPECT_EQ(fake.auth_ends, 1);

  auto server = host.BeginAuth(KVB_AUTH_SERVER);
  ASSERT_TRUE(server.ok());
  EXPECT_EQ(fake.auth_expected, "(null)");  // a server names no peer
  fake.refuse_auth = true;
  auto refused = host.BeginAuth(KVB_AUTH_CLIENT, "n2", 7);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), KVB_ERR_UNAUTHENTICATED);
  EXPECT_EQ(refused.status().message(), "no token configured");
}

TEST(SdkResult, HoldsAValueOrAnError) {
  Result<uint64_t> v = uint64_t{5};
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, 5u);
  EXPECT_TRUE(v.status().ok());
  Result<uint64_t> e = Status(KVB_ERR_NO_SPACE, "full");
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), KVB_ERR_NO_SPACE);
  EXPECT_EQ(e.status().message(), "full");
  Result<std::string> bug = Status();  // OK without a value is a bug, not a success
  ASSERT_FALSE(bug.ok());
  EXPECT_EQ(bug.status().code(), KVB_ERR_INTERNAL);
  // A bare code never silently becomes a numeric value.
  static_assert(!std::is_convertible_v<kvb_status_t, Result<uint64_t>>);
  static_assert(std::is_convertible_v<Status, Result<uint64_t>>);

  char err[8];
  EXPECT_EQ(Status(KVB_ERR_IO, "disk on fire").ToAbi(err, sizeof(err)), KVB_ERR_IO);
  EXPECT_STREQ(err, "disk on");  // truncated, NUL-terminated
}

}  // namespace
}  // namespace kvbridge::plugin::sdk

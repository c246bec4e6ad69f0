// The master's lean port (csrc/store/fast_rpc.h, docs/store.md "The master's lean port")
// against a real `kvbridge master` process on loopback: the store client's four calls go
// there and fall back to gRPC when it is off or gone; the master is killed (-9) and restarted
// on the same port, or frozen (SIGSTOP); raw sockets send it frames that do not parse and
// hellos without the cluster token, and each test checks that the master closes only that
// connection, serves nothing for it, and keeps serving everyone else.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge.grpc.pb.h"
#include "store/fast_rpc.h"
#include "store/master_client.h"
#include "store/rpc_auth.h"
#include "tests/common/raw_socket.h"
#include "tests/common/test_util.h"
#include "tests/store/master_client_fixture.h"
#include "tests/store/store_procs.h"
#include "util/little_endian.h"

namespace kvbridge {
namespace {

using testing::ChildProcess;
using Clock = std::chrono::steady_clock;

const std::string kToken = "the-lean-port-test-token";

int64_t MsSince(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
}

// A raw connection to the lean port, speaking its frames by hand.
class RawConn {
 public:
  explicit RawConn(uint16_t port) : fd_(testing::ConnectLoopback(port)) {}
  ~RawConn() {
    if (fd_ >= 0) ::close(fd_);
  }
  int fd() const { return fd_; }

  bool Send(const std::string& bytes) {
    return ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL) ==
           static_cast<ssize_t>(bytes.size());
  }
  // Exactly n bytes, or "" when the connection closes or nothing comes within timeout_ms.
  std::string Read(size_t n, int timeout_ms = 5000) {
    std::string out(n, '\0');
    size_t got = 0;
    const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (got < n && Clock::now() < until) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const ssize_t r = ::recv(fd_, out.data() + got, n - got, 0);
      if (r <= 0) return "";
      got += static_cast<size_t>(r);
    }
    return got == n ? out : "";
  }
  // The server's hello: its nonce (and whether it demands a token).
  bool Hello(store::AuthNonce* nonce, bool* token_required) {
    const std::string h = Read(24);
    if (h.size() != 24 || h.compare(0, 4, "KVBH") != 0) return false;
    const auto* b = reinterpret_cast<const uint8_t*>(h.data());
    EXPECT_EQ(util::GetLe16(b + 4), 1u) << "protocol version";
    *token_required = (util::GetLe16(b + 6) & 1) != 0;
    std::memcpy(nonce->data(), b + 8, nonce->size());
    return true;
  }
  // A reply frame: its code, message and payload; false when none comes whole.
  bool Reply(int* code, std::string* message, std::string* payload = nullptr) {
    const std::string head = Read(16);
    if (head.size() != 16 || head.compare(0, 4, "KVBR") != 0) return false;
    const auto* b = reinterpret_cast<const uint8_t*>(head.data());
    *code = static_cast<int>(util::GetLe32(b + 4));
    *message = Read(util::GetLe32(b + 8));
    const std::string body = Read(util::GetLe32(b + 12));
    if (payload) *payload = body;
    return true;
  }

 private:
  int fd_;
};

std::string Le16(uint16_t v) {
  std::string s(2, '\0');
  util::PutLe16(reinterpret_cast<uint8_t*>(s.data()), v);
  return s;
}
std::string Le32(uint32_t v) {
  std::string s(4, '\0');
  util::PutLe32(reinterpret_cast<uint8_t*>(s.data()), v);
  return s;
}
std::string ClientHello(const std::string& proof) {
  return "KVBA" + Le16(1) + Le16(static_cast<uint16_t>(proof.size())) + proof;
}
std::string Request(uint16_t method, const std::string& payload, uint32_t claimed_len) {
  return "KVBQ" + Le16(method) + Le16(0) + Le32(claimed_len) + payload;
}
std::string Request(uint16_t method, const std::string& payload) {
  return Request(method, payload, static_cast<uint32_t>(payload.size()));
}

class MasterFastPortTest : public testing::MasterClientFixture {
 protected:
  void TearDown() override { unsetenv("KVBRIDGE_MASTER_FAST_PATH"); }

  // Where the master says its lean port is (0: none), asked over gRPC with `token`.
  uint16_t LeanPort(const std::string& token = "") {
    auto stub =
        rpc::Master::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    store::RpcAuth(token).Sign(&ctx, store::method::kFastPath);
    rpc::FastPathReply reply;
    const grpc::Status st = stub->FastPath(&ctx, rpc::Empty(), &reply);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return static_cast<uint16_t>(reply.port());
  }

  // The master still answers a lean-port client (a fresh one, so that no pooled connection
  // hides a dead port).
  void ExpectServing(const std::string& token = "") {
    auto client = Client(3000, token);
    Result<std::vector<bool>> exists = client->Exists(keys_);
    ASSERT_TRUE(exists.ok()) << exists.status().ToString();
    EXPECT_EQ(client->fast_calls(), 1u) << "the call did not go over the lean port";
  }

  // Exists, as a raw request's payload.
  std::string ExistsPayload() const {
    rpc::KeysRequest req;
    for (const auto& k : keys_) req.add_keys(k);
    return req.SerializeAsString();
  }
};

// The client's four calls go over the lean port by default; with the port turned off at the
// master (--fast-port off), at the client (Options::fast_path, KVBRIDGE_MASTER_FAST_PATH=off),
// they all go over gRPC and answer the same.
TEST_F(MasterFastPortTest, ClientCallsUseTheLeanPortUnlessItIsOff) {
  StartMaster();
  ASSERT_NE(LeanPort(), 0u);
  auto client = Client(3000);
  ASSERT_TRUE(client->Exists(keys_).ok());
  Result<std::vector<store::ReadGrant>> got = client->GetReplicas(keys_, "test-client", false);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got.value().size(), keys_.size());
  for (const auto& g : got.value()) EXPECT_TRUE(g.status.IsNotFound()) << g.status.ToString();
  // No node: PutStart is answered per key (no space), which is an answer all the same.
  const std::vector<std::vector<uint64_t>> sizes(keys_.size(), std::vector<uint64_t>{4096});
  Result<std::vector<store::PutGrant>> grants =
      client->PutStart(keys_, sizes, 1, "test-client").Wait();
  ASSERT_TRUE(grants.ok()) << grants.status().ToString();
  ASSERT_EQ(grants.value().size(), keys_.size());
  for (const auto& g : grants.value()) EXPECT_FALSE(g.status.ok());
  std::vector<store::PutEndItem> ends(keys_.size());
  for (size_t i = 0; i < keys_.size(); ++i) ends[i].key = keys_[i];
  Result<std::vector<Status>> ended = client->PutEnd(ends);
  ASSERT_TRUE(ended.ok()) << ended.status().ToString();
  for (const Status& st : ended.value()) EXPECT_FALSE(st.ok()) << "ended a put never started";
  EXPECT_EQ(client->fast_calls(), 4u);
  EXPECT_EQ(client->fast_fallbacks(), 0u);

  auto off = Client(3000, "", /*heartbeat_channel=*/false, /*fast_path=*/false);
  ASSERT_TRUE(off->Exists(keys_).ok());
  EXPECT_EQ(off->fast_calls(), 0u);
  setenv("KVBRIDGE_MASTER_FAST_PATH", "off", 1);
  auto env_off = Client(3000);
  unsetenv("KVBRIDGE_MASTER_FAST_PATH");
  ASSERT_TRUE(env_off->GetReplicas(keys_, "test-client", false).ok());
  EXPECT_EQ(env_off->fast_calls(), 0u);

  master_->Kill();
  StartMaster("", {"--fast-port", "off"});
  EXPECT_EQ(LeanPort(), 0u);
  auto no_port = Client(3000);
  ASSERT_TRUE(no_port->Exists(keys_).ok());
  ASSERT_TRUE(no_port->GetReplicas(keys_, "test-client", false).ok());
  EXPECT_EQ(no_port->fast_calls(), 0u);
  EXPECT_EQ(no_port->fast_fallbacks(), 0u) << "the client tried a lean port the master lacks";
}

// A fixed lean port given on the command line is the one the master listens on; a port that
// is taken stops the start with an error naming it.
TEST_F(MasterFastPortTest, FixedLeanPortIsUsedAndATakenOneIsANamedError) {
  const uint16_t fixed = testing::FreePort();
  StartMaster("", {"--fast-port", std::to_string(fixed)});
  EXPECT_EQ(LeanPort(), fixed);
  ExpectServing();

  auto second =
      ChildProcess::Start({testing::KvbridgeBin(), "master", "--listen",
                           "127.0.0.1:" + std::to_string(testing::FreePort()), "--metrics-listen",
                           "off", "--fast-port", std::to_string(fixed)},
                          {"sh", "-c", "exec \"$0\" \"$@\" 2>&1"});
  const std::string said = second->ReadAll(15000);
  EXPECT_NE(second->Wait(5000), 0) << said;
  EXPECT_NE(said.find("fast_port"), std::string::npos) << said;
  EXPECT_NE(said.find(std::to_string(fixed)), std::string::npos) << said;

  auto bad = ChildProcess::Start({testing::KvbridgeBin(), "master", "--fast-port", "70000"},
                                 {"sh", "-c", "exec \"$0\" \"$@\" 2>&1"});
  const std::string bad_said = bad->ReadAll(15000);
  EXPECT_EQ(bad->Wait(5000), 2) << bad_said;
  EXPECT_NE(bad_said.find("--fast-port"), std::string::npos) << bad_said;
}

// kill -9 of the master and a restart on the same gRPC port (its lean port is another one
// now): the client's next calls fall back to gRPC at once, none fails once the master is
// back, and within a few seconds they are on the new lean port again.
TEST_F(MasterFastPortTest, MasterKilledAndRestartedOnTheSamePort) {
  StartMaster();
  auto client = Client(/*rpc_timeout_ms=*/10000);
  ASSERT_TRUE(client->Exists(keys_).ok());
  ASSERT_EQ(client->fast_calls(), 1u);
  const uint16_t before = LeanPort();
  master_->Kill();

  std::thread restart([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
    StartMaster();
  });
  // A retryable read made while the master is down: answered once it is back.
  const auto start = Clock::now();
  Result<std::vector<bool>> exists = client->Exists(keys_);
  restart.join();
  ASSERT_TRUE(exists.ok()) << exists.status().ToString();
  EXPECT_GE(MsSince(start), 700) << "answered before the master was back?";
  EXPECT_GE(client->fast_fallbacks(), 1u) << "the dead lean port was not noticed";
  std::printf("restart: lean port %u -> %u, %llu fallbacks\n", before, LeanPort(),
              static_cast<unsigned long long>(client->fast_fallbacks()));

  const uint64_t fast_before = client->fast_calls();
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (client->fast_calls() == fast_before && Clock::now() < until) {
    Result<std::vector<bool>> again = client->Exists(keys_);
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_GT(client->fast_calls(), fast_before) << "never back on the restarted master's lean port";
}

// A frozen master (SIGSTOP): a call on the lean port ends by its deadline, as over gRPC, and
// the same client is served once the master runs again.
TEST_F(MasterFastPortTest, FrozenMasterCostsACallItsDeadline) {
  StartMaster();
  auto client = Client(/*rpc_timeout_ms=*/1500);
  ASSERT_TRUE(client->Exists(keys_).ok());
  master_->Signal(SIGSTOP);
  const auto start = Clock::now();
  Result<std::vector<bool>> exists = client->Exists(keys_);
  const int64_t took = MsSince(start);
  master_->Signal(SIGCONT);
  ASSERT_FALSE(exists.ok());
  EXPECT_TRUE(exists.status().IsDeadlineExceeded() || exists.status().IsPeerUnreachable())
      << exists.status().ToString();
  EXPECT_GE(took, 1000) << exists.status().ToString();
  EXPECT_LT(took, 1500 + 1500) << exists.status().ToString();
  const uint64_t fast_before = client->fast_calls();
  Result<std::vector<bool>> after = client->Exists(keys_);
  ASSERT_TRUE(after.ok()) << after.status().ToString();
  EXPECT_GT(client->fast_calls(), fast_before);
}

// Frames that do not parse close their connection, and only it: a hello that is not a
// client's, a request with another magic, one claiming more than the size limit, one cut off
// mid-payload. A request for a method the port lacks is answered UNIMPLEMENTED on a connection
// that stays usable, and a payload that is not the method's message INVALID_ARGUMENT.
TEST_F(MasterFastPortTest, MalformedFramesCloseOnlyTheirConnection) {
  StartMaster();
  const uint16_t lean = LeanPort();
  ASSERT_NE(lean, 0u);
  store::AuthNonce nonce{};
  bool token_required = true;
  int code = -1;
  std::string message;

  RawConn good(lean);  // stays open through everything below
  ASSERT_TRUE(good.Hello(&nonce, &token_required));
  EXPECT_FALSE(token_required);
  ASSERT_TRUE(good.Send(ClientHello("")));
  ASSERT_TRUE(good.Reply(&code, &message));
  ASSERT_EQ(code, 0) << message;

  {
    RawConn c(lean);
    ASSERT_TRUE(c.Hello(&nonce, &token_required));
    ASSERT_TRUE(c.Send("GET / HTTP/1.1\r\n\r\n"));
    EXPECT_TRUE(testing::ClosedWithin(c.fd(), 5000)) << "a hello that is not a client's";
  }
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"another magic", "XXXX" + Le16(4) + Le16(0) + Le32(0)},
      {"over the size limit", Request(4, "", 0x7fffffff)},
  };
  for (const auto& [what, frame] : bad) {
    RawConn c(lean);
    ASSERT_TRUE(c.Hello(&nonce, &token_required));
    ASSERT_TRUE(c.Send(ClientHello("")));
    ASSERT_TRUE(c.Reply(&code, &message));
    ASSERT_TRUE(c.Send(frame));
    EXPECT_TRUE(testing::ClosedWithin(c.fd(), 5000)) << what;
  }
  {
    // Cut off: the header claims 100 bytes, 10 come, then the sender shuts its side.
    RawConn c(lean);
    ASSERT_TRUE(c.Hello(&nonce, &token_required));
    ASSERT_TRUE(c.Send(ClientHello("")));
    ASSERT_TRUE(c.Reply(&code, &message));
    ASSERT_TRUE(c.Send(Request(4, std::string(10, 'x'), 100)));
    ::shutdown(c.fd(), SHUT_WR);
    EXPECT_TRUE(testing::ClosedWithin(c.fd(), 5000)) << "a frame cut off";
  }

  ASSERT_TRUE(good.Send(Request(99, "")));
  ASSERT_TRUE(good.Reply(&code, &message));
  EXPECT_EQ(code, grpc::StatusCode::UNIMPLEMENTED) << message;
  EXPECT_NE(message.find("99"), std::string::npos) << message;
  ASSERT_TRUE(good.Send(Request(4, std::string("\xff\xff\xff", 3))));
  ASSERT_TRUE(good.Reply(&code, &message));
  EXPECT_EQ(code, grpc::StatusCode::INVALID_ARGUMENT) << message;
  // The same connection still answers a well-formed call.
  std::string payload;
  ASSERT_TRUE(good.Send(Request(4, ExistsPayload())));
  ASSERT_TRUE(good.Reply(&code, &message, &payload));
  EXPECT_EQ(code, 0) << message;
  rpc::ExistsReply reply;
  ASSERT_TRUE(reply.ParseFromString(payload));
  EXPECT_EQ(reply.exists_size(), static_cast<int>(keys_.size()));
  ExpectServing();
}

// With a cluster token, a connection is served only after its hello proves the token, bound
// to that connection's nonce: no proof, another token's proof, or a proof made for another
// connection's nonce is answered UNAUTHENTICATED and the connection closed, and a request sent
// anyway is never answered.
TEST_F(MasterFastPortTest, LeanPortWantsTheClusterTokenPerConnection) {
  StartMaster(kToken);
  const uint16_t lean = LeanPort(kToken);
  ASSERT_NE(lean, 0u);
  const store::RpcAuth right(kToken), wrong("another-token");
  store::AuthNonce nonce{}, other_nonce{};
  bool token_required = false;
  int code = -1;
  std::string message;

  RawConn other(lean);  // its nonce, for a proof replayed on another connection
  ASSERT_TRUE(other.Hello(&other_nonce, &token_required));
  EXPECT_TRUE(token_required);

  struct Case {
    std::string what;
    std::string proof;  // for this connection's nonce unless replayed
    bool replay;
  };
  const std::vector<Case> cases = {
      {"no proof", "", false},
      {"another token's proof", "", false},
      {"a proof for another connection", "", true},
      {"a proof for a gRPC method", right.Proof(store::method::kExists), false},
  };
  for (const Case& c : cases) {
    RawConn conn(lean);
    ASSERT_TRUE(conn.Hello(&nonce, &token_required)) << c.what;
    std::string proof = c.proof;
    if (c.what == "another token's proof") proof = wrong.Proof(store::fast::ConnectMethod(nonce));
    if (c.replay) proof = right.Proof(store::fast::ConnectMethod(other_nonce));
    // The request right behind the hello: it must not be served.
    ASSERT_TRUE(conn.Send(ClientHello(proof) + Request(4, ExistsPayload())));
    ASSERT_TRUE(conn.Reply(&code, &message)) << c.what;
    EXPECT_EQ(code, grpc::StatusCode::UNAUTHENTICATED) << c.what << ": " << message;
    EXPECT_TRUE(testing::ClosedWithin(conn.fd(), 5000)) << c.what << ": still open";
  }

  // The right proof for this connection's own nonce is served.
  RawConn conn(lean);
  ASSERT_TRUE(conn.Hello(&nonce, &token_required));
  ASSERT_TRUE(conn.Send(ClientHello(right.Proof(store::fast::ConnectMethod(nonce)))));
  ASSERT_TRUE(conn.Reply(&code, &message));
  ASSERT_EQ(code, 0) << message;
  std::string payload;
  ASSERT_TRUE(conn.Send(Request(4, ExistsPayload())));
  ASSERT_TRUE(conn.Reply(&code, &message, &payload));
  EXPECT_EQ(code, 0) << message;

  // A client with another token is refused (not by a fallback to gRPC that would hide it);
  // one with the right token is served on the lean port.
  auto stranger = Client(3000, "another-token");
  Result<std::vector<bool>> refused = stranger->Exists(keys_);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnauthenticated) << refused.status().ToString();
  ExpectServing(kToken);
}

// The lean port holds at most Server::kMaxConnections connections. One more is closed at once,
// before its hello; a client that connects then uses gRPC for that call and is answered, while
// a client that already holds a connection goes on using it; once connections close, the
// port takes new ones again.
TEST_F(MasterFastPortTest, ConnectionsPastTheCapAreClosedAndTheirClientsUseGrpc) {
  constexpr size_t kCap = store::fast::Server::kMaxConnections;
  // This process holds kCap sockets and the master (started from here, inheriting the limit)
  // as many again.
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &before), 0);
  const rlim_t want = kCap + 512;
  if (before.rlim_max != RLIM_INFINITY && before.rlim_max < want) {
    GTEST_SKIP() << "RLIMIT_NOFILE's hard limit here is " << before.rlim_max << ", under the "
                 << want << " descriptors the test needs";
  }
  rlimit raised = before;
  raised.rlim_cur = std::max<rlim_t>(before.rlim_cur, want);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &raised), 0) << std::strerror(errno);
  struct Restore {
    rlimit lim;
    ~Restore() { ::setrlimit(RLIMIT_NOFILE, &lim); }
  } restore{before};

  StartMaster();
  const uint16_t lean = LeanPort();
  auto holder = Client(3000);  // keeps one connection open (idle in its pool)
  ASSERT_TRUE(holder->Exists(keys_).ok());
  ASSERT_EQ(holder->fast_calls(), 1u);

  // The rest of the cap, each connection taken by the master (its hello read).
  std::vector<std::unique_ptr<RawConn>> conns;
  store::AuthNonce nonce{};
  bool token_required = false;
  const auto fill = Clock::now();
  for (size_t i = 0; i + 1 < kCap; ++i) {
    conns.push_back(std::make_unique<RawConn>(lean));
    ASSERT_GE(conns.back()->fd(), 0) << "connection " << i;
    ASSERT_TRUE(conns.back()->Hello(&nonce, &token_required)) << "connection " << i;
  }
  std::printf("%zu connections open in %lld ms\n", kCap, static_cast<long long>(MsSince(fill)));

  // One more: closed at once, no hello.
  {
    RawConn extra(lean);
    const auto start = Clock::now();
    EXPECT_FALSE(extra.Hello(&nonce, &token_required)) << "a connection past the cap was served";
    EXPECT_LT(MsSince(start), 4000) << "left open rather than closed";
  }
  // A new client is answered over gRPC; the holder still on its lean connection.
  auto newcomer = Client(3000);
  Result<std::vector<bool>> exists = newcomer->Exists(keys_);
  ASSERT_TRUE(exists.ok()) << exists.status().ToString();
  EXPECT_EQ(newcomer->fast_calls(), 0u);
  EXPECT_GE(newcomer->fast_fallbacks(), 1u);
  ASSERT_TRUE(holder->Exists(keys_).ok());
  EXPECT_EQ(holder->fast_calls(), 2u) << "the connection it held was not kept";

  // Some close: the newcomer is back on the lean port (it asks again 2 s after a fallback).
  conns.resize(conns.size() - 64);
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (newcomer->fast_calls() == 0 && Clock::now() < until) {
    ASSERT_TRUE(newcomer->Exists(keys_).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_GT(newcomer->fast_calls(), 0u) << "the port never took a connection again";
  conns.clear();
}

// A forked child never uses the connections it inherited, which are its parent's sockets too
// (the answers to one's requests could be read by the other): parent and child call at once,
// on the same MasterClient object (each its copy), asking about 2 and 3 keys, and each gets
// answers of its own length; the child's calls go over a lean connection of its own.
TEST_F(MasterFastPortTest, AForkedChildConnectsOnItsOwn) {
  StartMaster();
  auto client = Client(3000);
  ASSERT_TRUE(client->Exists(keys_).ok());  // a pooled connection to inherit
  ASSERT_EQ(client->fast_calls(), 1u);
  const std::vector<std::string> child_keys{"c0", "c1", "c2"};
  constexpr int kSeconds = 2;
  // Calls for kSeconds; 0 when every answer was right, else the step that went wrong.
  auto hammer = [&](const std::vector<std::string>& keys) -> int {
    const auto until = Clock::now() + std::chrono::seconds(kSeconds);
    while (Clock::now() < until) {
      Result<std::vector<bool>> r = client->Exists(keys);
      if (!r.ok()) return 2;
      if (r->size() != keys.size()) return 3;
    }
    return 0;
  };
  const pid_t child = ::fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    const uint64_t fast_before = client->fast_calls();
    int rc = hammer(child_keys);
    if (rc == 0 && client->fast_calls() == fast_before) rc = 4;  // not on the lean port
    ::_exit(rc);  // no destructors: the parent's objects are not the child's to shut down
  }
  const int parent_rc = hammer(keys_);
  int status = 0;
  pid_t waited = 0;
  const auto until = Clock::now() + std::chrono::seconds(kSeconds + 20);
  while ((waited = ::waitpid(child, &status, WNOHANG)) == 0 && Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (waited == 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
    FAIL() << "the child did not finish its calls";
  }
  EXPECT_EQ(parent_rc, 0) << "the parent got a wrong answer (2: a failed call, 3: another length)";
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child: 2 a failed call, 3 an answer of another "
                                       "length, 4 no call on the lean port";
}

// A lean port whose connection attempts are dropped (a firewall: SYNs go unanswered) costs a
// call at most the 1 s connect cap, after which the call goes over gRPC, and the calls of the
// next 2 s go over gRPC at once; once the port answers again the client is back on it. The
// master runs in a network namespace whose nft drops every packet to its lean port. Needs
// root, iproute2 and nft; skipped with the reason otherwise.
TEST_F(MasterFastPortTest, ALeanPortThatDropsConnectionAttemptsCostsOneSecondOnce) {
  std::string why;
  auto ns = testing::NetNamespace::Create(1, &why);
  if (!ns) GTEST_SKIP() << "network namespaces unavailable: " << why;
  if (!ns->Exec("nft --version")) {
    GTEST_SKIP() << "nft is not installed (scripts/setup.sh installs it)";
  }
  const std::string there = ns->RemoteAddress(0);
  const uint16_t lean = testing::FreePort();  // the namespace's ports are all free
  address_ = there + ":" + std::to_string(testing::FreePort());
  master_ = testing::StartMaster(address_, {"--fast-port", std::to_string(lean)},
                                 {"ip", "netns", "exec", ns->name()});
  ASSERT_TRUE(master_);
  ASSERT_EQ(LeanPort(), lean);
  const std::string table = "inet kvbleandrop";
  ASSERT_TRUE(ns->Exec("nft add table " + table) &&
              ns->Exec("nft 'add chain " + table + " in { type filter hook input priority 0; }'") &&
              ns->Exec("nft add rule " + table + " in tcp dport " + std::to_string(lean) + " drop"))
      << "could not install the nft drop rule";

  auto client = Client(/*rpc_timeout_ms=*/5000);
  auto start = Clock::now();
  Result<std::vector<bool>> exists = client->Exists(keys_);
  const int64_t first = MsSince(start);
  ASSERT_TRUE(exists.ok()) << exists.status().ToString();
  EXPECT_EQ(client->fast_calls(), 0u);
  EXPECT_EQ(client->fast_fallbacks(), 1u);
  EXPECT_GE(first, 900) << "the connect did not wait for its cap: was the port dropped?";
  EXPECT_LT(first, 3000) << "a dropped lean port cost more than its 1 s cap";
  start = Clock::now();
  ASSERT_TRUE(client->Exists(keys_).ok());
  const int64_t second = MsSince(start);
  EXPECT_LT(second, 500) << "the next call tried the dropped port again";
  EXPECT_EQ(client->fast_fallbacks(), 1u);
  std::printf("dropped lean port: first call %lld ms, next %lld ms\n",
              static_cast<long long>(first), static_cast<long long>(second));

  ASSERT_TRUE(ns->Exec("nft delete table " + table));
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (client->fast_calls() == 0 && Clock::now() < until) {
    ASSERT_TRUE(client->Exists(keys_).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  EXPECT_GT(client->fast_calls(), 0u) << "never back on the lean port once it answered";
  master_.reset();  // before its namespace goes
}

}  // namespace
}  // namespace kvbridge

// The daemons' observability with real processes: /metrics values that move with puts and gets,
// /health ok and 503 with the reason, the bearer token, a busy --metrics-listen, gRPC's health
// service, and the master's status page rendered by a headless Chromium (skipped without one).
// In-process masters check what the daemons cannot show: the leader hook and that an embedded
// master serves no HTTP unless asked.
#include <arpa/inet.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zlib.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <future>
#include <set>
#include <thread>

#include "kvbridge/store.h"
#include "tests/common/http_get.h"
#include "tests/common/test_util.h"
#include "tests/store/store_procs.h"

namespace kvbridge {
namespace {

using testing::ChildProcess;
using testing::FreePort;
using testing::HttpGet;
using testing::HttpReply;
using testing::Must;
using testing::ParseSamples;
using Clock = std::chrono::steady_clock;

std::string Loopback(uint16_t port) { return "127.0.0.1:" + std::to_string(port); }

// grpc.health.v1.Health/Check of `service` at `address`, through a generic call with the two
// messages encoded by hand (HealthCheckRequest{string service = 1}, HealthCheckResponse{enum
// status = 1}). The status number (1 SERVING, 2 NOT_SERVING), or -1 with *why when the call
// failed (NOT_FOUND: a service the server does not know).
int HealthCheck(const std::string& address, const std::string& service, std::string* why) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  std::string request;
  if (!service.empty()) {
    request.push_back(0x0a);
    request.push_back(static_cast<char>(service.size()));
    request += service;
  }
  grpc::Slice slice(request);
  grpc::ByteBuffer req(&slice, 1), resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                 [&](grpc::Status s) { done.set_value(s); });
  grpc::Status st = done.get_future().get();
  if (!st.ok()) {
    *why = std::to_string(st.error_code()) + ": " + st.error_message();
    return -1;
  }
  std::vector<grpc::Slice> slices;
  (void)resp.Dump(&slices);
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  if (bytes.empty()) return 0;  // UNKNOWN, the default, is sent as nothing
  if (bytes.size() != 2 || bytes[0] != 0x08) {
    *why = "unexpected reply of " + std::to_string(bytes.size()) + " bytes";
    return -1;
  }
  return bytes[1];
}

class StoreObs : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("KVBRIDGE_LOG_LEVEL", "warn", 1);
    master_addr_ = Loopback(FreePort());
    master_http_ = FreePort();
    node_http_ = FreePort();
    node_rpc_ = Loopback(FreePort());
  }

  void StartMasterAndNode(const std::string& node_id,
                          const std::vector<std::string>& master_extra = {}) {
    std::vector<std::string> extra = {"--node-ttl-ms", "1500", "--metrics-listen",
                                      Loopback(master_http_)};
    extra.insert(extra.end(), master_extra.begin(), master_extra.end());
    master_ = testing::StartMaster(master_addr_, extra);
    ASSERT_TRUE(master_);
    node_ = testing::StartNode(master_addr_, node_id,
                               {"--dram-bytes", std::to_string(kNodeBytes), "--metrics-listen",
                                Loopback(node_http_), "--rpc-listen", node_rpc_});
    ASSERT_TRUE(node_);
    ASSERT_TRUE(testing::WaitForActiveNodes(master_addr_, 1));
  }

  static constexpr uint64_t kNodeBytes = 64ull << 20;
  std::string master_addr_, node_rpc_;
  uint16_t master_http_ = 0, node_http_ = 0;
  std::unique_ptr<ChildProcess> master_, node_;
};

TEST_F(StoreObs, MetricsMoveWithPutsAndGets) {
  StartMasterAndNode("obs-node");
  StoreOptions so;
  so.master_address = master_addr_;
  so.engine.node_id = "obs-client";
  so.engine.transports = {"tcp"};
  auto client = Must(StoreClient::Create(so));
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(client->Put("key" + std::to_string(i), std::string(4096, 'a' + i)).ok());
  }
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(client->Get("key" + std::to_string(i)).ok());
  EXPECT_FALSE(client->Get("no-such-key").ok());

  HttpReply m = HttpGet(master_http_, "/metrics");
  ASSERT_EQ(m.status, 200) << m.error;
  EXPECT_EQ(m.content_type, "text/plain; version=0.0.4; charset=utf-8");
  auto s = ParseSamples(m.body);
  EXPECT_EQ(s["kvbridge_master_objects"], 3) << m.body;
  EXPECT_EQ(s["kvbridge_master_stored_bytes"], 3 * 4096);
  EXPECT_EQ(s["kvbridge_master_is_leader"], 1);
  EXPECT_EQ(s["kvbridge_master_nodes{state=\"ACTIVE\"}"], 1);
  EXPECT_EQ(s["kvbridge_master_node_capacity_bytes{node=\"obs-node\",tier=\"dram\"}"], kNodeBytes);
  EXPECT_GE(s["kvbridge_master_node_used_bytes{node=\"obs-node\",tier=\"dram\"}"], 3 * 4096);
  EXPECT_EQ(s["kvbridge_master_node_replicas{node=\"obs-node\"}"], 3);
  EXPECT_LT(s["kvbridge_master_node_heartbeat_age_seconds{node=\"obs-node\"}"], 1.5);
  EXPECT_GE(s["kvbridge_master_keys_total{op=\"put\"}"], 3);
  EXPECT_GE(s["kvbridge_master_get_keys_total{result=\"dram\"}"], 3);
  EXPECT_GE(s["kvbridge_master_get_keys_total{result=\"miss\"}"], 1);
  EXPECT_EQ(s["kvbridge_master_get_keys_total{result=\"ssd\"}"], 0);
  EXPECT_GE(s["kvbridge_master_rpc_duration_seconds_count{method=\"PutStart\"}"], 3);
  EXPECT_GE(s["kvbridge_master_rpc_duration_seconds_count{method=\"GetReplicas\"}"], 4);
  EXPECT_EQ(s["kvbridge_master_rpc_duration_seconds_bucket{method=\"GetReplicas\",le=\"+Inf\"}"],
            s["kvbridge_master_rpc_duration_seconds_count{method=\"GetReplicas\"}"]);

  HttpReply n = HttpGet(node_http_, "/metrics");
  ASSERT_EQ(n.status, 200) << n.error;
  auto ns = ParseSamples(n.body);
  EXPECT_EQ(ns["kvbridge_node_capacity_bytes{tier=\"dram\"}"], kNodeBytes) << n.body;
  EXPECT_EQ(ns["kvbridge_node_objects{tier=\"dram\"}"], 3);
  EXPECT_EQ(ns["kvbridge_node_used_bytes{tier=\"dram\"}"], 3 * 4096);
  EXPECT_EQ(ns["kvbridge_node_registered"], 1);
  EXPECT_EQ(ns["kvbridge_node_draining"], 0);
  // Transfers the node starts itself (none here: the client drove every put and get).
  EXPECT_EQ(
      ns.count("kvbridge_node_transport_bytes_total{transport=\"tcp\",direction=\"written\"}"), 1u);

  // The status page's data names the node and the registration event.
  HttpReply j = HttpGet(master_http_, "/status.json");
  ASSERT_EQ(j.status, 200);
  EXPECT_EQ(j.content_type, "application/json");
  EXPECT_NE(j.body.find("\"node_id\": \"obs-node\""), std::string::npos) << j.body;
  EXPECT_NE(j.body.find("\"kind\": \"registered\""), std::string::npos) << j.body;
}

// A node lost: the master counts the expiry and lists it among its events, and the survivors'
// metrics show the re-replication they ran and the breakers of the paths they copied over.
TEST_F(StoreObs, NodeLossShowsInMetricsAndEvents) {
  StartMasterAndNode("obs-repair-0");
  std::vector<std::unique_ptr<ChildProcess>> more;
  std::vector<uint16_t> http = {node_http_};
  for (int i = 1; i < 3; ++i) {
    http.push_back(FreePort());
    more.push_back(testing::StartNode(
        master_addr_, "obs-repair-" + std::to_string(i),
        {"--dram-bytes", std::to_string(kNodeBytes), "--metrics-listen", Loopback(http.back())}));
    ASSERT_TRUE(more.back());
  }
  ASSERT_TRUE(testing::WaitForActiveNodes(master_addr_, 3));
  StoreOptions so;
  so.master_address = master_addr_;
  so.replica_num = 2;
  so.engine.node_id = "obs-repair-client";
  so.engine.transports = {"tcp"};
  auto client = Must(StoreClient::Create(so));
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(client->Put("repair" + std::to_string(i), std::string(8192, 'r')).ok());
  }
  more[1]->Kill();  // obs-repair-2: silent from now on
  auto master_metrics = [&] { return ParseSamples(HttpGet(master_http_, "/metrics").body); };
  const auto until = Clock::now() + std::chrono::seconds(30);
  auto m = master_metrics();
  while ((m["kvbridge_master_nodes_expired_total"] < 1 ||
          m["kvbridge_master_under_replicated_objects"] > 0 ||
          m["kvbridge_master_replication_tasks_in_flight"] > 0) &&
         Clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    m = master_metrics();
  }
  EXPECT_EQ(m["kvbridge_master_nodes_expired_total"], 1);
  EXPECT_EQ(m["kvbridge_master_nodes{state=\"ACTIVE\"}"], 2);
  EXPECT_EQ(m["kvbridge_master_nodes{state=\"DEAD\"}"], 1);
  EXPECT_EQ(m["kvbridge_master_under_replicated_objects"], 0);
  EXPECT_EQ(m["kvbridge_master_under_replicated_oldest_age_seconds"], 0);
  EXPECT_EQ(m.count("kvbridge_master_node_replicas{node=\"obs-repair-2\"}"), 0u);
  EXPECT_EQ(m["kvbridge_master_node_replicas{node=\"obs-repair-0\"}"] +
                m["kvbridge_master_node_replicas{node=\"obs-repair-1\"}"],
            40);
  const std::string events = HttpGet(master_http_, "/status.json").body;
  EXPECT_NE(events.find("node obs-repair-2#"), std::string::npos) << events;
  EXPECT_NE(events.find("\"kind\": \"expired\""), std::string::npos) << events;
  // The copies were made by the survivors, over tcp to each other.
  double tasks = 0;
  size_t breakers = 0;
  for (int i = 0; i < 2; ++i) {
    auto n = ParseSamples(HttpGet(http[i], "/metrics").body);
    tasks += n["kvbridge_node_replication_tasks_total{result=\"ok\"}"];
    const std::string other = "obs-repair-" + std::to_string(1 - i);
    auto it = n.find("kvbridge_node_peer_breaker_state{peer=\"" + other + "\",transport=\"tcp\"}");
    if (it != n.end()) {
      ++breakers;
      EXPECT_EQ(it->second, 0) << "the path to " << other << " is not closed";
    }
  }
  EXPECT_GE(tasks, 1);
  EXPECT_GE(breakers, 1u);
}

TEST_F(StoreObs, HealthSaysWhyANodeLostItsMaster) {
  StartMasterAndNode("obs-health-node");
  HttpReply mh = HttpGet(master_http_, "/health");
  EXPECT_EQ(mh.status, 200);
  EXPECT_EQ(mh.body, "ok\n");
  EXPECT_EQ(HttpGet(node_http_, "/health").status, 200);
  master_->Signal(SIGKILL);
  (void)master_->Wait(5000);
  HttpReply nh;
  const auto until = Clock::now() + std::chrono::seconds(20);
  do {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    nh = HttpGet(node_http_, "/health");
  } while (nh.status == 200 && Clock::now() < until);
  EXPECT_EQ(nh.status, 503) << nh.body;
  EXPECT_NE(nh.body.find("not registered with the master at " + master_addr_), std::string::npos)
      << nh.body;
  auto ns = ParseSamples(HttpGet(node_http_, "/metrics").body);
  EXPECT_EQ(ns["kvbridge_node_registered"], 0);
  EXPECT_GE(ns["kvbridge_node_heartbeat_failures_total"], 1);
}

TEST_F(StoreObs, ExplicitBusyMetricsAddressIsAStartupError) {
  master_ = testing::StartMaster(master_addr_, {"--metrics-listen", Loopback(master_http_)});
  ASSERT_TRUE(master_);
  // Through a shell, for its stderr.
  auto second = ChildProcess::Start({"/bin/sh", "-c",
                                     "exec " + testing::KvbridgeBin() + " master --listen " +
                                         Loopback(FreePort()) + " --metrics-listen " +
                                         Loopback(master_http_) + " 2>&1"});
  ASSERT_TRUE(second);
  const std::string said = second->ReadAll(20000);
  EXPECT_EQ(second->Wait(20000), 1) << said;
  EXPECT_NE(said.find("cannot serve HTTP on " + Loopback(master_http_)), std::string::npos) << said;
}

// The default port (0.0.0.0:9480) taken, by this test or by anyone on the host: the master
// says so and serves without its endpoint.
TEST_F(StoreObs, BusyDefaultPortIsAWarning) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(9480);
  // The port must be held for the whole test: a master of another test (ctest -j2) that holds
  // it now would give it up before this one starts. So wait for it to be ours.
  const int one = 1;
  (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    if (std::chrono::steady_clock::now() > give_up) {
      close(fd);
      GTEST_SKIP() << "port 9480 stayed held by another process for 30 s";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_EQ(listen(fd, 1), 0);
  unsetenv("KVBRIDGE_METRICS_LISTEN");
  auto p = ChildProcess::Start(
      {"/bin/sh", "-c",
       "exec " + testing::KvbridgeBin() + " master --listen " + master_addr_ + " 2>&1"});
  ASSERT_TRUE(p);
  std::string said;
  for (int i = 0; i < 5 && said.find("listening on") == std::string::npos; ++i) {
    said += p->ReadLine(20000) + "\n";
  }
  close(fd);
  EXPECT_NE(said.find("master runs without its HTTP endpoint"), std::string::npos) << said;
  EXPECT_NE(said.find("0.0.0.0:9480"), std::string::npos) << said;
  EXPECT_NE(said.find("kvbridge master listening on " + master_addr_ + "\n"), std::string::npos)
      << said;
  EXPECT_GE(testing::ActiveNodes(master_addr_), 0);  // it serves
}

TEST_F(StoreObs, TokenGuardsMetricsButNotHealth) {
  setenv("KVBRIDGE_CLUSTER_TOKEN", "obs-test-token", 1);
  master_ = testing::StartMaster(master_addr_, {"--metrics-listen", Loopback(master_http_)});
  unsetenv("KVBRIDGE_CLUSTER_TOKEN");
  ASSERT_TRUE(master_);
  HttpReply none = HttpGet(master_http_, "/metrics");
  EXPECT_EQ(none.status, 401);
  EXPECT_EQ(none.body.find("kvbridge_master"), std::string::npos) << none.body;
  EXPECT_EQ(HttpGet(master_http_, "/status.json").status, 401);
  EXPECT_EQ(HttpGet(master_http_, "/metrics", "Bearer not-the-token").status, 401);
  HttpReply ok = HttpGet(master_http_, "/metrics", "Bearer obs-test-token");
  EXPECT_EQ(ok.status, 200);
  EXPECT_NE(ok.body.find("kvbridge_master_is_leader 1"), std::string::npos);
  EXPECT_EQ(HttpGet(master_http_, "/status.json", "Bearer obs-test-token").status, 200);
  HttpReply health = HttpGet(master_http_, "/health");
  EXPECT_EQ(health.status, 200);
  EXPECT_EQ(health.body, "ok\n");
}

TEST_F(StoreObs, GrpcHealthServing) {
  StartMasterAndNode("obs-grpc-node");
  std::string why;
  EXPECT_EQ(HealthCheck(master_addr_, "", &why), 1) << why;
  EXPECT_EQ(HealthCheck(master_addr_, "kvbridge.rpc.Master", &why), 1) << why;
  EXPECT_EQ(HealthCheck(master_addr_, "no.such.Service", &why), -1);
  EXPECT_NE(why.find(std::to_string(grpc::StatusCode::NOT_FOUND)), std::string::npos) << why;
  EXPECT_EQ(HealthCheck(node_rpc_, "", &why), 1) << why;
  EXPECT_EQ(HealthCheck(node_rpc_, "kvbridge.rpc.Node", &why), 1) << why;
}

TEST_F(StoreObs, StatusWatchRedrawsUntilStopped) {
  StartMasterAndNode("obs-watch-node");
  auto watch = ChildProcess::Start(
      {testing::KvbridgeBin(), "status", "--master", master_addr_, "--watch", "--interval", "0.2"});
  ASSERT_TRUE(watch);
  std::string out;  // what it printed in 2.5 s, while it keeps running
  for (const auto until = Clock::now() + std::chrono::milliseconds(2500); Clock::now() < until;) {
    out += watch->ReadLine(500) + "\n";
  }
  watch->Kill();
  size_t tables = 0;
  for (size_t at = out.find("obs-watch-node"); at != std::string::npos;
       at = out.find("obs-watch-node", at + 1)) {
    ++tables;
  }
  EXPECT_GE(tables, 3u) << out;
  EXPECT_NE(out.find("every 0.2s"), std::string::npos) << out;
  auto lone = ChildProcess::Start({"/bin/sh", "-c",
                                   "exec " + testing::KvbridgeBin() + " status --master " +
                                       master_addr_ + " --interval 1 2>&1"});
  ASSERT_TRUE(lone);
  EXPECT_NE(lone->ReadAll(10000).find("--interval goes with --watch"), std::string::npos);
  EXPECT_EQ(lone->Wait(10000), 2);
}

// Every metric docs/grafana/kvbridge.json queries is one the daemons expose (a renamed metric
// must not leave an empty panel behind), and every panel has a query.
TEST_F(StoreObs, GrafanaDashboardUsesOnlyExposedMetrics) {
  std::ifstream f(KVBRIDGE_SOURCE_DIR "/docs/grafana/kvbridge.json");
  ASSERT_TRUE(f) << "cannot read docs/grafana/kvbridge.json";
  const std::string dashboard((std::istreambuf_iterator<char>(f)),
                              std::istreambuf_iterator<char>());
  StartMasterAndNode("obs-grafana-node");
  const std::string exposed =
      HttpGet(master_http_, "/metrics").body + HttpGet(node_http_, "/metrics").body;
  ASSERT_NE(exposed.find("# TYPE kvbridge_node_"), std::string::npos);
  auto is_type = [&](const std::string& name, const std::string& type) {
    return exposed.find("# TYPE " + name + " " + type + "\n") != std::string::npos;
  };
  std::set<std::string> used;
  for (size_t at = dashboard.find("kvbridge_"); at != std::string::npos;
       at = dashboard.find("kvbridge_", at + 1)) {
    size_t end = at;
    while (end < dashboard.size() &&
           (std::islower(static_cast<unsigned char>(dashboard[end])) || dashboard[end] == '_')) {
      ++end;
    }
    const std::string name = dashboard.substr(at, end - at);
    if (name == "kvbridge_" || dashboard.compare(at - 1, 1, "\"") == 0) continue;  // uid, tags
    used.insert(name);
    at = end;
  }
  ASSERT_GE(used.size(), 20u);
  for (const std::string& name : used) {
    std::string base = name;
    for (const std::string suffix : {"_bucket", "_sum", "_count"}) {
      if (base.size() > suffix.size() &&
          base.compare(base.size() - suffix.size(), suffix.size(), suffix) == 0 &&
          is_type(base.substr(0, base.size() - suffix.size()), "histogram")) {
        base.resize(base.size() - suffix.size());
      }
    }
    EXPECT_TRUE(is_type(base, "counter") || is_type(base, "gauge") || is_type(base, "histogram"))
        << "the dashboard queries " << name << ", which no daemon exposes";
  }
  size_t panels = 0, exprs = 0;
  for (size_t at = dashboard.find("\"gridPos\""); at != std::string::npos;
       at = dashboard.find("\"gridPos\"", at + 1)) {
    ++panels;
  }
  for (size_t at = dashboard.find("\"expr\""); at != std::string::npos;
       at = dashboard.find("\"expr\"", at + 1)) {
    ++exprs;
  }
  EXPECT_GE(exprs, panels);
}

TEST(StoreObsInProcess, EmbeddedMasterServesNoHttpUnlessAsked) {
  MasterOptions o;
  o.listen = "127.0.0.1:0";
  auto plain = Must(MasterServer::Start(o));
  EXPECT_EQ(plain->metrics_address(), "");
  o.metrics_listen = "127.0.0.1:0";
  auto served = Must(MasterServer::Start(o));
  EXPECT_NE(served->metrics_address(), "");
  // A busy address: an error naming it, or, best effort, a master without the endpoint.
  o.metrics_listen = served->metrics_address();
  auto busy = MasterServer::Start(o);
  ASSERT_FALSE(busy.ok());
  EXPECT_NE(busy.status().ToString().find(served->metrics_address()), std::string::npos)
      << busy.status().ToString();
  o.metrics_listen_best_effort = true;
  auto without = Must(MasterServer::Start(o));
  EXPECT_EQ(without->metrics_address(), "");
}

// A metrics token of its own replaces the cluster token on the endpoint (scrapers need not hold
// the secret that opens the store).
TEST(StoreObsInProcess, MetricsTokenReplacesTheClusterTokenOnTheEndpoint) {
  MasterOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "127.0.0.1:0";
  o.cluster_token = "cluster-secret";
  o.metrics_token = "scrape-only";
  auto master = Must(MasterServer::Start(o));
  const uint16_t port = testing::PortOf(master->metrics_address());
  EXPECT_EQ(HttpGet(port, "/metrics", "Bearer scrape-only").status, 200);
  EXPECT_EQ(HttpGet(port, "/metrics", "Bearer cluster-secret").status, 401);
  EXPECT_EQ(HttpGet(port, "/metrics").status, 401);
  EXPECT_EQ(HttpGet(port, "/health").status, 200);
  HttpReply page = HttpGet(port, "/");
  EXPECT_EQ(page.status, 200);  // the page holds no data; its script asks for the token
  EXPECT_NE(page.body.find("status.json"), std::string::npos);
}

TEST(StoreObsInProcess, LeaderHookReachesHealthAndMetrics) {
  MasterOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_listen = "127.0.0.1:0";
  auto master = Must(MasterServer::Start(o));
  const uint16_t port = testing::PortOf(master->metrics_address());
  EXPECT_EQ(HttpGet(port, "/health").status, 200);
  master->SetLeader(false, "another master holds the lease");
  HttpReply h = HttpGet(port, "/health");
  EXPECT_EQ(h.status, 503);
  EXPECT_EQ(h.body, "not serving: this master is not the leader: another master holds the lease\n");
  EXPECT_EQ(ParseSamples(HttpGet(port, "/metrics").body)["kvbridge_master_is_leader"], 0);
  std::string why;
  EXPECT_EQ(HealthCheck(master->address(), "kvbridge.rpc.Master", &why), 2) << why;
  master->SetLeader(true);
  EXPECT_EQ(HttpGet(port, "/health").status, 200);
  EXPECT_EQ(HealthCheck(master->address(), "kvbridge.rpc.Master", &why), 1) << why;
}

// --- the status page in a browser ---

std::string Chromium() {
  for (const char* p :
       {"/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"}) {
    if (access(p, X_OK) == 0) return p;
  }
  return "";
}

// Width, height and whether the pixels differ at all, of an 8-bit RGB(A) PNG; false with *why
// otherwise. Minimal: the IHDR and the inflated IDAT stream, filters not undone (a blank page
// inflates to identical rows, which is enough to tell).
bool ReadPng(const std::string& path, uint32_t* width, uint32_t* height, bool* varied,
             std::string* why) {
  std::ifstream f(path, std::ios::binary);
  std::string data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (data.size() < 33 || data.compare(0, 8, "\x89PNG\r\n\x1a\n", 8) != 0) {
    *why = path + " is not a PNG (" + std::to_string(data.size()) + " bytes)";
    return false;
  }
  auto be32 = [&](size_t at) {
    const auto* p = reinterpret_cast<const unsigned char*>(data.data() + at);
    return uint32_t{p[0]} << 24 | uint32_t{p[1]} << 16 | uint32_t{p[2]} << 8 | p[3];
  };
  *width = be32(16);
  *height = be32(20);
  std::string idat;
  for (size_t at = 8; at + 8 <= data.size();) {
    const uint32_t len = be32(at);
    if (data.compare(at + 4, 4, "IDAT") == 0) idat.append(data, at + 8, len);
    at += 12 + len;
  }
  std::string pixels(static_cast<size_t>(*width) * *height * 4 + *height, '\0');
  uLongf out_len = pixels.size();
  if (uncompress(reinterpret_cast<Bytef*>(pixels.data()), &out_len,
                 reinterpret_cast<const Bytef*>(idat.data()), idat.size()) != Z_OK) {
    *why = "cannot inflate the PNG's image data";
    return false;
  }
  pixels.resize(out_len);
  // Rows of a blank page are all alike; a drawn table makes them differ.
  const size_t row = out_len / *height;
  size_t differing_rows = 0;
  for (uint32_t y = 1; y < *height; ++y) {
    differing_rows += pixels.compare(y * row + 1, row - 1, pixels, 1, row - 1) != 0;
  }
  *varied = differing_rows > 20;
  return true;
}

TEST_F(StoreObs, StatusPageRendersNodesInChromium) {
  const std::string chromium = Chromium();
  if (chromium.empty()) GTEST_SKIP() << "no chromium (apt-get install chromium) to render the page";
  StartMasterAndNode("obs-page-node");
  const std::string url = "http://" + Loopback(master_http_) + "/";
  const std::vector<std::string> common = {
      chromium,         "--headless=new",    "--no-sandbox",  "--disable-gpu",
      "--no-first-run", "--hide-scrollbars", "--log-level=3", "--virtual-time-budget=5000"};
  // The DOM after the page's script ran: the node's row is there.
  std::vector<std::string> dump = common;
  dump.insert(dump.end(), {"--dump-dom", url});
  auto p = ChildProcess::Start(dump);
  ASSERT_TRUE(p);
  const std::string dom = p->ReadAll(90000);
  (void)p->Wait(10000);
  EXPECT_NE(dom.find("obs-page-node"), std::string::npos) << dom.substr(0, 2000);
  EXPECT_NE(dom.find("ACTIVE"), std::string::npos);
  EXPECT_NE(dom.find("registered"), std::string::npos);  // the event list
  // A screenshot of the size asked for, not blank.
  const std::string png = ::testing::TempDir() + "kvbridge_status_page.png";
  std::remove(png.c_str());
  std::vector<std::string> shot = common;
  shot.insert(shot.end(), {"--screenshot=" + png, "--window-size=1200,800", url});
  auto q = ChildProcess::Start(shot);
  ASSERT_TRUE(q);
  (void)q->ReadAll(90000);
  (void)q->Wait(10000);
  uint32_t w = 0, h = 0;
  bool varied = false;
  std::string why;
  ASSERT_TRUE(ReadPng(png, &w, &h, &varied, &why)) << why;
  EXPECT_EQ(w, 1200u);
  EXPECT_EQ(h, 800u);
  EXPECT_TRUE(varied) << "the screenshot is blank";
}

}  // namespace
}  // namespace kvbridge

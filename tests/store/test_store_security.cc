// The store's control plane with a cluster token (docs/security.md), attacked the way the
// issue describes: real `kvbridge master` and `kvbridge node` processes sharing a token, an
// in-process client holding it, objects with known bytes, and raw gRPC calls from a caller
// without the token (or with it, but asking for what a token holder may not do). Every attack
// must be refused and leave every object readable with its exact bytes.
#include <google/protobuf/descriptor.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/descriptor.h"
#include "kvbridge.grpc.pb.h"
#include "kvbridge/store.h"
#include "store/rpc_auth.h"
#include "tests/common/test_util.h"
#include "tests/store/store_procs.h"

namespace kvbridge {
namespace {

namespace fs = std::filesystem;
using testing::Buffer;
using testing::ChildProcess;
using testing::Must;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kPage = 64 * 1024;  // one buffer (K or V); objects are two
constexpr size_t kObjects = 256;
constexpr uint32_t kTtlMs = 1000;

const std::string kBin = KVBRIDGE_BIN_DIR "/kvbridge";
const std::string kToken = "t0ken-of-the-security-tests";
const std::string kAdmin = "adm1n-of-the-security-tests";

using Metadata = std::vector<std::pair<std::string, std::string>>;

// A proof of `secret` (for `purpose`) for `method`, `skew_ms` away from now.
std::string Proof(const std::string& secret, std::string_view purpose, std::string_view method,
                  int64_t skew_ms = 0) {
  static std::mt19937_64 rng(std::random_device{}());
  store::AuthNonce nonce;
  for (auto& b : nonce) b = static_cast<uint8_t>(rng());
  return store::CallKey(secret, purpose)
      .Proof(method, static_cast<uint64_t>(static_cast<int64_t>(store::UnixMs()) + skew_ms), nonce);
}

std::string ClusterProof(std::string_view method, const std::string& token = kToken,
                         int64_t skew_ms = 0) {
  return Proof(token, store::kClusterKeyPurpose, method, skew_ms);
}

std::unique_ptr<grpc::ClientContext> Ctx(const Metadata& md) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  for (const auto& [k, v] : md) ctx->AddMetadata(k, v);
  return ctx;
}

// Calls `path` with an empty request (every request message parses from zero bytes).
grpc::Status RawCall(grpc::GenericStub& stub, const std::string& path, const Metadata& md) {
  auto ctx = Ctx(md);
  grpc::ByteBuffer request, response;
  grpc::Slice empty("", 0);
  request = grpc::ByteBuffer(&empty, 1);
  std::promise<grpc::Status> done;
  stub.UnaryCall(ctx.get(), path, grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) { done.set_value(std::move(s)); });
  return done.get_future().get();
}

// The generated descriptor of a service of kvbridge.proto ("kvbridge.rpc.Master").
const google::protobuf::ServiceDescriptor* Service(const char* full_name) {
  return google::protobuf::DescriptorPool::generated_pool()->FindServiceByName(full_name);
}

// Every method of a service, as gRPC paths ("/kvbridge.rpc.Master/PutStart"): a method added
// to kvbridge.proto is in this list without anyone remembering to add it.
std::vector<std::string> Paths(const google::protobuf::ServiceDescriptor* service) {
  std::vector<std::string> out;
  for (int i = 0; i < service->method_count(); ++i) {
    out.push_back("/" + service->full_name() + "/" + service->method(i)->name());
  }
  return out;
}

// Starts `argv` with its stderr joined to stdout (the log lines a daemon writes at start).
std::unique_ptr<ChildProcess> StartWithLog(const std::vector<std::string>& argv) {
  return ChildProcess::Start(argv, {"sh", "-c", "exec \"$0\" \"$@\" 2>&1"});
}

// Reads lines until one contains `want` (returned) or timeout ("").
std::string ReadUntil(ChildProcess& p, const std::string& want, std::string* before,
                      int timeout_ms = 20000) {
  const auto until = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < until) {
    const int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count());
    std::string line = p.ReadLine(std::max(left, 1));
    if (line.find(want) != std::string::npos) return line;
    if (before) *before += line + "\n";
  }
  return "";
}

// A master and three nodes sharing a cluster token (and an admin token at the master), node 0
// with an SSD tier that takes most of its replicas, 256 objects of 128 KiB stored twice.
class SecureCluster : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("KVBRIDGE_CLUSTER_TOKEN", kToken.c_str(), 1);
    setenv("KVBRIDGE_ADMIN_TOKEN", kAdmin.c_str(), 1);
    setenv("KVBRIDGE_PROGRESS_TIMEOUT_MS", "500", 1);
    setenv("KVBRIDGE_DEADLINE_MS", "3000", 1);
    setenv("KVBRIDGE_LOG_LEVEL", "warn", 1);
    // Node 0 (the only one with an SSD tier) moves its replicas to SSD, so ReadSsd has
    // objects to serve.
    setenv("KVBRIDGE_DEMOTE_HIGH_WATERMARK", "0.02", 1);
    setenv("KVBRIDGE_DEMOTE_LOW_WATERMARK", "0.01", 1);
    have_ssd_ = fs::exists(fs::path(KVBRIDGE_PLUGIN_BUILD_DIR_FOR_TESTS) / "libkvb_storage_ssd.so");
    ssd_dir_ = fs::temp_directory_path() / ("kvb-security-" + std::to_string(getpid()));
    fs::remove_all(ssd_dir_);
    fs::create_directories(ssd_dir_);
    master_port_ = testing::FreePort();
    master_addr_ = "127.0.0.1:" + std::to_string(master_port_);
    StartMaster();
    for (int i = 0; i < 3; ++i) nodes_.push_back(StartNode(i));
    WaitForActiveNodes(3);
    master_stub_ =
        rpc::Master::NewStub(grpc::CreateChannel(master_addr_, grpc::InsecureChannelCredentials()));
    client_ = Must(StoreClient::Create(ClientOptions("client")));
    ASSERT_TRUE(client_->RegisterBuffer(src_.data(), src_.size()).ok());
    ASSERT_TRUE(client_->RegisterBuffer(dst_.data(), dst_.size()).ok());
    ASSERT_EQ(PutRange(0, kObjects), 0);
    const auto until = Clock::now() + std::chrono::seconds(20);
    while (have_ssd_ && Clock::now() < until && View().ssd_replicas < 32) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (have_ssd_) {
      ASSERT_GE(View().ssd_replicas, 32u) << "node 0 demoted nothing to its SSD tier";
    }
    for (const auto& n : View().nodes) incarnations_[n.id.node_id] = n.id.incarnation;
    ASSERT_EQ(incarnations_.size(), 3u);
    ExpectIntact("after setup");
  }

  void TearDown() override {
    client_.reset();
    nodes_.clear();
    master_.reset();
    for (const char* v : {"KVBRIDGE_CLUSTER_TOKEN", "KVBRIDGE_ADMIN_TOKEN",
                          "KVBRIDGE_DEMOTE_HIGH_WATERMARK", "KVBRIDGE_DEMOTE_LOW_WATERMARK"}) {
      unsetenv(v);
    }
    if (!ssd_dir_.empty()) fs::remove_all(ssd_dir_);
  }

  StoreOptions ClientOptions(const std::string& node_id) const {
    StoreOptions so;
    so.master_address = master_addr_;
    so.replica_num = 2;
    so.transfer_deadline_ms = 3000;
    so.engine.node_id = node_id;
    so.engine.transports = {"tcp"};
    so.engine.progress_timeout_ms = 500;
    so.engine.default_deadline_ms = 3000;
    so.engine.cluster_token = kToken;
    return so;
  }

  void StartMaster() {
    master_ = testing::StartMaster(master_addr_,
                                   {"--node-ttl-ms", std::to_string(kTtlMs), "--lease-ms", "200"});
    ASSERT_TRUE(master_);
  }

  std::unique_ptr<ChildProcess> StartNode(int i) {
    const std::string id = "node" + std::to_string(i);
    std::vector<std::string> args = {"--dram-bytes", "268435456", "--drain-timeout-ms",
                                     "10000",        "--listen",  "127.0.0.1:0"};
    if (i == 0 && have_ssd_) {
      args.insert(args.end(), {"--ssd-path", (ssd_dir_ / id).string(), "--ssd-bytes",
                               std::to_string(256u << 20)});
      fs::create_directories(ssd_dir_ / id);
    }
    return testing::StartNode(master_addr_, id, args);
  }

  ClusterStatus View() { return Must(QueryClusterStatus(master_addr_, 3000, kToken)); }

  int ActiveNodes() { return testing::ActiveNodes(master_addr_, kToken); }

  void WaitForActiveNodes(int n, int timeout_ms = 15000) {
    ASSERT_TRUE(testing::WaitForActiveNodes(master_addr_, n, timeout_ms, kToken));
  }

  static std::string Key(size_t i) { return "secure-" + std::to_string(i); }
  std::vector<BufferRef> Slot(Buffer& arena, size_t i) {
    uint8_t* base = arena.data() + i * 2 * kPage;
    return {BufferRef{base, kPage}, BufferRef{base + kPage, kPage}};
  }

  int PutRange(size_t first, size_t n) {
    int failed = 0;
    for (size_t at = first; at < first + n; at += 128) {
      std::vector<std::string> keys;
      std::vector<std::vector<BufferRef>> bufs;
      for (size_t i = at; i < std::min(first + n, at + 128); ++i) {
        src_.Fill(7000 + i, i * 2 * kPage, 2 * kPage);
        keys.push_back(Key(i));
        bufs.push_back(Slot(src_, i));
      }
      for (const Status& st : client_->BatchPutFrom(keys, bufs)) {
        if (st.ok()) continue;
        ++failed;
        ADD_FAILURE() << "put: " << st.ToString();
      }
    }
    return failed;
  }

  // Reads every object and compares each byte with its pattern; returns the objects that
  // failed or came back wrong (the first one's story in *why).
  int WrongObjects(std::string* why) {
    std::memset(dst_.data(), 0, dst_.size());
    int failed = 0;
    for (size_t at = 0; at < kObjects; at += 128) {
      std::vector<std::string> keys;
      std::vector<std::vector<BufferRef>> bufs;
      for (size_t i = at; i < at + 128; ++i) {
        keys.push_back(Key(i));
        bufs.push_back(Slot(dst_, i));
      }
      auto got = client_->BatchGetInto(keys, bufs);
      for (size_t k = 0; k < got.size(); ++k) {
        const size_t i = at + k;
        const bool bytes_ok = got[k].ok() && got[k].value() == 2 * kPage &&
                              dst_.Matches(7000 + i, i * 2 * kPage, 2 * kPage, i * 2 * kPage);
        if (bytes_ok) continue;
        if (failed++ == 0) {
          *why = Key(i) + ": " + (got[k].ok() ? "wrong bytes" : got[k].status().ToString());
        }
      }
    }
    return failed;
  }

  // Every object reads back exactly; the master still holds them all; every node that has not
  // been stopped is ACTIVE with the incarnation it had at setup.
  void ExpectIntact(const std::string& when) {
    std::string why;
    EXPECT_EQ(WrongObjects(&why), 0) << when << ": " << why;
    ClusterStatus s = View();
    EXPECT_EQ(s.objects, kObjects) << when;
    std::map<std::string, uint64_t> now;
    for (const auto& n : s.nodes) {
      // A node the test killed stays listed, DEAD, for a while.
      EXPECT_EQ(n.state, stopped_.count(n.id.node_id) ? n.state : "ACTIVE")
          << when << ": " << n.id.ToString();
      now[n.id.node_id] = n.id.incarnation;
    }
    for (const auto& [id, inc] : incarnations_) {
      if (stopped_.count(id)) continue;
      EXPECT_EQ(now[id], inc) << when << ": node " << id << " is another incarnation";
    }
    for (const auto& [id, inc] : now) {
      EXPECT_TRUE(incarnations_.count(id)) << when << ": unknown node " << id << " registered";
    }
  }

  rpc::NodeIdentity Identity(const std::string& node_id) {
    rpc::NodeIdentity id;
    id.set_node_id(node_id);
    id.set_incarnation(incarnations_.at(node_id));
    return id;
  }

  // The master's directory entry of `node_id` (asked with the token).
  rpc::NodeDescriptor Directory(const std::string& node_id) {
    rpc::NodeDescriptorsRequest req;
    req.add_node_ids(node_id);
    rpc::NodeDescriptorsReply reply;
    auto ctx = Ctx({{store::kAuthHeader, ClusterProof(store::method::kGetNodeDescriptors)}});
    EXPECT_TRUE(master_stub_->GetNodeDescriptors(ctx.get(), req, &reply).ok());
    EXPECT_EQ(reply.nodes_size(), 1);
    return reply.nodes_size() == 1 ? reply.nodes(0) : rpc::NodeDescriptor();
  }

  bool have_ssd_ = false;  // the ssd storage plugin is built: node 0 gets an SSD tier
  fs::path ssd_dir_;
  uint16_t master_port_ = 0;
  std::string master_addr_;
  std::unique_ptr<ChildProcess> master_;
  std::vector<std::unique_ptr<ChildProcess>> nodes_;
  std::unique_ptr<rpc::Master::Stub> master_stub_;
  Buffer src_{kObjects * 2 * kPage}, dst_{kObjects * 2 * kPage};
  std::unique_ptr<StoreClient> client_;
  std::map<std::string, uint64_t> incarnations_;  // at setup
  std::set<std::string> stopped_;                 // nodes the test stopped
};

// Every method of both services, called with no proof, a proof of another token, a replayed
// proof and a proof 10 minutes off, is refused UNAUTHENTICATED; nothing changes.
TEST_F(SecureCluster, EveryMethodRefusesUnauthenticatedCalls) {
  grpc::GenericStub master(grpc::CreateChannel(master_addr_, grpc::InsecureChannelCredentials()));
  grpc::GenericStub node(
      grpc::CreateChannel(Directory("node0").rpc_address(), grpc::InsecureChannelCredentials()));
  struct Calls {
    grpc::GenericStub* stub;
    std::vector<std::string> paths;
  };
  const google::protobuf::ServiceDescriptor* master_service = Service("kvbridge.rpc.Master");
  const google::protobuf::ServiceDescriptor* node_service = Service("kvbridge.rpc.Node");
  ASSERT_NE(master_service, nullptr);
  ASSERT_NE(node_service, nullptr);
  const Calls services[] = {{&master, Paths(master_service)}, {&node, Paths(node_service)}};
  int methods = 0;
  for (const Calls& s : services) {
    for (const std::string& path : s.paths) {
      ++methods;
      const std::string valid = ClusterProof(path);
      const grpc::Status first = RawCall(*s.stub, path, {{store::kAuthHeader, valid}});
      EXPECT_NE(first.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << path << ": a valid proof was refused: " << first.error_message();
      const std::pair<const char*, Metadata> attacks[] = {
          {"no proof", {}},
          {"another token", {{store::kAuthHeader, ClusterProof(path, "not-the-token")}}},
          {"a replayed proof", {{store::kAuthHeader, valid}}},
          {"a proof 10 minutes old", {{store::kAuthHeader, ClusterProof(path, kToken, -600000)}}},
          {"a proof 10 minutes early", {{store::kAuthHeader, ClusterProof(path, kToken, 600000)}}},
          {"a proof for another method",
           {{store::kAuthHeader,
             ClusterProof(path == store::method::kStats ? store::method::kExists
                                                        : store::method::kStats)}}},
          {"the token itself", {{store::kAuthHeader, kToken}}}};
      for (const auto& [what, md] : attacks) {
        const grpc::Status st = RawCall(*s.stub, path, md);
        EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED)
            << path << " with " << what << ": " << st.error_message();
      }
    }
  }
  EXPECT_EQ(methods, master_service->method_count() + node_service->method_count());
  EXPECT_GE(methods, 19);
  ExpectIntact("after the unauthenticated calls");
}

// RemoveAll, RemoveByRegex, and Drain or Deregister of a node, from a caller without the token
// are UNAUTHENTICATED; from a token holder without the admin token PERMISSION_DENIED; nothing
// changes. With the admin token RemoveByRegex and RemoveAll work.
TEST_F(SecureCluster, RawRemoveAllDrainDeregisterChangeNothing) {
  const rpc::NodeIdentity node1 = Identity("node1");
  auto call = [&](std::string_view method, const Metadata& md) {
    auto ctx = Ctx(md);
    rpc::Status reply;
    rpc::Empty empty;
    if (method == store::method::kRemoveAll)
      return master_stub_->RemoveAll(ctx.get(), empty, &reply);
    if (method == store::method::kRemoveByRegex) {
      rpc::RegexRequest everything;
      everything.set_pattern(".*");
      rpc::RemoveByRegexReply removed;
      return master_stub_->RemoveByRegex(ctx.get(), everything, &removed);
    }
    if (method == store::method::kDrain) return master_stub_->Drain(ctx.get(), node1, &reply);
    return master_stub_->Deregister(ctx.get(), node1, &reply);
  };
  for (std::string_view m : {store::method::kRemoveAll, store::method::kRemoveByRegex,
                             store::method::kDrain, store::method::kDeregister}) {
    EXPECT_EQ(call(m, {}).error_code(), grpc::StatusCode::UNAUTHENTICATED) << m;
    const grpc::Status holder = call(m, {{store::kAuthHeader, ClusterProof(m)}});
    EXPECT_EQ(holder.error_code(), grpc::StatusCode::PERMISSION_DENIED) << m;
    EXPECT_NE(holder.error_message().find("KVBRIDGE_ADMIN_TOKEN"), std::string::npos)
        << holder.error_message();
    EXPECT_EQ(
        call(m, {{store::kAuthHeader, ClusterProof(m)},
                 {store::kAdminHeader, Proof("not-the-admin-token", store::kAdminKeyPurpose, m)}})
            .error_code(),
        grpc::StatusCode::PERMISSION_DENIED)
        << m;
    // A node's own secret is not something a caller can make up: a proof keyed by the cluster
    // token in its place is refused too.
    EXPECT_EQ(call(m, {{store::kAuthHeader, ClusterProof(m)},
                       {store::kNodeHeader, Proof(kToken, store::kNodeKeyPurpose, m)}})
                  .error_code(),
              grpc::StatusCode::PERMISSION_DENIED)
        << m;
  }
  // And through the client API: a client without the admin token gets PERMISSION_DENIED.
  Status st = client_->RemoveAll();
  EXPECT_EQ(st.code(), StatusCode::kPermissionDenied) << st.ToString();
  Result<uint64_t> by_regex = client_->RemoveByRegex(".");
  EXPECT_EQ(by_regex.status().code(), StatusCode::kPermissionDenied)
      << by_regex.status().ToString();
  std::this_thread::sleep_for(std::chrono::milliseconds(kTtlMs));  // a drain would show
  ExpectIntact("after the refused RemoveAll/Drain/Deregister calls");

  StoreOptions admin = ClientOptions("admin");
  admin.admin_token = kAdmin;
  auto admin_client = Must(StoreClient::Create(admin));
  const uint64_t before = View().objects;
  ASSERT_GT(before, 1u);
  Result<uint64_t> one = admin_client->RemoveByRegex("^" + Key(0) + "$");
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ(*one, 1u);
  EXPECT_EQ(View().objects, before - 1);
  ASSERT_TRUE(admin_client->RemoveAll().ok());
  EXPECT_EQ(View().objects, 0u);
}

// Registering as node 1 with a new incarnation (a takeover, which drops node 1's replicas)
// needs the token.
TEST_F(SecureCluster, TakeoverByNewIncarnationNeedsTheToken) {
  const rpc::NodeDescriptor node1 = Directory("node1");
  rpc::RegisterNodeRequest req;
  req.mutable_node()->set_node_id("node1");
  req.mutable_node()->set_incarnation(incarnations_.at("node1") + 1);
  req.set_engine_descriptor(node1.engine_descriptor());
  req.set_rpc_address(node1.rpc_address());
  for (const Metadata& md :
       {Metadata{},
        Metadata{{store::kAuthHeader, ClusterProof(store::method::kRegisterNode, "wrong")}}}) {
    auto ctx = Ctx(md);
    rpc::RegisterNodeReply reply;
    EXPECT_EQ(master_stub_->RegisterNode(ctx.get(), req, &reply).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(kTtlMs));
  ExpectIntact("after the takeover attempts");
}

// The chunked registration (RegisterNodeStream, which nodes use) needs the token like every
// call: node 1 registering again as a stream of a head and an inventory chunk, sent without a
// proof, with a proof of another token or with a proof for the unary RegisterNode, is refused
// UNAUTHENTICATED, and node 1 keeps its incarnation and its replicas.
TEST_F(SecureCluster, ChunkedRegistrationNeedsTheToken) {
  const rpc::NodeDescriptor node1 = Directory("node1");
  const core::Descriptor d = Must(core::DecodeDescriptor(node1.engine_descriptor()));
  ASSERT_FALSE(d.segments.empty());
  rpc::RegisterNodeRequest head;
  *head.mutable_node() = Identity("node1");
  head.set_engine_descriptor(node1.engine_descriptor());
  head.set_rpc_address(node1.rpc_address());
  rpc::Segment* seg = head.add_segments();
  seg->set_segment_id(d.segments[0].id);
  seg->set_capacity(d.segments[0].length);
  seg->set_tier(1);
  rpc::RegisterNodeRequest chunk;
  for (int i = 0; i < 3; ++i) {
    rpc::InventoryRecord* r = chunk.add_inventory();
    r->set_key("planted-" + std::to_string(i));
    r->set_version(1);
    r->add_sizes(4096);
    r->set_segment_id(d.segments[0].id);
    r->set_offset(static_cast<uint64_t>(i) * 4096);
    r->set_replica_num(1);
    r->set_replica_id(1);
  }
  for (const auto& [what, md] : std::vector<std::pair<const char*, Metadata>>{
           {"no proof", {}},
           {"another token",
            {{store::kAuthHeader, ClusterProof(store::method::kRegisterNodeStream, "wrong")}}},
           {"a proof for RegisterNode",
            {{store::kAuthHeader, ClusterProof(store::method::kRegisterNode)}}}}) {
    auto ctx = Ctx(md);
    rpc::RegisterNodeReply reply;
    auto writer = master_stub_->RegisterNodeStream(ctx.get(), &reply);
    writer->Write(head);  // may fail once the master has refused: the status says why
    writer->Write(chunk);
    writer->WritesDone();
    const grpc::Status st = writer->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << what << ": " << st.error_message();
    EXPECT_TRUE(reply.node_secret().empty()) << what;
  }
  ExpectIntact("after the unauthenticated chunked registrations");
}

// A token holder registering "evil" with node 1's engine descriptor (so that re-replication
// would write evil's copies into node 1's pool) is refused, and so is one without the token.
// Re-replication after node 0 is killed then copies only to real nodes: every object reads
// back exactly.
TEST_F(SecureCluster, FakeNodeWithARealDescriptorIsRefused) {
  const rpc::NodeDescriptor node1 = Directory("node1");
  const core::Descriptor d = Must(core::DecodeDescriptor(node1.engine_descriptor()));
  ASSERT_FALSE(d.segments.empty());
  rpc::RegisterNodeRequest req;
  req.mutable_node()->set_node_id("evil");
  req.mutable_node()->set_incarnation(0xbad);
  req.set_engine_descriptor(node1.engine_descriptor());
  req.set_rpc_address(node1.rpc_address());
  rpc::Segment* seg = req.add_segments();
  seg->set_segment_id(d.segments[0].id);
  seg->set_capacity(d.segments[0].length);
  seg->set_tier(1);
  {
    auto ctx = Ctx({});
    rpc::RegisterNodeReply reply;
    EXPECT_EQ(master_stub_->RegisterNode(ctx.get(), req, &reply).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  {
    auto ctx = Ctx({{store::kAuthHeader, ClusterProof(store::method::kRegisterNode)}});
    rpc::RegisterNodeReply reply;
    ASSERT_TRUE(master_stub_->RegisterNode(ctx.get(), req, &reply).ok());
    EXPECT_EQ(reply.status().code(), KVB_ERR_INVALID_ARGUMENT) << reply.status().message();
    EXPECT_NE(reply.status().message().find("node1"), std::string::npos)
        << reply.status().message();
    EXPECT_TRUE(reply.node_secret().empty());
  }
  // Its own identity but a segment the descriptor does not register: refused as well.
  core::Descriptor own = d;
  own.node_id = "evil";
  own.incarnation = 0xbad;
  req.set_engine_descriptor(core::EncodeDescriptor(own));
  seg->set_segment_id(d.segments[0].id + 1000);
  {
    auto ctx = Ctx({{store::kAuthHeader, ClusterProof(store::method::kRegisterNode)}});
    rpc::RegisterNodeReply reply;
    ASSERT_TRUE(master_stub_->RegisterNode(ctx.get(), req, &reply).ok());
    EXPECT_EQ(reply.status().code(), KVB_ERR_INVALID_ARGUMENT) << reply.status().message();
  }
  ExpectIntact("after the fake registrations");

  nodes_[0]->Kill();
  stopped_.insert("node0");
  // Re-replication restores two replicas of every object on nodes 1 and 2.
  bool repaired = false;
  const auto until = Clock::now() + std::chrono::seconds(60);
  while (Clock::now() < until && !repaired) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    ClusterStatus s = View();
    uint64_t replicas = 0;
    for (const auto& n : s.nodes) replicas += n.state == "ACTIVE" ? n.replicas : 0;
    repaired = s.under_replicated == 0 && replicas == 2 * kObjects;
  }
  EXPECT_TRUE(repaired) << "re-replication did not finish";
  ExpectIntact("after re-replication");
}

// ReadSsd makes a node WRITE an SSD object into the caller's memory. It must not be pointed
// at other memory: not without the token, not at a descriptor of someone other than the
// named client, not at a storage node's pool (another's or the node's own), and not at a known
// client's identity re-pointed to other endpoints. A client that shares a node's name under an
// incarnation of its own is served.
TEST_F(SecureCluster, ReadSsdCannotTargetOtherMemory) {
  if (!have_ssd_) GTEST_SKIP() << "the ssd storage plugin is not built";
  // An object of node 0's SSD tier, and where another object lies in node 2's pool.
  rpc::GetReplicasRequest greq;
  for (size_t i = 0; i < kObjects; ++i) greq.add_keys(Key(i));
  greq.set_sizes_only(true);
  rpc::GetReplicasReply grep;
  {
    auto ctx = Ctx({{store::kAuthHeader, ClusterProof(store::method::kGetReplicas)}});
    ASSERT_TRUE(master_stub_->GetReplicas(ctx.get(), greq, &grep).ok());
  }
  int on_ssd = -1;
  rpc::ReplicaLocation victim;  // a replica in node 2's pool
  for (int i = 0; i < grep.items_size(); ++i) {
    for (const auto& r : grep.items(i).replicas()) {
      if (r.node().node_id() == "node0" && r.tier() == 2 && on_ssd < 0) on_ssd = i;
      if (r.node().node_id() == "node2" && r.tier() == 1) victim = r;
    }
  }
  ASSERT_GE(on_ssd, 0) << "no object on node 0's SSD tier";
  ASSERT_EQ(victim.node().node_id(), "node2");

  auto node0 = rpc::Node::NewStub(
      grpc::CreateChannel(Directory("node0").rpc_address(), grpc::InsecureChannelCredentials()));
  // A reader of our own, with its memory registered: the legitimate target.
  EngineOptions eo;
  eo.node_id = "reader";
  eo.transports = {"tcp"};
  eo.cluster_token = kToken;
  auto reader = Must(TransferEngine::Create(eo));
  Buffer mem(2 * kPage);
  const SegmentId mem_seg = Must(reader->RegisterMemory(mem.data(), mem.size()));

  // A request of one object (its own fields), or of a batch (`items`, what a get sends): the
  // checks are the request's, before any item is looked at.
  bool as_items = false;
  auto read = [&](const rpc::NodeIdentity& client, const std::string& descriptor,
                  const rpc::Piece& dest, const Metadata& md, rpc::ReadSsdReply* reply) {
    rpc::ReadSsdRequest req;
    *req.mutable_node() = Identity("node0");
    if (as_items) {
      rpc::ReadSsdItem* item = req.add_items();
      item->set_key(Key(on_ssd));
      item->set_version(grep.items(on_ssd).version());
      *item->add_dests() = dest;
    } else {
      req.set_key(Key(on_ssd));
      req.set_version(grep.items(on_ssd).version());
      *req.add_dests() = dest;
    }
    req.set_client_descriptor(descriptor);
    *req.mutable_client() = client;
    req.set_timeout_ms(3000);
    auto ctx = Ctx(md);
    return node0->ReadSsd(ctx.get(), req, reply);
  };
  auto fresh = [] { return Metadata{{store::kAuthHeader, ClusterProof(store::method::kReadSsd)}}; };
  rpc::Piece into_node2;
  into_node2.set_segment_id(victim.segment_id());
  into_node2.set_offset(victim.offset());
  into_node2.set_length(2 * kPage);
  rpc::Piece into_reader;
  into_reader.set_segment_id(mem_seg);
  into_reader.set_offset(0);
  into_reader.set_length(2 * kPage);
  rpc::NodeIdentity reader_id;
  reader_id.set_node_id("reader");
  reader_id.set_incarnation(reader->self().incarnation);
  const std::string node2_desc = Directory("node2").engine_descriptor();
  const std::string node0_desc = Directory("node0").engine_descriptor();
  // A client under node 0's own name with an incarnation of its own: an embedded client that
  // shares its node's name (the Mooncake drop-in's, so that the master places its puts on its
  // own node) reads that node's SSD objects too. Its descriptor is its own engine's.
  EngineOptions to = eo;
  to.node_id = "node0";
  auto twin = Must(TransferEngine::Create(to));
  Buffer twin_mem(2 * kPage);
  rpc::Piece into_twin = into_reader;
  into_twin.set_segment_id(Must(twin->RegisterMemory(twin_mem.data(), twin_mem.size())));
  rpc::NodeIdentity twin_id;
  twin_id.set_node_id("node0");
  twin_id.set_incarnation(twin->self().incarnation);
  rpc::NodeIdentity node2_renamed;  // node 2's name under the twin's incarnation
  node2_renamed.set_node_id("node2");
  node2_renamed.set_incarnation(twin->self().incarnation);

  for (bool batch : {false, true}) {
    SCOPED_TRACE(batch ? "a batch (items)" : "one object");
    as_items = batch;
    std::memset(mem.data(), 0, mem.size());
    rpc::ReadSsdReply reply;
    // Without the token.
    EXPECT_EQ(read(Identity("node2"), node2_desc, into_node2, {}, &reply).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    // Node 2's descriptor under another client's name.
    ASSERT_TRUE(read(reader_id, node2_desc, into_node2, fresh(), &reply).ok());
    EXPECT_EQ(reply.status().code(), KVB_ERR_STALE_PEER) << reply.status().message();
    // Node 2 as the client: a storage node.
    ASSERT_TRUE(read(Identity("node2"), node2_desc, into_node2, fresh(), &reply).ok());
    EXPECT_EQ(reply.status().code(), KVB_ERR_PERMISSION_DENIED) << reply.status().message();
    // Node 0 itself as the client.
    rpc::Piece into_node0 = into_node2;
    into_node0.set_segment_id(Must(core::DecodeDescriptor(node0_desc)).segments[0].id);
    ASSERT_TRUE(read(Identity("node0"), node0_desc, into_node0, fresh(), &reply).ok());
    EXPECT_EQ(reply.status().code(), KVB_ERR_PERMISSION_DENIED) << reply.status().message();

    // The legitimate reader is served, with the object's exact bytes...
    ASSERT_TRUE(read(reader_id, reader->LocalDescriptor(), into_reader, fresh(), &reply).ok());
    ASSERT_EQ(reply.status().code(), KVB_OK) << reply.status().message();
    if (as_items) {
      ASSERT_EQ(reply.items_size(), 1);
      ASSERT_EQ(reply.items(0).status().code(), KVB_OK) << reply.items(0).status().message();
    }
    EXPECT_TRUE(mem.Matches(7000 + on_ssd, 0, 2 * kPage, on_ssd * 2 * kPage));
    // So is the client under node 0's name and an incarnation of its own...
    std::memset(twin_mem.data(), 0, twin_mem.size());
    ASSERT_TRUE(read(twin_id, twin->LocalDescriptor(), into_twin, fresh(), &reply).ok());
    ASSERT_EQ(reply.status().code(), KVB_OK) << reply.status().message();
    if (as_items) {
      ASSERT_EQ(reply.items_size(), 1);
      ASSERT_EQ(reply.items(0).status().code(), KVB_OK) << reply.items(0).status().message();
    }
    EXPECT_TRUE(twin_mem.Matches(7000 + on_ssd, 0, 2 * kPage, on_ssd * 2 * kPage));
    // ...but a storage node's name under another incarnation does not make its descriptor a
    // client's: the descriptor names the node's own incarnation.
    ASSERT_TRUE(read(node2_renamed, node2_desc, into_node2, fresh(), &reply).ok());
    EXPECT_EQ(reply.status().code(), KVB_ERR_STALE_PEER) << reply.status().message();
    // ...and its identity cannot then be re-pointed to node 2's endpoints and segments.
    core::Descriptor moved = Must(core::DecodeDescriptor(reader->LocalDescriptor()));
    const core::Descriptor n2 = Must(core::DecodeDescriptor(node2_desc));
    moved.transports = n2.transports;
    moved.segments = n2.segments;
    // Unsealed (a caller without the token could not seal it): refused at the seal.
    ASSERT_TRUE(read(reader_id, core::EncodeDescriptor(moved), into_node2, fresh(), &reply).ok());
    EXPECT_EQ(reply.status().code(), KVB_ERR_UNAUTHENTICATED) << reply.status().message();
    // Sealed under the token (a token holder doing it): refused as a move of a known peer.
    ASSERT_TRUE(
        read(reader_id, core::EncodeDescriptor(moved, kToken), into_node2, fresh(), &reply).ok());
    EXPECT_EQ(reply.status().code(), KVB_ERR_ALREADY_EXISTS) << reply.status().message();
  }
  ExpectIntact("after the ReadSsd attempts");
}

// Commit writes records into a node's inventory, which the node reports to a restarted
// master: without the token none may land.
TEST_F(SecureCluster, CommitIsRefusedWithoutTheToken) {
  const rpc::NodeDescriptor node1 = Directory("node1");
  auto stub = rpc::Node::NewStub(
      grpc::CreateChannel(node1.rpc_address(), grpc::InsecureChannelCredentials()));
  const core::Descriptor d = Must(core::DecodeDescriptor(node1.engine_descriptor()));
  rpc::CommitRequest req;
  *req.mutable_node() = Identity("node1");
  for (int i = 0; i < 4; ++i) {
    rpc::InventoryRecord* r = req.add_records();
    r->set_key("fake-" + std::to_string(i));
    r->set_version(1);
    r->add_sizes(2 * kPage);
    r->set_segment_id(d.segments[0].id);
    r->set_offset(i * 2 * kPage);
    r->set_replica_num(1);
    r->set_replica_id(1u << 30);
  }
  for (const Metadata& md :
       {Metadata{}, Metadata{{store::kAuthHeader, ClusterProof(store::method::kCommit, "x")}}}) {
    auto ctx = Ctx(md);
    rpc::Status reply;
    EXPECT_EQ(stub->Commit(ctx.get(), req, &reply).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  // A restarted master learns what the nodes hold: no fake key comes back.
  master_->Kill();
  StartMaster();
  const auto until = Clock::now() + std::chrono::seconds(20);
  while (Clock::now() < until && (ActiveNodes() != 3 || View().objects < kObjects)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::vector<std::string> fakes = {"fake-0", "fake-1", "fake-2", "fake-3"};
  EXPECT_EQ(Must(client_->BatchExists(fakes)), std::vector<bool>(4, false));
  ExpectIntact("after the refused commits and a master restart");
}

// Daemons without a token say so at start, in one line; daemons with one do not.
TEST(StoreSecurity, UntokenedDaemonsSayItLoudly) {
  setenv("KVBRIDGE_LOG_LEVEL", "warn", 1);
  for (const bool tokened : {false, true}) {
    SCOPED_TRACE(tokened ? "with a token" : "without a token");
    if (tokened) {
      setenv("KVBRIDGE_CLUSTER_TOKEN", kToken.c_str(), 1);
    } else {
      unsetenv("KVBRIDGE_CLUSTER_TOKEN");
    }
    const std::string addr = "127.0.0.1:" + std::to_string(testing::FreePort());
    auto master = StartWithLog({kBin, "master", "--listen", addr});
    ASSERT_TRUE(master);
    std::string log;
    ASSERT_NE(ReadUntil(*master, "listening on", &log), "");
    EXPECT_EQ(log.find("SECURITY: no cluster token") != std::string::npos, !tokened) << log;
    auto node = StartWithLog(
        {kBin, "node", "--master", addr, "--node-id", "loud", "--dram-bytes", "16777216"});
    ASSERT_TRUE(node);
    log.clear();
    ASSERT_NE(ReadUntil(*node, "serving", &log), "") << log;
    EXPECT_EQ(log.find("SECURITY: no cluster token") != std::string::npos, !tokened) << log;
  }
  unsetenv("KVBRIDGE_CLUSTER_TOKEN");
}

// An in-process cluster with a token, with direct peer discovery and an SSD tier that holds
// everything, serves every path (puts, gets from SSD through ReadSsd, Describe); a node drains
// itself with its registration secret; RemoveAll needs the admin token, and says so.
TEST(StoreSecurity, TokenedEmbeddedClusterServesEveryPath) {
  if (!fs::exists(fs::path(KVBRIDGE_PLUGIN_BUILD_DIR_FOR_TESTS) / "libkvb_storage_ssd.so")) {
    GTEST_SKIP() << "the ssd storage plugin is not built";
  }
  const fs::path dir = fs::temp_directory_path() / ("kvb-security-emb-" + std::to_string(getpid()));
  fs::remove_all(dir);
  for (const bool with_admin : {false, true}) {
    SCOPED_TRACE(with_admin ? "with an admin token" : "without an admin token");
    EmbeddedClusterOptions o;
    o.nodes = 2;
    o.dram_bytes_per_node = 32u << 20;
    o.replica_num = 1;
    o.peer_discovery = "direct";
    o.ssd_dir = (dir / (with_admin ? "a" : "b")).string();
    o.ssd_bytes_per_node = 128u << 20;
    o.engine.transports = {"tcp"};
    o.engine.plugin_path = KVBRIDGE_PLUGIN_BUILD_DIR_FOR_TESTS;
    o.engine.cluster_token = kToken;
    o.master.demote_high_watermark = 0.02;
    o.master.demote_low_watermark = 0.01;
    if (with_admin) o.master.admin_token = kAdmin;
    auto cluster = Must(EmbeddedCluster::Start(o));
    StoreClient& c = cluster->client();
    Buffer src(32 * 2 * kPage), dst(32 * 2 * kPage);
    ASSERT_TRUE(c.RegisterBuffer(src.data(), src.size()).ok());
    ASSERT_TRUE(c.RegisterBuffer(dst.data(), dst.size()).ok());
    std::vector<std::string> keys;
    std::vector<std::vector<BufferRef>> in, out;
    for (size_t i = 0; i < 32; ++i) {
      src.Fill(i, i * 2 * kPage, 2 * kPage);
      keys.push_back("emb-" + std::to_string(i));
      in.push_back({BufferRef{src.data() + i * 2 * kPage, 2 * kPage}});
      out.push_back({BufferRef{dst.data() + i * 2 * kPage, 2 * kPage}});
    }
    for (const Status& st : c.BatchPutFrom(keys, in)) ASSERT_TRUE(st.ok()) << st.ToString();
    const auto until = Clock::now() + std::chrono::seconds(20);
    while (Clock::now() < until &&
           Must(QueryClusterStatus(cluster->master_address(), 3000, kToken)).ssd_replicas < 16) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    EXPECT_GE(Must(QueryClusterStatus(cluster->master_address(), 3000, kToken)).ssd_replicas, 16u);
    EXPECT_EQ(QueryClusterStatus(cluster->master_address(), 3000).status().code(),
              StatusCode::kUnauthenticated);
    for (const auto& r : c.BatchGetInto(keys, out)) ASSERT_TRUE(r.ok()) << r.status().ToString();
    for (size_t i = 0; i < 32; ++i) {
      EXPECT_TRUE(dst.Matches(i, i * 2 * kPage, 2 * kPage, i * 2 * kPage)) << keys[i];
    }
    // A client without the token is refused, naming why.
    StoreOptions stranger;
    stranger.master_address = cluster->master_address();
    stranger.engine.transports = {"tcp"};
    stranger.engine.node_id = "stranger";
    auto s = Must(StoreClient::Create(stranger));
    auto exists = s->BatchExists(keys);
    ASSERT_FALSE(exists.ok());
    EXPECT_EQ(exists.status().code(), StatusCode::kUnauthenticated) << exists.status().ToString();
    // A node drains itself (its own secret, no admin token).
    EXPECT_TRUE(cluster->nodes()[1]->Drain().ok());
    Status removed = c.RemoveAll();
    if (with_admin) {
      EXPECT_TRUE(removed.ok()) << removed.ToString();
    } else {
      EXPECT_EQ(removed.code(), StatusCode::kPermissionDenied) << removed.ToString();
      EXPECT_NE(removed.message().find("KVBRIDGE_ADMIN_TOKEN"), std::string::npos)
          << removed.ToString();
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvbridge

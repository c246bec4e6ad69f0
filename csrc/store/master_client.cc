#include "store/master_client.h"

#include <google/protobuf/arena.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>
#include <utility>

#include "store/fast_rpc.h"
#include "store/master_ha.h"
#include "util/env.h"
#include "util/host_port.h"
#include "util/logging.h"

namespace kvbridge::store {

namespace {

using Clock = std::chrono::system_clock;

// How long a retried call waits for the leader's channel before asking etcd again.
constexpr uint32_t kLeaderAttemptMs = 1000;

rpc::NodeIdentity ToProto(const PeerId& id) {
  rpc::NodeIdentity out;
  out.set_node_id(id.node_id);
  out.set_incarnation(id.incarnation);
  return out;
}

PeerId FromProto(const rpc::NodeIdentity& id) { return PeerId{id.node_id(), id.incarnation()}; }

// The retry policy (master_client.h), one row per method of kvbridge.rpc.Master a MasterClient
// calls: retried are the idempotent reads only. Heartbeat is repeated by its caller, TaskDone
// and DemoteDone by the node's own queue of unanswered reports.
struct MethodPolicy {
  std::string_view method;
  bool retryable;
};
constexpr MethodPolicy kMasterMethods[] = {
    {method::kPutStart, false},
    {method::kPutEnd, false},
    {method::kGetReplicas, true},
    {method::kExists, true},
    {method::kRemove, false},
    {method::kRemoveAll, false},
    {method::kRemoveByRegex, false},
    {method::kReportBadReplica, false},
    {method::kGetNodeDescriptors, true},
    {method::kStats, true},
    {method::kPlace, false},
    {method::kQueryPlacement, true},
    {method::kFastPath, false},
    {method::kRegisterNodeStream, false},
    {method::kRegisterNode, false},
    {method::kHeartbeat, false},
    {method::kTaskDone, false},
    {method::kDemoteDone, false},
    {method::kDrain, false},
    {method::kDeregister, false},
};

ReplicaLocation FromProto(const rpc::ReplicaLocation& r) {
  return {{r.node().node_id(), r.node().incarnation()},
          r.segment_id(),
          r.offset(),
          r.length(),
          static_cast<Tier>(r.tier())};
}

std::vector<InventoryRecord> FromProto(
    const google::protobuf::RepeatedPtrField<rpc::InventoryRecord>& records) {
  std::vector<InventoryRecord> out;
  out.reserve(records.size());
  for (const rpc::InventoryRecord& r : records) out.push_back(RecordFromProto(r));
  return out;
}

NodeTask FromProto(const rpc::ReplicationTask& t) {
  return {t.task_id(),           t.key(),
          t.version(),           t.checksum(),
          FromProto(t.source()), FromProto(t.dest()),
          t.dest_descriptor(),   t.dest_rpc_address(),
          t.timeout_ms()};
}

std::shared_ptr<grpc::Channel> MasterChannel(const MasterClient::Options& o,
                                             const std::string& address, const char* name) {
  grpc::ChannelArguments args;
  args.SetString("kvbridge.channel", name);  // distinct arguments: a connection of its own
  // Only the waits between attempts are shortened. GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, which is
  // also each connection attempt's timeout, stays at gRPC's 20 s: a handshake with a master
  // on a loaded host can take longer than a short backoff.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS,
              static_cast<int>(std::min(o.retry.max_reconnect_backoff_ms, 100u)));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS,
              static_cast<int>(o.retry.max_reconnect_backoff_ms));
  return NewChannel(address, args);
}

// The node's own answer to Describe at `rpc_address`, checked to be `expect`'s (STALE_PEER
// otherwise, e.g. the node restarted) and to describe that node. Channels cached per address.
Result<std::string> DescribeNode(const std::string& rpc_address, const RpcAuth& auth,
                                 const PeerId& expect, uint32_t timeout_ms) {
  if (rpc_address.empty()) {
    return Status::PeerUnreachable("node " + expect.node_id + " published no control address");
  }
  static NodeStubCache stubs;
  const std::shared_ptr<rpc::Node::Stub> stub = stubs.Get(rpc_address);
  grpc::ClientContext ctx;
  ctx.set_deadline(Clock::now() + std::chrono::milliseconds(timeout_ms));
  auth.Sign(&ctx, method::kDescribe);
  rpc::Empty req;
  rpc::NodeDescriptor reply;
  grpc::Status gs = stub->Describe(&ctx, req, &reply);
  if (!gs.ok()) return FromGrpc(gs, "Describe", StatusOrigin::kStorageNode, rpc_address);
  if (reply.node().node_id() != expect.node_id ||
      reply.node().incarnation() != expect.incarnation) {
    return Status::StalePeer(rpc_address + " is " + reply.node().node_id() + " incarnation " +
                             std::to_string(reply.node().incarnation()) + ", not the expected " +
                             expect.node_id + " incarnation " + std::to_string(expect.incarnation));
  }
  return reply.engine_descriptor();
}

}  // namespace

InventoryRecord RecordFromProto(const rpc::InventoryRecord& r) {
  return {r.key(),
          r.version(),
          {r.sizes().begin(), r.sizes().end()},
          r.checksum(),
          r.segment_id(),
          r.offset(),
          r.replica_num(),
          r.replica_id(),
          r.hard_pin(),
          r.soft_pin_ttl_ms()};
}

rpc::InventoryRecord RecordToProto(const InventoryRecord& r) {
  rpc::InventoryRecord out;
  out.set_key(r.key);
  out.set_version(r.version);
  for (uint64_t s : r.sizes) out.add_sizes(s);
  out.set_checksum(r.checksum);
  out.set_segment_id(r.segment_id);
  out.set_offset(r.offset);
  out.set_replica_num(r.replica_num);
  out.set_replica_id(r.replica_id);
  out.set_hard_pin(r.hard_pin);
  out.set_soft_pin_ttl_ms(r.soft_pin_ttl_ms);
  return out;
}

bool MasterClient::Retryable(std::string_view method) {
  for (const MethodPolicy& m : kMasterMethods) {
    if (m.method == method) return m.retryable;
  }
  return false;  // a method missing from the table is sent once
}

MasterClient::MasterClient(Options options)
    : options_(std::move(options)), auth_(options_.cluster_token, options_.auth_skew_ms) {
  util::EnvBool("KVBRIDGE_MASTER_FAST_PATH", &fast_enabled_);  // a bad value is warned about
  fast_enabled_ = fast_enabled_ && options_.fast_path;
  if (IsEtcdAddress(options_.address)) {
    auto etcd = ParseEtcdAddress(options_.address);
    if (etcd.ok()) {
      resolver_ = std::make_unique<LeaderResolver>(
          std::move(etcd).value(), std::min<uint32_t>(1000, options_.retry.rpc_timeout_ms));
    } else {
      bad_address_ = etcd.status();
    }
    return;
  }
  fixed_ = Connect(options_.address);
}

std::shared_ptr<const MasterClient::Channels> MasterClient::Connect(
    const std::string& address) const {
  auto ch = std::make_shared<Channels>();
  ch->address = address;
  ch->fast = std::make_shared<FastLink>();
  ch->main = rpc::Master::NewStub(MasterChannel(options_, address, "master"));
  if (options_.heartbeat_channel) {
    ch->heartbeat = rpc::Master::NewStub(MasterChannel(options_, address, "heartbeat"));
  }
  return ch;
}

Result<std::shared_ptr<const MasterClient::Channels>> MasterClient::Current() {
  if (fixed_) return fixed_;
  if (!bad_address_.ok()) return bad_address_;
  auto leader = resolver_->Leader();
  if (!leader.ok()) return leader.status();
  std::lock_guard<std::mutex> lock(leader_mu_);
  if (!leader_ || leader_->address != *leader) {
    if (leader_) {
      KVB_LOG(INFO) << "the master leader in " << resolver_->Describe() << " is now " << *leader
                    << " (was " << leader_->address << ")";
    }
    leader_ = Connect(*leader);
  }
  return leader_;
}

namespace {
// A master's lean port is asked for again this long after it could not be asked or reached.
constexpr auto kFastRetryAfter = std::chrono::seconds(2);

// gRPC's deadlines are on the system clock, the lean port's on the steady one.
fast::Clock::time_point SteadyDeadline(std::chrono::system_clock::time_point deadline) {
  const auto left = std::min<std::chrono::system_clock::duration>(
      deadline - std::chrono::system_clock::now(), std::chrono::hours(24));
  return fast::Clock::now() + std::chrono::duration_cast<fast::Clock::duration>(left);
}
}  // namespace

struct MasterClient::FastLink {
  std::mutex mu;
  std::shared_ptr<fast::Client> client;  // once the master said where its lean port is
  Clock::time_point next_ask{};          // no question to the master before this
};

std::shared_ptr<fast::Client> MasterClient::Fast(const Channels& ch) const {
  if (!fast_enabled_) return nullptr;
  FastLink& link = *ch.fast;
  std::lock_guard<std::mutex> lock(link.mu);
  if (link.client || Clock::now() < link.next_ask) return link.client;
  // Asked once per master (and again after its lean port failed to connect): a master that
  // does not answer is asked again a few seconds later, one without a lean port (turned off,
  // or too old to know the question) a minute later; meanwhile its calls go over gRPC.
  link.next_ask = Clock::now() + kFastRetryAfter;
  grpc::ClientContext ctx;
  ctx.set_deadline(Clock::now() + std::chrono::milliseconds(
                                      std::min<uint32_t>(1000, options_.retry.rpc_timeout_ms)));
  auth_.Sign(&ctx, method::kFastPath);
  rpc::FastPathReply reply;
  const grpc::Status gs = ch.main->FastPath(&ctx, rpc::Empty(), &reply);
  std::string host, port;
  if (gs.error_code() == grpc::StatusCode::UNIMPLEMENTED || (gs.ok() && reply.port() == 0)) {
    link.next_ask = Clock::now() + std::chrono::seconds(60);
  } else if (gs.ok() && util::SplitHostPort(ch.address, &host, &port)) {
    link.client = std::make_shared<fast::Client>(host, static_cast<uint16_t>(reply.port()), auth_);
  }
  return link.client;
}

void MasterClient::DropFast(const Channels& ch, const std::shared_ptr<fast::Client>& client) const {
  FastLink& link = *ch.fast;
  std::lock_guard<std::mutex> lock(link.mu);
  if (link.client == client) {
    // Asked again in a little while (a restarted master has another lean port); meanwhile
    // gRPC, so that a port that cannot be reached costs one call its connection attempt, not
    // every call.
    link.client.reset();
    link.next_ask = Clock::now() + kFastRetryAfter;
  }
}

bool MasterClient::CallFast(const Channels& ch, fast::Method method, const grpc::ClientContext& ctx,
                            const google::protobuf::MessageLite& request,
                            google::protobuf::MessageLite* reply, grpc::Status* status) const {
  std::shared_ptr<fast::Client> f = Fast(ch);
  if (!f) return false;
  if (!f->Call(method, request, reply, SteadyDeadline(ctx.deadline()), status)) {
    fast_fallbacks_.fetch_add(1, std::memory_order_relaxed);
    DropFast(ch, f);
    return false;
  }
  fast_calls_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void MasterClient::ForgetLeader(const std::string& address) const {
  if (resolver_ && !address.empty()) resolver_->Forget(address);
}

std::string MasterClient::leader_address() {
  auto ch = Current();
  return ch.ok() ? (*ch)->address : std::string();
}

Status MasterClient::Failed(const grpc::Status& gs, std::string_view name,
                            const std::string& address) const {
  Status st =
      FromGrpc(gs, name, StatusOrigin::kMaster, address.empty() ? options_.address : address);
  if (!resolver_ || st.ok()) return st;
  return Status(st.code(), st.message() + " (the leader elected in " + resolver_->Describe() + ")")
      .WithOrigin(StatusOrigin::kMaster);
}

Status MasterClient::Run(
    std::string_view name, std::string_view method,
    const std::function<grpc::Status(grpc::ClientContext*, const Channels&)>& attempt,
    const std::function<void(grpc::ClientContext*)>& sign, uint32_t extra_deadline_ms,
    uint32_t single_attempt_ms) {
  const bool retryable = single_attempt_ms == 0 && Retryable(method);
  const auto deadline =
      Clock::now() +
      std::chrono::milliseconds(single_attempt_ms != 0
                                    ? uint64_t{single_attempt_ms}
                                    : uint64_t{options_.retry.rpc_timeout_ms} + extra_deadline_ms);
  uint32_t backoff_ms = options_.retry.first_backoff_ms;
  grpc::Status unavailable;  // the first UNAVAILABLE, once one was retried
  std::string address = options_.address;
  for (int tries = 1;; ++tries) {
    // With "etcd://": the leader etcd names now. None (an election in progress, etcd down)
    // counts as the master being unavailable.
    auto ch = Current();
    if (!ch.ok()) {
      const grpc::Status gs(grpc::StatusCode::UNAVAILABLE, ch.status().message());
      if (!(retryable && bad_address_.ok() &&
            Clock::now() + std::chrono::milliseconds(backoff_ms) < deadline)) {
        if (!bad_address_.ok()) return bad_address_;
        return Status::PeerUnreachable(std::string(name) + ": " + ch.status().message())
            .WithOrigin(StatusOrigin::kMaster);
      }
      if (tries == 1) unavailable = gs;
      std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
      backoff_ms = std::min(2 * backoff_ms, options_.retry.max_backoff_ms);
      continue;
    }
    address = (*ch)->address;
    grpc::ClientContext ctx;
    // Following a leader: a retry waits for the leader's channel at most kLeaderAttemptMs, then
    // asks etcd again, so a leader that died is left as soon as etcd names its successor.
    const bool capped = resolver_ && retryable && tries > 1 &&
                        Clock::now() + std::chrono::milliseconds(kLeaderAttemptMs) < deadline;
    ctx.set_deadline(capped ? Clock::now() + std::chrono::milliseconds(kLeaderAttemptMs)
                            : deadline);
    // A retry waits for the channel to connect again, up to the deadline, rather than failing
    // at once while it is down: the waiting call is what drives the reconnection (a blocking
    // client polls its connections only while a call is in progress), so the call goes out as
    // soon as the master is back instead of at gRPC's next background poll, 5 s later.
    ctx.set_wait_for_ready(tries > 1);
    auth_.Sign(&ctx, method);
    if (sign) sign(&ctx);
    attempts_.fetch_add(1, std::memory_order_relaxed);
    grpc::Status gs = attempt(&ctx, **ch);
    if (gs.ok()) return Status::OK();
    if (capped && gs.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      gs = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "the leader " + address + " did not answer within " +
                            std::to_string(kLeaderAttemptMs) + " ms");
    }
    // The leader may have changed: ask etcd again before the next call or retry.
    if (resolver_ && gs.error_code() == grpc::StatusCode::UNAVAILABLE) resolver_->Forget(address);
    const bool retry = retryable && gs.error_code() == grpc::StatusCode::UNAVAILABLE &&
                       Clock::now() + std::chrono::milliseconds(backoff_ms) < deadline;
    if (!retry) {
      // Still down at the deadline: say so (unreachable, and why), not only that it was late.
      const bool down = tries > 1 && gs.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
      Status st = Failed(down ? unavailable : gs, name, address);
      if (tries > 1) {
        st = Status(st.code(), st.message() + " (" + std::to_string(tries) +
                                   " attempts; the call's deadline is " +
                                   std::to_string(options_.retry.rpc_timeout_ms) + " ms)")
                 .WithOrigin(StatusOrigin::kMaster);
      }
      return st;
    }
    if (tries == 1) unavailable = gs;
    std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
    backoff_ms = std::min(2 * backoff_ms, options_.retry.max_backoff_ms);
  }
}

namespace {

// The start and largest block of the arena a call's messages live on: a PutStart or
// GetReplicas of 128 keys holds a message per key and per replica and a node id string per
// replica, about a thousand allocations that the arena makes a few blocks, freed at once.
google::protobuf::ArenaOptions CallArenaOptions() {
  google::protobuf::ArenaOptions o;
  o.start_block_size = 32 << 10;
  o.max_block_size = 256 << 10;
  return o;
}

}  // namespace

// The call goes out on a completion queue of its own that Wait() polls on the calling thread:
// the answer is read and handed over by the thread that waits for it, not by one of gRPC's
// threads that then wakes it (a callback call took two thread switches more per put).
struct MasterClient::PendingPutStart::State {
  State() : arena(CallArenaOptions()) {}
  ~State() {
    if (started && !done) {  // never waited for: cancel it and let its completion come
      ctx.TryCancel();
      void* tag = nullptr;
      bool ok = false;
      (void)cq.Next(&tag, &ok);
    }
    cq.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq.Next(&tag, &ok)) {
    }
  }
  google::protobuf::Arena arena;
  grpc::ClientContext ctx;
  grpc::CompletionQueue cq;
  rpc::PutStartRequest* req = nullptr;  // on the arena
  rpc::PutStartReply* reply = nullptr;  // on the arena
  std::unique_ptr<grpc::ClientAsyncResponseReader<rpc::PutStartReply>> call;
  bool started = false;  // the call went out (its completion is still to be taken from cq)
  bool done = false;
  grpc::Status gs;
  const MasterClient* owner = nullptr;
  std::shared_ptr<const MasterClient::Channels> channels;  // the leader it was sent to
  // Sent on the master's lean port instead: the connection to read the answer from.
  std::shared_ptr<fast::Client> fast;
  std::unique_ptr<fast::Connection> conn;
  fast::Clock::time_point deadline;
};

MasterClient::PendingPutStart MasterClient::PutStart(std::span<const std::string> keys,
                                                     std::span<const std::vector<uint64_t>> sizes,
                                                     uint32_t replica_num,
                                                     const std::string& client_node_id,
                                                     bool overwrite, const PutPins& pins) {
  PendingPutStart p;
  auto s = std::make_shared<PendingPutStart::State>();
  p.state_ = s;
  s->owner = this;
  s->req = google::protobuf::Arena::CreateMessage<rpc::PutStartRequest>(&s->arena);
  s->reply = google::protobuf::Arena::CreateMessage<rpc::PutStartReply>(&s->arena);
  rpc::PutStartRequest& req = *s->req;
  req.set_replica_num(replica_num);
  req.set_client_node_id(client_node_id);
  req.set_overwrite(overwrite);
  req.set_hard_pin(pins.hard_pin);
  req.set_soft_pin(static_cast<rpc::SoftPin>(pins.soft_pin));
  req.set_soft_pin_ttl_ms(pins.soft_pin_ttl_ms);
  req.mutable_keys()->Reserve(static_cast<int>(keys.size()));
  req.mutable_sizes()->Reserve(static_cast<int>(keys.size()));
  for (size_t i = 0; i < keys.size(); ++i) {
    req.add_keys(keys[i]);
    auto* sz = req.add_sizes();
    sz->mutable_sizes()->Reserve(static_cast<int>(sizes[i].size()));
    for (uint64_t b : sizes[i]) sz->add_sizes(b);
  }
  const auto deadline = Clock::now() + std::chrono::milliseconds(options_.retry.rpc_timeout_ms);
  s->ctx.set_deadline(deadline);
  s->deadline = SteadyDeadline(deadline);
  auth_.Sign(&s->ctx, method::kPutStart);
  auto ch = Current();
  if (!ch.ok()) {  // no leader known: fails as an unreachable master does
    s->gs = grpc::Status(grpc::StatusCode::UNAVAILABLE, ch.status().message());
    s->done = true;
    return p;
  }
  s->channels = *ch;
  attempts_.fetch_add(1, std::memory_order_relaxed);
  if (std::shared_ptr<fast::Client> f = Fast(**ch)) {
    bool fallback = false;
    s->conn = f->Send(fast::Method::kPutStart, req, s->deadline, &s->gs, &fallback);
    if (s->conn) {
      s->fast = std::move(f);
      return p;
    }
    if (!fallback) {
      s->done = true;
      return p;
    }
    fast_fallbacks_.fetch_add(1, std::memory_order_relaxed);
    DropFast(**ch, f);
  }
  s->call = s->channels->main->AsyncPutStart(&s->ctx, req, &s->cq);
  s->call->Finish(s->reply, &s->gs, s.get());
  s->started = true;
  return p;
}

Result<std::vector<PutGrant>> MasterClient::PendingPutStart::Wait() {
  State& s = *state_;
  if (!s.done && s.conn) {
    s.gs = s.fast->Receive(std::move(s.conn), s.reply, s.deadline);
    s.done = true;
    s.owner->fast_calls_.fetch_add(1, std::memory_order_relaxed);
  }
  if (!s.done) {
    void* tag = nullptr;
    bool ok = false;
    if (!s.cq.Next(&tag, &ok) || tag != &s) {
      s.gs = grpc::Status(grpc::StatusCode::INTERNAL, "the call's completion queue failed");
    }
    s.done = true;
  }
  if (!s.gs.ok() || s.reply->items_size() != s.req->keys_size()) {
    const std::string address = s.channels ? s.channels->address : std::string();
    if (s.gs.error_code() == grpc::StatusCode::UNAVAILABLE) s.owner->ForgetLeader(address);
    return s.owner->Failed(s.gs, "PutStart", address);
  }
  std::vector<PutGrant> out(s.reply->items_size());
  for (int i = 0; i < s.reply->items_size(); ++i) {
    const rpc::PutStartItem& item = s.reply->items(i);
    PutGrant& g = out[i];
    g.status = store::FromProto(item.status());
    g.version = item.version();
    g.replicas.reserve(item.replicas_size());
    for (const auto& r : item.replicas()) g.replicas.push_back(FromProto(r));
    g.deadline_ms = item.deadline_ms();
  }
  return out;
}

Result<std::vector<Status>> MasterClient::PutEnd(std::span<const PutEndItem> items,
                                                 std::span<const NodeIdentity> local_nodes,
                                                 std::vector<rpc::CommitRequest>* local_commits) {
  // The request on an arena; the reply on the heap, so that its commits move out whole.
  google::protobuf::Arena arena(CallArenaOptions());
  rpc::PutEndRequest& req = *google::protobuf::Arena::CreateMessage<rpc::PutEndRequest>(&arena);
  req.mutable_items()->Reserve(static_cast<int>(items.size()));
  if (local_commits != nullptr) {
    for (const NodeIdentity& n : local_nodes) {
      rpc::NodeIdentity* out = req.add_local_nodes();
      out->set_node_id(n.node_id);
      out->set_incarnation(n.incarnation);
    }
  }
  for (const PutEndItem& item : items) {
    auto* e = req.add_items();
    e->set_key(item.key);
    e->set_version(item.version);
    e->set_checksum(item.checksum);
    for (bool ok : item.replica_ok) e->add_replica_ok(ok);
  }
  rpc::KeyStatusReply reply;
  KVB_RETURN_IF_ERROR(
      Run("PutEnd", method::kPutEnd, [&](grpc::ClientContext* ctx, const Channels& ch) {
        if (grpc::Status fs; CallFast(ch, fast::Method::kPutEnd, *ctx, req, &reply, &fs)) {
          return fs;
        }
        return ch.main->PutEnd(ctx, req, &reply);
      }));
  if (reply.statuses_size() != req.items_size()) return Failed(grpc::Status::OK, "PutEnd");
  std::vector<Status> out;
  out.reserve(items.size());
  for (const auto& s : reply.statuses()) out.push_back(store::FromProto(s));
  if (local_commits != nullptr) {
    local_commits->assign(std::make_move_iterator(reply.mutable_local_commits()->begin()),
                          std::make_move_iterator(reply.mutable_local_commits()->end()));
  }
  return out;
}

Result<std::vector<ReadGrant>> MasterClient::GetReplicas(std::span<const std::string> keys,
                                                         const std::string& client_node_id,
                                                         bool sizes_only,
                                                         uint32_t single_attempt_ms) {
  rpc::GetReplicasRequest req;
  req.set_client_node_id(client_node_id);
  req.set_sizes_only(sizes_only);
  for (const auto& k : keys) req.add_keys(k);
  // On an arena (CallArenaOptions): about a thousand allocations for 128 keys at two replicas.
  google::protobuf::Arena arena(CallArenaOptions());
  rpc::GetReplicasReply& reply =
      *google::protobuf::Arena::CreateMessage<rpc::GetReplicasReply>(&arena);
  KVB_RETURN_IF_ERROR(Run(
      "GetReplicas", method::kGetReplicas,
      [&](grpc::ClientContext* ctx, const Channels& ch) {
        reply.Clear();
        if (grpc::Status fs; CallFast(ch, fast::Method::kGetReplicas, *ctx, req, &reply, &fs)) {
          return fs;
        }
        return ch.main->GetReplicas(ctx, req, &reply);
      },
      {}, 0, single_attempt_ms));
  if (reply.items_size() != static_cast<int>(keys.size())) {
    return Failed(grpc::Status::OK, "GetReplicas");
  }
  std::vector<ReadGrant> out(keys.size());
  for (int i = 0; i < reply.items_size(); ++i) {
    const rpc::GetItem& item = reply.items(i);
    ReadGrant& g = out[i];
    g.status = store::FromProto(item.status());
    g.version = item.version();
    g.sizes.assign(item.sizes().begin(), item.sizes().end());
    g.checksum = item.checksum();
    g.replicas.reserve(item.replicas_size());
    for (const auto& r : item.replicas()) g.replicas.push_back(FromProto(r));
    g.lease_ms = item.lease_ms();
  }
  return out;
}

Result<std::vector<bool>> MasterClient::Exists(std::span<const std::string> keys,
                                               uint32_t single_attempt_ms) {
  rpc::KeysRequest req;
  for (const auto& k : keys) req.add_keys(k);
  rpc::ExistsReply reply;
  KVB_RETURN_IF_ERROR(Run(
      "Exists", method::kExists,
      [&](grpc::ClientContext* ctx, const Channels& ch) {
        reply.Clear();
        if (grpc::Status fs; CallFast(ch, fast::Method::kExists, *ctx, req, &reply, &fs)) {
          return fs;
        }
        return ch.main->Exists(ctx, req, &reply);
      },
      {}, 0, single_attempt_ms));
  if (reply.exists_size() != static_cast<int>(keys.size())) {
    return Status::Protocol("Exists: reply from the master " + options_.address +
                            " has the wrong number of entries")
        .WithOrigin(StatusOrigin::kMaster);
  }
  return std::vector<bool>(reply.exists().begin(), reply.exists().end());
}

Result<uint64_t> MasterClient::Place(std::string_view key, const std::vector<std::string>& targets,
                                     const std::string& move_from) {
  rpc::PlaceRequest req;
  req.set_key(std::string(key));
  for (const auto& t : targets) req.add_targets(t);
  req.set_move_from(move_from);
  rpc::PlaceReply reply;
  KVB_RETURN_IF_ERROR(
      Run("Place", method::kPlace, [&](grpc::ClientContext* ctx, const Channels& ch) {
        reply.Clear();
        return ch.main->Place(ctx, req, &reply);
      }));
  if (Status st = FromProto(reply.status()); !st.ok()) return st.WithOrigin(StatusOrigin::kMaster);
  return reply.task_id();
}

Result<PlacementTask> MasterClient::QueryPlacement(uint64_t task_id) {
  rpc::PlacementQuery req;
  req.set_task_id(task_id);
  rpc::PlacementReply reply;
  KVB_RETURN_IF_ERROR(Run("QueryPlacement", method::kQueryPlacement,
                          [&](grpc::ClientContext* ctx, const Channels& ch) {
                            reply.Clear();
                            return ch.main->QueryPlacement(ctx, req, &reply);
                          }));
  if (Status st = FromProto(reply.status()); !st.ok()) return st.WithOrigin(StatusOrigin::kMaster);
  static constexpr const char* kStates[] = {"PROCESSING", "SUCCESS", "FAILED"};
  if (reply.state() > 2) {
    return Status::Protocol("QueryPlacement: unknown task state " + std::to_string(reply.state()) +
                            " from the master")
        .WithOrigin(StatusOrigin::kMaster);
  }
  return PlacementTask{reply.key(),
                       reply.move(),
                       kStates[reply.state()],
                       reply.message(),
                       reply.source(),
                       reply.created_unix_ms(),
                       reply.updated_unix_ms()};
}

Result<std::vector<Status>> MasterClient::Remove(std::span<const std::string> keys) {
  rpc::KeysRequest req;
  for (const auto& k : keys) req.add_keys(k);
  rpc::KeyStatusReply reply;
  KVB_RETURN_IF_ERROR(
      Run("Remove", method::kRemove, [&](grpc::ClientContext* ctx, const Channels& ch) {
        return ch.main->Remove(ctx, req, &reply);
      }));
  if (reply.statuses_size() != static_cast<int>(keys.size())) {
    return Failed(grpc::Status::OK, "Remove");
  }
  std::vector<Status> out;
  out.reserve(keys.size());
  for (const auto& s : reply.statuses()) out.push_back(store::FromProto(s));
  return out;
}

Status MasterClient::RemoveAll(const CallKey& admin_key) {
  rpc::Empty req;
  rpc::Status reply;
  KVB_RETURN_IF_ERROR(Run(
      "RemoveAll", method::kRemoveAll,
      [&](grpc::ClientContext* ctx, const Channels& ch) {
        return ch.main->RemoveAll(ctx, req, &reply);
      },
      [&](grpc::ClientContext* ctx) {
        RpcAuth::SignWith(ctx, kAdminHeader, admin_key, method::kRemoveAll);
      }));
  return store::FromProto(reply);
}

Result<uint64_t> MasterClient::RemoveByRegex(std::string_view pattern, const CallKey& admin_key) {
  rpc::RegexRequest req;
  req.set_pattern(std::string(pattern));
  rpc::RemoveByRegexReply reply;
  KVB_RETURN_IF_ERROR(Run(
      "RemoveByRegex", method::kRemoveByRegex,
      [&](grpc::ClientContext* ctx, const Channels& ch) {
        return ch.main->RemoveByRegex(ctx, req, &reply);
      },
      [&](grpc::ClientContext* ctx) {
        RpcAuth::SignWith(ctx, kAdminHeader, admin_key, method::kRemoveByRegex);
      }));
  KVB_RETURN_IF_ERROR(store::FromProto(reply.status()));
  return reply.removed();
}

void MasterClient::ReportBadReplica(const BadReplica& bad) {
  rpc::BadReplicaRequest req;
  req.set_key(bad.key);
  req.set_version(bad.version);
  *req.mutable_node() = ToProto(bad.node);
  req.set_segment_id(bad.segment_id);
  req.set_offset(bad.offset);
  req.set_node_unreachable(bad.node_unreachable);
  rpc::Status ignored;
  (void)Run("ReportBadReplica", method::kReportBadReplica,
            [&](grpc::ClientContext* ctx, const Channels& ch) {
              return ch.main->ReportBadReplica(ctx, req, &ignored);
            });
}

Result<std::vector<NodeEntry>> MasterClient::NodeDescriptors(
    std::span<const std::string> node_ids) {
  rpc::NodeDescriptorsRequest req;
  for (const auto& id : node_ids) req.add_node_ids(id);
  rpc::NodeDescriptorsReply reply;
  KVB_RETURN_IF_ERROR(Run("GetNodeDescriptors", method::kGetNodeDescriptors,
                          [&](grpc::ClientContext* ctx, const Channels& ch) {
                            reply.Clear();
                            return ch.main->GetNodeDescriptors(ctx, req, &reply);
                          }));
  std::vector<NodeEntry> out;
  out.reserve(reply.nodes_size());
  for (auto& nd : *reply.mutable_nodes()) {
    out.push_back({FromProto(nd.node()), std::move(*nd.mutable_engine_descriptor()),
                   std::move(*nd.mutable_rpc_address())});
  }
  return out;
}

Result<ClusterStatus> MasterClient::Stats() {
  rpc::Empty req;
  rpc::StatsReply reply;
  KVB_RETURN_IF_ERROR(
      Run("Stats", method::kStats, [&](grpc::ClientContext* ctx, const Channels& ch) {
        reply.Clear();
        return ch.main->Stats(ctx, req, &reply);
      }));
  ClusterStatus out;
  for (const auto& n : reply.nodes()) {
    NodeStatus ns;
    ns.id = FromProto(n.node());
    ns.state = n.state();
    ns.capacity_bytes = n.capacity();
    ns.used_bytes = n.used();
    ns.replicas = n.replicas();
    ns.ssd_capacity_bytes = n.ssd_capacity();
    ns.ssd_used_bytes = n.ssd_used();
    out.nodes.push_back(std::move(ns));
  }
  out.objects = reply.objects();
  out.pending_puts = reply.pending();
  out.stored_bytes = reply.bytes();
  out.evictions_total = reply.evictions_total();
  out.bad_replicas_total = reply.bad_replicas_total();
  out.unreachable_reports_total = reply.unreachable_reports_total();
  out.nodes_expired_total = reply.nodes_expired_total();
  out.under_replicated = reply.under_replicated();
  out.demotions_total = reply.demotions_total();
  out.ssd_replicas = reply.ssd_replicas();
  out.promotions_total = reply.promotions_total();
  out.departed_copies = reply.departed_copies();
  return out;
}

Result<NodeRegistered> MasterClient::Register(const NodeRegistration& registration,
                                              const std::vector<InventoryRecord>& records,
                                              bool on_heartbeat_channel) {
  rpc::RegisterNodeRequest head;  // everything but the inventory, which goes in chunks
  *head.mutable_node() =
      ToProto(PeerId{registration.identity.node_id, registration.identity.incarnation});
  head.set_engine_descriptor(registration.engine_descriptor);
  head.set_rpc_address(registration.control_endpoint);
  for (const SegmentInfo& seg : registration.segments) {
    auto* s = head.add_segments();
    s->set_segment_id(seg.segment_id);
    s->set_capacity(seg.capacity);
    s->set_tier(static_cast<uint32_t>(seg.tier));
  }
  head.set_draining(registration.draining);
  head.set_registered_before(registration.registered_before);
  rpc::RegisterNodeReply reply;
  // The master registers the node only once every record has arrived: a large inventory gets
  // 1 ms more per 100 records (10 s per million) on top of the usual deadline.
  const auto extra_ms = static_cast<uint32_t>(records.size() / 100);
  Status st = Run(
      "RegisterNode", method::kRegisterNodeStream,
      [&](grpc::ClientContext* ctx, const Channels& ch) {
        std::unique_ptr<grpc::ClientWriter<rpc::RegisterNodeRequest>> writer =
            ch.Pick(on_heartbeat_channel).RegisterNodeStream(ctx, &reply);
        rpc::RegisterNodeRequest msg = head;
        bool sent = false;
        size_t bytes = 0;
        for (const InventoryRecord& r : records) {
          rpc::InventoryRecord* added = msg.add_inventory();
          *added = RecordToProto(r);
          bytes += added->ByteSizeLong();
          if (msg.inventory_size() >= static_cast<int>(kInventoryChunkRecords) ||
              bytes >= kInventoryChunkBytes) {
            if (!writer->Write(msg)) return writer->Finish();  // the stream broke: why
            sent = true;
            msg.Clear();
            bytes = 0;
          }
        }
        if ((!sent || msg.inventory_size() > 0) && !writer->Write(msg)) return writer->Finish();
        writer->WritesDone();
        return writer->Finish();
      },
      {}, extra_ms);
  if (st.Is(StatusCode::kUnsupported)) {
    // A master from before RegisterNodeStream: everything in one message (at most ~40 k
    // records fit its 4 MiB limit).
    rpc::RegisterNodeRequest req = head;
    for (const InventoryRecord& r : records) *req.add_inventory() = RecordToProto(r);
    reply.Clear();
    st = Run("RegisterNode", method::kRegisterNode,
             [&](grpc::ClientContext* ctx, const Channels& ch) {
               return ch.Pick(on_heartbeat_channel).RegisterNode(ctx, req, &reply);
             });
  }
  if (!st.ok()) return st;
  if (Status refused = store::FromProto(reply.status()); !refused.ok()) {
    return refused.WithContext("RegisterNode");
  }
  NodeRegistered out;
  out.frees = FromProto(reply.frees());
  out.free_seqs.assign(reply.free_seqs().begin(), reply.free_seqs().end());
  out.more = reply.more();
  out.heartbeat_interval_ms = reply.heartbeat_interval_ms();
  out.node_secret = reply.node_secret();
  out.term = reply.term();
  return out;
}

Result<HeartbeatAnswer> MasterClient::Heartbeat(const PeerId& node, uint64_t frees_acked) {
  rpc::HeartbeatRequest req;
  *req.mutable_node() = ToProto(node);
  req.set_frees_acked(frees_acked);
  rpc::HeartbeatReply reply;
  KVB_RETURN_IF_ERROR(
      Run("Heartbeat", method::kHeartbeat, [&](grpc::ClientContext* ctx, const Channels& ch) {
        return ch.Pick(true).Heartbeat(ctx, req, &reply);
      }));
  Status st = store::FromProto(reply.status());
  if (!st.ok()) return st;
  HeartbeatAnswer out;
  out.frees = FromProto(reply.frees());
  out.free_seqs.assign(reply.free_seqs().begin(), reply.free_seqs().end());
  out.tasks.reserve(reply.tasks_size());
  for (const rpc::ReplicationTask& t : reply.tasks()) out.tasks.push_back(FromProto(t));
  out.moves.reserve(reply.demotions_size());
  for (const rpc::Demotion& d : reply.demotions()) {
    out.moves.push_back({RecordFromProto(d.source()), RecordFromProto(d.dest()), d.timeout_ms()});
  }
  out.drained = reply.drained();
  out.more = reply.more();
  out.term = reply.term();
  return out;
}

Status MasterClient::TaskDone(const TaskReport& done, Status* answer) {
  rpc::TaskDoneRequest req;
  *req.mutable_node() = ToProto(done.node);
  req.set_task_id(done.task_id);
  store::ToProto(done.status, req.mutable_status());
  rpc::Status reply;
  KVB_RETURN_IF_ERROR(
      Run("TaskDone", method::kTaskDone, [&](grpc::ClientContext* ctx, const Channels& ch) {
        return ch.main->TaskDone(ctx, req, &reply);
      }));
  *answer = store::FromProto(reply);
  return Status::OK();
}

Status MasterClient::DemoteDone(const MoveReport& done, Status* answer) {
  rpc::DemoteDoneRequest req;
  *req.mutable_node() = ToProto(done.node);
  req.set_key(done.key);
  req.set_version(done.version);
  req.set_dest_replica_id(done.dest_replica_id);
  store::ToProto(done.status, req.mutable_status());
  rpc::Status reply;
  KVB_RETURN_IF_ERROR(
      Run("DemoteDone", method::kDemoteDone, [&](grpc::ClientContext* ctx, const Channels& ch) {
        return ch.main->DemoteDone(ctx, req, &reply);
      }));
  *answer = store::FromProto(reply);
  return Status::OK();
}

Status MasterClient::Drain(const PeerId& node, const CallKey& node_key) {
  const rpc::NodeIdentity id = ToProto(node);
  rpc::Status reply;
  KVB_RETURN_IF_ERROR(Run(
      "Drain", method::kDrain,
      [&](grpc::ClientContext* ctx, const Channels& ch) { return ch.main->Drain(ctx, id, &reply); },
      [&](grpc::ClientContext* ctx) {
        RpcAuth::SignWith(ctx, kNodeHeader, node_key, method::kDrain);
      }));
  Status st = store::FromProto(reply);
  return st.ok() ? st : st.WithContext("Drain");
}

Status MasterClient::Deregister(const PeerId& node, const CallKey& node_key) {
  const rpc::NodeIdentity id = ToProto(node);
  rpc::Status reply;
  KVB_RETURN_IF_ERROR(Run(
      "Deregister", method::kDeregister,
      [&](grpc::ClientContext* ctx, const Channels& ch) {
        return ch.main->Deregister(ctx, id, &reply);
      },
      [&](grpc::ClientContext* ctx) {
        RpcAuth::SignWith(ctx, kNodeHeader, node_key, method::kDeregister);
      }));
  return store::FromProto(reply);
}

bool PeerDirectory::BackingOff(const PeerId& node) const {
  return backoff_.WaitMs(ToProto(node)) != 0;
}

Result<std::string> PeerDirectory::Descriptor(const NodeEntry& listed) {
  if (!direct_) return listed.engine_descriptor;
  const rpc::NodeIdentity node = ToProto(listed.id);
  if (const uint64_t wait = backoff_.WaitMs(node); wait != 0) {
    return Status::PeerUnreachable("node " + listed.id.node_id +
                                   " did not answer Describe recently; not asked again for " +
                                   std::to_string(wait) + " ms");
  }
  Result<std::string> d =
      DescribeNode(listed.rpc_address, master_->auth(), listed.id, master_->rpc_timeout_ms());
  if (d.ok()) {
    backoff_.Succeeded(node);
  } else {
    const uint32_t ms = backoff_.Failed(node);
    KVB_LOG(WARN) << "cannot reach storage node " << listed.id.node_id
                  << " directly: " << d.status().ToString() << "; not asked again for " << ms
                  << " ms";
  }
  return d;
}

Result<std::vector<NodeEntry>> PeerDirectory::Lookup(std::span<const PeerId> nodes) {
  std::vector<std::string> ids;
  for (const PeerId& n : nodes) {
    if (!BackingOff(n)) ids.push_back(n.node_id);  // its keys use other replicas meanwhile
  }
  if (ids.empty()) return std::vector<NodeEntry>{};
  Result<std::vector<NodeEntry>> listed = master_->NodeDescriptors(ids);
  if (!listed.ok()) return listed.status();
  std::vector<NodeEntry> out;
  out.reserve(listed->size());
  for (NodeEntry& e : *listed) {
    Result<std::string> d = Descriptor(e);
    if (!d.ok()) continue;  // logged; skipped until the backoff passes
    e.engine_descriptor = std::move(d).value();
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace kvbridge::store

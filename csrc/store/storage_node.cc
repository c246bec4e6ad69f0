#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <iterator>
#include <map>
#include <mutex>
#include <thread>

#include "core/host_services.h"
#include "core/plugin_loader.h"
#include "kvbridge.grpc.pb.h"
#include "kvbridge/store.h"
#include "store/rpc_util.h"
#include "util/clock.h"
#include "util/logging.h"

namespace kvbridge {

NodeOptions NodeOptions::FromEnv() {
  NodeOptions o;
  o.engine = EngineOptions::FromEnv();
  if (const char* v = std::getenv("KVBRIDGE_MASTER")) o.master_address = v;
  if (const char* v = std::getenv("KVBRIDGE_NODE_STORAGE_PLUGIN")) o.storage_plugin = v;
  if (const char* v = std::getenv("KVBRIDGE_NODE_RPC_LISTEN")) o.rpc_listen = v;
  store::EnvUint64("KVBRIDGE_NODE_DRAM_BYTES", &o.dram_bytes);
  store::EnvUint("KVBRIDGE_RPC_TIMEOUT_MS", &o.rpc_timeout_ms);
  store::EnvUint("KVBRIDGE_DRAIN_TIMEOUT_MS", &o.drain_timeout_ms);
  return o;
}

namespace {

using RangeKey = std::pair<uint64_t, uint64_t>;  // (segment id, offset)

}  // namespace

struct StorageNode::Impl final : public rpc::Node::Service {
  NodeOptions options;
  std::unique_ptr<TransferEngine> engine;
  core::PluginRegistry plugins;
  std::unique_ptr<core::HostServices> host;
  const kvb_storage_ops_t* storage_ops = nullptr;
  kvb_storage_t* storage = nullptr;
  char* pool = nullptr;
  uint64_t pool_bytes = 0;
  SegmentId segment = 0;

  std::unique_ptr<grpc::Server> server;
  std::string rpc_address;
  // Data-plane calls (task results, drain) and the heartbeat use separate channels, so a slow
  // control call can never delay a heartbeat behind it on one connection.
  std::unique_ptr<rpc::Master::Stub> master;
  std::unique_ptr<rpc::Master::Stub> heartbeat_master;
  uint32_t heartbeat_interval_ms = 1000;

  mutable std::mutex mu;
  std::condition_variable cv;
  std::map<RangeKey, rpc::InventoryRecord> inventory;
  std::deque<rpc::ReplicationTask> tasks;
  bool stopping = false;
  bool draining = false;  // Drain() was called: say so when re-registering
  bool drained = false;
  bool superseded = false;
  bool heartbeat_now = false;  // the task loop wants more work without waiting an interval
  std::thread heartbeat_thread;
  std::thread task_thread;

  ~Impl() override;
  std::unique_ptr<grpc::ClientContext> Context() const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() +
                      std::chrono::milliseconds(options.rpc_timeout_ms));
    return ctx;
  }
  rpc::NodeIdentity Identity() const {
    rpc::NodeIdentity id;
    id.set_node_id(engine->self().node_id);
    id.set_incarnation(engine->self().incarnation);
    return id;
  }
  Status Register(rpc::Master::Stub* stub);
  void ApplyFrees(const google::protobuf::RepeatedPtrField<rpc::InventoryRecord>& frees);
  void HeartbeatLoop();
  void TaskLoop();
  // Copies a batch of tasks' replicas with one engine batch; one status per task.
  std::vector<Status> RunTasks(const std::vector<rpc::ReplicationTask>& batch);
  void Stop();

  grpc::Status Commit(grpc::ServerContext*, const rpc::CommitRequest* req,
                      rpc::Status* reply) override;
};

StorageNode::Impl::~Impl() {
  Stop();
  if (segment != 0 && engine) (void)engine->DeregisterMemory(segment);
  engine.reset();
  if (storage != nullptr) storage_ops->destroy(storage);
}

grpc::Status StorageNode::Impl::Commit(grpc::ServerContext*, const rpc::CommitRequest* req,
                                       rpc::Status* reply) {
  if (req->node().node_id() != engine->self().node_id ||
      req->node().incarnation() != engine->self().incarnation) {
    store::ToProto(Status::StalePeer("commit meant for another incarnation"), reply);
    return grpc::Status::OK;
  }
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& r : req->records()) {
    if (r.segment_id() != segment) {
      store::ToProto(Status::NotRegistered("commit names segment " +
                                           std::to_string(r.segment_id()) + ", not this node's"),
                     reply);
      return grpc::Status::OK;
    }
    inventory[{r.segment_id(), r.offset()}] = r;
  }
  store::ToProto(Status::OK(), reply);
  return grpc::Status::OK;
}

Status StorageNode::Impl::Register(rpc::Master::Stub* stub) {
  rpc::RegisterNodeRequest req;
  *req.mutable_node() = Identity();
  req.set_engine_descriptor(engine->LocalDescriptor());
  req.set_rpc_address(rpc_address);
  auto* seg = req.add_segments();
  seg->set_segment_id(segment);
  seg->set_capacity(pool_bytes);
  seg->set_tier(1);
  {
    std::lock_guard<std::mutex> lock(mu);
    req.set_draining(draining);
    for (const auto& [k, r] : inventory) *req.add_inventory() = r;
  }
  rpc::RegisterNodeReply reply;
  auto ctx = Context();
  grpc::Status gs = stub->RegisterNode(ctx.get(), req, &reply);
  if (!gs.ok()) return store::FromGrpc(gs, "RegisterNode");
  Status st = store::FromProto(reply.status());
  if (!st.ok()) return st.WithContext("RegisterNode");
  if (reply.heartbeat_interval_ms() > 0) heartbeat_interval_ms = reply.heartbeat_interval_ms();
  ApplyFrees(reply.frees());
  return Status::OK();
}

void StorageNode::Impl::ApplyFrees(
    const google::protobuf::RepeatedPtrField<rpc::InventoryRecord>& frees) {
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& f : frees) {
    // Only the exact record: the range may already hold a newer object whose commit overtook
    // this free.
    auto it = inventory.find({f.segment_id(), f.offset()});
    if (it != inventory.end() && it->second.replica_id() == f.replica_id()) inventory.erase(it);
  }
}

void StorageNode::Impl::HeartbeatLoop() {
  std::unique_lock<std::mutex> lock(mu);
  while (!stopping) {
    cv.wait_for(lock, std::chrono::milliseconds(heartbeat_interval_ms),
                [&] { return stopping || heartbeat_now; });
    if (stopping) break;
    heartbeat_now = false;
    lock.unlock();
    rpc::HeartbeatRequest req;
    *req.mutable_node() = Identity();
    rpc::HeartbeatReply reply;
    auto ctx = Context();
    grpc::Status gs = heartbeat_master->Heartbeat(ctx.get(), req, &reply);
    Status st = gs.ok() ? store::FromProto(reply.status()) : store::FromGrpc(gs, "Heartbeat");
    if (st.IsNotFound()) {
      // The master does not know us (it restarted): register again with our inventory.
      Status reg = Register(heartbeat_master.get());
      if (!reg.ok())
        KVB_LOG(WARN) << "re-registration failed: " << reg.ToString();
      else
        KVB_LOG(INFO) << "re-registered with the master after it lost track of this node";
    } else if (st.IsStalePeer()) {
      KVB_LOG(ERROR) << "the master knows another incarnation of node " << engine->self().node_id
                     << "; this one stops serving";
      lock.lock();
      superseded = true;
      cv.notify_all();
      continue;
    } else if (!st.ok()) {
      KVB_LOG(WARN) << "heartbeat: " << st.ToString();
    } else {
      ApplyFrees(reply.frees());
    }
    lock.lock();
    if (st.ok()) {
      for (const auto& t : reply.tasks()) tasks.push_back(t);
      if (reply.drained()) drained = true;
      cv.notify_all();
    }
  }
}

std::vector<Status> StorageNode::Impl::RunTasks(const std::vector<rpc::ReplicationTask>& batch) {
  std::vector<Status> result(batch.size());
  std::vector<TransferOp> ops;
  std::vector<size_t> task_of_op;
  std::vector<std::string> dest_ids(batch.size());
  uint32_t deadline_ms = UINT32_MAX;
  for (size_t i = 0; i < batch.size(); ++i) {
    const rpc::ReplicationTask& task = batch[i];
    Result<PeerId> dest = engine->AddPeer(task.dest_descriptor());
    if (!dest.ok()) {
      result[i] = dest.status().WithContext("destination descriptor");
      continue;
    }
    const auto& src = task.source();
    if (src.segment_id() != segment || src.offset() > pool_bytes ||
        src.length() > pool_bytes - src.offset() || src.length() != task.dest().length()) {
      result[i] = Status::OutOfBounds("task source range is not inside this node's pool");
      continue;
    }
    if (task.timeout_ms() == 0) {
      result[i] = Status::DeadlineExceeded("task arrived past its deadline");
      continue;
    }
    dest_ids[i] = dest->node_id;
    deadline_ms = std::min(deadline_ms, task.timeout_ms());  // the master gives up after it
    ops.push_back(TransferOp{OpCode::kWrite, pool + src.offset(), src.length(), dest_ids[i],
                             task.dest().segment_id(), task.dest().offset()});
    task_of_op.push_back(i);
  }
  if (ops.empty()) return result;
  SubmitOptions so;
  so.deadline_ms = deadline_ms;
  Result<BatchId> id = engine->Submit(ops, so);
  if (!id.ok()) {
    for (size_t i : task_of_op) result[i] = id.status();
    return result;
  }
  BatchResult r = engine->Wait(id.value());
  for (size_t k = 0; k < ops.size(); ++k) result[task_of_op[k]] = r.op_status[k];
  return result;
}

void StorageNode::Impl::TaskLoop() {
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    cv.wait(lock, [&] { return stopping || !tasks.empty(); });
    if (stopping) return;
    // Everything queued goes out as one transfer batch: re-replication after a node loss moves
    // thousands of objects, and one engine batch per object would serialize them.
    std::vector<rpc::ReplicationTask> batch(std::make_move_iterator(tasks.begin()),
                                            std::make_move_iterator(tasks.end()));
    tasks.clear();
    lock.unlock();
    std::vector<Status> statuses = RunTasks(batch);
    for (size_t i = 0; i < batch.size(); ++i) {
      rpc::TaskDoneRequest done;
      *done.mutable_node() = Identity();
      done.set_task_id(batch[i].task_id());
      store::ToProto(statuses[i], done.mutable_status());
      rpc::Status reply;
      auto ctx = Context();
      grpc::Status gs = master->TaskDone(ctx.get(), done, &reply);
      if (!gs.ok()) KVB_LOG(WARN) << store::FromGrpc(gs, "TaskDone").ToString();
    }
    lock.lock();
    heartbeat_now = true;  // ask for the next tasks now, not an interval from now
    cv.notify_all();
  }
}

void StorageNode::Impl::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (stopping) return;
    stopping = true;
  }
  cv.notify_all();
  if (heartbeat_thread.joinable()) heartbeat_thread.join();
  if (task_thread.joinable()) task_thread.join();
  if (server) server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
}

StorageNode::StorageNode(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

StorageNode::~StorageNode() {
  if (!impl_) return;
  bool superseded;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    superseded = impl_->superseded;
  }
  impl_->Stop();
  if (!superseded && impl_->master) {
    rpc::NodeIdentity id = impl_->Identity();
    rpc::Status reply;
    auto ctx = impl_->Context();
    (void)impl_->master->Deregister(ctx.get(), id, &reply);
  }
}

const PeerId& StorageNode::id() const { return impl_->engine->self(); }

size_t StorageNode::object_count() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->inventory.size();
}

Result<std::unique_ptr<StorageNode>> StorageNode::Start(const NodeOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  auto engine = TransferEngine::Create(options.engine);
  if (!engine.ok()) return engine.status().WithContext("storage node");
  impl->engine = std::move(engine).value();

  impl->plugins.Scan(core::PluginRegistry::DefaultSearchPath(options.engine.plugin_path));
  std::string why;
  const core::PluginInfo* plugin =
      impl->plugins.Find(KVB_PLUGIN_STORAGE, options.storage_plugin, &why);
  if (plugin == nullptr || (plugin->caps & KVB_SCAP_POOL) == 0) {
    return Status::Unavailable("storage plugin '" + options.storage_plugin + "': " +
                               (plugin ? std::string("does not offer a memory pool") : why));
  }
  impl->storage_ops = plugin->storage_ops();
  // Storage nodes touch their whole pool up front unless told otherwise: page faults in the
  // first pass over a fresh pool halve its transfer rate for seconds.
  std::map<std::string, std::string> plugin_config = options.engine.plugin_config;
  if (!plugin_config.count("dram.prefault") && !std::getenv("KVBRIDGE_DRAM_PREFAULT")) {
    plugin_config["dram.prefault"] = "1";
  }
  impl->host = std::make_unique<core::HostServices>(std::move(plugin_config));
  kvb_storage_params_t params{.struct_size = sizeof(kvb_storage_params_t),
                              .node_id = impl->engine->self().node_id.c_str(),
                              .capacity_bytes = options.dram_bytes,
                              .path = nullptr};
  char err[512] = {0};
  kvb_status_t st =
      impl->storage_ops->create(impl->host->table(), &params, &impl->storage, err, sizeof(err));
  if (st != KVB_OK) {
    impl->storage = nullptr;
    return Status::FromAbi(st, err).WithContext("storage plugin '" + options.storage_plugin + "'");
  }
  void* addr = nullptr;
  st = impl->storage_ops->get_segment(impl->storage, &addr, &impl->pool_bytes);
  if (st != KVB_OK) return Status::FromAbi(st, "storage plugin has no segment");
  impl->pool = static_cast<char*>(addr);
  Result<SegmentId> seg = impl->engine->RegisterMemory(addr, impl->pool_bytes);
  if (!seg.ok()) return seg.status().WithContext("registering the DRAM pool");
  impl->segment = seg.value();

  auto server =
      store::StartServer(options.rpc_listen, impl.get(), "the node service", &impl->rpc_address);
  if (!server.ok()) return server.status();
  impl->server = std::move(server).value();

  impl->master = rpc::Master::NewStub(
      grpc::CreateChannel(options.master_address, grpc::InsecureChannelCredentials()));
  grpc::ChannelArguments heartbeat_args;
  heartbeat_args.SetString("kvbridge.channel", "heartbeat");  // a connection of its own
  impl->heartbeat_master = rpc::Master::NewStub(grpc::CreateCustomChannel(
      options.master_address, grpc::InsecureChannelCredentials(), heartbeat_args));
  Status reg = impl->Register(impl->master.get());
  if (!reg.ok()) return reg;
  KVB_LOG(INFO) << "storage node " << impl->engine->self().ToString() << " registered "
                << impl->pool_bytes << " bytes with " << options.master_address;
  Impl* raw = impl.get();
  impl->heartbeat_thread = std::thread([raw] { raw->HeartbeatLoop(); });
  impl->task_thread = std::thread([raw] { raw->TaskLoop(); });
  return std::unique_ptr<StorageNode>(new StorageNode(std::move(impl)));
}

Status StorageNode::Drain() {
  Impl& im = *impl_;
  rpc::NodeIdentity id = im.Identity();
  rpc::Status reply;
  {
    std::lock_guard<std::mutex> lock(im.mu);
    im.draining = true;
  }
  {
    auto ctx = im.Context();
    grpc::Status gs = im.master->Drain(ctx.get(), id, &reply);
    if (!gs.ok()) return store::FromGrpc(gs, "Drain");
    Status st = store::FromProto(reply);
    if (!st.ok()) return st.WithContext("Drain");
  }
  std::unique_lock<std::mutex> lock(im.mu);
  const bool done = im.cv.wait_for(lock, std::chrono::milliseconds(im.options.drain_timeout_ms),
                                   [&] { return im.drained || im.stopping || im.superseded; });
  const bool drained = im.drained;
  lock.unlock();
  if (!done || !drained) {
    return Status::DeadlineExceeded("drain not confirmed by the master within " +
                                    std::to_string(im.options.drain_timeout_ms) + " ms");
  }
  return Status::OK();
}

}  // namespace kvbridge

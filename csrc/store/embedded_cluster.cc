#include <filesystem>

#include "kvbridge/store.h"

namespace kvbridge {

struct EmbeddedCluster::Impl {
  std::unique_ptr<MasterServer> master;
  std::vector<std::unique_ptr<StorageNode>> nodes;
  std::unique_ptr<StoreClient> client;
};

EmbeddedCluster::EmbeddedCluster(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

EmbeddedCluster::~EmbeddedCluster() {
  if (!impl_) return;
  impl_->client.reset();  // clients first, then nodes (they deregister), then the master
  impl_->nodes.clear();
  impl_->master.reset();
}

Result<std::unique_ptr<EmbeddedCluster>> EmbeddedCluster::Start(
    const EmbeddedClusterOptions& options) {
  if (options.nodes < 1) return Status::InvalidArgument("EmbeddedCluster needs at least 1 node");
  if (options.replica_num < 1 || options.replica_num > static_cast<uint32_t>(options.nodes)) {
    return Status::InvalidArgument("replica_num must be between 1 and the number of nodes");
  }
  auto impl = std::make_unique<Impl>();
  MasterOptions mo = options.master;
  if (mo.listen == MasterOptions{}.listen) mo.listen = "127.0.0.1:0";
  // One token for the whole cluster: the engines' (EmbeddedClusterOptions::engine).
  mo.cluster_token = options.engine.cluster_token;
  auto master = MasterServer::Start(mo);
  if (!master.ok()) return master.status().WithContext("embedded master");
  impl->master = std::move(master).value();
  for (int i = 0; i < options.nodes; ++i) {
    NodeOptions no;
    no.master_address = impl->master->address();
    no.dram_bytes = options.dram_bytes_per_node;
    no.engine = options.engine;
    no.engine.node_id = options.node_id_prefix + "-node" + std::to_string(i);
    no.peer_discovery = options.peer_discovery;
    if (!options.ssd_dir.empty()) {
      no.ssd_path = options.ssd_dir + "/node" + std::to_string(i);
      std::error_code ec;
      std::filesystem::create_directories(no.ssd_path, ec);
      if (ec) {
        return Status::IoError("cannot create " + no.ssd_path + ": " + ec.message());
      }
      no.ssd_bytes = options.ssd_bytes_per_node;
      no.ssd_plugin = options.ssd_plugin;
      no.ssd_staging_bytes = options.ssd_staging_bytes;
    }
    auto node = StorageNode::Start(no);
    if (!node.ok()) return node.status().WithContext("embedded node " + std::to_string(i));
    impl->nodes.push_back(std::move(node).value());
  }
  StoreOptions so;
  so.master_address = impl->master->address();
  so.replica_num = options.replica_num;
  so.peer_discovery = options.peer_discovery;
  so.engine = options.engine;
  so.engine.node_id = options.node_id_prefix + "-client";
  so.admin_token = mo.admin_token;  // the cluster's own client may RemoveAll
  auto client = StoreClient::Create(so);
  if (!client.ok()) return client.status().WithContext("embedded client");
  impl->client = std::move(client).value();
  return std::unique_ptr<EmbeddedCluster>(new EmbeddedCluster(std::move(impl)));
}

const std::string& EmbeddedCluster::master_address() const { return impl_->master->address(); }
StoreClient& EmbeddedCluster::client() { return *impl_->client; }
std::vector<std::unique_ptr<StorageNode>>& EmbeddedCluster::nodes() { return impl_->nodes; }

}  // namespace kvbridge

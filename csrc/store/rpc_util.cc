#include "store/rpc_util.h"

#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "kvbridge.grpc.pb.h"
#include "store/rpc_auth.h"
#include "util/logging.h"

namespace kvbridge::store {

void PreferCallerPolling() {
  static std::once_flag once;
  std::call_once(once, [] { setenv("GRPC_POLL_STRATEGY", "poll", /*overwrite=*/0); });
}

Status CheckPeerDiscovery(const std::string& mode) {
  if (mode == "master" || mode == "direct") return Status::OK();
  return Status::InvalidArgument("peer_discovery is '" + mode +
                                 "'; use 'master' or 'direct' (KVBRIDGE_PEER_DISCOVERY)");
}

uint64_t DescribeBackoff::WaitMs(const rpc::NodeIdentity& node) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = nodes_.find(node.node_id());
  if (it == nodes_.end() || it->second.incarnation != node.incarnation()) return 0;
  const auto now = std::chrono::steady_clock::now();
  if (now >= it->second.retry_at) return 0;
  return static_cast<uint64_t>(
      std::chrono::ceil<std::chrono::milliseconds>(it->second.retry_at - now).count());
}

uint32_t DescribeBackoff::Failed(const rpc::NodeIdentity& node) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = nodes_[node.node_id()];
  e.backoff_ms = e.incarnation == node.incarnation() && e.backoff_ms != 0
                     ? std::min(2 * e.backoff_ms, kMaxMs)
                     : kFirstMs;
  e.incarnation = node.incarnation();
  e.retry_at = std::chrono::steady_clock::now() + std::chrono::milliseconds(e.backoff_ms);
  return e.backoff_ms;
}

void DescribeBackoff::Succeeded(const rpc::NodeIdentity& node) {
  std::lock_guard<std::mutex> lock(mu_);
  nodes_.erase(node.node_id());
}

Status FromGrpc(const grpc::Status& s, std::string_view call, StatusOrigin peer,
                std::string_view address) {
  const std::string what = std::string(call) + ": ";
  const std::string role = peer == StatusOrigin::kMaster ? "master" : "node";
  const std::string who = address.empty() ? role : role + " " + std::string(address);
  const std::string at = address.empty() ? "" : " (" + who + ")";
  Status st;
  if (s.ok()) {
    st = Status::Protocol(what + "malformed reply from the " + who);
  } else {
    switch (s.error_code()) {
      case grpc::StatusCode::DEADLINE_EXCEEDED:
        st = Status::DeadlineExceeded(what + "the " + who + " did not answer in time");
        break;
      case grpc::StatusCode::UNAVAILABLE:
        st = Status::PeerUnreachable(what + who + " unreachable: " + s.error_message());
        break;
      case grpc::StatusCode::INVALID_ARGUMENT:
        st = Status::InvalidArgument(what + s.error_message() + at);
        break;
      case grpc::StatusCode::UNIMPLEMENTED:
        st = Status::Unsupported(what + s.error_message() + at);
        break;
      case grpc::StatusCode::UNAUTHENTICATED:
        // No valid proof of the cluster token (none, another token, a replay, clocks apart).
        st = Status::Unauthenticated(what + s.error_message() +
                                     " (KVBRIDGE_CLUSTER_TOKEN must be the " + role + "'s; " + who +
                                     ")");
        break;
      case grpc::StatusCode::PERMISSION_DENIED:
        st = Status::PermissionDenied(what + s.error_message() + at);
        break;
      default:
        st = Status::Internal(what + "rpc failed (" + std::to_string(s.error_code()) +
                              "): " + s.error_message() + at);
    }
  }
  return st.WithOrigin(peer);
}

std::shared_ptr<grpc::Channel> NewChannel(const std::string& address, grpc::ChannelArguments args) {
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

std::shared_ptr<rpc::Node::Stub> NodeStubCache::Get(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_address_.find(address);
  if (it != by_address_.end()) {
    lru_.splice(lru_.begin(), lru_, it->second);
    return it->second->second;
  }
  lru_.emplace_front(address, rpc::Node::NewStub(NewChannel(address)));
  by_address_[address] = lru_.begin();
  while (lru_.size() > capacity_) {
    by_address_.erase(lru_.back().first);
    lru_.pop_back();
  }
  return lru_.front().second;
}

void NodeStubCache::Erase(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_address_.find(address);
  if (it == by_address_.end()) return;
  lru_.erase(it->second);
  by_address_.erase(it);
}

size_t NodeStubCache::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lru_.size();
}

Result<std::unique_ptr<grpc::Server>> StartServer(const std::string& listen, grpc::Service* service,
                                                  std::string_view what, std::string* address) {
  // grpc.health.v1.Health on every server (docs/operations.md): the overall status ("") is
  // SERVING once started; the master and the node set their own service's status.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    return Status::Unavailable(std::string(what) + " cannot listen on " + listen +
                               " (address in use or malformed?)");
  }
  *address = listen.substr(0, listen.rfind(':')) + ":" + std::to_string(port);
  if (grpc::HealthCheckServiceInterface* h = server->GetHealthCheckService()) {
    h->SetServingStatus(true);
  }
  return server;
}

Status ParseFaults(const std::string& spec, std::string_view what,
                   std::initializer_list<std::pair<const char*, std::atomic<uint32_t>*>> known) {
  size_t start = 0;
  while (start <= spec.size()) {
    size_t comma = spec.find(',', start);
    if (comma == std::string::npos) comma = spec.size();
    std::string item = spec.substr(start, comma - start);
    start = comma + 1;
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string name = item.substr(0, eq);
    std::atomic<uint32_t>* counter = nullptr;
    std::string names;
    for (const auto& [n, c] : known) {
      if (name == n) counter = c;
      names += (names.empty() ? "" : ", ") + std::string(n);
    }
    if (counter == nullptr) {
      return Status::InvalidArgument(std::string(what) + ": unknown fault '" + name +
                                     "' (known: " + names + ")");
    }
    const std::string count = eq == std::string::npos ? "" : item.substr(eq + 1);
    char* end = nullptr;
    const unsigned long n = std::strtoul(count.c_str(), &end, 10);
    if (count.empty() || *end != '\0' || count[0] == '-' || n > UINT32_MAX) {
      return Status::InvalidArgument(std::string(what) + ": '" + item +
                                     "' needs a count (name=N, N a non-negative integer)");
    }
    counter->store(static_cast<uint32_t>(n));
  }
  return Status::OK();
}

bool TakeFault(std::atomic<uint32_t>* left) {
  uint32_t n = left->load();
  while (n > 0 && !left->compare_exchange_weak(n, n - 1)) {
  }
  if (n > 0) KVB_LOG(WARN) << "fault injection: failing a call (" << n - 1 << " more to fail)";
  return n > 0;
}

}  // namespace kvbridge::store

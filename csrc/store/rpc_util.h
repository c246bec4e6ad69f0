// Glue between kvbridge types and the generated control-plane messages (csrc/rpc). Internal to
// the store; only .cc files of csrc/store include it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "kvbridge.grpc.pb.h"
#include "kvbridge.pb.h"
#include "kvbridge/status.h"

namespace kvbridge::store {

inline Status FromProto(const rpc::Status& s) { return Status::FromAbi(s.code(), s.message()); }

inline void ToProto(const Status& s, rpc::Status* out) {
  out->set_code(static_cast<int32_t>(s.code()));
  out->set_message(s.message());
}

// A failed gRPC call as a kvbridge Status naming the call and who was called (the master or a
// storage node, at `address` when given), with that as its origin(): callers such as the
// Mooncake compatibility layer tell a master failure from a data-path one by it. An OK grpc
// status with a malformed reply (wrong number of entries) is a PROTOCOL error.
Status FromGrpc(const grpc::Status& s, std::string_view call,
                StatusOrigin peer = StatusOrigin::kMaster, std::string_view address = {});

// Message size limits of every control-plane server and channel. gRPC's own default accepts
// at most 4 MiB per received message, which one list of ~40 k inventory records already
// exceeds; the store keeps its messages far below this limit instead (inventories go in chunks
// of kInventoryChunkRecords / kInventoryChunkBytes, the master caps each list of a heartbeat
// reply, clients split batches into kMaxKeysPerCall keys), so the limit is a safety margin,
// not a size anyone aims at. docs/store.md "Message sizes".
inline constexpr int kMaxMessageBytes = 64 << 20;
// Inventory records per RegisterNodeStream message, and the bytes at which a message is sent
// early (long keys).
inline constexpr size_t kInventoryChunkRecords = 8192;
inline constexpr size_t kInventoryChunkBytes = 2 << 20;
// Keys per client call to the master (PutStart, PutEnd, GetReplicas, Exists, Remove): larger
// batches go as several calls.
inline constexpr size_t kMaxKeysPerCall = 4096;

// Picks gRPC's "poll" engine for this process unless GRPC_POLL_STRATEGY is set already: called
// by store clients and storage nodes before their first channel or server (only the first
// gRPC use in a process reads the variable; the master daemon keeps gRPC's default, epoll1).
// With epoll1 every thread of a process waits on one shared epoll set, so the reply to a
// blocking call is read by whichever gRPC thread polls at the time (in an embedded client,
// often a thread of its node's server) and handed to the caller: on this project's VM three
// thread switches per call in the client against one with "poll", where the caller polls its
// own call, and a round trip of 390 -> 300 us (docs/performance.md "Small objects and the
// embedded deployment"). A client has a handful of connections (the master, its nodes), which
// poll(2) serves as well as epoll. Thread-safe; sets the variable at most once per process.
void PreferCallerPolling();

// A channel to `address` with the limits above (and `args`, e.g. a channel name).
std::shared_ptr<grpc::Channel> NewChannel(const std::string& address,
                                          grpc::ChannelArguments args = {});

// Node-service stubs (one channel each) by address, at most `capacity`, the least recently
// used dropped first: a process that meets many addresses over its life (nodes restarted on
// new ports, addresses named by callers) keeps a bounded number of channels open. Callers hold
// the shared_ptr for as long as a call (async included) uses the stub, so dropping one in use
// only closes its channel once that call is over. Thread-safe.
inline constexpr size_t kMaxCachedChannels = 1024;
class NodeStubCache {
 public:
  explicit NodeStubCache(size_t capacity = kMaxCachedChannels) : capacity_(capacity) {}
  std::shared_ptr<rpc::Node::Stub> Get(const std::string& address);
  void Erase(const std::string& address);
  size_t size() const;

 private:
  using Entry = std::pair<std::string, std::shared_ptr<rpc::Node::Stub>>;
  const size_t capacity_;
  mutable std::mutex mu_;
  std::list<Entry> lru_;  // most recently used first
  std::unordered_map<std::string, std::list<Entry>::iterator> by_address_;
};

// Starts a gRPC server for `service` on `listen` ("host:port", port 0 picks one) and sets
// *address to "host:<port actually bound>". UNAVAILABLE naming `what` and the address if it
// cannot listen.
Result<std::unique_ptr<grpc::Server>> StartServer(const std::string& listen, grpc::Service* service,
                                                  std::string_view what, std::string* address);

// Direct discovery (PeerDirectory, store/master_client.h): nodes whose Describe failed
// (frozen, partitioned, another incarnation answering) are not asked again until a backoff has
// passed (1 s, doubling per failure of the same incarnation up to 16 s; forgotten on success),
// so one bad node costs one Describe timeout per backoff period instead of one per request.
// Thread-safe.
class DescribeBackoff {
 public:
  static constexpr uint32_t kFirstMs = 1000, kMaxMs = 16000;
  // Milliseconds left before `node` (this incarnation) may be asked again; 0: ask now.
  uint64_t WaitMs(const rpc::NodeIdentity& node) const;
  // Records a failed Describe; returns the backoff now in force (ms).
  uint32_t Failed(const rpc::NodeIdentity& node);
  void Succeeded(const rpc::NodeIdentity& node);

 private:
  struct Entry {
    uint64_t incarnation = 0;
    std::chrono::steady_clock::time_point retry_at;
    uint32_t backoff_ms = 0;
  };
  mutable std::mutex mu_;
  std::unordered_map<std::string, Entry> nodes_;
};

// "master" (descriptors from the master's directory and tasks) or "direct" (from each node's
// own Node service); INVALID_ARGUMENT naming the value otherwise.
Status CheckPeerDiscovery(const std::string& mode);

// Fault injection for tests (MasterOptions::faults, StoreOptions::faults): sets each counter
// named in `spec` ("name=N,...", N a non-negative integer; blanks and empty items ignored).
// INVALID_ARGUMENT naming `what` and the unknown name (with the known ones) or the bad item.
Status ParseFaults(const std::string& spec, std::string_view what,
                   std::initializer_list<std::pair<const char*, std::atomic<uint32_t>*>> known);
// True (and one fewer left) when the next call is to fail.
bool TakeFault(std::atomic<uint32_t>* left);

}  // namespace kvbridge::store

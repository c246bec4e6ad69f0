// The etcd side of the HA control plane (docs/operations.md "High availability"):
//
//   <prefix>/leader        the leader's address, under the leader's lease. Created only if
//                          absent (one leader at a time); its create_revision is unique per
//                          election.
//   <prefix>/epoch         "<epoch> <first_version>" of the latest leader: the term that
//                          fences stale leaders at the nodes, and the floor of object versions.
//   <prefix>/nodes/<id>    one key per storage node ("<incarnation hex> <rpc address>"), under
//                          the node's own lease: the members a new leader waits for.
//   <prefix>/inflight/<id> where the leader's writers may still write on that node
//                          (InflightMap), written before the ranges are handed out: a new
//                          leader keeps new data off those chunks only, not the whole node.
//
// Nothing per object lives in etcd: every acknowledged object is in the inventory of the
// nodes holding it (a put is acknowledged only after its inventory commits), and a new leader
// rebuilds its object table from those inventories as the nodes register with it, exactly as a
// restarted single master does. Keeping objects out of etcd keeps a Raft round trip off every
// put and etcd's size independent of the number of objects.
//
// MasterElection campaigns and keeps a leader's lease; LeaderGate is what the leader's
// MasterServer checks before acting; LeaderResolver is how a MasterClient finds the leader;
// NodeMembership keeps a node's key. Internal to the store; all thread-safe.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "kvbridge/status.h"
#include "kvbridge/store.h"
#include "obs/http_server.h"
#include "store/etcd_client.h"
#include "store/master_state.h"
#include "util/clock.h"

namespace kvbridge::store {

struct HaKeys {
  explicit HaKeys(const std::string& prefix)
      : leader(prefix + "/leader"),
        epoch(prefix + "/epoch"),
        nodes(prefix + "/nodes/"),
        inflight(prefix + "/inflight/") {}
  std::string leader, epoch, nodes, inflight;
};

// Versions a leader hands out before every node has registered must exceed every version any
// predecessor handed out; each leader starts this far above the previous leader's start (and
// never below wall-clock microseconds, as a single master does).
inline constexpr uint64_t kVersionsPerTerm = uint64_t{1} << 40;

// What a leader's MasterServer checks before acting on a call.
class LeaderGate {
 public:
  LeaderGate(uint64_t epoch, const std::vector<std::string>& awaited_nodes,
             uint64_t takeover_wait_ms)
      : epoch_(epoch),
        awaited_(awaited_nodes.begin(), awaited_nodes.end()),
        takeover_until_ns_(util::MonoNs() + takeover_wait_ms * 1000000) {}

  uint64_t epoch() const { return epoch_; }

  // Where the predecessor's writers may still write (MasterConfig::inherited_inflight), and
  // whether that list is complete (there was a predecessor that published).
  std::vector<InflightMap> inherited;
  bool inherited_authoritative = false;
  // Writes this leader's maps to etcd, only while it holds the leader key.
  std::function<Status(const std::vector<InflightMap>&)> publish;
  // The lease may still be valid: the leader renewed it less than its TTL (less a margin)
  // ago, measured from before the renewal was sent, on the monotonic clock (which runs on
  // while a process is stopped).
  bool Valid() const { return util::MonoNs() < valid_until_ns_.load(std::memory_order_acquire); }
  void ExtendTo(uint64_t until_ns) { valid_until_ns_.store(until_ns, std::memory_order_release); }
  void Revoke() { valid_until_ns_.store(0, std::memory_order_release); }

  // Nodes listed in etcd at takeover that have not registered yet (0 once all have, or the
  // takeover wait is over).
  size_t Awaiting() {
    std::lock_guard<std::mutex> lock(mu_);
    if (!awaited_.empty() && util::MonoNs() >= takeover_until_ns_) awaited_.clear();
    return awaited_.size();
  }
  void Registered(const std::string& node_id) {
    std::lock_guard<std::mutex> lock(mu_);
    awaited_.erase(node_id);
  }

 private:
  const uint64_t epoch_;
  std::atomic<uint64_t> valid_until_ns_{0};
  std::mutex mu_;
  std::set<std::string> awaited_;
  const uint64_t takeover_until_ns_;
};

class MasterElection {
 public:
  struct Options {
    EtcdAddress etcd;
    std::string advertise;     // the value of the leader key
    uint32_t lease_ms = 3000;  // rounded up to whole seconds, at least 2
    uint32_t takeover_wait_ms = 5000;
    uint32_t call_timeout_ms = 1000;  // one etcd call
  };
  explicit MasterElection(Options options);
  ~MasterElection();

  // Blocks until this process leads (the gate of its term, valid) or `stopping()` turns true
  // (nullptr). While another leads, leader() names it.
  std::shared_ptr<LeaderGate> Campaign(const std::function<bool()>& stopping);
  // Renews the lease until it is lost or `stopping()`; returns why leadership ended. The gate
  // is revoked on return.
  Status KeepLeading(LeaderGate* gate, const std::function<bool()>& stopping);
  // Gives up leadership now: the leader key (if still ours) and the lease go.
  void Resign();
  std::string leader() const;
  // The first object version of the current term (Campaign's result).
  uint64_t first_version() const { return first_version_; }

 private:
  // The next term: "<epoch> <first_version>" in the epoch key, raised by compare-and-put.
  Result<uint64_t> NextEpoch();
  void SetLeader(std::string leader);

  const Options options_;
  const HaKeys keys_;
  EtcdClient etcd_;
  int64_t lease_id_ = 0;
  int64_t lease_ttl_s_ = 0;
  int64_t leader_revision_ = 0;  // our leader key's create_revision while we lead
  uint64_t prev_epoch_ = 0;      // the predecessor's epoch (0: this is the first leader)
  uint64_t first_version_ = 0;
  mutable std::mutex mu_;
  std::string leader_;
};

// Finds the leader for a MasterClient given "etcd://...": reads the leader key, remembers the
// answer until told it failed (Forget), and reads again then.
class LeaderResolver {
 public:
  LeaderResolver(EtcdAddress etcd, uint32_t call_timeout_ms);
  // The leader's address; UNAVAILABLE naming the etcd cluster and the key when none is elected
  // or etcd cannot be reached.
  Result<std::string> Leader();
  // `address` failed as the leader: the next Leader() reads etcd again.
  void Forget(const std::string& address);
  std::string Describe() const;

 private:
  const HaKeys keys_;
  EtcdClient etcd_;
  std::mutex mu_;
  std::string cached_;
};

// A storage node's membership key, kept alive on a thread of its own; the key goes with the
// lease when the node stops (or dies: the lease runs out). Re-created if the lease was lost
// (etcd restarted without its data, or the node frozen past its TTL).
class NodeMembership {
 public:
  NodeMembership(EtcdAddress etcd, std::string node_id, std::string value, uint32_t ttl_s);
  ~NodeMembership();  // revokes the lease
  // The last failure to keep the key (OK while it is in place).
  Status status() const;

 private:
  void Run();
  const HaKeys keys_;
  const std::string key_, value_;
  const uint32_t ttl_s_;
  EtcdClient etcd_;
  mutable std::mutex mu_;
  Status status_;
  bool stopping_ = false;
  std::condition_variable cv_;
  int64_t lease_id_ = 0;
  std::thread thread_;
};

// Starts the MasterServer of an elected leader: MasterServer::Start with `gate` checked before
// every action and versions from `first_version` up (master_service.cc).
Result<std::unique_ptr<MasterServer>> LaunchLeader(const MasterOptions& options,
                                                   std::shared_ptr<LeaderGate> gate,
                                                   uint64_t first_version);

// An InflightMap as stored in etcd: "<incarnation hex> <segment>:<chunk bytes>:<chunks hex>...".
std::string EncodeInflight(const InflightMap& map);
// The map of node `node_id` from its value; PROTOCOL naming the value if it does not parse.
Result<InflightMap> DecodeInflight(const std::string& node_id, const std::string& value);

// The HTTP routes of a running MasterServer (/metrics, /health, /, /status.json), for HaMaster's
// own endpoint to serve while that server leads (master_service.cc).
std::map<std::string, obs::HttpRoute> LeaderRoutes(MasterServer& server);

// Splits "etcd://a,b/prefix" and names the failure after `what` (e.g. "KVBRIDGE_MASTER").
Result<EtcdAddress> ParseEtcdFor(std::string_view address, std::string_view what);

}  // namespace kvbridge::store

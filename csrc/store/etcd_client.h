// EtcdClient: the few etcd v3 calls kvbridge's HA control plane makes (csrc/rpc/etcd.proto):
// reads, puts and deletes of single keys or prefixes, create-if-absent and compare-and-put
// transactions, and leases. One client talks to a whole etcd cluster: it keeps a channel per
// member and sends each call to the member that answered last, moving on to the next one when
// a member is down (UNAVAILABLE or a deadline), so one dead etcd member costs one failed attempt,
// not a failed call. Every call has a deadline; a failure names the call and every member tried.
//
// Addresses: "etcd://host:port[,host:port...][/prefix]" names an etcd cluster and the key
// prefix of one kvbridge cluster in it (default "kvbridge"); ParseEtcdAddress reads it. Where
// a master address is expected (StoreOptions::master_address, NodeOptions::master_address,
// `kvbridge status --master`), such an address means "the leader elected in this etcd".
// Internal to the store; thread-safe.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "etcd.grpc.pb.h"
#include "kvbridge/status.h"

namespace kvbridge::store {

inline constexpr std::string_view kEtcdScheme = "etcd://";

struct EtcdAddress {
  std::vector<std::string> endpoints;  // "host:port" of each member
  std::string prefix = "kvbridge";     // keys of this kvbridge cluster start with "<prefix>/"
};

inline bool IsEtcdAddress(std::string_view address) {
  return address.substr(0, kEtcdScheme.size()) == kEtcdScheme;
}
// "etcd://h:p,h:p/prefix", or a bare "h:p,h:p" (the --etcd flag). INVALID_ARGUMENT naming what
// is wrong: no endpoint, an endpoint without a port, an empty or '/'-containing prefix.
Result<EtcdAddress> ParseEtcdAddress(std::string_view address);

// One key as etcd holds it.
struct EtcdKv {
  std::string key, value;
  int64_t create_revision = 0;  // the revision that created this key (unique per creation)
  int64_t mod_revision = 0;
  int64_t lease = 0;
};

class EtcdClient {
 public:
  EtcdClient(std::vector<std::string> endpoints, uint32_t call_timeout_ms);

  const std::vector<std::string>& endpoints() const { return endpoints_; }
  // "etcd at a,b,c": how failures name the cluster.
  std::string Describe() const;

  // The key, or nullopt when it does not exist.
  Result<std::optional<EtcdKv>> Get(const std::string& key);
  // Every key that starts with `prefix`.
  Result<std::vector<EtcdKv>> GetPrefix(const std::string& prefix);
  // Returns the store's revision after the put.
  Result<int64_t> Put(const std::string& key, const std::string& value, int64_t lease = 0);
  Status Delete(const std::string& key);
  // Creates `key` only if it does not exist. created: this call created it (revision is the
  // new key's create_revision); otherwise `current` is the key as it is.
  struct CreateResult {
    bool created = false;
    int64_t revision = 0;
    EtcdKv current;
  };
  Result<CreateResult> CreateIfAbsent(const std::string& key, const std::string& value,
                                      int64_t lease);
  // Puts `value` only if `key` was last modified at `mod_revision` (0: does not exist).
  // false: someone else changed it first.
  Result<bool> PutIfUnchanged(const std::string& key, int64_t mod_revision,
                              const std::string& value);
  // Puts every (key, value) of `kvs` in one transaction, only while `guard` is the key created
  // at `create_revision` (a leader writing under its own leader key). false: it is not.
  Result<bool> PutAllWhile(const std::string& guard, int64_t create_revision,
                           const std::vector<std::pair<std::string, std::string>>& kvs);
  // Deletes `key` only while it is the one created at `create_revision` (a leader stepping
  // down removes its own key, never a successor's).
  Status DeleteIfCreatedAt(const std::string& key, int64_t create_revision);

  // A lease of ttl_s seconds (etcd may grant more: its minimum is about 2 s).
  struct Lease {
    int64_t id = 0;
    int64_t ttl_s = 0;
  };
  Result<Lease> GrantLease(int64_t ttl_s);
  // One keep-alive. The lease's remaining TTL in seconds; NOT_FOUND when it has expired.
  Result<int64_t> KeepAlive(int64_t lease_id);
  Status RevokeLease(int64_t lease_id);

 private:
  struct Member {
    std::string endpoint;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<etcdserverpb::KV::Stub> kv;
    std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  };
  // Runs `call(member, ctx)` on the member that answered last, then on each other one while
  // the failure is the member's (UNAVAILABLE, DEADLINE_EXCEEDED, the member has no leader).
  template <typename Fn>
  Status OnAnyMember(std::string_view name, Fn&& call);

  const std::vector<std::string> endpoints_;
  const uint32_t call_timeout_ms_;
  std::vector<Member> members_;
  std::atomic<size_t> preferred_{0};
};

}  // namespace kvbridge::store

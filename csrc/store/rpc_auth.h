// Proof of the cluster token on every control-plane call (docs/security.md). Internal to the
// store; only .cc files of csrc/store (and the store's tests) include it.
//
// A caller adds one metadata header per call:
//
//   x-kvb-auth: v1.<unix ms>.<nonce, 32 hex digits>.<mac, 64 hex digits>
//   mac = HMAC-SHA256(K, "kvbridge-rpc-v1" 0 <method path> 0 <unix ms, decimal> 0 <nonce>)
//   K   = HMAC-SHA256(cluster token, "kvbridge-rpc-key-v1")
//
// so the token itself never travels (a caller may be talking to an impostor), a proof is bound
// to one method, and it is good once, within the skew window of the callee's wall clock. The
// callee checks it before it reads the request: a call without a valid proof is answered
// UNAUTHENTICATED and changes nothing. The request body is not covered (an on-path attacker
// can rewrite it, as it can the data plane's payload; docs/security.md).
//
// The same format, keyed by other secrets, carries the two narrower proofs of destructive
// calls: x-kvb-admin-auth (the admin token) and x-kvb-node-auth (the secret the master gave a
// node when it registered, for its own drain and deregistration).
//
// Thread-safety: every method may be called concurrently.
#pragma once

#include <grpcpp/grpcpp.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_set>

// The first line of every handler of a service holding `auth` (a pointer to RpcAuth): a call
// without a valid proof of the cluster token is answered UNAUTHENTICATED, naming `who`, before
// anything is read or changed.
#define KVB_RPC_AUTH(auth, ctx, method, who)                                                \
  do {                                                                                      \
    if (grpc::Status _kvb_auth = (auth)->Check(*(ctx), (method), (who)); !_kvb_auth.ok()) { \
      return _kvb_auth;                                                                     \
    }                                                                                       \
  } while (0)

namespace kvbridge::store {

// The gRPC path of every control-plane method: what the proofs are bound to, on both sides.
namespace method {
inline constexpr std::string_view kRegisterNode = "/kvbridge.rpc.Master/RegisterNode";
inline constexpr std::string_view kRegisterNodeStream = "/kvbridge.rpc.Master/RegisterNodeStream";
inline constexpr std::string_view kHeartbeat = "/kvbridge.rpc.Master/Heartbeat";
inline constexpr std::string_view kTaskDone = "/kvbridge.rpc.Master/TaskDone";
inline constexpr std::string_view kDemoteDone = "/kvbridge.rpc.Master/DemoteDone";
inline constexpr std::string_view kDrain = "/kvbridge.rpc.Master/Drain";
inline constexpr std::string_view kDeregister = "/kvbridge.rpc.Master/Deregister";
inline constexpr std::string_view kPutStart = "/kvbridge.rpc.Master/PutStart";
inline constexpr std::string_view kPutEnd = "/kvbridge.rpc.Master/PutEnd";
inline constexpr std::string_view kPutRevoke = "/kvbridge.rpc.Master/PutRevoke";
inline constexpr std::string_view kGetReplicas = "/kvbridge.rpc.Master/GetReplicas";
inline constexpr std::string_view kExists = "/kvbridge.rpc.Master/Exists";
inline constexpr std::string_view kRemove = "/kvbridge.rpc.Master/Remove";
inline constexpr std::string_view kRemoveAll = "/kvbridge.rpc.Master/RemoveAll";
inline constexpr std::string_view kRemoveByRegex = "/kvbridge.rpc.Master/RemoveByRegex";
inline constexpr std::string_view kReportBadReplica = "/kvbridge.rpc.Master/ReportBadReplica";
inline constexpr std::string_view kGetNodeDescriptors = "/kvbridge.rpc.Master/GetNodeDescriptors";
inline constexpr std::string_view kStats = "/kvbridge.rpc.Master/Stats";
inline constexpr std::string_view kPlace = "/kvbridge.rpc.Master/Place";
inline constexpr std::string_view kQueryPlacement = "/kvbridge.rpc.Master/QueryPlacement";
inline constexpr std::string_view kFastPath = "/kvbridge.rpc.Master/FastPath";
inline constexpr std::string_view kCommit = "/kvbridge.rpc.Node/Commit";
inline constexpr std::string_view kReadSsd = "/kvbridge.rpc.Node/ReadSsd";
inline constexpr std::string_view kDescribe = "/kvbridge.rpc.Node/Describe";
inline constexpr std::string_view kHolds = "/kvbridge.rpc.Node/Holds";
}  // namespace method

inline constexpr char kAuthHeader[] = "x-kvb-auth";
inline constexpr char kAdminHeader[] = "x-kvb-admin-auth";
inline constexpr char kNodeHeader[] = "x-kvb-node-auth";

// Key purposes (the second argument of CallKey).
inline constexpr std::string_view kClusterKeyPurpose = "kvbridge-rpc-key-v1";
inline constexpr std::string_view kAdminKeyPurpose = "kvbridge-admin-key-v1";
inline constexpr std::string_view kNodeKeyPurpose = "kvbridge-node-key-v1";

// Default of MasterOptions/NodeOptions::rpc_auth_skew_ms.
inline constexpr uint32_t kDefaultAuthSkewMs = 60000;

using AuthNonce = std::array<uint8_t, 16>;

// A MAC key for one purpose, derived from a secret (never kept itself).
class CallKey {
 public:
  CallKey() = default;  // none: empty()
  CallKey(std::string_view secret, std::string_view purpose);
  bool empty() const { return !set_; }
  // The header value proving this key for `method` at `unix_ms` with `nonce`.
  std::string Proof(std::string_view method, uint64_t unix_ms, const AuthNonce& nonce) const;
  // The same, now, with a fresh random nonce.
  std::string Proof(std::string_view method) const;
  // Whether `header` is well formed and its MAC is this key's for `method` (constant-time);
  // *unix_ms and *nonce get its time and nonce. Freshness is the caller's (RpcAuth's) check.
  bool Verify(std::string_view header, std::string_view method, uint64_t* unix_ms,
              AuthNonce* nonce) const;

 private:
  std::array<uint8_t, 32> key_{};
  bool set_ = false;
};

// Nonces of accepted proofs, each kept for twice the skew window (after which its proof is
// refused as too old anyway), at most kMaxEntries (the oldest go first).
class ReplayCache {
 public:
  static constexpr size_t kMaxEntries = size_t{1} << 20;
  // False if `nonce` was accepted before (a replay).
  bool Insert(const AuthNonce& nonce, uint64_t now_ms, uint64_t keep_ms);
  size_t size() const;

 private:
  struct Hash {
    size_t operator()(const AuthNonce& n) const;
  };
  mutable std::mutex mu_;
  std::unordered_set<AuthNonce, Hash> seen_;
  std::deque<std::pair<uint64_t, AuthNonce>> order_;  // (forget at, nonce), oldest first
};

// One side's control-plane authentication: signs outgoing calls and checks incoming ones
// with the cluster token. Without a token (enabled() false) calls go unsigned and every call
// is accepted: the behaviour of a cluster that has none (with the start-up warning,
// WarnIfDisabled).
class RpcAuth {
 public:
  explicit RpcAuth(std::string_view cluster_token = {}, uint32_t skew_ms = kDefaultAuthSkewMs);
  bool enabled() const { return !key_.empty(); }
  uint32_t skew_ms() const { return skew_ms_; }

  // Adds x-kvb-auth for `method` to an outgoing call (nothing without a token).
  void Sign(grpc::ClientContext* ctx, std::string_view method) const;
  // The x-kvb-auth value for `method`, "" without a token: a proof carried in something else
  // than gRPC metadata (the master's lean port, store/fast_rpc.h).
  std::string Proof(std::string_view method) const {
    return key_.empty() ? std::string() : key_.Proof(method);
  }
  // Adds `header` proving `key` for `method` (nothing for an empty key).
  static void SignWith(grpc::ClientContext* ctx, const char* header, const CallKey& key,
                       std::string_view method);

  // The first thing every handler does: OK, or UNAUTHENTICATED (then the handler returns it
  // and touches nothing). `who` names this side in the warning ("master", "node node0").
  grpc::Status Check(const grpc::ServerContext& ctx, std::string_view method, std::string_view who);
  // Check() of a proof carried elsewhere: `proof` (found: whether the caller gave one) from
  // the caller at `peer`.
  grpc::Status CheckProof(std::string_view proof, bool found, std::string_view method,
                          std::string_view peer, std::string_view who);
  // Whether the call carries `header` with a fresh, unreplayed proof of `key` for `method`.
  // False (with *why) when it is absent or not valid.
  bool CheckExtra(const grpc::ServerContext& ctx, const char* header, const CallKey& key,
                  std::string_view method, std::string* why);

  // The one-line start-up warning of a side without a token (logged at WARN when disabled).
  void WarnIfDisabled(std::string_view what, std::string_view address) const;

 private:
  bool Fresh(uint64_t unix_ms, const AuthNonce& nonce, std::string* why);
  void WarnRefused(std::string_view peer, std::string_view method, std::string_view who,
                   const std::string& why);

  CallKey key_;
  uint32_t skew_ms_;
  ReplayCache replay_;
  std::atomic<int64_t> last_warn_ms_{0};
  std::atomic<uint64_t> unwarned_{0};
  std::atomic<bool> told_unneeded_{false};
};

// Milliseconds since the Unix epoch (the wall clock the proofs carry).
uint64_t UnixMs();

// 32 bytes from the OpenSSL CSPRNG (a node's registration secret); empty if the RNG fails.
std::string RandomSecret();

}  // namespace kvbridge::store

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <span>
#include <string_view>
#include <thread>
#include <tuple>
#include <unordered_map>

#include "core/device_bounce.h"
#include "core/memory_kinds.h"
#include "kvbridge.grpc.pb.h"
#include "kvbridge/store.h"
#include "store/client_stats.h"
#include "store/etcd_client.h"
#include "store/key_pattern.h"
#include "store/local_nodes.h"
#include "store/master_client.h"
#include "store/rpc_auth.h"
#include "store/rpc_util.h"
#include "util/checksum.h"
#include "util/env.h"
#include "util/logging.h"
#include "util/worker_pool.h"

namespace kvbridge {

using store::FromProto;
using store::ToProto;

StoreOptions StoreOptions::FromEnv() {
  using util::EnvNumber;
  using util::EnvString;
  StoreOptions o;
  o.engine = EngineOptions::FromEnv();
  EnvString("KVBRIDGE_MASTER", &o.master_address);
  EnvNumber("KVBRIDGE_REPLICA_NUM", &o.replica_num);
  EnvNumber("KVBRIDGE_RPC_TIMEOUT_MS", &o.rpc_timeout_ms);
  EnvNumber("KVBRIDGE_STORE_TRANSFER_DEADLINE_MS", &o.transfer_deadline_ms);
  // KVBRIDGE_VERIFY_CHECKSUMS is still accepted and ignored: every read is verified.
  EnvNumber("KVBRIDGE_HEDGE_AFTER_MS", &o.hedge_after_ms);
  EnvNumber("KVBRIDGE_HEDGE_BANDWIDTH_MBPS", &o.hedge_bandwidth_mbps);
  EnvNumber("KVBRIDGE_LOCATION_CACHE_ENTRIES", &o.location_cache_entries);
  EnvNumber("KVBRIDGE_MASTER_WAIT_MS", &o.master_wait_ms);
  EnvString("KVBRIDGE_PEER_DISCOVERY", &o.peer_discovery);
  EnvString("KVBRIDGE_ADMIN_TOKEN", &o.admin_token);
  EnvString("KVBRIDGE_CLIENT_FAULTS", &o.faults);
  return o;
}

namespace {

constexpr uint64_t kStagingBytes = 64ull << 20;
// The pinned bounce buffer the checksums of pieces in CUDA buffers are taken through, in two
// halves: one is copied into while the CRC runs over the other (core/device_bounce.h). Only the
// checksum goes through it: transfers go straight from and into the device segment, so that
// replicas, hedged reads and SSD reads (a node writes into the caller's buffer) work as for
// host memory and a transport with direct device access needs no host copy at all; the cost
// is one extra device-to-host copy per byte (docs/store.md "Device buffers").
constexpr uint64_t kBounceBytes = 8ull << 20;

// Where one key's bytes go: the object's byte range [obj_off, obj_off+len) maps to local memory.

struct Piece {
  uint64_t obj_off;
  char* local;
  uint64_t len;
  int device = -1;  // the CUDA device of a piece in a CUDA buffer (Impl::MarkDevices); else -1
};

// Splits an object of `total` bytes over caller buffers filled in order.
bool MapPieces(uint64_t total, const std::vector<BufferRef>& bufs, std::vector<Piece>* out) {
  out->clear();
  uint64_t off = 0;
  for (const auto& b : bufs) {
    if (off == total) break;
    const uint64_t take = std::min(b.length, total - off);
    if (take > 0) out->push_back({off, static_cast<char*>(b.addr), take});
    off += take;
  }
  return off == total;
}

std::string HexAddress(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

// The CRC-32C of each key's pieces, in order, on the pool's threads from 1 MiB in all
// (util::CrcInParts). REQUIRES: every piece in host memory.
void HostChecksums(std::span<const std::vector<Piece>* const> keys, std::vector<uint32_t>* crcs,
                   util::WorkerPool& pool) {
  std::vector<const Piece*> pieces;
  std::vector<uint64_t> lengths;
  for (const auto* key : keys) {
    for (const Piece& p : *key) {
      pieces.push_back(&p);
      lengths.push_back(p.len);
    }
  }
  const std::vector<uint32_t> piece_crcs =
      util::CrcInParts(pool, lengths, [&](size_t i, uint64_t at, uint64_t len) {
        return util::Crc32c(static_cast<const char*>(pieces[i]->local) + at, len);
      });
  size_t i = 0;
  for (size_t k = 0; k < keys.size(); ++k) {
    for (size_t first = i; i < first + keys[k]->size(); ++i) {
      (*crcs)[k] =
          i == first ? piece_crcs[i] : util::Crc32cCombine((*crcs)[k], piece_crcs[i], lengths[i]);
    }
  }
}

bool OnDevice(const std::vector<Piece>& pieces) {
  return std::any_of(pieces.begin(), pieces.end(), [](const Piece& p) { return p.device >= 0; });
}

// A batch of more than store::kMaxKeysPerCall keys as several batches, so that no request or
// reply to the master nears the message size limit: `call(begin, count)` runs one slice, and
// the results are joined in the caller's order.
template <typename R, typename Call>
std::vector<R> BySlices(size_t n, Call&& call) {
  std::vector<R> out;
  out.reserve(n);
  for (size_t begin = 0; begin < n; begin += store::kMaxKeysPerCall) {
    std::vector<R> part = call(begin, std::min(n - begin, store::kMaxKeysPerCall));
    for (R& r : part) out.push_back(std::move(r));
  }
  return out;
}

}  // namespace

namespace {
bool MasterAway(const Status& st);  // below
}  // namespace

struct StoreClient::Impl {
  StoreOptions options;
  // StoreOptions::faults.
  std::atomic<uint32_t> put_stall_before_write_ms{0};
  std::atomic<uint32_t> put_ignore_deadline{0};
  std::atomic<uint32_t> put_stall_before_local_commit_ms{0};
  std::unique_ptr<TransferEngine> engine;
  // Every call to the master; its RpcAuth signs the calls to nodes too (ReadSsd).
  std::unique_ptr<store::MasterClient> master;
  // Where the nodes' descriptors come from (StoreOptions::peer_discovery). In direct discovery
  // a node whose Describe failed is not asked again for a while; its keys go to other replicas
  // meanwhile.
  std::unique_ptr<store::PeerDirectory> directory;
  store::CallKey admin_key;  // StoreOptions::admin_token (RemoveAll)
  store::PutPins pins;       // StoreOptions::hard_pin, soft_pin, soft_pin_ttl_ms

  std::mutex peers_mu;
  std::unordered_map<std::string, uint64_t> peers;        // node id -> incarnation added to engine
  std::unordered_map<std::string, std::string> node_rpc;  // node id -> its Node service
  store::NodeStubCache node_stubs;                        // by address
  SegmentId staging_segment = 0;

  struct Registered {
    SegmentId segment;
    uint64_t length;
    MemoryKind kind = MemoryKind::kHost;
    int device = -1;  // kCuda: the buffer's device
  };
  std::mutex buffers_mu;
  std::map<uintptr_t, Registered> buffers;  // registered caller buffers by start address
  std::atomic<size_t> device_buffers{0};    // how many of them are CUDA buffers
  // Made by the first registration of a CUDA buffer (under bounce_mu), before that buffer is
  // in `buffers`, and kept: a piece found in a CUDA buffer (MarkDevices, under buffers_mu)
  // finds it set.
  std::mutex bounce_mu;
  std::unique_ptr<core::DeviceBounce> bounce;

  // The threads that share a large checksum pass (EngineOptions::local_copy_threads).
  std::unique_ptr<util::WorkerPool> crc_pool;
  // Whether the last put found a replica of each key where its write takes the checksum: a
  // node of this process (an embedded client's own: the copy takes it) or a node reached over
  // a transport that takes it as the bytes leave (KVB_TCAP_OP_CRC32C). Then the next put takes
  // the checksum of such keys from that write (TransferOp::checksum) instead of a pass over the
  // caller's bytes while PutStart is out. The first put finds out.
  std::atomic<bool> put_crc_in_copy{true};

  std::mutex staging_mu;  // one Put/Get at a time uses the staging area
  std::unique_ptr<char[]> staging;
  store::ClientCounters counters;  // StoreClient::stats()

  // BatchPutFrom and BatchGetInto without the counting of calls and per-key outcomes, which
  // the public calls do once around them (these call themselves for slices and subsets).
  // What only they see (which tier served a hit, whether a put wrote) they count themselves.
  // overwrite: new versions of keys that exist (BatchUpsertFrom). `busy`, when given, is set for
  // each key refused because a put of it was in flight (an overwrite waits for it).
  std::vector<Status> PutFrom(std::span<const std::string> keys,
                              std::span<const std::vector<BufferRef>> buffers,
                              bool overwrite = false, std::vector<bool>* busy = nullptr);
  // BatchPutFrom and BatchUpsertFrom: PutFrom, counted, with its retries.
  std::vector<Status> PutCall(std::span<const std::string> keys,
                              std::span<const std::vector<BufferRef>> buffers, bool overwrite);
  // Put and Upsert: one key through the staging area.
  Status PutStaged(std::string_view key, std::string_view value, bool overwrite);
  std::vector<Result<uint64_t>> GetInto(std::span<const std::string> keys,
                                        std::span<const std::vector<BufferRef>> buffers);

  // OK when every buffer of one key lies inside a registered buffer (or the staging area);
  // else NOT_REGISTERED naming the first one that does not, so that key alone fails.
  Status CheckRegistered(const std::vector<BufferRef>& bufs, size_t key_index) {
    std::lock_guard<std::mutex> lock(buffers_mu);
    for (size_t b = 0; b < bufs.size(); ++b) {
      auto start = reinterpret_cast<uintptr_t>(bufs[b].addr);
      auto staging_start = reinterpret_cast<uintptr_t>(staging.get());
      if (start >= staging_start && start + bufs[b].length <= staging_start + kStagingBytes) {
        continue;
      }
      auto it = buffers.upper_bound(start);
      if (it != buffers.begin()) {
        --it;
        if (start + bufs[b].length <= it->first + it->second.length) continue;
      }
      return Status::NotRegistered("key " + std::to_string(key_index) + ", buffer " +
                                   std::to_string(b) + ": [" + HexAddress(bufs[b].addr) + ", +" +
                                   std::to_string(bufs[b].length) +
                                   ") is not inside a buffer registered with RegisterBuffer");
    }
    return Status::OK();
  }
  bool LocalSegment(const char* p, uint64_t len, SegmentId* seg, uint64_t* off);
  // Sets the device of each piece that lies in a registered CUDA buffer.
  void MarkDevices(std::vector<Piece>* pieces) {
    if (device_buffers.load(std::memory_order_acquire) == 0) return;
    std::lock_guard<std::mutex> lock(buffers_mu);
    for (Piece& p : *pieces) {
      const auto start = reinterpret_cast<uintptr_t>(p.local);
      auto it = buffers.upper_bound(start);
      if (it == buffers.begin()) continue;
      --it;
      if (it->second.kind == MemoryKind::kCuda && start < it->first + it->second.length) {
        p.device = it->second.device;
      }
    }
  }
  // The CRC-32C of each key's pieces, in order. Pieces in host memory are read where they
  // are. Pieces in CUDA buffers are never read by the CPU: they are copied (one device-to-host
  // copy per byte) into the pinned bounce buffer and the CRC runs there, over one half while
  // the other is being filled; concurrent calls take turns at the bounce buffer. (*status)[k]:
  // a copy of key k's bytes that failed (IO_ERROR naming it; its checksum is then unknown).
  void Checksums(std::span<const std::vector<Piece>* const> keys, std::vector<uint32_t>* crcs,
                 std::vector<Status>* status) {
    crcs->assign(keys.size(), 0);
    status->assign(keys.size(), Status::OK());
    if (std::none_of(keys.begin(), keys.end(), [](const auto* p) { return OnDevice(*p); })) {
      HostChecksums(keys, crcs, *crc_pool);
      return;
    }
    std::vector<core::DeviceBounce::Span> spans;
    std::vector<size_t> key_of;
    for (size_t k = 0; k < keys.size(); ++k) {
      for (const Piece& p : *keys[k]) {
        spans.push_back({p.local, p.len, p.device});
        key_of.push_back(k);
      }
    }
    const std::vector<Status> got =
        bounce->Read(spans, [&](size_t s, const char* data, uint64_t len) {
          uint32_t& crc = (*crcs)[key_of[s]];
          crc = util::Crc32c(data, len, crc);
        });
    for (size_t s = 0; s < spans.size(); ++s) {
      Status& st = (*status)[key_of[s]];
      if (st.ok() && !got[s].ok()) st = got[s];
    }
  }
  // The master's replicas and sizes of each key, without a lease (a size query); a failed
  // call is a Status.
  Status QuerySizes(std::span<const std::string> keys, std::vector<store::ReadGrant>* got) {
    Result<std::vector<store::ReadGrant>> r =
        master->GetReplicas(keys, engine->self().node_id, /*sizes_only=*/true);
    if (!r.ok()) return r.status();
    *got = std::move(r).value();
    return Status::OK();
  }
  // --- Reads while the master is away (StoreOptions::location_cache_entries) ---
  // Where an object was last written or read: a grant without a lease.
  struct Remembered {
    uint64_t version = 0;
    std::vector<uint64_t> sizes;
    uint32_t checksum = 0;
    std::vector<store::ReplicaLocation> replicas;
    // The order of remembering, through the map's own nodes (which never move): first
    // remembered, first forgotten; remembering a key again keeps its place.
    const std::string* key = nullptr;  // this entry's key, in its node
    Remembered* older = nullptr;
    Remembered* newer = nullptr;
  };
  std::mutex cache_mu;
  std::unordered_map<std::string, Remembered> cache;
  Remembered* cache_oldest = nullptr;
  Remembered* cache_newest = nullptr;
  void Unlink(Remembered& r) {
    (r.older != nullptr ? r.older->newer : cache_oldest) = r.newer;
    (r.newer != nullptr ? r.newer->older : cache_newest) = r.older;
    r.older = r.newer = nullptr;
  }
  void LinkNewest(Remembered& r, const std::string& key) {
    r.key = &key;
    r.older = cache_newest;
    r.newer = nullptr;
    (cache_newest != nullptr ? cache_newest->newer : cache_oldest) = &r;
    cache_newest = &r;
  }
  // Until then (steady clock, ns), gets (and exists) whose every key is remembered do not ask
  // the master: it failed one within master_wait_ms.
  std::atomic<int64_t> master_away_until_ns{0};
  bool MasterAwayNow() const {
    return master_away_until_ns.load(std::memory_order_relaxed) >
           std::chrono::steady_clock::now().time_since_epoch().count();
  }
  void MarkMasterAway() {
    master_away_until_ns.store(
        (std::chrono::steady_clock::now() + std::chrono::seconds(1)).time_since_epoch().count(),
        std::memory_order_relaxed);
  }

  void Remember(const std::string& key, uint64_t version, const std::vector<uint64_t>& sizes,
                uint32_t checksum, std::vector<store::ReplicaLocation> replicas) {
    if (options.location_cache_entries == 0 || replicas.empty()) return;
    std::lock_guard<std::mutex> lock(cache_mu);
    RememberLocked(key, version, sizes, checksum, std::move(replicas));
  }
  // The grants a get was given (those found), under one lock. A key remembered with the same
  // version and replicas (the common case: a key read again) costs a lookup, no copy.
  void RememberGrants(std::span<const std::string> keys,
                      const std::vector<store::ReadGrant>& grants) {
    if (options.location_cache_entries == 0) return;
    std::lock_guard<std::mutex> lock(cache_mu);
    for (size_t i = 0; i < keys.size(); ++i) {
      const store::ReadGrant& g = grants[i];
      if (g.status.ok() && !g.replicas.empty()) {
        RememberLocked(keys[i], g.version, g.sizes, g.checksum, g.replicas);
      }
    }
  }
  // `replicas`: a const vector (copied only when it differs from what is remembered) or an
  // rvalue (moved in).
  // A full cache forgets its oldest entry and reuses that node, key string and vectors for the
  // new one: in a steady stream of new keys (a put loop) remembering allocates nothing, where
  // a node, a key, sizes and replicas per key, and their frees, were a quarter of an embedded
  // 1 KiB put's CPU (docs/performance.md).
  template <typename Replicas>
  void RememberLocked(const std::string& key, uint64_t version, const std::vector<uint64_t>& sizes,
                      uint32_t checksum, Replicas&& replicas) {
    auto it = cache.find(key);
    if (it != cache.end()) {
      Remembered& r = it->second;
      if (r.version == version && r.replicas == replicas) return;
      r.version = version;
      r.sizes = sizes;
      r.checksum = checksum;
      r.replicas = std::forward<Replicas>(replicas);
      return;
    }
    if (cache.size() >= options.location_cache_entries) {  // full: the oldest node is reused
      Remembered* oldest = cache_oldest;
      Unlink(*oldest);
      auto node = cache.extract(*oldest->key);
      node.key() = key;
      it = cache.insert(std::move(node)).position;
    } else {
      it = cache.try_emplace(key).first;
    }
    Remembered& r = it->second;
    r.version = version;
    r.sizes = sizes;
    r.checksum = checksum;
    r.replicas = std::forward<Replicas>(replicas);
    LinkNewest(r, it->first);
  }
  void Forget(std::span<const std::string> keys) {
    if (options.location_cache_entries == 0) return;
    std::lock_guard<std::mutex> lock(cache_mu);
    for (const std::string& k : keys) {
      auto it = cache.find(k);
      if (it == cache.end()) continue;
      Unlink(it->second);
      cache.erase(it);
    }
  }
  // The regular expression runs outside the lock over a copy of the keys (a cache of 64 k
  // keys takes tens of ms to match), so gets that use the cache are not held up meanwhile.
  void ForgetMatching(const store::KeyPattern& pattern) {
    std::vector<std::string> keys;
    {
      std::lock_guard<std::mutex> lock(cache_mu);
      keys.reserve(cache.size());
      for (const auto& entry : cache) keys.push_back(entry.first);
    }
    std::erase_if(keys, [&](const std::string& k) { return !pattern.Matches(k); });
    if (!keys.empty()) Forget(keys);
  }
  void ForgetAll() {
    std::lock_guard<std::mutex> lock(cache_mu);
    cache.clear();
    cache_oldest = cache_newest = nullptr;
  }
  // Which of `keys` are remembered (*known, when not null); whether all are. Copies nothing:
  // the grants themselves are recalled (Recall) only when the master is away.
  bool Known(std::span<const std::string> keys, std::vector<bool>* known) {
    if (known != nullptr) known->assign(keys.size(), false);
    if (options.location_cache_entries == 0) return false;
    bool all = true;
    std::lock_guard<std::mutex> lock(cache_mu);
    for (size_t i = 0; i < keys.size(); ++i) {
      const bool have = cache.contains(keys[i]);
      all = all && have;
      if (known != nullptr) (*known)[i] = have;
      if (!have && known == nullptr) break;
    }
    return all && !keys.empty();
  }
  // Remembered grants of `keys` (an empty optional for a key not remembered); whether all are.
  bool Recall(std::span<const std::string> keys,
              std::vector<std::optional<store::ReadGrant>>* out) {
    out->assign(keys.size(), std::nullopt);
    if (options.location_cache_entries == 0) return false;
    bool all = true;
    std::lock_guard<std::mutex> lock(cache_mu);
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = cache.find(keys[i]);
      if (it == cache.end()) {
        all = false;
        continue;
      }
      store::ReadGrant g;
      g.version = it->second.version;
      g.sizes = it->second.sizes;
      g.checksum = it->second.checksum;
      g.replicas = it->second.replicas;
      (*out)[i] = std::move(g);
    }
    return all && !keys.empty();
  }
  // The grants of a get: the master's, or, while it is away, the remembered ones that their
  // nodes confirm (*without_master[i] set for those). A failed call is the Status of the keys
  // not remembered.
  Status GrantsForGet(std::span<const std::string> keys, std::vector<store::ReadGrant>* got,
                      std::vector<bool>* without_master);
  // Keeps of each remembered grant the replicas their nodes say they still hold (Node.Holds,
  // every node at once, within the get's deadline): NOT_FOUND when every node that answered
  // no longer holds the object; `away` (the master's failure) when no node answered.
  void ConfirmHeld(std::span<const std::string> keys, std::vector<store::ReadGrant>* got,
                   const std::vector<bool>& recalled, const Status& away);
  // The remembered grants (`recalled`, moved from) in *got, *have[i] set for those and `away`
  // the status of the others; then ConfirmHeld over them. Whether any was remembered.
  bool ConfirmRecalled(std::span<const std::string> keys,
                       std::vector<std::optional<store::ReadGrant>>& recalled,
                       std::vector<store::ReadGrant>* got, std::vector<bool>* have,
                       const Status& away) {
    got->assign(keys.size(), store::ReadGrant{});
    have->assign(keys.size(), false);
    bool any = false;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (recalled[i]) {
        (*got)[i] = std::move(*recalled[i]);
        (*have)[i] = any = true;
      } else {
        (*got)[i].status = away;
      }
    }
    if (any) ConfirmHeld(keys, got, *have, away);
    return any;
  }
  // Answers each key from the master's size-only reply (no lease, no access): `fn(item)` for
  // the keys found, the item's status for the others.
  template <typename T, typename Fn>
  std::vector<Result<T>> FromSizeQuery(std::span<const std::string> keys, Fn&& fn) {
    if (keys.size() > store::kMaxKeysPerCall) {
      return BySlices<Result<T>>(keys.size(), [&](size_t begin, size_t count) {
        return FromSizeQuery<T>(keys.subspan(begin, count), fn);
      });
    }
    std::vector<Result<T>> result(keys.size(), Status::Internal("not attempted"));
    if (keys.empty()) return result;
    std::vector<store::ReadGrant> got;
    if (Status st = QuerySizes(keys, &got); !st.ok()) {
      result.assign(keys.size(), st);
      if (!MasterAway(st)) return result;
      // The master away: remembered keys their nodes confirm are answered from what this
      // client remembers (docs/store.md "Reads while the master is away").
      std::vector<std::optional<store::ReadGrant>> recalled;
      Recall(keys, &recalled);
      std::vector<bool> have;
      if (!ConfirmRecalled(keys, recalled, &got, &have, st)) return result;
      for (size_t i = 0; i < keys.size(); ++i) {
        if (have[i]) result[i] = got[i].status.ok() ? Result<T>(fn(got[i])) : got[i].status;
      }
      return result;
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      const store::ReadGrant& item = got[i];
      result[i] = item.status.ok() ? Result<T>(fn(item)) : Result<T>(item.status);
    }
    return result;
  }
  // Stub of a node's Node service; null (and *why) when no control address is known.
  std::shared_ptr<rpc::Node::Stub> NodeStub(const std::string& node_id, Status* why);
  // One SSD read: the replica to read and where the key's bytes go.
  struct SsdTarget {
    const store::ReplicaLocation* loc = nullptr;
    const std::string* key = nullptr;
    uint64_t version = 0;
    const std::vector<Piece>* pieces = nullptr;
  };
  // Another SSD replica of group g's key, not on node `avoid`; false if none.
  using SsdAlternative = std::function<bool(size_t g, std::string_view avoid, SsdTarget* out)>;
  // A get's SSD reads (docs/store.md "Tiers"): one ReadSsd per node with every key read there,
  // all nodes at once, every call bounded by `deadline`. A key whose node failed as a whole
  // (unreachable, another incarnation, out of time), or whose call is still unanswered after
  // the hedge delay, is read again from its next SSD replica on another node. Returns once
  // every call it sent is answered or past its deadline, so no node writes into the buffers
  // afterwards (a node writes only within its call's deadline). *late gets one group per node
  // whose call failed while other replicas served all its keys.
  void RunSsd(const std::vector<std::pair<size_t, SsdTarget>>& reads, size_t groups,
              const SsdAlternative& alternative, std::chrono::steady_clock::time_point deadline,
              std::vector<Status>* group_status, std::vector<size_t>* late);
  // Makes sure the engine knows the current incarnation of every node named.
  Status EnsurePeers(const std::set<std::pair<std::string, uint64_t>>& nodes);
  // Whether the engine knows this incarnation of the node (EnsurePeers added it).
  bool Knows(const store::NodeIdentity& node) {
    std::lock_guard<std::mutex> lock(peers_mu);
    auto it = peers.find(node.node_id);
    return it != peers.end() && it->second == node.incarnation;
  }
  // Tells the master a replica (node_level: its whole node) failed this client; best effort.
  void Report(const std::string& key, uint64_t version, const store::ReplicaLocation& loc,
              bool node_level) {
    master->ReportBadReplica({key, version, PeerId{loc.node.node_id, loc.node.incarnation},
                              loc.segment_id, loc.offset, node_level});
  }
  // One transfer pass, bounded by deadline_ms (0: transfer_deadline_ms); fills ok[i] per
  // group of ops.
  void Run(std::vector<TransferOp>& ops, const std::vector<size_t>& group_of_op, size_t groups,
           std::vector<Status>* group_status, uint32_t deadline_ms = 0);
  // Appends the ops reading group g from another replica, not on node `avoid`; false if none.
  using Alternative =
      std::function<bool(size_t g, std::string_view avoid, std::vector<TransferOp>* out)>;
  // A get's pass with hedging (StoreOptions::hedge_after_ms): every op of a group goes to one
  // node; each node's ops are one batch, and a late batch's groups are read again through
  // `alternative`. Returns once every batch is final or cancelled, so that no transfer
  // touches the buffers afterwards. *late gets one group per node whose read was cancelled
  // because other replicas served all its keys.
  void RunHedged(const std::vector<TransferOp>& ops, const std::vector<size_t>& group_of_op,
                 size_t groups, const Alternative& alternative, std::vector<Status>* group_status,
                 std::vector<size_t>* late, uint32_t deadline_ms);
};

Status StoreClient::Impl::EnsurePeers(const std::set<std::pair<std::string, uint64_t>>& nodes) {
  std::vector<PeerId> unknown;
  {
    std::lock_guard<std::mutex> lock(peers_mu);
    for (const auto& [id, inc] : nodes) {
      auto it = peers.find(id);
      if (it == peers.end() || it->second != inc) unknown.push_back(PeerId{id, inc});
    }
  }
  if (unknown.empty()) return Status::OK();
  // Nodes backing off after a failed Describe are left out: their keys use other replicas.
  Result<std::vector<store::NodeEntry>> listed = directory->Lookup(unknown);
  if (!listed.ok()) return listed.status();
  for (const store::NodeEntry& nd : *listed) {
    // The entry's descriptor must be that node's own: one naming another node would send the
    // reads and writes meant for it elsewhere (and its SSD reads to this entry's address).
    AddPeerOptions expect;
    expect.expect = &nd.id;
    Result<PeerId> added = engine->AddPeer(nd.engine_descriptor, expect);
    if (!added.ok()) {
      KVB_LOG(WARN) << "cannot add storage node " << nd.id.node_id << ": "
                    << added.status().ToString();
      continue;
    }
    std::lock_guard<std::mutex> lock(peers_mu);
    peers[added->node_id] = added->incarnation;
    std::string& address = node_rpc[added->node_id];
    if (!address.empty() && address != nd.rpc_address) node_stubs.Erase(address);  // moved
    address = nd.rpc_address;
  }
  return Status::OK();
}

// The engine segment and offset of local memory (a registered buffer or the staging area).
bool StoreClient::Impl::LocalSegment(const char* p, uint64_t len, SegmentId* seg, uint64_t* off) {
  const auto start = reinterpret_cast<uintptr_t>(p);
  const auto staging_start = reinterpret_cast<uintptr_t>(staging.get());
  if (start >= staging_start && start + len <= staging_start + kStagingBytes) {
    *seg = staging_segment;
    *off = start - staging_start;
    return true;
  }
  std::lock_guard<std::mutex> lock(buffers_mu);
  auto it = buffers.upper_bound(start);
  if (it == buffers.begin()) return false;
  --it;
  if (start + len > it->first + it->second.length) return false;
  *seg = it->second.segment;
  *off = start - it->first;
  return true;
}

std::shared_ptr<rpc::Node::Stub> StoreClient::Impl::NodeStub(const std::string& node_id,
                                                             Status* why) {
  std::string address;
  {
    std::lock_guard<std::mutex> lock(peers_mu);
    auto a = node_rpc.find(node_id);
    if (a == node_rpc.end() || a->second.empty()) {
      *why = Status::PeerUnreachable("no control address known for node " + node_id)
                 .WithOrigin(StatusOrigin::kStorageNode);
      return nullptr;
    }
    address = a->second;
  }
  return node_stubs.Get(address);
}

namespace {

// The master did not answer a get (down, frozen, an election in progress, a new leader still
// gathering inventories, or not within master_wait_ms): what reads without it stand in for.
bool MasterAway(const Status& st) {
  return st.origin() == StatusOrigin::kMaster &&
         (st.IsPeerUnreachable() || st.Is(StatusCode::kUnavailable) || st.IsDeadlineExceeded());
}

}  // namespace

Status StoreClient::Impl::GrantsForGet(std::span<const std::string> keys,
                                       std::vector<store::ReadGrant>* got,
                                       std::vector<bool>* without_master) {
  without_master->assign(keys.size(), false);
  std::vector<bool> known;
  const bool all = Known(keys, &known);
  Status st;
  if (all && MasterAwayNow()) {
    st = Status::PeerUnreachable("the master failed a get within master_wait_ms moments ago")
             .WithOrigin(StatusOrigin::kMaster);
  } else {
    Result<std::vector<store::ReadGrant>> r = master->GetReplicas(
        keys, engine->self().node_id, /*sizes_only=*/false, all ? options.master_wait_ms : 0);
    if (r.ok()) {
      *got = std::move(r).value();
      RememberGrants(keys, *got);
      std::vector<std::string> gone;  // removed by another client meanwhile, say
      for (size_t i = 0; i < keys.size(); ++i) {
        if (known[i] && (*got)[i].status.IsNotFound()) gone.push_back(keys[i]);
      }
      Forget(gone);
      return Status::OK();
    }
    st = r.status();
    if (!MasterAway(st)) return st;
    if (all) MarkMasterAway();
  }
  // The master away: what is remembered now (it may have changed meanwhile).
  std::vector<std::optional<store::ReadGrant>> recalled;
  Recall(keys, &recalled);
  std::vector<bool> have;
  if (!ConfirmRecalled(keys, recalled, got, &have, st)) return st;
  for (size_t i = 0; i < keys.size(); ++i) {
    (*without_master)[i] = have[i] && (*got)[i].status.ok();
  }
  return Status::OK();
}

void StoreClient::Impl::ConfirmHeld(std::span<const std::string> keys,
                                    std::vector<store::ReadGrant>* got,
                                    const std::vector<bool>& recalled, const Status& away) {
  // One Holds call per node, every replica of every remembered key on it.
  struct Call {
    std::string node;
    std::shared_ptr<rpc::Node::Stub> stub;
    std::vector<std::pair<size_t, size_t>> asked;  // (key, replica)
    rpc::HoldsRequest req;
    rpc::HoldsReply reply;
    grpc::ClientContext ctx;
    grpc::Status gs;
    bool done = false;
  };
  std::vector<std::unique_ptr<Call>> calls;
  std::map<std::string, Call*> by_node;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!recalled[i]) continue;
    const store::ReadGrant& g = (*got)[i];
    for (size_t r = 0; r < g.replicas.size(); ++r) {
      const store::ReplicaLocation& loc = g.replicas[r];
      Call*& c = by_node[loc.node.node_id];
      if (c == nullptr) {
        calls.push_back(std::make_unique<Call>());
        c = calls.back().get();
        c->node = loc.node.node_id;
        c->req.mutable_node()->set_node_id(loc.node.node_id);
        c->req.mutable_node()->set_incarnation(loc.node.incarnation);
      }
      rpc::InventoryRecord* q = c->req.add_records();
      q->set_key(keys[i]);
      q->set_version(g.version);
      q->set_segment_id(loc.segment_id);
      q->set_offset(loc.offset);
      c->asked.emplace_back(i, r);
    }
  }
  std::mutex mu;
  std::condition_variable cv;
  const auto deadline =
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(std::min(options.rpc_timeout_ms, options.transfer_deadline_ms));
  for (auto& c : calls) {
    Status why;
    c->stub = NodeStub(c->node, &why);
    if (c->stub == nullptr) {
      c->gs = grpc::Status(grpc::StatusCode::UNAVAILABLE, why.message());
      c->done = true;
      continue;
    }
    c->ctx.set_deadline(deadline);
    master->auth().Sign(&c->ctx, store::method::kHolds);
    Call* raw = c.get();
    c->stub->async()->Holds(&c->ctx, &c->req, &c->reply, [&mu, &cv, raw](grpc::Status s) {
      std::lock_guard<std::mutex> lock(mu);
      raw->gs = std::move(s);
      raw->done = true;
      cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] {
      return std::all_of(calls.begin(), calls.end(), [](const auto& c) { return c->done; });
    });
  }
  // held[i][r]: 1 the node holds it, 0 it does not, -1 no answer.
  std::vector<std::vector<int>> held(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (recalled[i]) held[i].assign((*got)[i].replicas.size(), -1);
  }
  for (const auto& c : calls) {
    const bool answered = c->gs.ok() && FromProto(c->reply.status()).ok() &&
                          c->reply.held_size() == static_cast<int>(c->asked.size());
    if (!answered) continue;
    for (size_t k = 0; k < c->asked.size(); ++k) {
      const auto [i, r] = c->asked[k];
      held[i][r] = c->reply.held(static_cast<int>(k)) ? 1 : 0;
    }
  }
  std::vector<std::string> gone;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!recalled[i]) continue;
    store::ReadGrant& g = (*got)[i];
    std::vector<store::ReplicaLocation> kept;
    bool any_answer = false;
    for (size_t r = 0; r < g.replicas.size(); ++r) {
      any_answer = any_answer || held[i][r] >= 0;
      if (held[i][r] == 1) kept.push_back(g.replicas[r]);
    }
    g.replicas = std::move(kept);
    if (!g.replicas.empty()) continue;
    if (any_answer) {
      g.status = Status::NotFound(
          "no node still holds the replicas this client remembers, and the master is away (" +
          away.message() + ")");
      gone.push_back(keys[i]);
    } else {
      g.status = away.WithContext("no node holding a remembered replica answered either");
    }
  }
  Forget(gone);
}

namespace {

// A get walks a key's replicas with an int index (-1: none yet).
int Count(const std::vector<store::ReplicaLocation>& replicas) {
  return static_cast<int>(replicas.size());
}

// A failure of the node as a whole (gone, frozen, replaced), not of one replica or our memory.
bool NodeLevel(const Status& st) {
  return st.IsPeerUnreachable() || st.IsStalePeer() || st.Is(StatusCode::kProgressTimeout) ||
         st.IsDeadlineExceeded();
}

// An op's failure as a get or put reports it: every op here moves bytes to or from a storage
// node, so a node-level failure names the node as the side that failed.
Status OpFailure(const Status& st) {
  return NodeLevel(st) ? st.WithOrigin(StatusOrigin::kStorageNode) : st;
}

}  // namespace

void StoreClient::Impl::RunSsd(const std::vector<std::pair<size_t, SsdTarget>>& reads,
                               size_t groups, const SsdAlternative& alternative,
                               std::chrono::steady_clock::time_point deadline,
                               std::vector<Status>* group_status, std::vector<size_t>* late) {
  using Clock = std::chrono::steady_clock;
  group_status->assign(groups, Status::OK());
  late->clear();
  if (reads.empty()) return;
  struct Call {
    std::string node;
    std::shared_ptr<rpc::Node::Stub> stub;  // kept until the call is over
    bool hedge = false;
    std::vector<size_t> groups;  // per item
    rpc::ReadSsdRequest req;
    rpc::ReadSsdReply reply;
    grpc::ClientContext ctx;
    std::optional<Clock::time_point> hedge_at;  // a first read not yet hedged
    grpc::Status gs;                            // under mu once done
    bool done = false;                          // answered, failed or past its deadline (under mu)
    bool handled = false;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::unique_ptr<Call>> calls;
  std::vector<uint32_t> sources(groups, 0);  // reads of the group not yet handled
  std::vector<bool> resolved(groups, false);
  std::vector<std::optional<Status>> first_error(groups);
  const std::string descriptor = engine->LocalDescriptor();

  // A read that could not be sent, or that failed: the group is settled once no read of it is
  // left, with the first read's error (else a hedge's).
  auto failed = [&](size_t g, const Status& st, bool hedge) {
    if (resolved[g]) return;
    if (!first_error[g] || !hedge) first_error[g] = OpFailure(st);
    if (sources[g] == 0) {
      resolved[g] = true;
      (*group_status)[g] = *first_error[g];
    }
  };
  // Sends one call per node of `batch` (group, target); `hedge`: reads of keys already asked
  // elsewhere.
  auto send = [&](const std::vector<std::pair<size_t, SsdTarget>>& batch, bool hedge) {
    std::vector<Call*> out;
    for (const auto& [g, t] : batch) {
      const std::string& node = t.loc->node.node_id;
      Call* c = nullptr;
      for (Call* o : out) {
        if (o->node == node) c = o;
      }
      if (c == nullptr) {
        calls.push_back(std::make_unique<Call>());
        c = calls.back().get();
        c->node = node;
        c->hedge = hedge;
        c->req.mutable_node()->set_node_id(t.loc->node.node_id);
        c->req.mutable_node()->set_incarnation(t.loc->node.incarnation);
        c->req.set_client_descriptor(descriptor);
        c->req.mutable_client()->set_node_id(engine->self().node_id);
        c->req.mutable_client()->set_incarnation(engine->self().incarnation);
        out.push_back(c);
      }
      rpc::ReadSsdItem item;
      item.set_key(*t.key);
      item.set_version(t.version);
      bool registered = true;
      for (const Piece& p : *t.pieces) {
        SegmentId seg = 0;
        uint64_t off = 0;
        registered = registered && LocalSegment(p.local, p.len, &seg, &off);
        auto* d = item.add_dests();
        d->set_segment_id(seg);
        d->set_offset(off);
        d->set_length(p.len);
      }
      if (!registered) {  // (PreCheck makes this unreachable)
        failed(g, Status::NotRegistered("a buffer of the get is not registered"), hedge);
        continue;
      }
      *c->req.add_items() = std::move(item);
      c->groups.push_back(g);
      ++sources[g];
    }
    const auto now = Clock::now();
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
    for (Call* c : out) {
      Status why;
      c->stub = NodeStub(c->node, &why);
      rpc::Node::Stub* stub = c->stub.get();
      if (c->groups.empty()) {  // nothing to send
        std::lock_guard<std::mutex> lock(mu);
        c->done = true;
        continue;
      }
      if (stub == nullptr || left.count() <= 0) {
        if (stub != nullptr) {
          why = Status::DeadlineExceeded("the get's deadline passed before this SSD read");
        }
        // Not sent: the reply's status says why.
        store::ToProto(why, c->reply.mutable_status());
        std::lock_guard<std::mutex> lock(mu);
        c->done = true;
        continue;
      }
      uint64_t bytes = 0;
      for (const auto& item : c->req.items()) {
        for (const auto& d : item.dests()) bytes += d.length();
      }
      if (!hedge && options.hedge_after_ms != 0) {
        c->hedge_at = now + std::chrono::milliseconds(options.hedge_after_ms) +
                      std::chrono::nanoseconds(bytes * 1000 / options.hedge_bandwidth_mbps);
      }
      // The node writes nothing past the call's deadline, which is the get's.
      c->req.set_timeout_ms(static_cast<uint32_t>(std::min<int64_t>(left.count(), UINT32_MAX)));
      c->ctx.set_deadline(std::chrono::system_clock::now() + left);
      master->auth().Sign(&c->ctx, store::method::kReadSsd);
      stub->async()->ReadSsd(&c->ctx, &c->req, &c->reply, [&mu, &cv, c](grpc::Status s) {
        std::lock_guard<std::mutex> lock(mu);
        c->gs = std::move(s);
        c->done = true;
        cv.notify_all();
      });
    }
  };
  auto on_final = [&](Call& c) {
    Status call_st = c.gs.ok() ? FromProto(c.reply.status())
                               : store::FromGrpc(c.gs, "ReadSsd", StatusOrigin::kStorageNode);
    if (call_st.ok() && c.reply.items_size() != static_cast<int>(c.groups.size())) {
      call_st =
          Status::Protocol("ReadSsd: the node answered " + std::to_string(c.reply.items_size()) +
                           " items of " + std::to_string(c.groups.size()))
              .WithOrigin(StatusOrigin::kStorageNode);
    }
    std::vector<std::pair<size_t, SsdTarget>> again;
    bool node_failed = false;
    for (size_t k = 0; k < c.groups.size(); ++k) {
      const size_t g = c.groups[k];
      --sources[g];
      const Status st =
          call_st.ok() ? FromProto(c.reply.items(static_cast<int>(k)).status()) : call_st;
      node_failed = node_failed || NodeLevel(st);
      if (resolved[g]) continue;
      if (st.ok()) {
        resolved[g] = true;
        (*group_status)[g] = Status::OK();
        continue;
      }
      // The node failed as a whole: the key's next replica, now, if none is being read.
      SsdTarget alt;
      if (NodeLevel(st) && sources[g] == 0 && alternative(g, c.node, &alt)) {
        if (!first_error[g] || !c.hedge) first_error[g] = OpFailure(st);
        again.emplace_back(g, alt);
        continue;
      }
      failed(g, st, c.hedge);
    }
    if (!c.hedge && node_failed && std::all_of(c.groups.begin(), c.groups.end(), [&](size_t g) {
          return resolved[g] && (*group_status)[g].ok();
        })) {
      late->push_back(c.groups.front());
    }
    if (!again.empty()) send(again, /*hedge=*/true);
  };

  send(reads, /*hedge=*/false);
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    std::vector<Call*> finished;
    bool in_flight = false;
    std::optional<Clock::time_point> until;
    for (auto& c : calls) {
      if (c->done && !c->handled) {
        c->handled = true;
        finished.push_back(c.get());
      } else if (!c->done) {
        in_flight = true;
        if (c->hedge_at && (!until || *c->hedge_at < *until)) until = c->hedge_at;
      }
    }
    lock.unlock();
    for (Call* c : finished) on_final(*c);
    // Late first reads: their unresolved keys are read again from another replica.
    const auto now = Clock::now();
    std::vector<std::pair<size_t, SsdTarget>> hedges;
    const size_t sent = calls.size();
    for (size_t i = 0; i < sent; ++i) {
      Call& c = *calls[i];
      if (c.handled || !c.hedge_at || now < *c.hedge_at) continue;
      c.hedge_at.reset();
      size_t n = 0;
      for (size_t g : c.groups) {
        SsdTarget alt;
        if (resolved[g] || !alternative(g, c.node, &alt)) continue;
        hedges.emplace_back(g, alt);
        ++n;
      }
      if (n > 0) {
        KVB_LOG(DEBUG) << "get: the SSD read from " << c.node << " is late; " << n
                       << " keys also read from other replicas";
      }
    }
    if (!hedges.empty()) send(hedges, /*hedge=*/true);
    lock.lock();
    if (!finished.empty() || !hedges.empty()) continue;
    if (!in_flight) break;
    auto ready = [&] {
      return std::any_of(calls.begin(), calls.end(),
                         [](const auto& c) { return c->done && !c->handled; });
    };
    // Every call ends by its deadline (gRPC's), so this wait ends too.
    if (until) {
      cv.wait_until(lock, *until, ready);
    } else {
      cv.wait(lock, ready);
    }
  }
  for (size_t g = 0; g < groups; ++g) {
    if (!resolved[g] && first_error[g]) (*group_status)[g] = *first_error[g];
  }
}

void StoreClient::Impl::Run(std::vector<TransferOp>& ops, const std::vector<size_t>& group_of_op,
                            size_t groups, std::vector<Status>* group_status,
                            uint32_t deadline_ms) {
  group_status->assign(groups, Status::OK());
  if (ops.empty()) return;
  SubmitOptions so;
  so.deadline_ms = deadline_ms != 0 ? deadline_ms : options.transfer_deadline_ms;
  Result<BatchId> id = engine->Submit(ops, so);
  if (!id.ok()) {
    for (size_t g = 0; g < groups; ++g) (*group_status)[g] = id.status();
    return;
  }
  BatchResult r = engine->Wait(id.value());
  for (size_t i = 0; i < ops.size(); ++i) {
    Status& gs = (*group_status)[group_of_op[i]];
    if (gs.ok() && !r.op_status[i].ok()) gs = OpFailure(r.op_status[i]);
  }
}

void StoreClient::Impl::RunHedged(const std::vector<TransferOp>& ops,
                                  const std::vector<size_t>& group_of_op, size_t groups,
                                  const Alternative& alternative, std::vector<Status>* group_status,
                                  std::vector<size_t>* late, uint32_t deadline_ms) {
  using Clock = std::chrono::steady_clock;
  group_status->assign(groups, Status::OK());
  late->clear();
  if (ops.empty()) return;
  struct NodeBatch {
    std::string_view node;
    std::vector<TransferOp> ops;
    std::vector<size_t> group_of_op;
    std::vector<size_t> groups;                 // distinct, in first-op order
    std::optional<BatchId> id;                  // set while in flight
    std::optional<Clock::time_point> hedge_at;  // a first read not yet hedged
    bool hedge = false;
    bool cancelled = false;
  };
  std::vector<NodeBatch> batches;
  auto batch_for = [&](std::string_view node, size_t from) -> NodeBatch& {
    for (size_t b = from; b < batches.size(); ++b) {
      if (batches[b].node == node) return batches[b];
    }
    batches.emplace_back();
    batches.back().node = node;
    return batches.back();
  };
  auto add_op = [](NodeBatch& nb, const TransferOp& op, size_t g) {
    nb.ops.push_back(op);
    nb.group_of_op.push_back(g);
    if (nb.groups.empty() || nb.groups.back() != g) nb.groups.push_back(g);
  };
  for (size_t k = 0; k < ops.size(); ++k) add_op(batch_for(ops[k].peer, 0), ops[k], group_of_op[k]);

  std::vector<uint32_t> sources(groups, 0);  // reads of the group in flight or not yet seen
  std::vector<bool> resolved(groups, false);
  std::vector<std::optional<Status>> first_error(groups);
  SubmitOptions so;
  so.deadline_ms = deadline_ms;
  auto on_final = [&](NodeBatch& nb, const BatchResult& r) {
    nb.id.reset();
    std::unordered_map<size_t, Status> err;  // per group of this batch: its first failed op
    for (size_t k = 0; k < nb.ops.size(); ++k) {
      const Status& st = k < r.op_status.size() ? r.op_status[k] : r.status;
      if (!st.ok()) err.emplace(nb.group_of_op[k], st);
    }
    for (size_t g : nb.groups) {
      --sources[g];
      if (resolved[g]) continue;
      auto e = err.find(g);
      if (e == err.end()) {
        resolved[g] = true;
        (*group_status)[g] = Status::OK();
        continue;
      }
      // The error the caller reports and moves on from: the first read's, else a hedge's.
      if (!first_error[g] || !nb.hedge) first_error[g] = OpFailure(e->second);
      if (sources[g] == 0) {
        resolved[g] = true;
        (*group_status)[g] = *first_error[g];
      }
    }
  };
  auto submit = [&](NodeBatch& nb) {
    for (size_t g : nb.groups) ++sources[g];
    Result<BatchId> id = engine->Submit(nb.ops, so);
    if (id.ok()) {
      nb.id = id.value();
      return;
    }
    BatchResult failed;
    failed.status = id.status();
    on_final(nb, failed);
  };
  const auto start = Clock::now();
  for (auto& nb : batches) {
    uint64_t bytes = 0;
    for (const auto& op : nb.ops) bytes += op.length;
    nb.hedge_at = start + std::chrono::milliseconds(options.hedge_after_ms) +
                  std::chrono::nanoseconds(bytes * 1000 / options.hedge_bandwidth_mbps);
  }
  for (auto& nb : batches) submit(nb);

  for (;;) {
    bool changed = false;
    for (auto& nb : batches) {
      if (!nb.id) continue;
      if (std::optional<BatchResult> r = engine->Poll(*nb.id)) {
        on_final(nb, *r);
        changed = true;
      }
    }
    // Late first reads: their unresolved groups are read again from another replica.
    const auto now = Clock::now();
    const size_t first_reads = batches.size();
    for (size_t b = 0; b < first_reads; ++b) {
      if (!batches[b].id || !batches[b].hedge_at || now < *batches[b].hedge_at) continue;
      batches[b].hedge_at.reset();
      const size_t hedges_from = batches.size();
      std::vector<TransferOp> alt;
      for (size_t g : std::vector<size_t>(batches[b].groups)) {
        alt.clear();
        if (resolved[g] || !alternative(g, batches[b].node, &alt) || alt.empty()) continue;
        NodeBatch& h = batch_for(alt.front().peer, hedges_from);
        h.hedge = true;
        for (const auto& op : alt) add_op(h, op, g);
      }
      for (size_t h = hedges_from; h < batches.size(); ++h) submit(batches[h]);
      if (batches.size() > hedges_from) {
        KVB_LOG(DEBUG) << "get: the read from " << batches[b].node << " is late; "
                       << batches[b].groups.size() << " keys also read from other replicas";
      }
      changed = true;
    }
    // A read whose every key is served elsewhere is cancelled: after Cancel returns it
    // touches no buffer, and it ends CANCELLED (ignored, its keys being resolved).
    bool in_flight = false;
    for (auto& nb : batches) {
      if (!nb.id) continue;
      in_flight = true;
      if (nb.cancelled) continue;
      if (std::all_of(nb.groups.begin(), nb.groups.end(), [&](size_t g) { return resolved[g]; })) {
        engine->Cancel(*nb.id);
        nb.cancelled = true;
        if (!nb.hedge) late->push_back(nb.groups.front());
        changed = true;
      }
    }
    if (!in_flight) break;
    if (changed) continue;
    // Wait on the first read in flight until the next hedge is due; while two reads race,
    // look at all of them every millisecond.
    std::optional<Clock::time_point> until;
    size_t flying = 0;
    NodeBatch* first = nullptr;
    for (auto& nb : batches) {
      if (!nb.id) continue;
      ++flying;
      if (first == nullptr) first = &nb;
      if (nb.hedge_at && (!until || *nb.hedge_at < *until)) until = nb.hedge_at;
    }
    const bool racing = std::any_of(batches.begin(), batches.end(),
                                    [](const NodeBatch& nb) { return nb.id && nb.hedge; });
    if (racing && flying > 1) {
      const auto slice = Clock::now() + std::chrono::milliseconds(1);
      if (!until || slice < *until) until = slice;
    }
    std::optional<BatchResult> r;
    if (until) {
      r = engine->WaitFor(*first->id, *until - Clock::now());
    } else {
      r = engine->Wait(*first->id);
    }
    if (r) on_final(*first, *r);
  }
}

namespace {

// The keys of a batch whose memory is registered, when some key's is not.
struct Subset {
  std::vector<std::string> keys;
  std::vector<std::vector<BufferRef>> buffers;
  std::vector<size_t> index;  // position in the caller's batch
};

// Fills (*result)[i] with NOT_REGISTERED for each key whose buffers are not registered and
// returns the other keys; nullopt when every key is fine (the common case: no copies).
template <typename R>
std::optional<Subset> PreCheck(StoreClient::Impl& im, std::span<const std::string> keys,
                               std::span<const std::vector<BufferRef>> buffers,
                               std::vector<R>* result) {
  std::vector<Status> checks;
  checks.reserve(keys.size());
  bool all_ok = true;
  for (size_t i = 0; i < keys.size(); ++i) {
    checks.push_back(im.CheckRegistered(buffers[i], i));
    all_ok = all_ok && checks.back().ok();
  }
  if (all_ok) return std::nullopt;
  Subset subset;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!checks[i].ok()) {
      (*result)[i] = std::move(checks[i]);
      continue;
    }
    subset.keys.push_back(keys[i]);
    subset.buffers.push_back(buffers[i]);
    subset.index.push_back(i);
  }
  return subset;
}

}  // namespace

StoreClient::StoreClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StoreClient::~StoreClient() = default;

Result<std::unique_ptr<StoreClient>> StoreClient::Create(const StoreOptions& options) {
  if (options.replica_num == 0) return Status::InvalidArgument("replica_num must be >= 1");
  if (options.hedge_after_ms != 0 && options.hedge_bandwidth_mbps == 0) {
    return Status::InvalidArgument(
        "hedge_bandwidth_mbps must be >= 1 while hedging is on (hedge_after_ms > 0)");
  }
  std::optional<store::SoftPin> soft_pin;
  if (options.soft_pin == "preserve") soft_pin = store::SoftPin::kPreserve;
  if (options.soft_pin == "enable") soft_pin = store::SoftPin::kEnable;
  if (options.soft_pin == "disable") soft_pin = store::SoftPin::kDisable;
  if (!soft_pin) {
    return Status::InvalidArgument("soft_pin \"" + options.soft_pin +
                                   "\" is none of preserve, enable, disable");
  }
  if (options.soft_pin_ttl_ms != 0 && *soft_pin != store::SoftPin::kEnable) {
    return Status::InvalidArgument("soft_pin_ttl_ms " + std::to_string(options.soft_pin_ttl_ms) +
                                   " needs soft_pin \"enable\" (it is \"" + options.soft_pin +
                                   "\")");
  }
  if (options.location_cache_entries != 0 && options.master_wait_ms == 0) {
    return Status::InvalidArgument(
        "master_wait_ms must be >= 1 while reads without the master are on "
        "(location_cache_entries > 0)");
  }
  KVB_RETURN_IF_ERROR(store::CheckPeerDiscovery(options.peer_discovery));
  store::PreferCallerPolling();
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->admin_key = store::CallKey(options.admin_token, store::kAdminKeyPurpose);
  impl->pins = {options.hard_pin, *soft_pin, options.soft_pin_ttl_ms};
  impl->crc_pool = std::make_unique<util::WorkerPool>(options.engine.local_copy_threads != 0
                                                          ? options.engine.local_copy_threads
                                                          : util::WorkerPool::DefaultThreads());
  KVB_RETURN_IF_ERROR(store::ParseFaults(
      options.faults, "StoreOptions::faults",
      {{"put_stall_before_write_ms", &impl->put_stall_before_write_ms},
       {"put_ignore_deadline", &impl->put_ignore_deadline},
       {"put_stall_before_local_commit_ms", &impl->put_stall_before_local_commit_ms}}));
  auto engine = TransferEngine::Create(options.engine);
  if (!engine.ok()) return engine.status().WithContext("store client");
  impl->engine = std::move(engine).value();
  store::MasterClient::Options mo;
  mo.address = options.master_address;
  mo.cluster_token = options.engine.cluster_token;
  mo.retry.rpc_timeout_ms = options.rpc_timeout_ms;
  impl->master = std::make_unique<store::MasterClient>(std::move(mo));
  impl->directory =
      std::make_unique<store::PeerDirectory>(impl->master.get(), options.peer_discovery);
  impl->staging.reset(new char[kStagingBytes]);  // not zero-filled: it is only ever copied into
  Result<SegmentId> seg = impl->engine->RegisterMemory(impl->staging.get(), kStagingBytes);
  if (!seg.ok()) return seg.status().WithContext("registering the staging buffer");
  impl->staging_segment = seg.value();
  return std::unique_ptr<StoreClient>(new StoreClient(std::move(impl)));
}

TransferEngine& StoreClient::engine() { return *impl_->engine; }

Status StoreClient::RegisterBuffer(void* addr, uint64_t length, MemoryKind kind, int device_id) {
  Impl& im = *impl_;
  if (kind == MemoryKind::kDetect) std::tie(kind, device_id) = core::DetectMemoryKind(addr);
  if (kind == MemoryKind::kCuda) {
    // The checksums of a CUDA buffer's bytes are taken through the driver (Impl::Checksums).
    std::lock_guard<std::mutex> lock(im.bounce_mu);
    if (!im.bounce) {
      Result<std::unique_ptr<core::DeviceBounce>> b = core::DeviceBounce::Create(kBounceBytes);
      if (!b.ok()) {
        return Status(b.status().code(),
                      "RegisterBuffer: a CUDA device buffer needs the CUDA driver (the store "
                      "client copies its bytes with it to checksum them): " +
                          b.status().message());
      }
      im.bounce = std::move(b).value();
    }
  }
  // The engine checks the kind (neither kHost nor kCuda: INVALID_ARGUMENT) and that the memory
  // is what it says (core/memory_kinds.h).
  Result<SegmentId> seg = im.engine->RegisterMemory(addr, length, kind, device_id);
  if (!seg.ok()) return seg.status();
  int device = device_id;
  if (kind == MemoryKind::kCuda && device < 0) {
    Result<int> d = core::DeviceBounce::DeviceOf(addr, length);
    if (!d.ok()) {
      (void)im.engine->DeregisterMemory(seg.value());
      return d.status();
    }
    device = d.value();
  }
  std::lock_guard<std::mutex> lock(im.buffers_mu);
  im.buffers[reinterpret_cast<uintptr_t>(addr)] = {seg.value(), length, kind, device};
  if (kind == MemoryKind::kCuda) im.device_buffers.fetch_add(1, std::memory_order_release);
  return Status::OK();
}

Status StoreClient::UnregisterBuffer(void* addr) {
  SegmentId seg;
  {
    std::lock_guard<std::mutex> lock(impl_->buffers_mu);
    auto it = impl_->buffers.find(reinterpret_cast<uintptr_t>(addr));
    if (it == impl_->buffers.end()) {
      return Status::NotFound("UnregisterBuffer: no buffer registered at this address");
    }
    seg = it->second.segment;
    if (it->second.kind == MemoryKind::kCuda) impl_->device_buffers.fetch_sub(1);
    impl_->buffers.erase(it);
  }
  return impl_->engine->DeregisterMemory(seg);
}

std::vector<Status> StoreClient::Impl::PutFrom(std::span<const std::string> keys,
                                               std::span<const std::vector<BufferRef>> buffers,
                                               bool overwrite, std::vector<bool>* busy) {
  Impl& im = *this;
  std::vector<Status> result(keys.size());
  if (busy) busy->assign(keys.size(), false);
  if (buffers.size() != keys.size()) {
    result.assign(keys.size(), Status::InvalidArgument("BatchPutFrom: one buffer list per key"));
    return result;
  }
  if (keys.size() > store::kMaxKeysPerCall) {
    std::vector<bool> slice_busy;
    return BySlices<Status>(keys.size(), [&](size_t begin, size_t count) {
      std::vector<Status> r = PutFrom(keys.subspan(begin, count), buffers.subspan(begin, count),
                                      overwrite, busy ? &slice_busy : nullptr);
      for (size_t j = 0; busy && j < count; ++j) (*busy)[begin + j] = slice_busy[j];
      return r;
    });
  }
  // A key whose memory is not registered fails alone; the others go on without it.
  if (auto subset = PreCheck(im, keys, buffers, &result)) {
    std::vector<bool> sub_busy;
    std::vector<Status> sub =
        PutFrom(subset->keys, subset->buffers, overwrite, busy ? &sub_busy : nullptr);
    for (size_t j = 0; j < sub.size(); ++j) {
      result[subset->index[j]] = std::move(sub[j]);
      if (busy) (*busy)[subset->index[j]] = sub_busy[j];
    }
    return result;
  }
  std::vector<std::vector<uint64_t>> sizes(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    for (const auto& b : buffers[i]) sizes[i].push_back(b.length);
  }
  // Checksums depend only on the caller's bytes, so they are computed while the master
  // allocates, overlapping the PutStart round trip. The bytes of CUDA buffers are copied to
  // host memory for it then too (Impl::Checksums). A key of one host piece whose replica goes
  // to a node of this process (an embedded client's own), or over a transport that checksums
  // what it sends, gets its checksum from that write instead, taken while the bytes are in
  // cache, when the last put found its keys so placed (put_crc_in_copy): a pass over bytes not
  // in cache costs more than the round trip it overlaps (docs/performance.md "Small objects
  // and the embedded deployment"). A key whose write did not give one (a failed write, a
  // failover to another path) is checksummed after the writes.
  std::vector<store::PutGrant> started;
  std::vector<uint32_t> checksums(keys.size(), 0);
  std::vector<Status> unread(keys.size());  // per key: why its bytes could not be read
  std::vector<std::vector<Piece>> pieces(keys.size());
  std::vector<char> crc_from_copy(keys.size(), 0);  // the key's checksum is its copy's
  const bool try_copy_crc = im.put_crc_in_copy.load(std::memory_order_relaxed);
  // The checksums of these keys (one pass, shared by the pool's threads), in place.
  const auto checksum_keys = [&](std::span<const size_t> which) {
    if (which.empty()) return;
    std::vector<const std::vector<Piece>*> of_key;
    of_key.reserve(which.size());
    for (size_t i : which) of_key.push_back(&pieces[i]);
    std::vector<uint32_t> crcs;
    std::vector<Status> st;
    im.Checksums(of_key, &crcs, &st);
    for (size_t j = 0; j < which.size(); ++j) {
      checksums[which[j]] = crcs[j];
      unread[which[j]] = std::move(st[j]);
    }
  };
  // The master's write deadline counts from its answer: measured from before asking, it ends
  // no later here than there.
  const auto put_base = std::chrono::steady_clock::now();
  {
    store::MasterClient::PendingPutStart pending = im.master->PutStart(
        keys, sizes, im.options.replica_num, im.engine->self().node_id, overwrite, im.pins);
    std::vector<size_t> now;  // keys checksummed while PutStart is out
    now.reserve(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      uint64_t total = 0;
      for (const auto& b : buffers[i]) total += b.length;
      MapPieces(total, buffers[i], &pieces[i]);
      im.MarkDevices(&pieces[i]);
      if (try_copy_crc && pieces[i].size() == 1 && pieces[i][0].device < 0) {
        crc_from_copy[i] = 1;
        continue;
      }
      now.push_back(i);
    }
    checksum_keys(now);
    Result<std::vector<store::PutGrant>> reply = pending.Wait();
    if (!reply.ok()) {
      result.assign(keys.size(), reply.status());
      return result;
    }
    started = std::move(reply).value();
  }
  // Writes: every replica of every admitted key, all in one batch, ended by the earliest of
  // their deadlines from the master (its put_timeout_ms). After a deadline the master revokes
  // the put and, a margin later, reuses its ranges for other objects: a write started or still
  // sending then could land on them (docs/store.md "Late writes").
  std::set<std::pair<std::string, uint64_t>> nodes;
  std::optional<std::chrono::steady_clock::time_point> write_deadline;
  const store::NodeIdentity* last_node = nullptr;  // most keys' replicas go to the same nodes
  for (const store::PutGrant& item : started) {
    for (const auto& r : item.replicas) {
      if (last_node != nullptr && last_node->incarnation == r.node.incarnation &&
          last_node->node_id == r.node.node_id) {
        continue;
      }
      nodes.emplace(r.node.node_id, r.node.incarnation);
      last_node = &r.node;
    }
    if (item.status.ok() && !item.replicas.empty()) {
      const auto d = put_base + std::chrono::milliseconds(item.deadline_ms);
      if (!write_deadline || d < *write_deadline) write_deadline = d;
    }
  }
  Status peers_ok = im.EnsurePeers(nodes);
  // Commits to nodes of this process come back with PutEnd's answer (below); their copies are
  // where a key's checksum can come from, or else a write over a transport that takes it.
  const std::vector<store::NodeIdentity> local_nodes =
      store::LocalNodesAmong(nodes, im.options.engine.cluster_token);
  // Whether a write to this (not local) node gets its checksum from the transport; asked of the
  // engine once per node and put.
  std::vector<std::pair<const store::NodeIdentity*, bool>> checksumming;
  const auto write_checksums = [&](const store::NodeIdentity& node) {
    for (const auto& [n, yes] : checksumming) {
      if (n->incarnation == node.incarnation && n->node_id == node.node_id) return yes;
    }
    const bool yes = im.engine->TransportChecksumsOpsTo(node.node_id);
    checksumming.emplace_back(&node, yes);
    return yes;
  };
  // The replica whose write gives the key's checksum: one in this process, else the first
  // whose node is reached over a transport that takes it; -1 for none.
  const auto crc_replica = [&](const store::PutGrant& item) -> int {
    int over_transport = -1;
    for (size_t r = 0; r < item.replicas.size(); ++r) {
      const store::NodeIdentity& node = item.replicas[r].node;
      for (const auto& n : local_nodes) {
        if (n.incarnation == node.incarnation && n.node_id == node.node_id) {
          return static_cast<int>(r);
        }
      }
      if (over_transport < 0 && write_checksums(node)) over_transport = static_cast<int>(r);
    }
    return over_transport;
  };
  std::vector<OpChecksum> copy_crcs(try_copy_crc ? keys.size() : 0);
  bool all_placed = true;  // every admitted key has a replica whose write gives its checksum
  if (const uint32_t stall = im.put_stall_before_write_ms.load(); stall > 0) {
    KVB_LOG(WARN) << "fault injection: put stalls " << stall << " ms before its transfer";
    std::this_thread::sleep_for(std::chrono::milliseconds(stall));
  }
  // Sized once: grown op by op, a batch of 512 keys reallocated each about ten times, and such
  // large blocks, among a put's many small frees, cost the process's malloc most of all
  // (docs/performance.md).
  size_t replicas_total = 0, pieces_total = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    replicas_total += started[i].replicas.size();
    pieces_total += started[i].replicas.size() * pieces[i].size();
  }
  std::vector<TransferOp> ops;
  std::vector<size_t> group_of_op;
  std::vector<std::pair<size_t, size_t>> groups;  // (key index, replica index)
  ops.reserve(pieces_total);
  group_of_op.reserve(pieces_total);
  groups.reserve(replicas_total);
  std::vector<size_t> unread_groups;  // groups of keys whose bytes could not be read
  uint64_t existing = 0;              // keys stored already (counters)
  for (size_t i = 0; i < keys.size(); ++i) {
    const store::PutGrant& item = started[i];
    const Status& st = item.status;
    if (st.Is(StatusCode::kAlreadyExists)) {  // stored already: success, no rewrite
      ++existing;
      continue;
    }
    if (!st.ok()) {
      result[i] = st;
      if (busy && overwrite && st.Is(StatusCode::kUnavailable)) (*busy)[i] = true;
      continue;
    }
    // No checksum, no write: its replicas go to PutEnd as failed, so that the master drops the
    // object at once (nothing stored, nothing half-written).
    if (!unread[i].ok()) {
      for (size_t r = 0; r < item.replicas.size(); ++r) {
        groups.emplace_back(i, r);
        unread_groups.push_back(groups.size() - 1);
      }
      continue;
    }
    const int local = crc_replica(item);
    if (local < 0) all_placed = false;
    for (size_t r = 0; r < item.replicas.size(); ++r) {
      const store::ReplicaLocation& loc = item.replicas[r];
      groups.emplace_back(i, r);
      for (const auto& p : pieces[i]) {
        ops.push_back(TransferOp{OpCode::kWrite, p.local, p.len, loc.node.node_id, loc.segment_id,
                                 loc.offset + p.obj_off});
        if (crc_from_copy[i] && static_cast<int>(r) == local) ops.back().checksum = &copy_crcs[i];
        group_of_op.push_back(groups.size() - 1);
      }
    }
  }
  im.put_crc_in_copy.store(all_placed, std::memory_order_relaxed);
  std::vector<Status> group_status;
  bool sent = true;  // false: nothing went out (no node to blame for the failure)
  const int64_t left_ms = write_deadline ? std::chrono::duration_cast<std::chrono::milliseconds>(
                                               *write_deadline - std::chrono::steady_clock::now())
                                               .count()
                                         : int64_t{im.options.transfer_deadline_ms};
  if (im.put_ignore_deadline.load() != 0) {
    im.Run(ops, group_of_op, groups.size(), &group_status);
  } else if (left_ms <= 0) {
    sent = false;
    group_status.assign(groups.size(),
                        Status::DeadlineExceeded("the put's deadline from the master passed "
                                                 "before its transfer started; nothing written"));
  } else {
    im.Run(ops, group_of_op, groups.size(), &group_status,
           static_cast<uint32_t>(std::min<int64_t>(left_ms, im.options.transfer_deadline_ms)));
  }
  if (!peers_ok.ok()) KVB_LOG(WARN) << "put: " << peers_ok.ToString();
  for (size_t g : unread_groups) group_status[g] = unread[groups[g].first];
  // Keys written whose checksum was to come from a copy that did not give it (no replica in
  // this process, a failed copy): a pass over the caller's bytes now. Keys not admitted (stored
  // already, refused) need none.
  {
    std::vector<size_t> late;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!crc_from_copy[i]) continue;
      if (copy_crcs[i].computed) {
        checksums[i] = copy_crcs[i].crc32c;
      } else if (started[i].status.ok() && !started[i].replicas.empty()) {
        late.push_back(i);
      }
    }
    checksum_keys(late);
  }

  std::vector<store::PutEndItem> end;
  end.reserve(keys.size());
  std::vector<int> end_item_of_key(keys.size(), -1);
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto [i, r] = groups[g];
    if (end_item_of_key[i] < 0) {
      end_item_of_key[i] = static_cast<int>(end.size());
      end.push_back({keys[i], started[i].version, {}, checksums[i]});
    }
    end[end_item_of_key[i]].replica_ok.push_back(group_status[g].ok());
  }
  im.counters.PutsExisting(existing);
  if (end.empty()) return result;
  // Commits to nodes of this process come back with the answer and are applied here, before
  // the put is reported done (store/local_nodes.h); a key whose record one of them could not
  // keep is not reported stored.
  std::vector<rpc::CommitRequest> local_commits;
  // The ranges those commits will fill, told to their nodes from before the PutEnd is sent
  // until the commits are applied (store::ExpectLocalCommits): a free there that overtakes its
  // commit is remembered by the node and the commit leaves that record out.
  struct Expected {
    std::vector<std::pair<store::NodeIdentity, std::vector<std::pair<uint64_t, uint64_t>>>> nodes;
    ~Expected() {
      for (const auto& [node, ranges] : nodes) store::ExpectLocalCommits(node, ranges, false);
    }
  } expected;
  for (const store::NodeIdentity& n : local_nodes) {
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (const auto& [i, r] : groups) {
      const store::ReplicaLocation& loc = started[i].replicas[r];
      if (loc.node.incarnation == n.incarnation && loc.node.node_id == n.node_id) {
        ranges.emplace_back(loc.segment_id, loc.offset);
      }
    }
    if (ranges.empty()) continue;
    store::ExpectLocalCommits(n, ranges, true);
    expected.nodes.emplace_back(n, std::move(ranges));
  }
  const auto end_sent = std::chrono::steady_clock::now();
  Result<std::vector<Status>> ended = im.master->PutEnd(end, local_nodes, &local_commits);
  std::unordered_map<std::string_view, Status> not_kept;  // by key
  if (const uint32_t stall = im.put_stall_before_local_commit_ms.load();
      stall > 0 && !local_commits.empty()) {
    KVB_LOG(WARN) << "fault injection: put stalls " << stall << " ms before its local commits";
    std::this_thread::sleep_for(std::chrono::milliseconds(stall));
  }
  for (rpc::CommitRequest& c : local_commits) {
    Status st = store::ApplyLocalCommit(c, end_sent);
    if (st.ok()) continue;
    KVB_LOG(WARN) << "put: the inventory records of " << c.records_size() << " object(s) at "
                  << c.node().node_id() << " of this process were not kept: " << st.ToString();
    for (const auto& r : c.records()) not_kept.emplace(r.key(), st);
  }
  uint64_t stored = 0, written = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const int e = end_item_of_key[i];
    if (e < 0) continue;
    if (!unread[i].ok()) {  // the master dropped it (or will: the put times out)
      result[i] = unread[i].WithContext("not stored");
      continue;
    }
    if (!ended.ok()) {
      result[i] = ended.status();
      continue;
    }
    result[i] = (*ended)[e];
    if (auto nk = not_kept.find(keys[i]); result[i].ok() && nk != not_kept.end()) {
      result[i] = nk->second.WithContext(
          "not acknowledged: its record at this process's storage node was not kept");
    }
    if (result[i].ok()) {
      ++stored;
      written += std::accumulate(sizes[i].begin(), sizes[i].end(), uint64_t{0});
      if (im.options.location_cache_entries != 0) {
        std::vector<store::ReplicaLocation> replicas;  // those written
        for (size_t g = 0; g < groups.size(); ++g) {
          if (groups[g].first == i && group_status[g].ok()) {
            replicas.push_back(started[i].replicas[groups[g].second]);
          }
        }
        im.Remember(keys[i], started[i].version, sizes[i], checksums[i], std::move(replicas));
      }
    } else {
      // Say why the replicas failed, not only that the master revoked the object.
      for (size_t g = 0; g < groups.size(); ++g) {
        if (groups[g].first == i && !group_status[g].ok()) {
          result[i] = result[i].WithContext(group_status[g].ToString());
          break;
        }
      }
    }
  }
  im.counters.PutsStored(stored, written);
  // A node that failed a write as a whole (gone, frozen, replaced) is reported once, as gets
  // do: placed last for a while, so the next puts put their replicas elsewhere first instead
  // of each waiting out the same progress timeout until its TTL expires. Nothing is dropped.
  std::set<std::string> reported;
  for (size_t g = 0; sent && g < groups.size(); ++g) {
    if (group_status[g].ok() || !NodeLevel(group_status[g])) continue;
    const auto [i, r] = groups[g];
    const store::PutGrant& item = started[i];
    const store::ReplicaLocation& loc = item.replicas[r];
    if (im.Knows(loc.node) && reported.insert(loc.node.node_id).second) {
      im.Report(keys[i], item.version, loc, /*node_level=*/true);
    }
  }
  return result;
}

namespace {

// The master could not be reached for the put (down, restarting, an election in progress):
// nothing of it was acknowledged, so the whole put may go again.
bool MasterUnavailable(const Status& st) {
  return st.origin() == StatusOrigin::kMaster &&
         (st.Is(StatusCode::kUnavailable) || st.Is(StatusCode::kPeerUnreachable));
}

}  // namespace

std::vector<Status> StoreClient::BatchPutFrom(std::span<const std::string> keys,
                                              std::span<const std::vector<BufferRef>> buffers) {
  return impl_->PutCall(keys, buffers, /*overwrite=*/false);
}

std::vector<Status> StoreClient::BatchUpsertFrom(std::span<const std::string> keys,
                                                 std::span<const std::vector<BufferRef>> buffers) {
  return impl_->PutCall(keys, buffers, /*overwrite=*/true);
}

std::vector<Status> StoreClient::Impl::PutCall(std::span<const std::string> keys,
                                               std::span<const std::vector<BufferRef>> buffers,
                                               bool overwrite) {
  const auto start = store::ClientCounters::Clock::now();
  std::vector<bool> busy;
  std::vector<Status> result = PutFrom(keys, buffers, overwrite, &busy);
  // Overwrites the master refused while another put of their key was in flight are put again
  // (concurrent upserts of a key take turns, the last to start wins); and with HA masters
  // ("etcd://"), so are keys whose put failed only because no master answered: put again, whole
  // (a new PutStart: a new version, the same bytes), so a put rides through an election
  // (docs/ha.md) as a read does. A single master that is down fails puts at once. Both until
  // rpc_timeout_ms from the call's start.
  const auto until = start + std::chrono::milliseconds(options.rpc_timeout_ms);
  const bool ha = store::IsEtcdAddress(options.master_address);
  for (uint32_t backoff_ms = 100;; backoff_ms = std::min<uint32_t>(2 * backoff_ms, 500)) {
    std::vector<size_t> again;
    for (size_t i = 0; i < result.size(); ++i) {
      if ((ha && MasterUnavailable(result[i])) || busy[i]) again.push_back(i);
    }
    if (again.empty() || buffers.size() != keys.size() ||
        store::ClientCounters::Clock::now() + std::chrono::milliseconds(backoff_ms) >= until) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
    std::vector<std::string> k;
    std::vector<std::vector<BufferRef>> b;
    for (size_t i : again) {
      k.push_back(keys[i]);
      b.push_back(buffers[i]);
    }
    std::vector<bool> retried_busy;
    std::vector<Status> retried = PutFrom(k, b, overwrite, &retried_busy);
    for (size_t j = 0; j < again.size(); ++j) {
      result[again[j]] = std::move(retried[j]);
      busy[again[j]] = retried_busy[j];
    }
  }
  for (const Status& st : result) {
    if (!st.ok()) counters.Error(StoreOp::kPut, st.code());
  }
  counters.Call(StoreOp::kPut, keys.size(), store::ClientCounters::Clock::now() - start);
  return result;
}

std::vector<Result<uint64_t>> StoreClient::BatchGetInto(
    std::span<const std::string> keys, std::span<const std::vector<BufferRef>> buffers) {
  const auto start = store::ClientCounters::Clock::now();
  std::vector<Result<uint64_t>> result = impl_->GetInto(keys, buffers);
  uint64_t misses = 0;
  for (const Result<uint64_t>& r : result) {
    if (r.ok()) continue;  // a hit, counted by GetInto with its tier
    if (r.status().IsNotFound()) {
      ++misses;
    } else {
      impl_->counters.Error(StoreOp::kGet, r.status().code());
    }
  }
  impl_->counters.GetMisses(misses);
  impl_->counters.Call(StoreOp::kGet, keys.size(), store::ClientCounters::Clock::now() - start);
  return result;
}

std::vector<Result<uint64_t>> StoreClient::BatchGetSize(std::span<const std::string> keys) {
  return impl_->FromSizeQuery<uint64_t>(keys, [](const store::ReadGrant& item) {
    return std::accumulate(item.sizes.begin(), item.sizes.end(), uint64_t{0});
  });
}

std::vector<Result<std::vector<ReplicaInfo>>> StoreClient::BatchGetReplicaInfo(
    std::span<const std::string> keys) {
  return impl_->FromSizeQuery<std::vector<ReplicaInfo>>(keys, [](const store::ReadGrant& item) {
    std::vector<ReplicaInfo> out;
    out.reserve(item.replicas.size());
    for (const auto& r : item.replicas) {
      out.push_back({PeerId{r.node.node_id, r.node.incarnation}, r.tier == store::Tier::kSsd,
                     r.segment_id, r.offset, r.length});
    }
    return out;
  });
}

std::vector<Result<uint64_t>> StoreClient::Impl::GetInto(
    std::span<const std::string> keys, std::span<const std::vector<BufferRef>> buffers) {
  Impl& im = *this;
  std::vector<Result<uint64_t>> result(keys.size(), Status::Internal("not attempted"));
  if (buffers.size() != keys.size()) {
    result.assign(keys.size(), Status::InvalidArgument("BatchGetInto: one buffer list per key"));
    return result;
  }
  if (keys.size() > store::kMaxKeysPerCall) {
    return BySlices<Result<uint64_t>>(keys.size(), [&](size_t begin, size_t count) {
      return GetInto(keys.subspan(begin, count), buffers.subspan(begin, count));
    });
  }
  if (auto subset = PreCheck(im, keys, buffers, &result)) {
    auto sub = GetInto(subset->keys, subset->buffers);
    for (size_t j = 0; j < sub.size(); ++j) result[subset->index[j]] = std::move(sub[j]);
    return result;
  }
  std::vector<store::ReadGrant> got;
  std::vector<bool> without_master;  // read from remembered replicas (the master away)
  if (Status st = im.GrantsForGet(keys, &got, &without_master); !st.ok()) {
    result.assign(keys.size(), st);
    return result;
  }
  std::vector<std::vector<Piece>> pieces(keys.size());
  std::vector<int> next_replica(keys.size(), 0);
  std::vector<size_t> pending;
  std::set<std::pair<std::string, uint64_t>> nodes;
  for (size_t i = 0; i < keys.size(); ++i) {
    const store::ReadGrant& item = got[i];
    if (!item.status.ok()) {
      result[i] = item.status;
      continue;
    }
    uint64_t total = 0;
    for (uint64_t s : item.sizes) total += s;
    if (!MapPieces(total, buffers[i], &pieces[i])) {
      result[i] = Status::InvalidArgument("buffers hold fewer bytes than the object's " +
                                          std::to_string(total));
      continue;
    }
    im.MarkDevices(&pieces[i]);
    if (item.replicas.empty()) {
      result[i] = Status::NotFound("object has no readable replica");
      continue;
    }
    for (const auto& r : item.replicas) nodes.emplace(r.node.node_id, r.node.incarnation);
    pending.push_back(i);
  }
  Status peers_ok = im.EnsurePeers(nodes);
  if (!peers_ok.ok()) KVB_LOG(WARN) << "get: " << peers_ok.ToString();
  // Counters, added once at the end.
  uint64_t hits_dram = 0, hits_ssd = 0, hit_bytes = 0, hits_without_master = 0;
  // The transfers of the whole get, every pass, DRAM and SSD, end within transfer_deadline_ms
  // from here; a key still failing then keeps its last error.
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::milliseconds(im.options.transfer_deadline_ms);
  // Each pass reads every pending key from its next replica; failures move on at once.
  bool first_pass = true;
  while (!pending.empty()) {
    const int64_t left_ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left_ms <= 0) break;
    std::vector<TransferOp> ops;
    std::vector<size_t> group_of_op;
    ops.reserve(pending.size());  // one piece per key, most often
    group_of_op.reserve(pending.size());
    std::vector<std::pair<size_t, Impl::SsdTarget>> from_ssd;  // groups whose replica is on SSD
    // A key of one piece read on the first pass asks the engine for the checksum of what it
    // copies, when it copies from a node of this process (TransferOp::checksum): then the
    // bytes need no second pass to be checked. The key's op is its group's only writer into
    // its buffer unless a hedge is sent, and then the key is checked from the buffer.
    std::vector<OpChecksum> op_crcs(pending.size());  // per group
    std::vector<bool> crc_asked(pending.size(), false);
    for (size_t g = 0; g < pending.size(); ++g) {
      const size_t i = pending[g];
      const store::ReadGrant& item = got[i];
      const store::ReplicaLocation& loc = item.replicas[next_replica[i]];
      if (loc.tier == store::Tier::kSsd) {
        from_ssd.emplace_back(g, Impl::SsdTarget{&loc, &keys[i], item.version, &pieces[i]});
        continue;
      }
      for (const auto& p : pieces[i]) {
        ops.push_back(TransferOp{OpCode::kRead, p.local, p.len, loc.node.node_id, loc.segment_id,
                                 loc.offset + p.obj_off});
        group_of_op.push_back(g);
      }
      if (first_pass && pieces[i].size() == 1 && pieces[i][0].device < 0) {
        crc_asked[g] = true;
        ops.back().checksum = &op_crcs[g];
      }
    }
    first_pass = false;
    std::vector<Status> group_status;
    std::vector<size_t> late;  // one group per node whose read other replicas served
    std::vector<int> hedged_from(pending.size(), -1);  // the last replica a hedge read, per group
    // SSD replicas are served by their nodes, which write them into our buffers: one call per
    // node, all at once, while the DRAM reads run here. The SSD-first keys have only SSD
    // replicas left (the master ranks DRAM first): the next one on another node.
    std::vector<Status> ssd_status;
    std::vector<size_t> ssd_late;
    std::thread ssd_reads;
    if (!from_ssd.empty()) {
      auto ssd_alternative = [&](size_t g, std::string_view avoid, Impl::SsdTarget* out) {
        const size_t i = pending[g];
        const store::ReadGrant& item = got[i];
        for (int r = std::max(next_replica[i], hedged_from[g]) + 1; r < Count(item.replicas); ++r) {
          const store::ReplicaLocation& loc = item.replicas[r];
          if (loc.tier != store::Tier::kSsd || loc.node.node_id == avoid || !im.Knows(loc.node)) {
            continue;
          }
          *out = Impl::SsdTarget{&loc, &keys[i], item.version, &pieces[i]};
          hedged_from[g] = r;
          return true;
        }
        return false;
      };
      ssd_reads = std::thread([&, ssd_alternative] {
        im.RunSsd(from_ssd, pending.size(), ssd_alternative, deadline, &ssd_status, &ssd_late);
      });
    }
    const auto dram_deadline_ms = static_cast<uint32_t>(std::min<int64_t>(left_ms, UINT32_MAX));
    if (im.options.hedge_after_ms == 0) {
      im.Run(ops, group_of_op, pending.size(), &group_status, dram_deadline_ms);
    } else {
      // Another complete DRAM replica of group g's key, after the one this pass reads.
      auto alternative = [&](size_t g, std::string_view avoid, std::vector<TransferOp>* out) {
        const size_t i = pending[g];
        const store::ReadGrant& item = got[i];
        for (int r = next_replica[i] + 1; r < Count(item.replicas); ++r) {
          const store::ReplicaLocation& loc = item.replicas[r];
          if (loc.tier == store::Tier::kSsd || loc.node.node_id == avoid || !im.Knows(loc.node)) {
            continue;
          }
          for (const auto& p : pieces[i]) {
            out->push_back(TransferOp{OpCode::kRead, p.local, p.len, loc.node.node_id,
                                      loc.segment_id, loc.offset + p.obj_off});
          }
          hedged_from[g] = r;
          return true;
        }
        return false;
      };
      im.RunHedged(ops, group_of_op, pending.size(), alternative, &group_status, &late,
                   dram_deadline_ms);
    }
    if (ssd_reads.joinable()) {
      ssd_reads.join();
      for (const auto& [g, t] : from_ssd) group_status[g] = ssd_status[g];
      late.insert(late.end(), ssd_late.begin(), ssd_late.end());
    }
    std::vector<size_t> retry;
    std::set<std::string> reported_nodes;
    auto report = [&](size_t i, const store::ReplicaLocation& bad, bool node_level) {
      if (without_master[i]) return;  // the master is away: nothing to tell it
      im.Report(keys[i], got[i].version, bad, node_level);
    };
    // A node so late that other replicas served all it was asked for is reported like one
    // that is unreachable: placed last for a while, nothing dropped.
    for (size_t g : late) {
      const size_t i = pending[g];
      const store::ReplicaLocation& slow = got[i].replicas[next_replica[i]];
      if (reported_nodes.insert(slow.node.node_id).second) report(i, slow, true);
    }
    // Every byte handed to the caller is checked, lease or not, DRAM or SSD: a lease keeps
    // the master from reusing the range, but not a late writer, a node that lost track of its
    // memory, or a node that answers a ReadSsd without writing (docs/store.md). The bytes in
    // CUDA buffers are copied back to host memory for it (Impl::Checksums).
    // Checked as copied: the engine's checksum of the key's only op, with no hedge sent.
    auto copied_checked = [&](size_t g) {
      return crc_asked[g] && op_crcs[g].computed && hedged_from[g] < 0;
    };
    std::vector<const std::vector<Piece>*> to_check;
    for (size_t g = 0; g < pending.size(); ++g) {
      if (group_status[g].ok() && !copied_checked(g)) to_check.push_back(&pieces[pending[g]]);
    }
    std::vector<uint32_t> crcs;
    std::vector<Status> unread;
    im.Checksums(to_check, &crcs, &unread);
    size_t checked = 0;  // the next entry of crcs/unread
    for (size_t g = 0; g < pending.size(); ++g) {
      const size_t i = pending[g];
      const store::ReadGrant& item = got[i];
      Status st = group_status[g];
      bool mismatch = false;
      bool local_copy_failed = false;  // our copy of the key's CUDA buffers for the checksum
      if (st.ok() && copied_checked(g)) {
        if (op_crcs[g].crc32c != item.checksum) {
          st = Status::IoError("checksum mismatch: the replica's bytes are not the object's");
          mismatch = true;
        }
      } else if (st.ok()) {
        const size_t c = checked++;
        if (!unread[c].ok()) {
          st = unread[c];
          local_copy_failed = true;
        } else if (crcs[c] != item.checksum) {
          st = Status::IoError("checksum mismatch: the replica's bytes are not the object's");
          mismatch = true;
        }
      }
      if (st.ok()) {
        const uint64_t size = std::accumulate(item.sizes.begin(), item.sizes.end(), uint64_t{0});
        // Hedges read a replica of the tier of the one they stand in for.
        ++(item.replicas[next_replica[i]].tier == store::Tier::kSsd ? hits_ssd : hits_dram);
        hit_bytes += size;
        if (without_master[i]) ++hits_without_master;
        result[i] = size;
        continue;
      }
      const store::ReplicaLocation& bad = item.replicas[next_replica[i]];
      // A node that is gone, frozen or replaced fails every key it holds; the master learns
      // that from its heartbeats (TTL) or re-registration, and one report per key would only
      // delay this get: one report per node and pass marks it suspect (placed last until it
      // recovers or expires) and drops nothing: this client's view of the network is not
      // proof that the replica is gone (other readers may reach it; a frozen node resumes).
      // Replica-level faults (bad bytes, a range the node does not hold) are reported per key
      // and drop that replica: only the reader can see them.
      const bool node_level = NodeLevel(st);
      // A copy of our own CUDA buffers that failed says nothing about the replica, and
      // another replica would meet the same device: the key fails with it, nothing reported.
      if (local_copy_failed) {
        result[i] =
            st.WithContext("checking the bytes read from the replica on " + bad.node.node_id);
        continue;
      }
      // Says nothing about the replica (a busy node, our own memory, a node that could not
      // write back to us, a node this client could not learn about and so never asked): move
      // on without reporting it. An I/O error of a transfer into CUDA buffers may be one of
      // our device's copies (a transport staging device memory through host memory) as well
      // as the node's: it is not held against the replica either.
      const bool not_the_replica =
          st.Is(StatusCode::kBackpressure) || st.Is(StatusCode::kNotRegistered) ||
          st.Is(StatusCode::kUnavailable) || !im.Knows(bad.node) ||
          (st.Is(StatusCode::kIoError) && !mismatch && OnDevice(pieces[i]));
      if (!not_the_replica && (!node_level || reported_nodes.insert(bad.node.node_id).second)) {
        report(i, bad, node_level);
      }
      result[i] = st.WithContext("replica on " + bad.node.node_id);
      // A failed key whose hedge was sent failed there too: the next pass skips that replica.
      next_replica[i] = std::max(next_replica[i], hedged_from[g]) + 1;
      if (next_replica[i] < Count(item.replicas)) retry.push_back(i);
    }
    pending.swap(retry);
  }
  im.counters.GetHits(hits_dram, hits_ssd, hit_bytes);
  im.counters.GetsWithoutMaster(hits_without_master);
  return result;
}

namespace {

Result<std::vector<bool>> ExistsUncounted(StoreClient::Impl& im,
                                          std::span<const std::string> keys) {
  if (keys.size() > store::kMaxKeysPerCall) {
    std::vector<bool> all;
    all.reserve(keys.size());
    for (size_t begin = 0; begin < keys.size(); begin += store::kMaxKeysPerCall) {
      Result<std::vector<bool>> part = ExistsUncounted(
          im, keys.subspan(begin, std::min(keys.size() - begin, store::kMaxKeysPerCall)));
      if (!part.ok()) return part.status();
      all.insert(all.end(), part->begin(), part->end());
    }
    return all;
  }
  // Every key remembered: the master is asked once, within master_wait_ms; away, the nodes
  // holding the remembered replicas answer (docs/store.md "Reads while the master is away").
  if (!im.Known(keys, nullptr)) return im.master->Exists(keys);
  Status away;
  if (im.MasterAwayNow()) {
    away = Status::PeerUnreachable("the master failed a call within master_wait_ms moments ago")
               .WithOrigin(StatusOrigin::kMaster);
  } else {
    Result<std::vector<bool>> r = im.master->Exists(keys, im.options.master_wait_ms);
    if (r.ok() || !MasterAway(r.status())) return r;
    away = r.status();
    im.MarkMasterAway();
  }
  std::vector<std::optional<store::ReadGrant>> recalled;
  im.Recall(keys, &recalled);
  std::vector<store::ReadGrant> got;
  std::vector<bool> have;
  im.ConfirmRecalled(keys, recalled, &got, &have, away);
  std::vector<bool> out(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!got[i].status.ok() && !got[i].status.IsNotFound()) return got[i].status;
    out[i] = got[i].status.ok();
  }
  return out;
}

std::vector<Status> RemoveUncounted(StoreClient::Impl& im, std::span<const std::string> keys) {
  if (keys.size() > store::kMaxKeysPerCall) {
    return BySlices<Status>(keys.size(), [&](size_t begin, size_t count) {
      return RemoveUncounted(im, keys.subspan(begin, count));
    });
  }
  Result<std::vector<Status>> removed = im.master->Remove(keys);
  if (!removed.ok()) return std::vector<Status>(keys.size(), removed.status());
  return std::move(removed).value();
}

}  // namespace

Result<std::vector<bool>> StoreClient::BatchExists(std::span<const std::string> keys) {
  const auto start = store::ClientCounters::Clock::now();
  Result<std::vector<bool>> result = ExistsUncounted(*impl_, keys);
  if (!result.ok()) impl_->counters.Error(StoreOp::kExists, result.status().code(), keys.size());
  impl_->counters.Call(StoreOp::kExists, keys.size(), store::ClientCounters::Clock::now() - start);
  return result;
}

// A remove of this many objects or more (or a RemoveAll) asks the storage nodes of this process
// to heartbeat now: the master queues their frees for their next heartbeat, up to a second
// away, and an embedded client's next puts and gets would otherwise share the CPU with
// applying them (docs/store.md "Commits to a node in the caller's own process"). Fewer frees
// wait for the regular heartbeat: a heartbeat per small remove would double the master's calls.
constexpr uint64_t kFreesWorthAHeartbeat = 256;

std::vector<Status> StoreClient::BatchRemove(std::span<const std::string> keys) {
  const auto start = store::ClientCounters::Clock::now();
  impl_->Forget(keys);  // whatever the outcome: a get of them asks the master
  std::vector<Status> result = RemoveUncounted(*impl_, keys);
  uint64_t removed = 0;
  for (const Status& st : result) {
    if (st.ok()) {
      ++removed;
    } else {
      impl_->counters.Error(StoreOp::kRemove, st.code());
    }
  }
  impl_->counters.Removed(removed);
  if (removed >= kFreesWorthAHeartbeat)
    store::HeartbeatLocalNodesNow(impl_->options.engine.cluster_token);
  impl_->counters.Call(StoreOp::kRemove, keys.size(), store::ClientCounters::Clock::now() - start);
  return result;
}

StoreClientStats StoreClient::stats() const { return impl_->counters.Snapshot(); }

void StoreClient::ResetStats() { impl_->counters.Reset(); }

const char* StoreOpName(StoreOp op) {
  switch (op) {
    case StoreOp::kGet:
      return "get";
    case StoreOp::kPut:
      return "put";
    case StoreOp::kRemove:
      return "remove";
    case StoreOp::kExists:
      return "exists";
  }
  return "unknown";
}

Result<uint64_t> StoreClient::CopyObject(std::string_view key, const std::vector<std::string>& to) {
  return impl_->master->Place(key, to, "");
}

Result<uint64_t> StoreClient::MoveObject(std::string_view key, const std::string& from,
                                         const std::string& to) {
  if (from.empty()) return Status::InvalidArgument("MoveObject: no source node");
  Result<uint64_t> id = impl_->master->Place(key, {to}, from);
  // Where this client remembers it (reads without the master) is about to change.
  if (id.ok()) impl_->Forget(std::vector<std::string>{std::string(key)});
  return id;
}

Result<PlacementTask> StoreClient::QueryTask(uint64_t task_id) {
  return impl_->master->QueryPlacement(task_id);
}

Status StoreClient::RemoveAll() {
  impl_->ForgetAll();
  Status st = impl_->master->RemoveAll(impl_->admin_key);
  if (st.ok()) store::HeartbeatLocalNodesNow(impl_->options.engine.cluster_token);
  return st;
}

Result<uint64_t> StoreClient::RemoveByRegex(std::string_view pattern) {
  Result<store::KeyPattern> re = store::KeyPattern::Compile(pattern);  // named before any call
  if (!re.ok()) return re.status();
  impl_->ForgetMatching(*re);
  Result<uint64_t> removed = impl_->master->RemoveByRegex(pattern, impl_->admin_key);
  // Again once removed: a get that ran meanwhile may have remembered a grant of a removed key.
  if (removed.ok() && *removed > 0) impl_->ForgetMatching(*re);
  if (removed.ok() && *removed >= kFreesWorthAHeartbeat) {
    store::HeartbeatLocalNodesNow(impl_->options.engine.cluster_token);
  }
  return removed;
}

Status StoreClient::Put(std::string_view key, std::string_view value) {
  return impl_->PutStaged(key, value, /*overwrite=*/false);
}

Status StoreClient::Upsert(std::string_view key, std::string_view value) {
  return impl_->PutStaged(key, value, /*overwrite=*/true);
}

Status StoreClient::Impl::PutStaged(std::string_view key, std::string_view value, bool overwrite) {
  const char* name = overwrite ? "Upsert" : "Put";
  if (value.size() > kStagingBytes) {
    counters.Error(StoreOp::kPut, StatusCode::kInvalidArgument);  // a put that failed
    counters.Call(StoreOp::kPut, 1, store::ClientCounters::Clock::duration::zero());
    return Status::InvalidArgument(std::string(name) + ": value larger than the staging area (" +
                                   std::to_string(kStagingBytes) + " bytes); use Batch" + name +
                                   "From on registered memory");
  }
  std::lock_guard<std::mutex> lock(staging_mu);
  std::memcpy(staging.get(), value.data(), value.size());
  std::string k(key);
  std::vector<std::vector<BufferRef>> bufs = {{BufferRef{staging.get(), value.size()}}};
  return PutCall(std::span(&k, 1), bufs, overwrite)[0];
}

Result<std::string> StoreClient::Get(std::string_view key) {
  std::lock_guard<std::mutex> lock(impl_->staging_mu);
  std::string k(key);
  std::vector<std::vector<BufferRef>> bufs = {{BufferRef{impl_->staging.get(), kStagingBytes}}};
  Result<uint64_t> n = std::move(BatchGetInto(std::span(&k, 1), bufs)[0]);
  if (!n.ok()) return n.status();
  return std::string(impl_->staging.get(), n.value());
}

}  // namespace kvbridge

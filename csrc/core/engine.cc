#include "kvbridge/engine.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <shared_mutex>
#include <span>
#include <tuple>
#include <unordered_map>

#include "core/circuit_breaker.h"
#include "core/cuda_driver.h"
#include "core/descriptor.h"
#include "core/handshake.h"
#include "core/memory_kinds.h"
#include "core/path_choice.h"
#include "core/plugin_host.h"
#include "core/plugin_loader.h"
#include "core/transport_instance.h"
#include "util/checksum.h"
#include "util/clock.h"
#include "util/host_key.h"
#include "util/logging.h"
#include "util/worker_pool.h"

namespace kvbridge {

using core::CircuitBreaker;
using core::Descriptor;
using core::PluginRegistry;
using core::SegmentDesc;
using core::TransportInstance;

std::string PeerId::ToString() const {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "@%016llx", static_cast<unsigned long long>(incarnation));
  return node_id + buf;
}

namespace {

constexpr size_t kWaitSlots = 64;
constexpr size_t kReapedIdsKept = 4096;  // ids of reaped batches remembered for Poll's answer

struct LocalRegion {
  SegmentId id = 0;
  uintptr_t addr = 0;
  uint64_t length = 0;
  MemoryKind kind = MemoryKind::kHost;
  // kCuda: the device the memory lives on (checked at registration, core/memory_kinds.h);
  // published in the segment's descriptor entry (version 3).
  int device_id = -1;
  std::map<std::string, std::string> rkeys;  // transport name -> remote key
  // Transports that registered the region for this process's ops only (KVB_REG_LOCAL_ONLY):
  // their keys are left out of the descriptor, so peers reach the region over other paths.
  std::set<std::string> local_only;
};

using SegmentMap = std::unordered_map<uint64_t, SegmentDesc>;

// One way to reach a peer incarnation: a transport both sides speak, with its own transport
// peer handle, circuit breaker and counters (docs/transfer-engine.md "Several transports per
// peer").
struct Path {
  TransportInstance* transport = nullptr;
  uint32_t transport_index = 0;  // in Impl::transports (the local preference order)
  std::unique_ptr<TransportInstance::Peer> tpeer;  // remove_peer when the path dies
  std::string endpoints;  // where the transport reaches it (from its descriptor; under peers_mu)
  CircuitBreaker breaker;
  std::atomic<uint64_t> ops_ok{0}, ops_failed{0}, fast_failed{0}, failed_over_from{0};

  Path(TransportInstance* t, uint32_t index, const CircuitBreaker::Config& cfg)
      : transport(t), transport_index(index), breaker(cfg) {}
};

// One known peer incarnation. Batches hold it by shared_ptr, so the transport peer handles
// live until the last batch using it is collected. `paths` is fixed for the record's life (a
// new incarnation, or a permitted move, makes a new record).
struct PeerRecord {
  PeerId id;
  std::vector<std::unique_ptr<Path>> paths;    // in local preference order
  std::shared_ptr<const SegmentMap> segments;  // replaced wholesale on update (under peers_mu)
  std::atomic<bool> stale{false};
  std::atomic<uint64_t> fast_failed{0};   // ops refused because no path's breaker admitted
  std::atomic<uint64_t> local_copied{0};  // ops done by a memory copy (an engine of this process)

  explicit PeerRecord(PeerId pid) : id(std::move(pid)) {}
};

// Completion notifications land here; the slot outlives every transport, so a late
// on_complete never touches freed memory.
struct WaitSlot {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t seq = 0;
};

void OnTransportComplete(void* user) {
  auto* slot = static_cast<WaitSlot*>(user);
  {
    std::lock_guard<std::mutex> lock(slot->mu);
    ++slot->seq;
  }
  slot->cv.notify_all();
}

// The ops of one batch posted to one peer over one path.
struct SubRequest {
  std::shared_ptr<PeerRecord> peer;
  Path* path = nullptr;  // one of peer->paths
  // Released (cancelled first if not final) when reset or destroyed, before `peer` dies.
  std::unique_ptr<TransportInstance::Request> req;
  std::vector<uint32_t> op_index;
  // Paths (indices into peer->paths) its failed ops may fail over to, in order; with some,
  // `xops` keeps the posted ops for re-posting.
  std::vector<uint32_t> next_paths;
  std::vector<kvb_xfer_op_t> xops;
  bool final = false;
  bool cancelled_by_deadline = false;
  bool outcome_recorded = false;  // its failure was recorded on the path when it failed over
  kvb_status_t status = KVB_IN_PROGRESS;
};

// Transports fail their own requests at the deadline (it is in every post); the engine cancels
// what is still open this long after it, as a backstop. Cancelling right at the deadline would
// race the transport's own answer, and a transport's cancel may rightly wait (ucx: while UCX
// holds a READ's memory on a same-host endpoint to a frozen peer) where its deadline does not.
constexpr uint64_t kDeadlineBackstopGraceNs = 50'000'000;

struct Batch {
  BatchId id = 0;
  uint64_t deadline_ns = 0;
  uint64_t backstop_ns() const { return deadline_ns + kDeadlineBackstopGraceNs; }
  uint64_t progress_timeout_ns = 0;
  WaitSlot* slot = nullptr;
  std::mutex mu;  // serializes poll passes, cancel and collection of this batch
  std::vector<Status> op_status;
  std::vector<SubRequest> subs;
  std::vector<SegmentId> local_segments;  // the local regions its ops use (sorted, unique)
  // Per op, the paths it tried ("mock: PEER_UNREACHABLE (...)"); empty until an op fails over.
  std::vector<std::string> history;
  bool cancelled = false;  // Cancel or DeregisterMemory: nothing fails over any more
  bool collected = false;
  // Found final by a sweep (SweepFinished) before anyone polled it: its transport requests
  // are released and op_status waits for Poll/Wait, or for reaping (max_unpolled_batches).
  bool finished = false;
  bool reaped = false;  // reaped unpolled: collected, its result dropped
  // Ops on host memory that asked for their checksum (TransferOp::checksum), by op; empty
  // when none did. A transport with KVB_TCAP_OP_CRC32C fills op_crcs (never resized once ops
  // are posted: transports hold pointers into it); FinishOp copies a filled one to crc_to.
  std::vector<kvb_op_crc_t> op_crcs;
  std::vector<OpChecksum*> crc_to;
};

std::string DefaultNodeId() {
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "host");
  return std::string(host) + "-" + std::to_string(getpid());
}

uint64_t DrawIncarnation() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return v;
}

// Outcomes that count against a path's breaker (and, when ops fail over, every path failure).
bool IsPeerFailure(kvb_status_t code) {
  return code == KVB_ERR_PEER_UNREACHABLE || code == KVB_ERR_PROGRESS_TIMEOUT ||
         code == KVB_ERR_DEADLINE_EXCEEDED;
}

// Outcomes after which an op may be re-posted on the peer's next path. Not STALE_PEER (the
// peer restarted: every path reaches the new process), DEADLINE_EXCEEDED, CANCELLED, or a
// refusal by a live peer (NOT_REGISTERED, OUT_OF_BOUNDS, ...).
bool IsPathFailure(kvb_status_t code) {
  return code == KVB_ERR_PEER_UNREACHABLE || code == KVB_ERR_PROGRESS_TIMEOUT ||
         code == KVB_ERR_BACKPRESSURE || code == KVB_ERR_PROTOCOL;
}

// "mock: PEER_UNREACHABLE (mock: injected fault PEER_UNREACHABLE)" or "mock_b: OK".
std::string Attempt(const Path& path, kvb_status_t code, std::string_view msg) {
  std::string s = path.transport->name() + ": " + StatusCodeName(StatusCode(code));
  if (code != KVB_OK && !msg.empty()) s += " (" + std::string(msg) + ")";
  return s;
}

}  // namespace

struct TransferEngine::Impl {
  EngineOptions options;
  PeerId self;
  std::string host_key = util::HostKey();     // published in the descriptor (version 3)
  std::shared_ptr<core::PluginHost> plugins;  // shared with the process's other users
  std::vector<std::unique_ptr<TransportInstance>> transports;
  CircuitBreaker::Config breaker_config;

  std::mutex admin_mu;  // serializes Register/Deregister (calls into plugins, never data path)
  mutable std::shared_mutex regions_mu;
  std::map<uintptr_t, LocalRegion> regions;  // by start address
  uint64_t next_segment_id = 1;

  mutable std::shared_mutex peers_mu;
  std::unordered_map<std::string, std::shared_ptr<PeerRecord>> peers;

  std::mutex batches_mu;
  std::unordered_map<BatchId, std::shared_ptr<Batch>> batches;
  // Under batches_mu. Ids in `batches` found final by a sweep and not yet polled (oldest
  // first), and the last kReapedIdsKept ids reaped from among them, so that a late Poll of one
  // says what happened (an older one gets the "unknown batch" answer, which mentions reaping).
  std::set<BatchId> finished_ids;
  std::set<BatchId> reaped_ids;
  std::atomic<BatchId> next_batch_id{1};
  std::array<WaitSlot, kWaitSlots> wait_slots;
  // Stopped first in ~Impl (declared last): it calls LocalDescriptor().
  std::unique_ptr<core::RequestServer> handshake;

  ~Impl();
  TransportInstance* FindTransport(std::string_view name) const;
  // Local region containing [addr, addr+len), or nullptr. Caller holds regions_mu.
  const LocalRegion* FindLocal(uintptr_t addr, uint64_t len) const;
  std::shared_ptr<Batch> FindBatch(BatchId id);
  // One non-blocking pass over the batch's unfinished subs; ops that failed on a path are
  // re-posted on the next one (failover). Returns true when all are final.
  bool PollPass(Batch& b);
  // Posts ops (op_index and xops, in the same order) to `peer` over the first of `candidates`
  // (indices into peer->paths) whose breaker admits; a post refused with a path failure moves
  // on to the next. Appends a SubRequest and returns true, or gives every op its final status
  // and returns false. `failure`: why the ops are re-posted (failover), or OK on first post.
  bool Dispatch(Batch& b, const std::shared_ptr<PeerRecord>& peer,
                std::span<const uint32_t> candidates, std::vector<uint32_t> op_index,
                std::vector<kvb_xfer_op_t> xops, const Status& failure);
  // Whether failed ops of `b` may be re-posted now: path_failover on, the batch not cancelled,
  // and at least failover_min_budget_ms left before its deadline.
  bool MayFailOver(const Batch& b, uint64_t now) const;
  // Appends one attempt ("mock: PEER_UNREACHABLE (...)") to op `op`'s path history.
  static void NoteAttempt(Batch& b, uint32_t op, std::string attempt);
  // Sets op `op`'s final status: `code` with `msg` from `path` (null when no path took it),
  // its message prefixed with the peer and, if the op failed over, its whole path history.
  static void FinishOp(Batch& b, uint32_t op, const PeerRecord& peer, const Path* path,
                       kvb_status_t code, const std::string& msg);
  void CancelSubs(Batch& b, bool by_deadline);
  // Releases the batch's transport requests (recording their outcome on each peer); idempotent.
  void Release(Batch& b);
  BatchResult Collect(Batch& b);
  // Batches in flight: submitted and not yet found final. Caller holds batches_mu.
  size_t InflightLocked() const { return batches.size() - finished_ids.size(); }
  // Submit's bound on batches in flight (max_inflight_batches): OK or BACKPRESSURE. At the
  // bound it first sweeps for batches that finished meanwhile.
  Status AdmitBatch();
  // Polls every batch in flight once (without waiting on any lock a poller holds), moves the
  // final ones to finished_ids, and reaps the oldest finished ones past max_unpolled_batches.
  void SweepFinished();
  // block: wait until final or until_ns (0 = no limit); else return at once.
  std::optional<BatchResult> PollOrWait(BatchId id, bool block, uint64_t until_ns = 0);

  // The engines of this process by incarnation (local_copy). An engine is listed once created
  // and unlisted first thing when destroyed; a copy into or out of one holds the list's lock
  // shared, so the engine outlives it.
  static std::shared_mutex& ProcessMu();
  static std::unordered_map<uint64_t, Impl*>& ProcessEngines();
  // How many are listed, read without the lock: a process with one engine (the usual client)
  // never takes it on the data path.
  static std::atomic<size_t> process_engines;
  // When `peer` is an engine of this process (same node id and incarnation, same cluster
  // token): the ops of `indices` on host memory at both ends are copied now, their status set
  // (OK, or NOT_REGISTERED / OUT_OF_BOUNDS against the peer's live registrations). Returns the
  // ops left for a transport (all of them when the peer is not in this process).
  std::vector<uint32_t> CopyInProcess(Batch& b, PeerRecord& peer, std::span<const TransferOp> ops,
                                      std::vector<uint32_t> indices,
                                      const std::vector<uint32_t>& local_kind);
  // The threads CopyInProcess shares a large batch's copies with (local_copy_threads).
  // Set in Create, after the options.
  std::unique_ptr<util::WorkerPool> copy_pool;
};

std::atomic<size_t> TransferEngine::Impl::process_engines{0};

std::shared_mutex& TransferEngine::Impl::ProcessMu() {
  static auto* mu = new std::shared_mutex;  // never destroyed: engines may outlive statics
  return *mu;
}

std::unordered_map<uint64_t, TransferEngine::Impl*>& TransferEngine::Impl::ProcessEngines() {
  static auto* engines = new std::unordered_map<uint64_t, Impl*>;
  return *engines;
}

namespace {

// One op's copy in CopyInProcess; `crc` set: the CRC-32C of the bytes is wanted there.
struct CopyJob {
  char* dst;
  const char* src;
  uint64_t len;
  OpChecksum* crc;
};

// The copies (with the CRCs asked for), shared with the pool's threads from 1 MiB in all.
// A batch that moves at least kStreamingBatchBytes writes its objects of kStreamingOpBytes
// and more with stores that bypass the cache (util::CopyStores::kStreaming): the batch does
// not fit in L2 anyway, and the reads for ownership a cached store costs are what bounds such a
// copy (8 MiB of 64 KiB objects with their CRCs: 9.5 GB/s copied then checksummed from the
// cache, 15-16 GB/s fused with streaming stores, on this project's test VM). Smaller objects
// keep cached stores (a streaming 1 KiB copy waits on its fence: half the speed).
constexpr uint64_t kStreamingBatchBytes = 1 << 20, kStreamingOpBytes = 4 << 10;

void RunCopies(std::span<const CopyJob> jobs, util::WorkerPool& pool) {
  std::vector<uint64_t> lengths;
  lengths.reserve(jobs.size());
  uint64_t total = 0;
  for (const CopyJob& j : jobs) {
    lengths.push_back(j.len);
    total += j.len;
  }
  const bool large_batch = total >= kStreamingBatchBytes;
  const std::vector<uint32_t> crcs =
      util::CrcInParts(pool, lengths, [&](size_t i, uint64_t at, uint64_t len) -> uint32_t {
        const CopyJob& j = jobs[i];
        if (j.crc != nullptr) {
          const bool streaming = large_batch && j.len >= kStreamingOpBytes;
          return util::CopyCrc32c(
              j.dst + at, j.src + at, len, 0,
              streaming ? util::CopyStores::kStreaming : util::CopyStores::kCached);
        }
        std::memcpy(j.dst + at, j.src + at, len);
        return 0;
      });
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (jobs[i].crc == nullptr) continue;
    jobs[i].crc->crc32c = crcs[i];
    jobs[i].crc->computed = true;
  }
}

}  // namespace

std::vector<uint32_t> TransferEngine::Impl::CopyInProcess(Batch& b, PeerRecord& peer,
                                                          std::span<const TransferOp> ops,
                                                          std::vector<uint32_t> indices,
                                                          const std::vector<uint32_t>& local_kind) {
  std::shared_lock<std::shared_mutex> list_lock(ProcessMu());
  auto eit = ProcessEngines().find(peer.id.incarnation);
  if (eit == ProcessEngines().end() || eit->second == this) return indices;
  const Impl& target = *eit->second;
  // A token mismatch goes through the transport, which refuses it the way any peer would.
  if (target.self.node_id != peer.id.node_id ||
      target.options.cluster_token != options.cluster_token) {
    return indices;
  }
  // Held through the copies: the peer's DeregisterMemory erases a region under the exclusive
  // lock (and holds nothing else then), so no region is freed under a copy.
  std::shared_lock<std::shared_mutex> regions_lock(target.regions_mu);
  std::vector<uint32_t> rest;
  std::vector<CopyJob> copies;
  const LocalRegion* r = nullptr;
  for (uint32_t i : indices) {
    const TransferOp& op = ops[i];
    if (r == nullptr || r->id != op.remote_segment) {
      r = nullptr;
      for (const auto& [addr, region] : target.regions) {
        if (region.id == op.remote_segment) r = &region;
      }
    }
    if (r == nullptr) {
      b.op_status[i] = Status::NotRegistered("peer " + peer.id.ToString() + " has no segment " +
                                             std::to_string(op.remote_segment) + " (deregistered)");
      continue;
    }
    if (r->kind != MemoryKind::kHost || local_kind[i] != static_cast<uint32_t>(MemoryKind::kHost)) {
      rest.push_back(i);  // device memory: a transport (or its bounce) moves it
      continue;
    }
    if (op.remote_offset > r->length || op.length > r->length - op.remote_offset) {
      b.op_status[i] = Status::OutOfBounds(
          "op " + std::to_string(i) + ": [" + std::to_string(op.remote_offset) + ", +" +
          std::to_string(op.length) + ") is outside segment " + std::to_string(op.remote_segment) +
          " of " + std::to_string(r->length) + " bytes");
      continue;
    }
    auto* remote = reinterpret_cast<char*>(r->addr + op.remote_offset);
    auto* local = static_cast<char*>(op.local_addr);
    if (op.opcode == OpCode::kWrite) {
      copies.push_back({remote, local, op.length, op.checksum});
    } else {
      copies.push_back({local, remote, op.length, op.checksum});
    }
    b.op_status[i] = Status::OK();
  }
  RunCopies(copies, *copy_pool);
  peer.local_copied.fetch_add(copies.size(), std::memory_order_relaxed);
  return rest;
}

TransferEngine::Impl::~Impl() {
  handshake.reset();
  std::unordered_map<BatchId, std::shared_ptr<Batch>> left;
  {
    std::lock_guard<std::mutex> lock(batches_mu);
    left.swap(batches);
  }
  for (auto& [id, b] : left) {
    std::lock_guard<std::mutex> lock(b->mu);
    b->subs.clear();  // each request cancelled (unless final) and released
  }
  left.clear();
  peers.clear();       // remove_peer on each transport
  transports.clear();  // destroy each instance
}

TransportInstance* TransferEngine::Impl::FindTransport(std::string_view name) const {
  for (const auto& t : transports) {
    if (t->name() == name) return t.get();
  }
  return nullptr;
}

const LocalRegion* TransferEngine::Impl::FindLocal(uintptr_t addr, uint64_t len) const {
  auto it = regions.upper_bound(addr);
  if (it == regions.begin()) return nullptr;
  --it;
  const LocalRegion& r = it->second;
  if (addr < r.addr || addr - r.addr > r.length || len > r.length - (addr - r.addr)) {
    return nullptr;
  }
  return &r;
}

std::shared_ptr<Batch> TransferEngine::Impl::FindBatch(BatchId id) {
  std::lock_guard<std::mutex> lock(batches_mu);
  auto it = batches.find(id);
  return it == batches.end() ? nullptr : it->second;
}

bool TransferEngine::Impl::MayFailOver(const Batch& b, uint64_t now) const {
  if (!options.path_failover || b.cancelled) return false;
  return b.deadline_ns == 0 ||
         (b.deadline_ns > now &&
          b.deadline_ns - now >= util::MsToNs(options.failover_min_budget_ms));
}

void TransferEngine::Impl::NoteAttempt(Batch& b, uint32_t op, std::string attempt) {
  if (b.history.empty()) b.history.resize(b.op_status.size());
  std::string& h = b.history[op];
  h += (h.empty() ? "" : "; then ") + attempt;
}

void TransferEngine::Impl::FinishOp(Batch& b, uint32_t op, const PeerRecord& peer, const Path* path,
                                    kvb_status_t code, const std::string& msg) {
  const bool moved = !b.history.empty() && !b.history[op].empty();
  if (moved && path != nullptr) NoteAttempt(b, op, Attempt(*path, code, msg));
  b.op_status[op] = code == KVB_OK ? Status::OK()
                                   : Status::FromAbi(code, "peer " + peer.id.ToString() + ": " +
                                                               (moved ? b.history[op] : msg));
  if (code == KVB_OK && !b.crc_to.empty() && b.crc_to[op] != nullptr &&
      b.op_crcs[op].computed != 0) {
    *b.crc_to[op] = OpChecksum{.crc32c = b.op_crcs[op].crc32c, .computed = true};
  }
}

bool TransferEngine::Impl::PollPass(Batch& b) {
  bool all_final = true;
  // By index: a failover appends to b.subs.
  for (size_t k = 0; k < b.subs.size(); ++k) {
    SubRequest& s = b.subs[k];
    if (s.final) continue;
    TransportInstance::PollResult polled = s.path->transport->Poll(*s.req);
    if (!polled.final) {
      all_final = false;
      continue;
    }
    const auto st = static_cast<kvb_status_t>(polled.status.code());
    const std::string& err = polled.status.message();
    s.final = true;
    s.status = st;
    const bool failover =
        !s.next_paths.empty() && IsPathFailure(st) && MayFailOver(b, util::MonoNs());
    std::vector<uint32_t> again;  // ops to re-post, and their xops
    std::vector<kvb_xfer_op_t> again_xops;
    uint64_t ok = 0;
    for (size_t i = 0; i < s.op_index.size(); ++i) {
      kvb_status_t c = polled.op_codes[i];
      if (c == KVB_IN_PROGRESS) c = st == KVB_OK ? KVB_ERR_INTERNAL : st;  // defensive
      if (c == KVB_ERR_CANCELLED && s.cancelled_by_deadline) c = KVB_ERR_DEADLINE_EXCEEDED;
      std::string msg;
      if (c != KVB_OK) {
        msg = (c == st && !err.empty()) ? err : StatusCodeName(StatusCode(c));
        if (c == KVB_ERR_DEADLINE_EXCEEDED && s.cancelled_by_deadline) {
          msg = "batch deadline passed before the op finished";
        }
      } else {
        ++ok;
      }
      // An op the transport cancelled because its request failed on the path goes along.
      const bool path_failed = IsPathFailure(c) || c == KVB_ERR_CANCELLED;
      if (failover && path_failed &&
          (s.xops[i].opcode == KVB_OP_READ || options.path_failover_writes)) {
        NoteAttempt(b, s.op_index[i], Attempt(*s.path, c, msg));
        again.push_back(s.op_index[i]);
        again_xops.push_back(s.xops[i]);
        continue;
      }
      FinishOp(b, s.op_index[i], *s.peer, s.path, c, msg);
    }
    s.path->ops_ok.fetch_add(ok);
    s.path->ops_failed.fetch_add(s.op_index.size() - ok);
    if (again.empty()) continue;
    // The failed path's breaker records the failure now (not in Release), the serving path's
    // its success when that sub is released.
    s.outcome_recorded = true;
    s.path->breaker.RecordFailure(util::MonoNs());
    s.path->failed_over_from.fetch_add(again.size());
    KVB_LOG(DEBUG) << "batch " << b.id << ": " << again.size() << " op(s) to peer "
                   << s.peer->id.ToString() << " failed on " << s.path->transport->name() << " ("
                   << polled.status.ToString() << "); failing over";
    const std::shared_ptr<PeerRecord> peer = s.peer;
    const std::vector<uint32_t> next = std::move(s.next_paths);
    s.xops.clear();
    // `s` dangles from here: Dispatch appends to b.subs.
    if (Dispatch(b, peer, next, std::move(again), std::move(again_xops), polled.status)) {
      all_final = false;
    }
  }
  return all_final;
}

bool TransferEngine::Impl::Dispatch(Batch& b, const std::shared_ptr<PeerRecord>& peer,
                                    std::span<const uint32_t> candidates,
                                    std::vector<uint32_t> op_index, std::vector<kvb_xfer_op_t> xops,
                                    const Status& failure) {
  const TransportInstance::PostOptions popts{.deadline_ns = b.deadline_ns,
                                             .progress_timeout_ns = b.progress_timeout_ns,
                                             .on_complete = OnTransportComplete,
                                             .user = b.slot};
  std::vector<uint32_t> refused;  // candidates whose breaker refused
  kvb_status_t last = static_cast<kvb_status_t>(failure.code());  // KVB_OK on first post
  // Ops that ask for their checksum: their slots cleared before each post, so that only the
  // path that completes an op speaks for it (a transport writes a slot only for an op that ends
  // OK, and those are never posted again; this keeps a misbehaving one from leaving a stale
  // checksum for the next path), and posted without the ask to a transport that takes none.
  bool asks_crc = false;
  for (kvb_xfer_op_t& x : xops) {
    if (x.crc == nullptr) continue;
    x.crc->computed = 0;
    asks_crc = true;
  }
  std::vector<kvb_xfer_op_t> without_crc;
  for (size_t k = 0; k < candidates.size(); ++k) {
    Path& path = *peer->paths[candidates[k]];
    const uint64_t now = util::MonoNs();
    if (!path.breaker.Allow(now)) {
      path.fast_failed.fetch_add(op_index.size());
      refused.push_back(candidates[k]);
      continue;
    }
    std::span<const kvb_xfer_op_t> posted = xops;
    if (asks_crc && (path.transport->caps() & KVB_TCAP_OP_CRC32C) == 0) {
      if (without_crc.empty()) {
        without_crc = xops;
        for (kvb_xfer_op_t& x : without_crc) {
          x.flags &= ~KVB_XOP_CRC32C;
          x.crc = nullptr;
        }
      }
      posted = without_crc;
    }
    Result<std::unique_ptr<TransportInstance::Request>> req =
        path.transport->Post(*path.tpeer, posted, popts);
    if (req.ok()) {
      SubRequest sub;
      sub.peer = peer;
      sub.path = &path;
      sub.req = std::move(req).value();
      sub.op_index = std::move(op_index);
      if (options.path_failover) {
        sub.next_paths.assign(candidates.begin() + k + 1, candidates.end());
        sub.next_paths.insert(sub.next_paths.end(), refused.begin(), refused.end());
        if (!sub.next_paths.empty()) sub.xops = std::move(xops);
      }
      b.subs.push_back(std::move(sub));
      return true;
    }
    // Refused at post: nothing was queued, so re-posting elsewhere (WRITEs too) is safe.
    const auto code = static_cast<kvb_status_t>(req.status().code());
    const std::string& msg = req.status().message();
    const bool fail_over =
        IsPathFailure(code) && k + 1 < candidates.size() && MayFailOver(b, util::MonoNs());
    if (IsPeerFailure(code) || fail_over) path.breaker.RecordFailure(util::MonoNs());
    path.ops_failed.fetch_add(op_index.size());
    if (!fail_over) {
      for (uint32_t i : op_index) FinishOp(b, i, *peer, &path, code, msg);
      return false;
    }
    path.failed_over_from.fetch_add(op_index.size());
    for (uint32_t i : op_index) NoteAttempt(b, i, Attempt(path, code, msg));
    last = code;
  }
  // Every remaining candidate's breaker refused.
  std::vector<core::PathView> views(peer->paths.size());
  const uint64_t now = util::MonoNs();
  for (uint32_t i : refused) {
    const Path& p = *peer->paths[i];
    views[i] = {.transport = p.transport->name(),
                .consecutive_failures = p.breaker.consecutive_failures(),
                .retry_in_ms = p.breaker.retry_in_ns(now) / 1000000};
  }
  const std::string open = core::CircuitOpenMessage(views, refused, peer->id.ToString());
  if (last == KVB_OK) {  // nothing was tried: fail fast
    peer->fast_failed.fetch_add(op_index.size());
    const Status st = Status::PeerUnreachable(open);
    for (uint32_t i : op_index) b.op_status[i] = st;
    return false;
  }
  for (uint32_t i : op_index) {
    NoteAttempt(b, i, open);
    FinishOp(b, i, *peer, nullptr, last, "");
  }
  return false;
}

void TransferEngine::Impl::CancelSubs(Batch& b, bool by_deadline) {
  if (!by_deadline) b.cancelled = true;
  for (auto& s : b.subs) {
    if (s.final || s.req == nullptr) continue;
    s.cancelled_by_deadline = by_deadline;
    s.path->transport->Cancel(*s.req);
  }
}

void TransferEngine::Impl::Release(Batch& b) {
  const uint64_t now = util::MonoNs();
  for (auto& s : b.subs) {
    PeerRecord& peer = *s.peer;
    kvb_status_t st = s.status;
    if (s.cancelled_by_deadline && st == KVB_ERR_CANCELLED) st = KVB_ERR_DEADLINE_EXCEEDED;
    if (st == KVB_ERR_STALE_PEER) {
      // Any path: the incarnation is gone, and every path reaches the same process.
      if (!peer.stale.exchange(true)) {
        KVB_LOG(WARN) << "peer " << peer.id.ToString()
                      << " is stale (another incarnation answers at its address); its ops fail "
                         "fast until AddPeer() gets the new descriptor";
      }
    } else if (s.outcome_recorded) {
      // Failed over: recorded on its path then.
    } else if (IsPeerFailure(st)) {
      s.path->breaker.RecordFailure(now);
    } else if (st != KVB_ERR_CANCELLED) {
      s.path->breaker.RecordSuccess();  // the peer answered, even if it refused an op
    }
    s.req.reset();
  }
  b.subs.clear();
}

BatchResult TransferEngine::Impl::Collect(Batch& b) {
  Release(b);
  b.collected = true;
  BatchResult r;
  r.op_status = std::move(b.op_status);
  r.op_path_history = std::move(b.history);
  for (const auto& st : r.op_status) {
    if (!st.ok()) {
      r.status = st;
      break;
    }
  }
  return r;
}

Status TransferEngine::Impl::AdmitBatch() {
  const size_t max = options.max_inflight_batches;
  {
    std::lock_guard<std::mutex> lock(batches_mu);
    if (InflightLocked() < max) return Status::OK();
  }
  SweepFinished();
  std::lock_guard<std::mutex> lock(batches_mu);
  const size_t inflight = InflightLocked();
  if (inflight < max) return Status::OK();
  return Status::Backpressure("Submit: " + std::to_string(inflight) +
                              " batches are in flight (max_inflight_batches = " +
                              std::to_string(max) + "); poll, wait for or cancel some first");
}

void TransferEngine::Impl::SweepFinished() {
  std::vector<std::shared_ptr<Batch>> candidates;
  {
    std::lock_guard<std::mutex> lock(batches_mu);
    candidates.reserve(InflightLocked());
    for (const auto& [id, b] : batches) {
      if (!finished_ids.count(id)) candidates.push_back(b);
    }
  }
  std::vector<BatchId> done;
  const uint64_t now = util::MonoNs();
  for (const auto& b : candidates) {
    // A batch another thread is polling, posting or cancelling is skipped, not waited for.
    std::unique_lock<std::mutex> lock(b->mu, std::try_to_lock);
    if (!lock.owns_lock() || b->collected || b->finished) continue;
    bool final = PollPass(*b);
    if (!final && b->deadline_ns != 0 && now >= b->backstop_ns()) {
      CancelSubs(*b, /*by_deadline=*/true);
      final = PollPass(*b);
    }
    if (!final) continue;
    Release(*b);
    b->finished = true;
    done.push_back(b->id);
  }
  std::vector<std::shared_ptr<Batch>> reaped;
  {
    std::lock_guard<std::mutex> lock(batches_mu);
    for (BatchId id : done) {
      if (batches.count(id)) finished_ids.insert(id);  // else polled meanwhile
    }
    while (finished_ids.size() > options.max_unpolled_batches) {
      const BatchId oldest = *finished_ids.begin();
      finished_ids.erase(finished_ids.begin());
      auto it = batches.find(oldest);
      reaped.push_back(std::move(it->second));
      batches.erase(it);
      reaped_ids.insert(oldest);
      if (reaped_ids.size() > kReapedIdsKept) reaped_ids.erase(reaped_ids.begin());
    }
  }
  if (reaped.empty()) return;
  KVB_LOG(WARN) << "reaped " << reaped.size() << " finished batch(es) nobody polled (ids "
                << reaped.front()->id << ".." << reaped.back()->id
                << "): more than max_unpolled_batches (" << options.max_unpolled_batches
                << ") waited; their results are dropped";
  for (const auto& b : reaped) {
    std::lock_guard<std::mutex> lock(b->mu);  // a Poll that found it before sees `reaped`
    b->collected = true;
    b->reaped = true;
  }
}

std::optional<BatchResult> TransferEngine::Impl::PollOrWait(BatchId id, bool block,
                                                            uint64_t until_ns) {
  std::shared_ptr<Batch> b;
  bool was_reaped = false;
  {
    std::lock_guard<std::mutex> lock(batches_mu);
    auto it = batches.find(id);
    if (it != batches.end()) {
      b = it->second;
    } else {
      was_reaped = reaped_ids.count(id) > 0;
    }
  }
  auto reaped_result = [&] {
    BatchResult r;
    r.status = Status::NotFound("batch " + std::to_string(id) +
                                " was reaped: it finished and was not polled while more than "
                                "max_unpolled_batches (" +
                                std::to_string(options.max_unpolled_batches) +
                                ") finished batches waited; its result is lost");
    return r;
  };
  if (!b) {
    if (was_reaped) return reaped_result();
    BatchResult r;
    r.status = Status::NotFound("unknown batch " + std::to_string(id) +
                                " (never submitted, its result was already returned, or it was "
                                "reaped unpolled past max_unpolled_batches)");
    return r;
  }
  WaitSlot& slot = *b->slot;
  for (;;) {
    uint64_t seq;
    {
      std::lock_guard<std::mutex> lock(slot.mu);
      seq = slot.seq;
    }
    {
      std::lock_guard<std::mutex> lock(b->mu);
      if (b->reaped) return reaped_result();
      if (b->collected) {
        BatchResult r;
        r.status =
            Status::NotFound("batch " + std::to_string(id) + " was collected by another call");
        return r;
      }
      bool done = PollPass(*b);
      if (!done && b->deadline_ns != 0 && util::MonoNs() >= b->backstop_ns()) {
        CancelSubs(*b, /*by_deadline=*/true);
        done = PollPass(*b);
      }
      if (done) {
        {
          std::lock_guard<std::mutex> lock2(batches_mu);
          batches.erase(id);
          finished_ids.erase(id);
        }
        return Collect(*b);
      }
    }
    if (!block) return std::nullopt;
    const uint64_t now = util::MonoNs();
    if (until_ns != 0 && now >= until_ns) return std::nullopt;
    std::unique_lock<std::mutex> lock(slot.mu);
    uint64_t wait_ns = 100'000'000;  // re-check at least every 100 ms
    if (b->deadline_ns != 0) {
      const uint64_t backstop = b->backstop_ns();
      wait_ns = std::min<uint64_t>(wait_ns, backstop > now ? backstop - now : 0);
    }
    if (until_ns != 0) wait_ns = std::min<uint64_t>(wait_ns, until_ns - now);
    slot.cv.wait_for(lock, std::chrono::nanoseconds(wait_ns), [&] { return slot.seq != seq; });
  }
}

TransferEngine::TransferEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TransferEngine::~TransferEngine() {
  if (!impl_) return;
  {
    // Waits for copies into or out of this engine's memory by engines of this process.
    std::unique_lock<std::shared_mutex> lock(Impl::ProcessMu());
    Impl::ProcessEngines().erase(impl_->self.incarnation);
    Impl::process_engines.store(Impl::ProcessEngines().size());
  }
  // The handshake thread calls LocalDescriptor(): stop it while impl_ is whole.
  impl_->handshake.reset();
}

Result<std::unique_ptr<TransferEngine>> TransferEngine::Create(const EngineOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->copy_pool = std::make_unique<util::WorkerPool>(options.local_copy_threads != 0
                                                           ? options.local_copy_threads
                                                           : util::WorkerPool::DefaultThreads());
  impl->self.node_id = options.node_id.empty() ? DefaultNodeId() : options.node_id;
  impl->self.incarnation = DrawIncarnation();
  impl->breaker_config.failure_threshold = options.breaker_failures;
  impl->breaker_config.backoff_ms = options.breaker_backoff_ms;
  impl->breaker_config.max_backoff_ms = options.breaker_max_backoff_ms;
  impl->breaker_config.probe_timeout_ms =
      std::max(options.default_deadline_ms, options.breaker_max_backoff_ms);

  // Scanned once per process and search path: a storage node's plugins come from this host.
  impl->plugins = core::PluginHost::Acquire(PluginRegistry::DefaultSearchPath(options.plugin_path));
  const PluginRegistry& registry = impl->plugins->registry();

  std::vector<std::pair<const core::PluginInfo*, bool>> chosen;  // (plugin, explicitly named)
  if (!options.transports.empty()) {
    for (const auto& name : options.transports) {
      std::string why;
      const core::PluginInfo* p = registry.Find(KVB_PLUGIN_TRANSPORT, name, &why);
      if (p == nullptr) {
        return Status::Unavailable("transport '" + name + "' was requested but " + why);
      }
      chosen.emplace_back(p, true);
    }
  } else {
    for (const core::PluginInfo* p : registry.Loaded(KVB_PLUGIN_TRANSPORT)) {
      if ((p->caps & KVB_TCAP_OPT_IN) != 0) {  // only when named in EngineOptions::transports
        KVB_LOG(DEBUG) << "transport '" << p->name
                       << "' is opt-in: not used unless named in the engine's transports";
        continue;
      }
      chosen.emplace_back(p, false);
    }
  }
  core::TransportConfig config;
  config.node_id = impl->self.node_id;
  config.incarnation = impl->self.incarnation;
  config.listen = options.listen;
  config.cluster_token = options.cluster_token;
  config.plugin_config = options.plugin_config;
  for (const auto& [plugin, explicit_name] : chosen) {
    Result<std::unique_ptr<TransportInstance>> t = impl->plugins->CreateTransport(*plugin, config);
    if (!t.ok()) {
      if (explicit_name) return t.status();
      KVB_LOG(WARN) << t.status().ToString() << "; continuing without it";
      continue;
    }
    KVB_LOG(INFO) << "transport " << t.value()->name() << " listening on " << t.value()->endpoints()
                  << " as " << impl->self.ToString();
    impl->transports.push_back(std::move(t).value());
  }
  if (impl->transports.empty()) {
    std::string searched;
    for (const auto& d : impl->plugins->dirs()) searched += (searched.empty() ? "" : ":") + d;
    return Status::Unavailable("no usable transport plugin (searched " + searched +
                               "; set KVBRIDGE_PLUGIN_PATH or EngineOptions::plugin_path)");
  }
  std::unique_ptr<TransferEngine> engine(new TransferEngine(std::move(impl)));
  if (!options.handshake_listen.empty()) {
    TransferEngine* raw = engine.get();
    auto hs = core::StartHandshakeServer(options.handshake_listen,
                                         [raw] { return raw->LocalDescriptor(); });
    if (!hs.ok()) return hs.status().WithContext("handshake service");
    engine->impl_->handshake = std::move(hs).value();
    KVB_LOG(INFO) << "handshake service on " << engine->impl_->handshake->address();
  }
  {
    std::unique_lock<std::shared_mutex> lock(Impl::ProcessMu());
    Impl::ProcessEngines()[engine->impl_->self.incarnation] = engine->impl_.get();
    Impl::process_engines.store(Impl::ProcessEngines().size());
  }
  return engine;
}

std::string TransferEngine::handshake_endpoint() const {
  return impl_->handshake ? impl_->handshake->address() : std::string();
}

Result<std::string> TransferEngine::FetchDescriptor(const std::string& host_port,
                                                    uint32_t timeout_ms) {
  return core::FetchDescriptor(host_port, timeout_ms);
}

Result<std::vector<RemoteSegment>> TransferEngine::PeerSegments(std::string_view node_id) const {
  std::shared_lock<std::shared_mutex> lock(impl_->peers_mu);
  auto it = impl_->peers.find(std::string(node_id));
  if (it == impl_->peers.end()) {
    return Status::NotFound("PeerSegments: unknown peer '" + std::string(node_id) + "'");
  }
  std::vector<RemoteSegment> out;
  for (const auto& [id, s] : *it->second->segments) out.push_back({id, s.base, s.length});
  std::sort(out.begin(), out.end(),
            [](const RemoteSegment& a, const RemoteSegment& b) { return a.base < b.base; });
  return out;
}

const PeerId& TransferEngine::self() const { return impl_->self; }

std::vector<std::string> TransferEngine::transports() const {
  std::vector<std::string> names;
  for (const auto& t : impl_->transports) names.push_back(t->name());
  return names;
}

std::string TransferEngine::endpoints(std::string_view transport) const {
  TransportInstance* t = impl_->FindTransport(transport);
  return t ? t->endpoints() : std::string();
}

Result<SegmentId> TransferEngine::RegisterMemory(void* addr, uint64_t length, MemoryKind kind,
                                                 int device_id) {
  if (addr == nullptr || length == 0) {
    return Status::InvalidArgument("RegisterMemory: address must be non-null and length > 0");
  }
  if (kind == MemoryKind::kDetect) std::tie(kind, device_id) = core::DetectMemoryKind(addr);
  if (kind != MemoryKind::kHost && kind != MemoryKind::kCuda) {
    return Status::InvalidArgument("RegisterMemory: unknown memory kind " +
                                   std::to_string(static_cast<uint32_t>(kind)) +
                                   " (neither kHost nor kCuda)");
  }
  const auto start = reinterpret_cast<uintptr_t>(addr);
  if (start + length < start) return Status::InvalidArgument("RegisterMemory: range wraps");
  std::lock_guard<std::mutex> admin(impl_->admin_mu);
  LocalRegion region;
  {
    std::shared_lock<std::shared_mutex> lock(impl_->regions_mu);
    auto it = impl_->regions.lower_bound(start);
    bool overlap = (it != impl_->regions.end() && it->first < start + length);
    if (!overlap && it != impl_->regions.begin()) {
      --it;
      overlap = it->second.addr + it->second.length > start;
    }
    if (overlap) {
      return Status::AlreadyExists("RegisterMemory: range overlaps registered segment " +
                                   std::to_string(it->second.id));
    }
    region.id = impl_->next_segment_id++;
  }
  const uint64_t want_cap = kind == MemoryKind::kCuda ? KVB_TCAP_CUDA_MEM : KVB_TCAP_HOST_MEM;
  // A transport's CUDA_MEM moves device bytes with the host's device services, which need a
  // CUDA driver: without one no transport takes CUDA memory (the UNSUPPORTED below).
  std::string no_driver;
  if (kind == MemoryKind::kCuda) {
    Result<const core::cuda::Driver*> driver = core::cuda::GetDriver();
    if (!driver.ok()) no_driver = driver.status().message();
  }
  auto takes = [&](const TransportInstance& t) {
    return (t.caps() & want_cap) != 0 && no_driver.empty();
  };
  // The memory must be what `kind` says (core/memory_kinds.h): checked once some transport
  // would take it, so a kind no transport handles stays the UNSUPPORTED below.
  if (std::any_of(impl_->transports.begin(), impl_->transports.end(),
                  [&](const auto& t) { return takes(*t); })) {
    Result<int> device = core::CheckMemoryKind(addr, length, kind, device_id);
    if (!device.ok()) return device.status();
    device_id = device.value();  // kCuda: the pointer's device when -1 was given
  }
  region.addr = start;
  region.length = length;
  region.kind = kind;
  region.device_id = device_id;
  std::vector<TransportInstance*> done;
  for (auto& t : impl_->transports) {
    if (!takes(*t)) continue;
    Result<TransportInstance::Registration> reg =
        t->RegisterMemory(region.id, addr, length, static_cast<kvb_mem_kind_t>(kind), device_id);
    if (!reg.ok()) {
      for (TransportInstance* d : done) (void)d->DeregisterMemory(region.id);
      return reg.status();
    }
    region.rkeys[t->name()] = std::move(reg->rkey);
    if (reg->local_only) region.local_only.insert(t->name());
    done.push_back(t.get());
  }
  if (done.empty()) {
    return Status::Unsupported(kind != MemoryKind::kCuda
                                   ? "no loaded transport supports host memory"
                               : no_driver.empty() ? "no loaded transport supports CUDA memory"
                                                   : "no loaded transport supports CUDA memory "
                                                     "here (" +
                                                         no_driver + ")");
  }
  SegmentId id = region.id;
  std::unique_lock<std::shared_mutex> lock(impl_->regions_mu);
  impl_->regions.emplace(start, std::move(region));
  return id;
}

Status TransferEngine::DeregisterMemory(SegmentId id) {
  std::lock_guard<std::mutex> admin(impl_->admin_mu);
  {
    std::unique_lock<std::shared_mutex> lock(impl_->regions_mu);
    auto it = std::find_if(impl_->regions.begin(), impl_->regions.end(),
                           [&](const auto& kv) { return kv.second.id == id; });
    if (it == impl_->regions.end()) {
      return Status::NotFound("DeregisterMemory: unknown segment " + std::to_string(id));
    }
    impl_->regions.erase(it);
  }
  // Outbound batches still using the region are cancelled: once cancel returns, a transport
  // no longer touches their local memory (ABI), so the caller may free it when this returns.
  std::vector<std::shared_ptr<Batch>> users;
  {
    std::lock_guard<std::mutex> lock(impl_->batches_mu);
    for (const auto& [bid, b] : impl_->batches) {
      if (std::binary_search(b->local_segments.begin(), b->local_segments.end(), id)) {
        users.push_back(b);
      }
    }
  }
  size_t cancelled = 0;
  for (const auto& b : users) {
    std::lock_guard<std::mutex> lock(b->mu);
    if (b->collected) continue;
    for (const SubRequest& sub : b->subs) cancelled += sub.final ? 0 : 1;
    impl_->CancelSubs(*b, /*by_deadline=*/false);
  }
  if (cancelled > 0) {
    KVB_LOG(WARN) << "DeregisterMemory: segment " << id << " was the local memory of " << cancelled
                  << " transfer(s) not yet seen final; cancelled";
  }
  Status result;
  for (auto& t : impl_->transports) {
    Status st = t->DeregisterMemory(id);
    if (!st.ok() && !st.IsNotFound() && result.ok()) result = st;
  }
  return result;
}

std::string TransferEngine::LocalDescriptor() const {
  Descriptor d;
  d.node_id = impl_->self.node_id;
  d.incarnation = impl_->self.incarnation;
  d.host_key = impl_->host_key;
  for (const auto& t : impl_->transports) {
    d.transports.push_back({t->name(), t->endpoints(), t->caps()});
  }
  std::shared_lock<std::shared_mutex> lock(impl_->regions_mu);
  for (const auto& [addr, r] : impl_->regions) {
    SegmentDesc s;
    s.id = r.id;
    s.base = r.addr;
    s.length = r.length;
    s.mem_kind = static_cast<uint32_t>(r.kind);
    s.device_id = r.device_id;
    s.rkeys = r.rkeys;
    for (const std::string& t : r.local_only) s.rkeys.erase(t);
    d.segments.push_back(std::move(s));
  }
  return core::EncodeDescriptor(d, impl_->options.cluster_token);
}

Result<PeerId> TransferEngine::AddPeer(std::string_view blob, const AddPeerOptions& options) {
  // With a cluster token only a sealed descriptor is taken: its endpoints, addresses and keys
  // are where this engine would write.
  Result<Descriptor> decoded = core::DecodeDescriptor(blob, impl_->options.cluster_token);
  if (!decoded.ok()) return decoded.status();
  Descriptor& d = decoded.value();
  if (options.expect != nullptr &&
      (d.node_id != options.expect->node_id || d.incarnation != options.expect->incarnation)) {
    return Status::StalePeer("the descriptor is " + PeerId{d.node_id, d.incarnation}.ToString() +
                             ", not the expected " + options.expect->ToString());
  }
  // One path per transport both sides speak, in local preference order.
  struct Shared {
    TransportInstance* transport;
    uint32_t index;
    const core::TransportDesc* remote;
  };
  std::vector<Shared> shared;
  for (uint32_t j = 0; j < impl_->transports.size(); ++j) {
    TransportInstance* t = impl_->transports[j].get();
    auto rt = std::find_if(d.transports.begin(), d.transports.end(),
                           [&](const core::TransportDesc& r) { return r.name == t->name(); });
    if (rt != d.transports.end()) shared.push_back({t, j, &*rt});
  }
  // A peer on this host (the same non-empty host key) is tried first over the transports that
  // reach it through shared memory (KVB_TCAP_LOCAL_SHM); otherwise local preference order.
  if (!d.host_key.empty() && d.host_key == impl_->host_key) {
    std::stable_partition(shared.begin(), shared.end(), [](const Shared& sh) {
      return (sh.transport->caps() & KVB_TCAP_LOCAL_SHM) != 0;
    });
  }
  if (shared.empty()) {
    std::string theirs, ours;
    for (const auto& rt : d.transports) theirs += (theirs.empty() ? "" : ",") + rt.name;
    for (const auto& t : impl_->transports) ours += (ours.empty() ? "" : ",") + t->name();
    return Status::Unsupported("peer " + d.node_id + " offers transports [" + theirs +
                               "], this engine has [" + ours + "]");
  }
  auto segments = std::make_shared<SegmentMap>();
  for (const auto& s : d.segments) {
    segments->emplace(s.id, s);
  }
  // What one transport is told of the peer: its endpoints, and each segment the peer published
  // a key of that transport for, with the key (a segment the peer's transport did not register,
  // or registered for its own ops only, is not reachable over it; path choice never posts
  // there). `psegs` points into *segments, which stays put while it is moved into the record.
  std::vector<TransportInstance::PeerSegment> psegs;
  auto view_for = [&](const Shared& sh) {
    psegs.clear();
    for (const auto& [sid, s] : *segments) {
      auto it = s.rkeys.find(sh.transport->name());
      if (it == s.rkeys.end()) continue;
      psegs.push_back({.id = s.id,
                       .mem_kind = s.mem_kind,
                       .length = s.length,
                       .rkey = std::string_view(it->second)});
    }
    return TransportInstance::PeerView{.node_id = d.node_id,
                                       .incarnation = d.incarnation,
                                       .endpoints = sh.remote->endpoints,
                                       .segments = psegs};
  };
  PeerId pid{d.node_id, d.incarnation};
  std::string route;  // "mock mock:eng-b, mock_b mock_b:eng-b"
  for (const Shared& sh : shared) {
    route += (route.empty() ? "" : ", ") + sh.transport->name() + " " + sh.remote->endpoints;
  }

  std::shared_ptr<PeerRecord> existing;
  std::string known_route;
  bool same_transports = false;
  {
    std::shared_lock<std::shared_mutex> lock(impl_->peers_mu);
    auto it = impl_->peers.find(d.node_id);
    if (it != impl_->peers.end()) {
      existing = it->second;
      same_transports = existing->paths.size() == shared.size();
      for (size_t k = 0; k < existing->paths.size(); ++k) {
        const Path& p = *existing->paths[k];
        known_route += (known_route.empty() ? "" : ", ") + p.transport->name() + " " + p.endpoints;
        same_transports = same_transports && p.transport == shared[k].transport;
      }
    }
  }
  // The "no move without restart" rule, over every path.
  const bool same_incarnation = existing && existing->id.incarnation == d.incarnation;
  if (same_incarnation && !options.allow_endpoint_change && known_route != route) {
    return Status::AlreadyExists("peer " + pid.ToString() + " is known at " + known_route +
                                 "; a descriptor naming " + route +
                                 " for the same incarnation is refused (a peer does not move "
                                 "without restarting)");
  }
  if (same_incarnation && same_transports) {
    for (size_t k = 0; k < shared.size(); ++k) {
      Status st = shared[k].transport->UpdatePeer(*existing->paths[k]->tpeer, view_for(shared[k]));
      if (!st.ok()) {
        return st.WithContext("updating peer " + pid.ToString() + " on " +
                              shared[k].transport->name());
      }
    }
    std::unique_lock<std::shared_mutex> lock(impl_->peers_mu);
    existing->segments = std::move(segments);
    for (size_t k = 0; k < shared.size(); ++k) {
      existing->paths[k]->endpoints = shared[k].remote->endpoints;
    }
    return pid;
  }
  // A new incarnation (or a permitted move to other transports): every path is new.
  auto record = std::make_shared<PeerRecord>(pid);
  for (const Shared& sh : shared) {
    auto path = std::make_unique<Path>(sh.transport, sh.index, impl_->breaker_config);
    path->endpoints = sh.remote->endpoints;
    Result<std::unique_ptr<TransportInstance::Peer>> tpeer = sh.transport->AddPeer(view_for(sh));
    if (!tpeer.ok()) {
      return tpeer.status().WithContext("adding peer " + pid.ToString() + " on " +
                                        sh.transport->name());
    }
    path->tpeer = std::move(tpeer).value();
    record->paths.push_back(std::move(path));
  }
  record->segments = std::move(segments);
  std::shared_ptr<PeerRecord> replaced;
  {
    std::unique_lock<std::shared_mutex> lock(impl_->peers_mu);
    auto& slot = impl_->peers[d.node_id];
    replaced = std::move(slot);
    slot = record;
  }
  if (replaced && replaced->id.incarnation != d.incarnation) {
    KVB_LOG(INFO) << "peer " << d.node_id << " restarted: " << replaced->id.ToString() << " -> "
                  << pid.ToString();
  }
  return pid;  // `replaced` dies here, outside the lock
}

Status TransferEngine::RemovePeer(std::string_view node_id) {
  std::shared_ptr<PeerRecord> removed;
  {
    std::unique_lock<std::shared_mutex> lock(impl_->peers_mu);
    auto it = impl_->peers.find(std::string(node_id));
    if (it == impl_->peers.end()) {
      return Status::NotFound("RemovePeer: unknown peer '" + std::string(node_id) + "'");
    }
    removed = std::move(it->second);
    impl_->peers.erase(it);
  }
  return Status::OK();
}

Result<BatchId> TransferEngine::Submit(std::span<const TransferOp> ops,
                                       const SubmitOptions& options) {
  Impl& im = *impl_;
  if (ops.empty()) return Status::InvalidArgument("Submit: empty batch");
  if (ops.size() > im.options.max_ops_per_batch) {
    return Status::InvalidArgument(
        "Submit: " + std::to_string(ops.size()) + " ops exceed max_ops_per_batch (" +
        std::to_string(im.options.max_ops_per_batch) + "); split the batch");
  }
  KVB_RETURN_IF_ERROR(im.AdmitBatch());
  std::vector<uint64_t> local_seg(ops.size());
  // Per op: which transports its local region is registered with (bit = index in transports)
  // and its memory kind, for path choice once the lock is dropped.
  std::vector<uint64_t> local_paths(ops.size());
  std::vector<uint32_t> local_kind(ops.size());
  // Held until the batch is in `batches`: DeregisterMemory erases a region under the exclusive
  // lock, so every batch that saw the region is findable then, and cancelled.
  std::shared_lock<std::shared_mutex> regions_lock(im.regions_mu);
  {
    for (size_t i = 0; i < ops.size(); ++i) {
      const TransferOp& op = ops[i];
      auto where = [i] { return "Submit: op " + std::to_string(i); };
      if (op.opcode != OpCode::kRead && op.opcode != OpCode::kWrite) {
        return Status::InvalidArgument(where() + ": opcode must be READ or WRITE");
      }
      if (op.local_addr == nullptr || op.length == 0) {
        return Status::InvalidArgument(where() + ": local address is null or length is 0");
      }
      if (op.peer.empty()) return Status::InvalidArgument(where() + ": peer node id is empty");
      const LocalRegion* r = im.FindLocal(reinterpret_cast<uintptr_t>(op.local_addr), op.length);
      if (r == nullptr) {
        char buf[96];
        std::snprintf(buf, sizeof(buf),
                      ": local memory [%p, +%llu) is not inside a registered region", op.local_addr,
                      static_cast<unsigned long long>(op.length));
        return Status::NotRegistered(where() + buf);
      }
      local_seg[i] = r->id;
      local_kind[i] = static_cast<uint32_t>(r->kind);
      if (i > 0 && local_seg[i - 1] == r->id) {
        local_paths[i] = local_paths[i - 1];
        continue;
      }
      for (size_t j = 0; j < im.transports.size() && j < 64; ++j) {
        if (r->rkeys.count(im.transports[j]->name())) local_paths[i] |= uint64_t{1} << j;
      }
    }
  }

  auto batch = std::make_shared<Batch>();
  batch->id = im.next_batch_id.fetch_add(1);
  batch->slot = &im.wait_slots[batch->id % kWaitSlots];
  const uint64_t now = util::MonoNs();
  const uint32_t deadline_ms =
      options.deadline_ms ? options.deadline_ms : im.options.default_deadline_ms;
  batch->deadline_ns = now + util::MsToNs(deadline_ms);
  const uint32_t progress_ms =
      options.progress_timeout_ms ? options.progress_timeout_ms : im.options.progress_timeout_ms;
  batch->progress_timeout_ns = util::MsToNs(progress_ms);
  batch->op_status.assign(ops.size(), Status::InProgress());
  for (uint32_t i = 0; i < ops.size(); ++i) {
    if (ops[i].checksum == nullptr || local_kind[i] != KVB_MEM_HOST) continue;
    if (batch->crc_to.empty()) {
      batch->crc_to.assign(ops.size(), nullptr);
      batch->op_crcs.assign(ops.size(), kvb_op_crc_t{});
    }
    batch->crc_to[i] = ops[i].checksum;
  }
  batch->local_segments.assign(local_seg.begin(), local_seg.end());
  std::sort(batch->local_segments.begin(), batch->local_segments.end());
  batch->local_segments.erase(
      std::unique(batch->local_segments.begin(), batch->local_segments.end()),
      batch->local_segments.end());
  {
    std::lock_guard<std::mutex> lock(im.batches_mu);
    // Checked again: other Submits may have been admitted since AdmitBatch.
    if (im.InflightLocked() >= im.options.max_inflight_batches) {
      return Status::Backpressure("Submit: " + std::to_string(im.InflightLocked()) +
                                  " batches are in flight (max_inflight_batches = " +
                                  std::to_string(im.options.max_inflight_batches) +
                                  "); poll, wait for or cancel some first");
    }
    im.batches.emplace(batch->id, batch);
  }
  // Posted under the batch's own lock and no map's: a DeregisterMemory that found the batch
  // waits for the posting to end, then cancels what was posted.
  std::lock_guard<std::mutex> batch_lock(batch->mu);
  regions_lock.unlock();

  // Group ops by peer, keeping submission order inside each group.
  std::vector<std::pair<std::string_view, std::vector<uint32_t>>> groups;
  for (uint32_t i = 0; i < ops.size(); ++i) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == ops[i].peer; });
    if (it == groups.end()) {
      groups.emplace_back(ops[i].peer, std::vector<uint32_t>{});
      it = std::prev(groups.end());
    }
    it->second.push_back(i);
  }

  for (auto& [peer_name, indices] : groups) {
    std::shared_ptr<PeerRecord> peer;
    std::shared_ptr<const SegmentMap> segs;
    {
      std::shared_lock<std::shared_mutex> lock(im.peers_mu);
      auto it = im.peers.find(std::string(peer_name));
      if (it != im.peers.end()) {
        peer = it->second;
        segs = peer->segments;
      }
    }
    auto fail_all = [&](const Status& st) {
      for (uint32_t i : indices) batch->op_status[i] = st;
    };
    if (!peer) {
      fail_all(Status::NotFound("unknown peer '" + std::string(peer_name) +
                                "' (AddPeer() its descriptor first)"));
      continue;
    }
    if (peer->stale.load()) {
      fail_all(Status::StalePeer("peer " + peer->id.ToString() +
                                 " was replaced by another incarnation at its address; "
                                 "AddPeer() its new descriptor"));
      continue;
    }
    if (im.options.local_copy && Impl::process_engines.load(std::memory_order_relaxed) > 1) {
      indices = im.CopyInProcess(*batch, *peer, ops, std::move(indices), local_kind);
      if (indices.empty()) continue;
    }
    // The paths as path choice sees them, breakers read once for the whole group.
    const std::string peer_name_full = peer->id.ToString();
    std::vector<core::PathView> views(peer->paths.size());
    for (size_t k = 0; k < peer->paths.size(); ++k) {
      const Path& p = *peer->paths[k];
      views[k].transport = p.transport->name();
      views[k].breaker_refuses = p.breaker.state(now) == BreakerState::kOpen;
      views[k].consecutive_failures = p.breaker.consecutive_failures();
      views[k].retry_in_ms = p.breaker.retry_in_ns(now) / 1000000;
    }
    // Ops grouped by the paths to try (one sub-request per group), in submission order.
    struct Group {
      std::vector<uint32_t> order;
      std::vector<uint32_t> op_index;
      std::vector<kvb_xfer_op_t> xops;
    };
    std::vector<Group> by_path;
    for (uint32_t i : indices) {
      const TransferOp& op = ops[i];
      auto sit = segs->find(op.remote_segment);
      if (sit == segs->end()) {
        batch->op_status[i] = Status::NotRegistered("peer " + peer_name_full + " has no segment " +
                                                    std::to_string(op.remote_segment));
        continue;
      }
      const SegmentDesc& seg = sit->second;
      const uint64_t seg_len = seg.length;
      if (op.remote_offset > seg_len || op.length > seg_len - op.remote_offset) {
        batch->op_status[i] = Status::OutOfBounds(
            "op " + std::to_string(i) + ": [" + std::to_string(op.remote_offset) + ", +" +
            std::to_string(op.length) + ") is outside segment " +
            std::to_string(op.remote_segment) + " of " + std::to_string(seg_len) + " bytes");
        continue;
      }
      for (size_t k = 0; k < peer->paths.size(); ++k) {
        const Path& p = *peer->paths[k];
        views[k].remote_registered = seg.rkeys.count(p.transport->name()) != 0;
        views[k].local_registered =
            p.transport_index < 64 && (local_paths[i] >> p.transport_index & 1) != 0;
        views[k].kinds_served = core::ServesKinds(p.transport->caps(), local_kind[i], seg.mem_kind);
        views[k].device_direct = (local_kind[i] == KVB_MEM_CUDA || seg.mem_kind == KVB_MEM_CUDA) &&
                                 (p.transport->caps() & KVB_TCAP_CUDA_DIRECT) != 0;
      }
      core::PathChoice choice = core::ChoosePaths(views, peer_name_full);
      // Paths passed over because their breaker refuses count the op as fast-failed there.
      for (size_t k = choice.admitting; k < choice.order.size(); ++k) {
        peer->paths[choice.order[k]]->fast_failed.fetch_add(1);
      }
      if (!choice.status.ok()) {
        if (choice.status.IsPeerUnreachable()) peer->fast_failed.fetch_add(1);
        batch->op_status[i] = std::move(choice.status);
        continue;
      }
      auto g = std::find_if(by_path.begin(), by_path.end(),
                            [&](const Group& x) { return x.order == choice.order; });
      if (g == by_path.end()) {
        by_path.push_back(Group{std::move(choice.order), {}, {}});
        g = std::prev(by_path.end());
      }
      g->op_index.push_back(i);
      const bool crc = !batch->crc_to.empty() && batch->crc_to[i] != nullptr;
      g->xops.push_back(kvb_xfer_op_t{.opcode = static_cast<uint32_t>(op.opcode),
                                      .flags = crc ? KVB_XOP_CRC32C : 0,
                                      .local_segment = local_seg[i],
                                      .local_addr = op.local_addr,
                                      .length = op.length,
                                      .remote_segment = op.remote_segment,
                                      .remote_offset = op.remote_offset,
                                      .crc = crc ? &batch->op_crcs[i] : nullptr});
    }
    for (Group& g : by_path) {
      im.Dispatch(*batch, peer, g.order, std::move(g.op_index), std::move(g.xops), Status::OK());
    }
  }
  return batch->id;
}

std::optional<BatchResult> TransferEngine::Poll(BatchId id) {
  return impl_->PollOrWait(id, /*block=*/false);
}

BatchResult TransferEngine::Wait(BatchId id) { return *impl_->PollOrWait(id, /*block=*/true); }

std::optional<BatchResult> TransferEngine::WaitFor(BatchId id, std::chrono::nanoseconds timeout) {
  const int64_t ns = std::max<int64_t>(timeout.count(), 0);
  if (ns >= (int64_t{1} << 62)) return impl_->PollOrWait(id, /*block=*/true);  // ~146 years
  return impl_->PollOrWait(id, /*block=*/true, util::MonoNs() + static_cast<uint64_t>(ns) + 1);
}

void TransferEngine::Cancel(BatchId id) {
  std::shared_ptr<Batch> b = impl_->FindBatch(id);
  if (!b) return;
  std::lock_guard<std::mutex> lock(b->mu);
  if (!b->collected) impl_->CancelSubs(*b, /*by_deadline=*/false);
}

Status TransferEngine::Transfer(std::span<const TransferOp> ops, const SubmitOptions& options) {
  Result<BatchId> id = Submit(ops, options);
  if (!id.ok()) return id.status();
  return Wait(id.value()).status;
}

std::optional<PeerHealth> TransferEngine::GetPeerHealth(std::string_view node_id) const {
  std::shared_ptr<PeerRecord> peer;
  {
    std::shared_lock<std::shared_mutex> lock(impl_->peers_mu);
    auto it = impl_->peers.find(std::string(node_id));
    if (it == impl_->peers.end()) return std::nullopt;
    peer = it->second;
  }
  PeerHealth h;
  const uint64_t now = util::MonoNs();
  h.id = peer->id;
  for (const auto& p : peer->paths) {
    h.paths.push_back(PathHealth{.transport = p->transport->name(),
                                 .breaker = p->breaker.state(now),
                                 .consecutive_failures = p->breaker.consecutive_failures(),
                                 .ops_ok = p->ops_ok.load(),
                                 .ops_failed = p->ops_failed.load(),
                                 .fast_failed = p->fast_failed.load(),
                                 .failed_over_from = p->failed_over_from.load()});
  }
  if (!h.paths.empty()) {
    h.transport = h.paths[0].transport;
    h.breaker = h.paths[0].breaker;
    h.consecutive_failures = h.paths[0].consecutive_failures;
  }
  h.fast_failed_ops = peer->fast_failed.load();
  h.local_copy_ops = peer->local_copied.load();
  h.stale = peer->stale.load();
  return h;
}

bool TransferEngine::TransportChecksumsOpsTo(std::string_view node_id) const {
  std::shared_lock<std::shared_mutex> lock(impl_->peers_mu);
  auto it = impl_->peers.find(std::string(node_id));
  if (it == impl_->peers.end() || it->second->paths.empty()) return false;
  return (it->second->paths.front()->transport->caps() & KVB_TCAP_OP_CRC32C) != 0;
}

Result<TransportStats> TransferEngine::GetTransportStats(std::string_view transport) const {
  TransportInstance* t = impl_->FindTransport(transport);
  if (t == nullptr) return Status::NotFound("no transport '" + std::string(transport) + "'");
  return t->Stats();
}

}  // namespace kvbridge

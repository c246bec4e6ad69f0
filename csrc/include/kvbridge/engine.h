// TransferEngine: one-sided READ/WRITE between registered memory of this process and of peers.
//
// Typical use (the no-master, P2P case):
//   auto engine = TransferEngine::Create(EngineOptions::FromEnv()).value();
//   SegmentId seg = engine->RegisterMemory(buf, len).value();
//   send(engine->LocalDescriptor());                 // to the peer, any way you like
//   PeerId peer = engine->AddPeer(descriptor_from_peer).value();
//   Status st = engine->Transfer({{OpCode::kWrite, buf, len, peer.node_id, remote_seg, 0}});
//
// Rules the engine enforces (docs/transfer-engine.md):
//  - Peers are (node id, incarnation). A peer restarted on the same address is a different
//    incarnation: ops to the old one fail with STALE_PEER, never land in the new process, and
//    keep failing fast until AddPeer() is called with the new descriptor.
//  - Every batch ends, done or failed with a named code, by its deadline. A peer that stops
//    moving bytes fails with PROGRESS_TIMEOUT well before the deadline.
//  - A peer has one path per transport both sides speak, each with its own circuit breaker:
//    after `breaker_failures` consecutive failed batches on a path, ops avoid it; when every
//    path's breaker is open they fail at once with PEER_UNREACHABLE (no socket attempts) until
//    a probe succeeds. Ops that fail on one path fail over to the next within their deadline
//    (EngineOptions::path_failover).
//  - One peer's failure never delays ops to other peers; no engine lock is held across I/O or
//    across a call into a plugin.
//
// Thread-safety: every method may be called concurrently from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/export.h"
#include "kvbridge/options.h"
#include "kvbridge/status.h"

namespace kvbridge {

using SegmentId = uint64_t;
using BatchId = uint64_t;

// kDetect (registration only): CUDA device memory of its device when this process's CUDA driver
// knows the address as such, host memory otherwise; for callers that hold raw pointers of
// either kind (the Mooncake-compatible API).
enum class MemoryKind : uint32_t { kHost = 1, kCuda = 2, kDetect = 3 };
enum class OpCode : uint32_t { kRead = 1, kWrite = 2 };

// A process incarnation: node id plus a random 64-bit number drawn at engine start.
struct KVBRIDGE_API PeerId {
  std::string node_id;
  uint64_t incarnation = 0;
  std::string ToString() const;  // "node@0123abcd..."
  bool operator==(const PeerId&) const = default;
};

// The checksum of an op's bytes, where the engine takes it for next to nothing
// (TransferOp::checksum).
struct OpChecksum {
  uint32_t crc32c = 0;    // CRC-32C (Castagnoli) of the bytes the op moved
  bool computed = false;  // whether the engine filled crc32c
};

struct TransferOp {
  OpCode opcode = OpCode::kRead;
  void* local_addr = nullptr;  // REQUIRES: inside a region registered with this engine
  uint64_t length = 0;         // REQUIRES: > 0
  std::string_view peer;       // peer node id; only read during Submit()
  SegmentId remote_segment = 0;
  uint64_t remote_offset = 0;
  // Optional. An op that the engine completes as a copy to or from a peer engine of this
  // process (EngineOptions::local_copy) fills it with the CRC-32C of the bytes it copied, taken
  // in the same pass as the copy (util::CopyCrc32c): a reader that verifies what
  // it received, or a writer that must report the checksum of what it wrote, needs no second
  // pass over the buffer. An op on host memory that a transport with KVB_TCAP_OP_CRC32C moved
  // gets the checksum the transport took as the bytes moved (tcp does; TransportChecksumsOpsTo
  // says whether a peer's preferred path is such a transport). Left untouched otherwise (a
  // transport without the cap, or the op failed). Must stay valid until the batch is final.
  OpChecksum* checksum = nullptr;
};

struct SubmitOptions {
  uint32_t deadline_ms = 0;          // 0 = EngineOptions::default_deadline_ms
  uint32_t progress_timeout_ms = 0;  // 0 = EngineOptions::progress_timeout_ms
};

struct AddPeerOptions {
  // The identity the descriptor must carry (STALE_PEER naming both if it carries another);
  // null: any.
  const PeerId* expect = nullptr;
  // Let a descriptor of an already known (node id, incarnation) change how that peer is
  // reached (its transport or endpoints). Off, such a descriptor is refused ALREADY_EXISTS:
  // whoever hands this process descriptors (a task, a read request, a directory) could
  // otherwise re-route its traffic for a known peer through another address. A real peer
  // never moves without restarting (a new incarnation).
  bool allow_endpoint_change = false;
};

// A segment a peer registered, as its descriptor lists it: `base` is the peer's own address
// of byte 0 (what Mooncake-style APIs call the remote virtual address).
struct RemoteSegment {
  SegmentId id = 0;
  uint64_t base = 0;
  uint64_t length = 0;
};

struct BatchResult {
  Status status;                  // OK, or the first failed op's status
  std::vector<Status> op_status;  // one per op, in submission order
  // Empty unless some op of the batch failed over to another path; then one per op: "" for an
  // op that stayed on its first path, else its path history, e.g. "mock: PEER_UNREACHABLE
  // (mock: injected fault PEER_UNREACHABLE); then mock_b: OK". A failed op's status message
  // carries the same history.
  std::vector<std::string> op_path_history;
};

enum class BreakerState { kClosed, kOpen, kHalfOpen };

// One path to a peer: a transport both sides speak, with its own breaker and counters.
struct PathHealth {
  std::string transport;
  BreakerState breaker = BreakerState::kClosed;
  uint32_t consecutive_failures = 0;
  uint64_t ops_ok = 0;            // ops that ended OK on this path
  uint64_t ops_failed = 0;        // ops that ended with an error on it (failed over or not)
  uint64_t fast_failed = 0;       // ops that skipped it because its breaker refused
  uint64_t failed_over_from = 0;  // ops re-posted on another path after failing on this one
};

struct PeerHealth {
  PeerId id;
  std::string transport;                         // the preferred path's transport (paths[0])
  BreakerState breaker = BreakerState::kClosed;  // paths[0]'s breaker
  uint32_t consecutive_failures = 0;             // paths[0]'s
  uint64_t fast_failed_ops = 0;  // ops refused without touching the network (every breaker open)
  bool stale = false;            // a handshake found another incarnation at its address
  // Ops done by a memory copy because the peer is an engine of this process (local_copy).
  uint64_t local_copy_ops = 0;
  std::vector<PathHealth> paths;  // one per transport both sides speak, in preference order
};

struct TransportStats {
  std::string name;
  uint64_t connections_open = 0;
  uint64_t connections_opened = 0;
  uint64_t connections_closed_idle = 0;
  uint64_t connections_evicted = 0;
  uint64_t inbound_open = 0;
  uint64_t bytes_written = 0;
  uint64_t bytes_read = 0;
  uint64_t frames_rejected = 0;
  uint64_t queued_bytes = 0;
  // How CUDA memory moves (0 from a transport of ABI < 1.5): regions registered for moves
  // without a host copy, regions whose bytes are copied through host buffers, and the bytes of
  // those copies.
  uint64_t device_regions_direct = 0;
  uint64_t device_regions_staged = 0;
  uint64_t device_bytes_staged = 0;
};

class KVBRIDGE_API TransferEngine {
 public:
  // Loads the transport plugins, draws the incarnation and starts the listeners.
  // Fails if no transport is usable, or if a transport named in options.transports is not.
  static Result<std::unique_ptr<TransferEngine>> Create(const EngineOptions& options);
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  const PeerId& self() const;
  // Names of the transports in use, in preference order.
  std::vector<std::string> transports() const;
  // The endpoints a transport listens on ("127.0.0.1:41235"), with the ports actually bound.
  std::string endpoints(std::string_view transport) const;

  // Makes [addr, addr+length) reachable by peers. Overlapping an existing region is
  // ALREADY_EXISTS. The returned id is what peers name as remote_segment. kDetect registers
  // it as what it is (core/memory_kinds.h DetectMemoryKind), with device_id ignored.
  Result<SegmentId> RegisterMemory(void* addr, uint64_t length, MemoryKind kind = MemoryKind::kHost,
                                   int device_id = -1);
  // After return nothing touches the region any more: no peer request, and no batch of this
  // process that used it as local memory (those are cancelled: their unfinished ops end
  // CANCELLED). The memory may be freed then. NOT_FOUND for an unknown id.
  Status DeregisterMemory(SegmentId id);

  // Everything a peer needs to reach this process: identity, endpoints per transport and the
  // registered segments. Opaque bytes; re-fetch after registering more memory.
  std::string LocalDescriptor() const;
  // Learns (or updates) a peer from its descriptor. A descriptor with a new incarnation for a
  // known node id replaces the old incarnation; one of the known incarnation may add segments
  // but not move the peer (AddPeerOptions::allow_endpoint_change). INVALID_ARGUMENT for a
  // malformed descriptor, UNSUPPORTED when no transport is shared with the peer, STALE_PEER
  // when it is not options.expect, ALREADY_EXISTS for a move.
  Result<PeerId> AddPeer(std::string_view descriptor, const AddPeerOptions& options = {});
  Status RemovePeer(std::string_view node_id);
  // The segments of a known peer's current incarnation (NOT_FOUND for an unknown peer).
  Result<std::vector<RemoteSegment>> PeerSegments(std::string_view node_id) const;

  // "host:port" of this engine's handshake service, or "" when options.handshake_listen is
  // empty.
  std::string handshake_endpoint() const;
  // Asks the handshake service at "host:port" for that engine's descriptor (pass it to
  // AddPeer). PEER_UNREACHABLE, DEADLINE_EXCEEDED (timeout_ms), PROTOCOL (not a handshake
  // port). Touches no engine state.
  static Result<std::string> FetchDescriptor(const std::string& host_port, uint32_t timeout_ms);

  // Queues a batch. Structural errors (null address, zero length, bad opcode, local memory
  // not registered, more ops than EngineOptions::max_ops_per_batch) refuse the whole batch
  // with INVALID_ARGUMENT / NOT_REGISTERED and queue nothing, and so does BACKPRESSURE when
  // max_inflight_batches batches are still in flight. Per-peer conditions (unknown peer, stale
  // peer, every path's breaker open, no path serving the op, backpressure, remote bounds)
  // become that op's status in the BatchResult. Ops that fail on one path to a peer fail over
  // to its next path within the deadline (EngineOptions::path_failover).
  Result<BatchId> Submit(std::span<const TransferOp> ops, const SubmitOptions& options = {});
  // Non-blocking. nullopt while in flight. Once final, returns the result and forgets the
  // batch (a later Poll/Wait of the same id gives NOT_FOUND). A final batch left unpolled
  // while more than max_unpolled_batches others waited is reaped: NOT_FOUND "... was reaped".
  std::optional<BatchResult> Poll(BatchId id);
  // Blocks until the batch is final (at the latest at its deadline), returns and forgets it.
  BatchResult Wait(BatchId id);
  // Wait for at most `timeout`: nullopt if the batch is still in flight then (it stays
  // pending; a later Poll/Wait/WaitFor collects it).
  std::optional<BatchResult> WaitFor(BatchId id, std::chrono::nanoseconds timeout);
  // Unfinished ops become CANCELLED; after return none of the batch's local memory is touched.
  void Cancel(BatchId id);
  // Submit + Wait; returns the batch status.
  Status Transfer(std::span<const TransferOp> ops, const SubmitOptions& options = {});

  std::optional<PeerHealth> GetPeerHealth(std::string_view node_id) const;
  // Whether an op to this peer that asks for TransferOp::checksum gets it from the transport of
  // the peer's preferred path (KVB_TCAP_OP_CRC32C), as far as the engine can tell before the
  // op runs: a breaker or a failover may still move it to a path without. False for an unknown
  // peer. Copies in this process (local_copy) take their checksum whatever this says.
  bool TransportChecksumsOpsTo(std::string_view node_id) const;
  // UNSUPPORTED when the transport does not report stats.
  Result<TransportStats> GetTransportStats(std::string_view transport) const;

  struct KVBRIDGE_HIDDEN Impl;  // engine.cc; not exported

 private:
  explicit TransferEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge

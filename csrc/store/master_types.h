// What the store client and the storage node send to the master and get back, as kvbridge
// types: MasterClient (store/master_client.h) converts them to and from the generated messages
// of kvbridge.rpc.Master, so neither caller reads a protobuf reply. Where the master's state
// machine already has the type (ReplicaLocation, InventoryRecord, NodeRegistration, PutEndItem:
// store/master_state.h), it is reused. Plain values; internal to the store (csrc/store).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvbridge/engine.h"  // PeerId
#include "kvbridge/status.h"
#include "store/master_state.h"

namespace kvbridge::store {

// --- store client ---

// One key of a PutStart answer.
struct PutGrant {
  // ALREADY_EXISTS: stored already (write nothing); otherwise non-OK: not admitted.
  Status status;
  uint64_t version = 0;
  std::vector<ReplicaLocation> replicas;  // write every one; report each in PutEndItem
  // The write's budget from when the master answered: no transfer for the key starts after
  // it (docs/store.md "Late writes").
  uint32_t deadline_ms = 0;
};

// One key of a GetReplicas answer.
struct ReadGrant {
  Status status;  // NOT_FOUND: absent or not complete
  uint64_t version = 0;
  std::vector<uint64_t> sizes;  // one per buffer
  uint32_t checksum = 0;        // CRC-32C of the concatenated buffers
  // Readable replicas, best first (the master ranks the client's own node and DRAM first).
  std::vector<ReplicaLocation> replicas;
  uint32_t lease_ms = 0;  // what remained of the read lease when the master answered
};

// --- storage node ---

// The master's answer to a registration.
struct NodeRegistered {
  std::vector<InventoryRecord> frees;  // records to drop (each only if its replica_id matches)
  std::vector<uint64_t> free_seqs;     // their sequence numbers, to acknowledge in Heartbeat
  bool more = false;                   // more frees are queued: heartbeat at once for them
  uint32_t heartbeat_interval_ms = 0;  // 0: keep the node's own
  // The secret of this registration (empty without a token): proves the node to Drain and
  // Deregister (store/rpc_auth.h).
  std::string node_secret;
  // The master's term (0: a single master). A node refuses answers and commits of a lower term
  // than the highest it saw: a replaced leader cannot act at a node that met its successor.
  uint64_t term = 0;
};

// A replication task as the node receives it: copy `source` (on this node) to `dest`, then
// report it (TaskReport) within timeout_ms of the heartbeat that brought it.
struct NodeTask {
  uint64_t task_id = 0;
  std::string key;
  uint64_t version = 0;
  uint32_t checksum = 0;
  ReplicaLocation source;
  ReplicaLocation dest;
  std::string dest_descriptor;   // the destination's engine descriptor
  std::string dest_rpc_address;  // its Node service (direct peer discovery)
  uint32_t timeout_ms = 0;
};

// A move between the node's DRAM and SSD (a demotion, or back: a promotion): write `dest`'s
// object from `source`, record it, then report it (MoveReport) within timeout_ms.
struct NodeMove {
  InventoryRecord source;
  InventoryRecord dest;
  uint32_t timeout_ms = 0;
};

// The master's answer to a heartbeat whose status was OK.
struct HeartbeatAnswer {
  std::vector<InventoryRecord> frees;
  std::vector<uint64_t> free_seqs;  // one per free, increasing
  std::vector<NodeTask> tasks;
  std::vector<NodeMove> moves;
  bool drained = false;  // a draining node may deregister and exit
  bool more = false;     // more is queued than this answer carries: ask again at once
  uint64_t term = 0;     // as NodeRegistered::term
};

// A finished replication task (TaskDone).
struct TaskReport {
  PeerId node;
  uint64_t task_id = 0;
  Status status;
};

// A finished move (DemoteDone); dest_replica_id names it.
struct MoveReport {
  PeerId node;
  std::string key;
  uint64_t version = 0;
  uint64_t dest_replica_id = 0;
  Status status;  // OK: the new copy is durable (SSD) or written (DRAM) and recorded
};

}  // namespace kvbridge::store

// EngineOptions: every knob of the transfer engine, with its default.
//
// Each field is mirrored 1:1 by a KVBRIDGE_* environment variable (named next to it);
// EngineOptions::FromEnv() starts from the defaults below and applies the variables that are
// set. Plugin settings live in `plugin_config` under "<plugin>.<key>" and are mirrored by
// KVBRIDGE_<PLUGIN>_<KEY> (e.g. "tcp.lanes_per_peer" <-> KVBRIDGE_TCP_LANES_PER_PEER); an
// explicit plugin_config entry wins over the variable. docs/configuration.md lists every key.
//
// A plain value type; not synchronized.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kvbridge/export.h"

namespace kvbridge {

struct KVBRIDGE_API EngineOptions {
  // --- Identity ---
  // This process's node id. Empty = "<hostname>-<pid>". KVBRIDGE_NODE_ID.
  std::string node_id;

  // --- Plugins ---
  // Transports to use, in preference order ("tcp,ucx"). Empty = every transport plugin that
  // loads and reports itself available. A transport named here that is missing, refused or
  // unavailable makes Create() fail with the plugin's reason. KVBRIDGE_TRANSPORTS.
  std::vector<std::string> transports;
  // Extra plugin directories, ':'-separated, searched first. Then come the directories in
  // KVBRIDGE_PLUGIN_PATH (read by the loader), the build tree's and the install's.
  std::string plugin_path;

  // --- Network ---
  // Where transports listen: comma-separated "host:port" list (one per NIC); port 0 picks a
  // free port, and the descriptor publishes the port actually bound. KVBRIDGE_LISTEN.
  std::string listen = "127.0.0.1:0";
  // Where the handshake service listens ("host:port"; port 0 picks one; empty = none): it
  // hands LocalDescriptor() to anyone who asks (FetchDescriptor), so peers known only by
  // "host:port" need no other exchange. KVBRIDGE_HANDSHAKE_LISTEN.
  std::string handshake_listen;
  // Shared secret; when set, peers must prove they hold it at handshake (HMAC-SHA256), and
  // unauthenticated peers are refused. KVBRIDGE_CLUSTER_TOKEN.
  std::string cluster_token;

  // --- Deadlines ---
  // Deadline of a batch when SubmitOptions gives none. KVBRIDGE_DEADLINE_MS.
  uint32_t default_deadline_ms = 10000;
  // A transfer whose peer moves no bytes for this long fails with PROGRESS_TIMEOUT, well
  // before its deadline (a frozen peer). KVBRIDGE_PROGRESS_TIMEOUT_MS.
  uint32_t progress_timeout_ms = 2000;

  // --- Circuit breaker, one per path to a peer ---
  // Consecutive failed batches (unreachable, progress timeout, deadline) that open the breaker;
  // 0 disables it. KVBRIDGE_BREAKER_FAILURES.
  uint32_t breaker_failures = 3;
  // How long the breaker stays open before letting one probe batch through; doubles after
  // each failed probe up to breaker_max_backoff_ms. KVBRIDGE_BREAKER_BACKOFF_MS.
  uint32_t breaker_backoff_ms = 200;
  // KVBRIDGE_BREAKER_MAX_BACKOFF_MS.
  uint32_t breaker_max_backoff_ms = 5000;

  // --- Several transports per peer (docs/transfer-engine.md "Several transports per peer") ---
  // When ops fail on one path to a peer with PEER_UNREACHABLE, PROGRESS_TIMEOUT, BACKPRESSURE
  // or PROTOCOL, re-post them (only the failed ones) on the peer's next path whose breaker
  // admits, within the batch's deadline. KVBRIDGE_PATH_FAILOVER (0 or 1).
  bool path_failover = true;
  // Fail WRITEs over too. A WRITE that timed out on one path may still land late through it
  // after the same bytes landed through the next (identical bytes: the local buffer is the
  // caller's until the batch ends); off, failed WRITEs end with their first path's error.
  // KVBRIDGE_PATH_FAILOVER_WRITES (0 or 1).
  bool path_failover_writes = true;
  // Least time that must be left before a batch's deadline for a failover to be tried; with
  // less, the ops end with their path's error. KVBRIDGE_FAILOVER_MIN_BUDGET_MS.
  uint32_t failover_min_budget_ms = 5;

  // --- Peers in the same process (docs/transfer-engine.md "Peers in the same process") ---
  // Ops to a peer that is another engine of this process (same node id and incarnation, same
  // cluster token), on host memory at both ends, are done with a memory copy inside Submit:
  // no socket, no transport, and the peer's live registration is checked (a deregistered
  // segment is NOT_REGISTERED, bounds OUT_OF_BOUNDS) just as its transport would. Off, such
  // ops go through a transport like any other peer's (what the transport tests want).
  // KVBRIDGE_LOCAL_COPY (0 or 1).
  bool local_copy = true;
  // Threads that share one Submit's in-process copies when they add up to 1 MiB or more, the
  // submitting thread included: each op cut into 256 KiB pieces, handed out as threads come
  // free. 0: the CPUs this process may use, at most 4; 1: the submitting thread alone.
  // KVBRIDGE_LOCAL_COPY_THREADS.
  uint32_t local_copy_threads = 0;

  // --- Bounds (what one process keeps for batches; docs/transfer-engine.md "Batches") ---
  // Most ops one Submit takes; more is INVALID_ARGUMENT naming this limit.
  // KVBRIDGE_MAX_OPS_PER_BATCH.
  uint32_t max_ops_per_batch = 1u << 20;
  // Batches submitted and not yet known to be final. Submit past it first looks for batches
  // that finished meanwhile; if there are still this many in flight it is BACKPRESSURE (poll,
  // wait or cancel some first). KVBRIDGE_MAX_INFLIGHT_BATCHES.
  uint32_t max_inflight_batches = 65536;
  // Batches found final that nobody has polled yet: past it the oldest is reaped (its result
  // dropped, with a WARN), and a later Poll/Wait of its id is NOT_FOUND saying it was reaped.
  // KVBRIDGE_MAX_UNPOLLED_BATCHES.
  uint32_t max_unpolled_batches = 65536;

  // --- Plugin settings ---
  // "<plugin>.<key>" -> value; see docs/configuration.md for each plugin's keys.
  std::map<std::string, std::string> plugin_config;

  // Defaults, overridden by every KVBRIDGE_* variable that is set. A malformed number in a
  // variable is ignored with a logged warning naming the variable.
  static EngineOptions FromEnv();
};

}  // namespace kvbridge

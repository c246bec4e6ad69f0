#include "kvbridge/options.h"

#include "util/env.h"

namespace kvbridge {

using util::EnvBool;
using util::EnvList;
using util::EnvNumber;
using util::EnvString;

EngineOptions EngineOptions::FromEnv() {
  EngineOptions o;
  EnvString("KVBRIDGE_NODE_ID", &o.node_id);
  EnvList("KVBRIDGE_TRANSPORTS", &o.transports);
  // KVBRIDGE_PLUGIN_PATH is read by the plugin loader itself (DefaultSearchPath), so it is
  // not copied into plugin_path here.
  EnvString("KVBRIDGE_LISTEN", &o.listen);
  EnvString("KVBRIDGE_HANDSHAKE_LISTEN", &o.handshake_listen);
  EnvString("KVBRIDGE_CLUSTER_TOKEN", &o.cluster_token);
  EnvNumber("KVBRIDGE_DEADLINE_MS", &o.default_deadline_ms);
  EnvNumber("KVBRIDGE_PROGRESS_TIMEOUT_MS", &o.progress_timeout_ms);
  EnvNumber("KVBRIDGE_BREAKER_FAILURES", &o.breaker_failures);
  EnvNumber("KVBRIDGE_BREAKER_BACKOFF_MS", &o.breaker_backoff_ms);
  EnvNumber("KVBRIDGE_BREAKER_MAX_BACKOFF_MS", &o.breaker_max_backoff_ms);
  EnvBool("KVBRIDGE_PATH_FAILOVER", &o.path_failover);
  EnvBool("KVBRIDGE_PATH_FAILOVER_WRITES", &o.path_failover_writes);
  EnvNumber("KVBRIDGE_FAILOVER_MIN_BUDGET_MS", &o.failover_min_budget_ms);
  EnvBool("KVBRIDGE_LOCAL_COPY", &o.local_copy);
  EnvNumber("KVBRIDGE_LOCAL_COPY_THREADS", &o.local_copy_threads);
  EnvNumber("KVBRIDGE_MAX_OPS_PER_BATCH", &o.max_ops_per_batch);
  EnvNumber("KVBRIDGE_MAX_INFLIGHT_BATCHES", &o.max_inflight_batches);
  EnvNumber("KVBRIDGE_MAX_UNPOLLED_BATCHES", &o.max_unpolled_batches);
  return o;
}

}  // namespace kvbridge

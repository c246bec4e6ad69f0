#include "kvbridge/options.h"

#include <charconv>
#include <cstdlib>
#include <string>
#include <string_view>

#include "util/logging.h"

namespace kvbridge {
namespace {

void SetString(const char* var, std::string* out) {
  if (const char* v = std::getenv(var)) *out = v;
}

void SetUint(const char* var, uint32_t* out) {
  const char* v = std::getenv(var);
  if (v == nullptr) return;
  std::string_view s(v);
  uint32_t value = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || ptr != s.data() + s.size() || s.empty()) {
    KVB_LOG(WARN) << "ignoring " << var << "='" << s << "': not an unsigned 32-bit number";
    return;
  }
  *out = value;
}

void SetBool(const char* var, bool* out) {
  const char* v = std::getenv(var);
  if (v == nullptr) return;
  std::string_view s(v);
  if (s == "1" || s == "true" || s == "on") {
    *out = true;
  } else if (s == "0" || s == "false" || s == "off") {
    *out = false;
  } else {
    KVB_LOG(WARN) << "ignoring " << var << "='" << s << "': not 0/1, true/false or on/off";
  }
}

}  // namespace

EngineOptions EngineOptions::FromEnv() {
  EngineOptions o;
  SetString("KVBRIDGE_NODE_ID", &o.node_id);
  if (const char* v = std::getenv("KVBRIDGE_TRANSPORTS")) {
    std::string_view s(v);
    while (!s.empty()) {
      size_t comma = s.find(',');
      std::string_view item = s.substr(0, comma);
      if (!item.empty()) o.transports.emplace_back(item);
      if (comma == std::string_view::npos) break;
      s.remove_prefix(comma + 1);
    }
  }
  // KVBRIDGE_PLUGIN_PATH is read by the plugin loader itself (DefaultSearchPath), so it is
  // not copied into plugin_path here.
  SetString("KVBRIDGE_LISTEN", &o.listen);
  SetString("KVBRIDGE_HANDSHAKE_LISTEN", &o.handshake_listen);
  SetString("KVBRIDGE_CLUSTER_TOKEN", &o.cluster_token);
  SetUint("KVBRIDGE_DEADLINE_MS", &o.default_deadline_ms);
  SetUint("KVBRIDGE_PROGRESS_TIMEOUT_MS", &o.progress_timeout_ms);
  SetUint("KVBRIDGE_BREAKER_FAILURES", &o.breaker_failures);
  SetUint("KVBRIDGE_BREAKER_BACKOFF_MS", &o.breaker_backoff_ms);
  SetUint("KVBRIDGE_BREAKER_MAX_BACKOFF_MS", &o.breaker_max_backoff_ms);
  SetBool("KVBRIDGE_PATH_FAILOVER", &o.path_failover);
  SetBool("KVBRIDGE_PATH_FAILOVER_WRITES", &o.path_failover_writes);
  SetUint("KVBRIDGE_FAILOVER_MIN_BUDGET_MS", &o.failover_min_budget_ms);
  SetUint("KVBRIDGE_MAX_OPS_PER_BATCH", &o.max_ops_per_batch);
  SetUint("KVBRIDGE_MAX_INFLIGHT_BATCHES", &o.max_inflight_batches);
  SetUint("KVBRIDGE_MAX_UNPOLLED_BATCHES", &o.max_unpolled_batches);
  return o;
}

}  // namespace kvbridge

// MasterServer: the gRPC shell around MasterState. Handlers translate messages, call the state
// machine (which never does I/O), and — for the two operations that must reach nodes before
// answering (put end, finished re-replication) — send the inventory commits with no lock held,
// in parallel, then finish. A ticker thread drives time (node expiry, revokes, eviction,
// re-replication, drains).
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/descriptor.h"
#include "kvbridge.grpc.pb.h"
#include "kvbridge/store.h"
#include "obs/http_server.h"
#include "obs/metrics.h"
#include "obs/status_page.h"
#include "store/fast_rpc.h"
#include "store/master_client.h"
#include "store/master_ha.h"
#include "store/master_state.h"
#include "store/rpc_auth.h"
#include "store/rpc_util.h"
#include "util/clock.h"
#include "util/env.h"
#include "util/host_port.h"
#include "util/logging.h"

namespace kvbridge {

using store::FromProto;
using store::ToProto;

MasterOptions MasterOptions::FromEnv() {
  using util::EnvNumber;
  using util::EnvString;
  MasterOptions o;
  EnvString("KVBRIDGE_MASTER_LISTEN", &o.listen);
  EnvNumber("KVBRIDGE_NODE_TTL_MS", &o.node_ttl_ms);
  EnvNumber("KVBRIDGE_LEASE_MS", &o.lease_ms);
  EnvNumber("KVBRIDGE_PUT_TIMEOUT_MS", &o.put_timeout_ms);
  EnvNumber("KVBRIDGE_SOFT_PIN_TTL_MS", &o.soft_pin_ttl_ms);
  EnvNumber("KVBRIDGE_MIN_REPLICAS", &o.min_replicas);
  EnvNumber("KVBRIDGE_HIGH_WATERMARK", &o.high_watermark);
  EnvNumber("KVBRIDGE_LOW_WATERMARK", &o.low_watermark);
  EnvNumber("KVBRIDGE_DEMOTE_HIGH_WATERMARK", &o.demote_high_watermark);
  EnvNumber("KVBRIDGE_DEMOTE_LOW_WATERMARK", &o.demote_low_watermark);
  EnvNumber("KVBRIDGE_PROMOTE_AFTER_READS", &o.promote_after_reads);
  EnvNumber("KVBRIDGE_DRAIN_TIMEOUT_MS", &o.drain_timeout_ms);
  EnvNumber("KVBRIDGE_RPC_TIMEOUT_MS", &o.rpc_timeout_ms);
  EnvNumber("KVBRIDGE_TASK_TIMEOUT_MS", &o.task_timeout_ms);
  EnvNumber("KVBRIDGE_DEPARTED_NODE_TTL_MS", &o.departed_node_ttl_ms);
  EnvNumber("KVBRIDGE_MAX_DEPARTED_NODES", &o.max_departed_nodes);
  EnvNumber("KVBRIDGE_MAX_DEPARTED_COPIES", &o.max_departed_copies);
  EnvString("KVBRIDGE_MASTER_FAULTS", &o.faults);
  EnvString("KVBRIDGE_CLUSTER_TOKEN", &o.cluster_token);
  EnvString("KVBRIDGE_ADMIN_TOKEN", &o.admin_token);
  EnvNumber("KVBRIDGE_RPC_AUTH_SKEW_MS", &o.rpc_auth_skew_ms);
  EnvString("KVBRIDGE_MASTER_ETCD", &o.etcd);
  EnvString("KVBRIDGE_MASTER_ADVERTISE", &o.advertise);
  EnvNumber("KVBRIDGE_HA_LEASE_MS", &o.ha_lease_ms);
  EnvNumber("KVBRIDGE_HA_TAKEOVER_WAIT_MS", &o.ha_takeover_wait_ms);
  std::string fast_port;
  EnvString("KVBRIDGE_MASTER_FAST_PORT", &fast_port);
  if (fast_port == "off") {
    o.fast_port = -1;
  } else if (!fast_port.empty()) {
    uint32_t port = UINT32_MAX;  // a value that does not parse is warned about, and kept out
    EnvNumber("KVBRIDGE_MASTER_FAST_PORT", &port);
    if (port <= 65535) {
      o.fast_port = static_cast<int32_t>(port);
    } else if (port != UINT32_MAX) {
      KVB_LOG(WARN) << "KVBRIDGE_MASTER_FAST_PORT=" << fast_port
                    << " is not a port (0-65535, or off); the lean port stays on any free port";
    }
  }
  EnvString("KVBRIDGE_METRICS_LISTEN", &o.metrics_listen);
  if (o.metrics_listen == "off") o.metrics_listen.clear();
  EnvString("KVBRIDGE_METRICS_TOKEN", &o.metrics_token);
  return o;
}

namespace {

// How often the master ticks (liveness, repairs, eviction).
uint64_t TickPeriodMs(uint64_t node_ttl_ms) {
  return std::max<uint64_t>(20, std::min<uint64_t>(200, node_ttl_ms / 6));
}

store::NodeIdentity FromProto(const rpc::NodeIdentity& id) {
  return store::NodeIdentity{id.node_id(), id.incarnation()};
}

void ToProto(const store::NodeIdentity& id, rpc::NodeIdentity* out) {
  out->set_node_id(id.node_id);
  out->set_incarnation(id.incarnation);
}

void ToProto(const store::ReplicaLocation& r, rpc::ReplicaLocation* out) {
  ToProto(r.node, out->mutable_node());
  out->set_segment_id(r.segment_id);
  out->set_offset(r.offset);
  out->set_length(r.length);
  out->set_tier(static_cast<uint32_t>(r.tier));
}

// Observes how long a handler ran, in seconds, when it returns.
class Timed {
 public:
  explicit Timed(obs::Histogram* h) : h_(h), start_(std::chrono::steady_clock::now()) {}
  ~Timed() {
    h_->Observe(std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  obs::Histogram* h_;
  std::chrono::steady_clock::time_point start_;
};

int64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

grpc::Status Done(const Status& st, rpc::Status* reply) {
  ToProto(st, reply);
  return grpc::Status::OK;
}

// A registration's engine descriptor must be the registering node's own: its identity, with
// every DRAM segment registered (at least its capacity long). Otherwise other nodes, told by
// tasks to write to "this node", would write into whatever process the descriptor names.
Status CheckDescriptor(const rpc::RegisterNodeRequest& req) {
  Result<core::Descriptor> d = core::DecodeDescriptor(req.engine_descriptor());
  if (!d.ok()) return d.status().WithContext("engine descriptor");
  if (d->node_id != req.node().node_id() || d->incarnation != req.node().incarnation()) {
    return Status::InvalidArgument(
        "the engine descriptor is " +
        store::ToString(store::NodeIdentity{d->node_id, d->incarnation}) +
        ", not the registering " +
        store::ToString(store::NodeIdentity{req.node().node_id(), req.node().incarnation()}));
  }
  for (const auto& s : req.segments()) {
    if (s.tier() == 2) continue;  // SSD tiers are not engine memory
    auto it = std::find_if(d->segments.begin(), d->segments.end(),
                           [&](const core::SegmentDesc& e) { return e.id == s.segment_id(); });
    if (it == d->segments.end() || it->length < s.capacity()) {
      return Status::InvalidArgument("DRAM segment " + std::to_string(s.segment_id()) + " (" +
                                     std::to_string(s.capacity()) +
                                     " bytes) is not registered in the engine descriptor");
    }
  }
  return Status::OK();
}

}  // namespace

// Every handler first checks the caller's proof, then that this master may act (Gate).
#define KVB_AUTH(ctx, method)                                                     \
  do {                                                                            \
    KVB_RPC_AUTH(auth, ctx, method, "master");                                    \
    if (grpc::Status _kvb_gate = Gate(method); !_kvb_gate.ok()) return _kvb_gate; \
  } while (0)

// MasterOptions::faults: counters of calls still to be failed, each taken once.
struct Faults {
  std::atomic<uint32_t> demote_done_lose_request{0};
  std::atomic<uint32_t> demote_done_lose_reply{0};
  std::atomic<uint32_t> task_done_lose_request{0};
  std::atomic<uint32_t> task_done_lose_reply{0};
  std::atomic<uint32_t> heartbeat_lose_reply{0};   // counts only replies that carry frees
  std::atomic<uint32_t> register_lose_reply{0};    // counts only registrations with an inventory
  std::atomic<uint32_t> inflight_publish_fail{0};  // counts only publishes with maps to write

  Status Parse(const std::string& spec) {
    return store::ParseFaults(spec, "MasterOptions::faults",
                              {{"demote_done_lose_request", &demote_done_lose_request},
                               {"demote_done_lose_reply", &demote_done_lose_reply},
                               {"task_done_lose_request", &task_done_lose_request},
                               {"task_done_lose_reply", &task_done_lose_reply},
                               {"heartbeat_lose_reply", &heartbeat_lose_reply},
                               {"register_lose_reply", &register_lose_reply},
                               {"inflight_publish_fail", &inflight_publish_fail}});
  }
  static bool Take(std::atomic<uint32_t>* left) { return store::TakeFault(left); }
};

struct MasterServer::Impl final : public rpc::Master::Service {
  MasterOptions options;
  std::unique_ptr<store::RpcAuth> auth;
  // Destructive calls (RemoveAll; Drain/Deregister of a node by someone else) need the admin
  // token's proof whenever the cluster has a token (or an admin token is set).
  bool admin_required = false;
  store::CallKey admin_key;  // empty: no admin token configured
  // Per node id: the secret of its current registration (admin_required only), with which a
  // node drains and deregisters itself. Lost on a master restart: the node registers again.
  struct NodeSecret {
    uint64_t incarnation = 0;
    std::string secret;
  };
  std::mutex secrets_mu;
  std::unordered_map<std::string, NodeSecret> node_secrets;
  Faults faults;
  // Set when this master was elected in etcd (HaMaster): it acts only while the gate is valid,
  // and answers clients only once the nodes listed in etcd have registered.
  std::shared_ptr<store::LeaderGate> gate;
  std::unique_ptr<store::MasterState> state;
  std::unique_ptr<grpc::Server> server;
  std::string address;
  std::unique_ptr<store::fast::Server> fast;  // the lean port; null when turned off
  obs::Counter* fast_calls = nullptr;

  store::NodeStubCache node_stubs;

  std::mutex task_fail_mu;
  uint64_t task_failures = 0;
  std::string first_task_failure;

  std::mutex tick_mu;
  std::condition_variable tick_cv;
  bool stopping = false;
  std::thread ticker;

  // MasterServer::Start, and HaMaster's leader with the gate of its term and the first
  // version its term may hand out.
  static Result<std::unique_ptr<MasterServer>> Launch(const MasterOptions& options,
                                                      std::shared_ptr<store::LeaderGate> gate,
                                                      uint64_t first_version);
  // --- observability (docs/operations.md) ---
  obs::Registry metrics;
  struct RpcMetrics {
    obs::Histogram* seconds = nullptr;  // per call
    obs::Counter* keys = nullptr;       // keys asked for, over all calls
  };
  RpcMetrics put_start_metrics, put_end_metrics, get_metrics, remove_metrics;
  // GetReplicas keys by what they found: a DRAM replica, SSD replicas only, nothing.
  obs::Counter* get_dram = nullptr;
  obs::Counter* get_ssd = nullptr;
  obs::Counter* get_miss = nullptr;
  obs::Counter* publish_failures = nullptr;  // in-flight map writes to etcd that failed
  std::atomic<bool> is_leader{true};
  std::mutex leader_mu;
  std::string not_leader_why;  // under leader_mu
  // The last kMaxEvents membership and repair events, for the status page.
  struct Event {
    int64_t unix_ms = 0;
    std::string kind;
    std::string text;
  };
  static constexpr size_t kMaxEvents = 200;
  std::mutex events_mu;
  std::deque<Event> events;
  uint64_t start_ns = 0;
  // MasterState::Stats() walks the whole table: scrapes and status pages (every 2 s, per open
  // browser) share one walk a second.
  struct StatsSnapshot {
    store::MasterStats stats;
    uint64_t taken_ns = 0;  // heartbeat ages are counted to here
  };
  std::mutex stats_mu;
  std::shared_ptr<const StatsSnapshot> stats;
  std::shared_ptr<const StatsSnapshot> RecentStats() {
    std::lock_guard<std::mutex> lock(stats_mu);
    if (!stats || util::MonoNs() - stats->taken_ns > 1000000000ull) {
      auto fresh = std::make_shared<StatsSnapshot>();
      fresh->stats = state->Stats();
      fresh->taken_ns = util::MonoNs();
      stats = std::move(fresh);
    }
    return stats;
  }
  std::unique_ptr<obs::HttpServer> http;  // null: no endpoint
  std::string metrics_address;

  ~Impl() override {
    http.reset();  // its handlers read the state and the server
    fast.reset();  // its connection threads call the handlers
    {
      std::lock_guard<std::mutex> lock(tick_mu);
      stopping = true;
    }
    tick_cv.notify_all();
    if (ticker.joinable()) ticker.join();
    if (server) server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  uint64_t term() const { return gate ? gate->epoch() : 0; }

  // UNAVAILABLE once an elected master's lease may have run out (it was replaced, or is about
  // to be: it must not act, and the caller finds the leader again), and for client calls while
  // a new leader waits for the nodes listed in etcd (it does not know their objects yet).
  grpc::Status Gate(std::string_view method) {
    if (!gate) return grpc::Status::OK;
    if (!gate->Valid()) {
      return {grpc::StatusCode::UNAVAILABLE,
              "the master at " + address +
                  " is no longer the leader (its etcd lease may have run out); the leader is "
                  "the one etcd names now"};
    }
    static constexpr std::string_view kWaitFor[] = {
        store::method::kPutStart, store::method::kGetReplicas, store::method::kExists,
        store::method::kRemove,   store::method::kRemoveAll,   store::method::kRemoveByRegex};
    if (std::find(std::begin(kWaitFor), std::end(kWaitFor), method) == std::end(kWaitFor)) {
      return grpc::Status::OK;
    }
    if (const size_t n = gate->Awaiting(); n > 0) {
      return {grpc::StatusCode::UNAVAILABLE,
              "the master at " + address + " took over as leader and waits for " +
                  std::to_string(n) +
                  " node(s) listed in etcd to register (it does not know their objects yet)"};
    }
    return grpc::Status::OK;
  }

  // An elected leader writes where its writers may still write to etcd before handing ranges
  // out (docs/ha.md); calls serialize, so a shrinking map never overwrites a growing one.
  std::mutex publish_mu;
  Status PublishInflight(bool growth_only = true) {
    if (!gate || !gate->publish) return Status::OK();
    std::lock_guard<std::mutex> lock(publish_mu);
    const uint64_t now = util::MonoNs();
    std::vector<store::InflightMap> maps = state->InflightToPublish(now, growth_only);
    if (maps.empty()) return Status::OK();
    Status st = faults.Take(&faults.inflight_publish_fail)
                    ? Status::Unavailable("fault injection: inflight_publish_fail")
                    : gate->publish(maps);
    if (!st.ok()) {
      publish_failures->Inc();
      return st.WithContext("publishing where writers may write (etcd " +
                            std::to_string(maps.size()) + " node map(s))");
    }
    state->InflightPublished(maps, now);
    return Status::OK();
  }

  void AddEvent(std::string kind, std::string text) {
    std::lock_guard<std::mutex> lock(events_mu);
    events.push_back({UnixMs(), std::move(kind), std::move(text)});
    if (events.size() > kMaxEvents) events.pop_front();
  }

  RpcMetrics MetricsOf(const std::string& method, const std::string& op) {
    RpcMetrics m;
    m.seconds = metrics.Histogram("kvbridge_master_rpc_duration_seconds",
                                  "Time the master took to answer a client call, by method.",
                                  {{"method", method}});
    m.keys = metrics.Counter("kvbridge_master_keys_total",
                             "Keys asked for by client calls, by operation.", {{"op", op}});
    return m;
  }

  void SetUpMetrics() {
    put_start_metrics = MetricsOf("PutStart", "put");
    put_end_metrics = MetricsOf("PutEnd", "put_end");
    get_metrics = MetricsOf("GetReplicas", "get");
    remove_metrics = MetricsOf("Remove", "remove");
    const std::string get_help =
        "Keys of GetReplicas calls (gets, not size queries) by what they found: a DRAM replica, "
        "SSD replicas only, or none.";
    get_dram = metrics.Counter("kvbridge_master_get_keys_total", get_help, {{"result", "dram"}});
    get_ssd = metrics.Counter("kvbridge_master_get_keys_total", get_help, {{"result", "ssd"}});
    get_miss = metrics.Counter("kvbridge_master_get_keys_total", get_help, {{"result", "miss"}});
    publish_failures = metrics.Counter(
        "kvbridge_master_inflight_publish_failures_total",
        "HA leader: writes of the in-flight maps to etcd that failed; each failed the PutStart "
        "(revoked, UNAVAILABLE) or heartbeat reply that needed it.");
    fast_calls = metrics.Counter("kvbridge_master_fast_calls_total",
                                 "Client calls answered on the lean port (PutStart, PutEnd, "
                                 "GetReplicas, Exists) instead of gRPC.");
    metrics.AddCollector([this](obs::MetricWriter& w) { Collect(w); });
  }

  // Everything the state machine already counts, read at scrape time.
  void Collect(obs::MetricWriter& w) {
    const std::shared_ptr<const StatsSnapshot> snapshot = RecentStats();
    const store::MasterStats& s = snapshot->stats;
    const uint64_t now = snapshot->taken_ns;
    auto gauge = [&](const char* name, const char* help, double v, const obs::Labels& l = {}) {
      w.Gauge(name, help, l, v);
    };
    auto counter = [&](const char* name, const char* help, double v) {
      w.Counter(name, help, {}, v);
    };
    gauge("kvbridge_master_is_leader", "1 when this master leads the cluster, else 0.",
          is_leader.load() ? 1 : 0);
    gauge("kvbridge_master_uptime_seconds", "Seconds since the master started.",
          (util::MonoNs() - start_ns) / 1e9);
    gauge("kvbridge_master_objects", "Complete objects.", s.objects);
    gauge("kvbridge_master_stored_bytes", "Logical bytes of complete objects.", s.bytes);
    gauge("kvbridge_master_replica_bytes", "Bytes of all complete replicas.", s.replica_bytes);
    gauge("kvbridge_master_held_bytes",
          "Space of dropped replicas waiting for a read lease or a late writer to run out.",
          s.held_bytes);
    gauge("kvbridge_master_pending_puts", "Objects being written (PENDING or COMMITTING).",
          s.pending);
    gauge("kvbridge_master_under_replicated_objects",
          "Objects with fewer complete replicas than asked for, queued for re-replication.",
          s.under_replicated);
    gauge("kvbridge_master_under_replicated_oldest_age_seconds",
          "Seconds the longest-waiting under-replicated object has waited; 0 when none waits.",
          s.oldest_repair_ns && now > s.oldest_repair_ns ? (now - s.oldest_repair_ns) / 1e9 : 0);
    gauge("kvbridge_master_replication_tasks_in_flight",
          "Re-replication tasks handed to nodes and not yet reported.", s.tasks_in_flight);
    gauge("kvbridge_master_demotions_in_flight",
          "DRAM to SSD (and back) moves handed to nodes and not yet reported.",
          s.demotions_in_flight);
    gauge("kvbridge_master_ssd_replicas", "Complete replicas on SSD tiers.", s.ssd_replicas);
    gauge("kvbridge_master_departed_copies",
          "Copies remembered for nodes that left, until they come back or are forgotten.",
          s.departed_copies);
    counter("kvbridge_master_evictions_total", "Objects evicted to make room.", s.evictions_total);
    counter("kvbridge_master_put_revokes_total", "Puts revoked for not ending in time.",
            s.revokes_total);
    counter("kvbridge_master_nodes_expired_total", "Nodes declared dead (silent past the TTL).",
            s.nodes_expired_total);
    counter("kvbridge_master_bad_replicas_total",
            "Replicas dropped because a reader found them damaged or missing.",
            s.bad_replicas_total);
    counter("kvbridge_master_unreachable_reports_total",
            "Reads that could not reach a node (its replicas kept).", s.unreachable_reports_total);
    counter("kvbridge_master_demotions_total", "Replicas moved from DRAM to an SSD tier.",
            s.demotions_total);
    counter("kvbridge_master_promotions_total",
            "Replicas moved from SSD back to DRAM after repeated reads.", s.promotions_total);
    std::map<std::string, int> by_state = {{"ACTIVE", 0}, {"DRAINING", 0}, {"DEAD", 0}};
    for (const store::NodeStats& n : s.nodes) {
      const std::string state_name = store::NodeStateName(n.state);
      ++by_state[state_name];
      if (n.state == store::NodeState::kDead) continue;
      const std::string& id = n.identity.node_id;
      const char* cap_help = "Capacity a node contributes, by tier.";
      const char* used_help = "Bytes allocated on a node (replicas and held ranges), by tier.";
      gauge("kvbridge_master_node_capacity_bytes", cap_help, n.capacity,
            {{"node", id}, {"tier", "dram"}});
      gauge("kvbridge_master_node_used_bytes", used_help, n.used, {{"node", id}, {"tier", "dram"}});
      if (n.ssd_capacity > 0) {
        gauge("kvbridge_master_node_capacity_bytes", cap_help, n.ssd_capacity,
              {{"node", id}, {"tier", "ssd"}});
        gauge("kvbridge_master_node_used_bytes", used_help, n.ssd_used,
              {{"node", id}, {"tier", "ssd"}});
      }
      gauge("kvbridge_master_node_replicas", "Replicas a node holds.", n.replicas, {{"node", id}});
      gauge(
          "kvbridge_master_node_heartbeat_age_seconds",
          "Seconds since the master last heard from a node.",
          n.last_heartbeat_ns && now > n.last_heartbeat_ns ? (now - n.last_heartbeat_ns) / 1e9 : 0,
          {{"node", id}});
    }
    for (const auto& [state_name, count] : by_state) {
      gauge("kvbridge_master_nodes", "Nodes by state (DEAD: the most recent ones remembered).",
            count, {{"state", state_name}});
    }
  }

  // GET /status.json: what the status page shows.
  std::string StatusJson() {
    const std::shared_ptr<const StatsSnapshot> snapshot = RecentStats();
    const store::MasterStats& s = snapshot->stats;
    const uint64_t now = snapshot->taken_ns;
    std::string j = "{\"master\": " + obs::JsonString(address);
    j += ", \"is_leader\": " + std::string(is_leader.load() ? "true" : "false");
    j += ", \"uptime_s\": " + std::to_string((util::MonoNs() - start_ns) / 1000000000);
    auto num = [&](const char* k, uint64_t v) {
      j += ", \"" + std::string(k) + "\": " + std::to_string(v);
    };
    num("objects", s.objects);
    num("stored_bytes", s.bytes);
    num("replica_bytes", s.replica_bytes);
    num("pending_puts", s.pending);
    num("under_replicated", s.under_replicated);
    num("tasks_in_flight", s.tasks_in_flight);
    num("ssd_replicas", s.ssd_replicas);
    num("evictions_total", s.evictions_total);
    num("bad_replicas_total", s.bad_replicas_total);
    num("nodes_expired_total", s.nodes_expired_total);
    num("demotions_total", s.demotions_total);
    num("promotions_total", s.promotions_total);
    j += ", \"nodes\": [";
    for (size_t i = 0; i < s.nodes.size(); ++i) {
      const store::NodeStats& n = s.nodes[i];
      char inc[24];
      std::snprintf(inc, sizeof(inc), "%016llx",
                    static_cast<unsigned long long>(n.identity.incarnation));
      j += std::string(i ? ", " : "") + "{\"node_id\": " + obs::JsonString(n.identity.node_id) +
           ", \"incarnation\": \"" + inc + "\", \"state\": \"" + store::NodeStateName(n.state) +
           "\", \"dram_capacity\": " + std::to_string(n.capacity) +
           ", \"dram_used\": " + std::to_string(n.used) +
           ", \"ssd_capacity\": " + std::to_string(n.ssd_capacity) +
           ", \"ssd_used\": " + std::to_string(n.ssd_used) +
           ", \"replicas\": " + std::to_string(n.replicas) + ", \"heartbeat_age_ms\": " +
           std::to_string(n.state != store::NodeState::kDead && now > n.last_heartbeat_ns
                              ? (now - n.last_heartbeat_ns) / 1000000
                              : 0) +
           "}";
    }
    j += "], \"events\": [";
    {
      std::lock_guard<std::mutex> lock(events_mu);
      bool first = true;
      for (auto it = events.rbegin(); it != events.rend(); ++it) {  // newest first
        j += std::string(first ? "" : ", ") + "{\"unix_ms\": " + std::to_string(it->unix_ms) +
             ", \"kind\": " + obs::JsonString(it->kind) +
             ", \"text\": " + obs::JsonString(it->text) + "}";
        first = false;
      }
    }
    return j + "]}\n";
  }

  obs::HttpResponse Health() {
    if (is_leader.load()) return {200, "text/plain; charset=utf-8", "ok\n"};
    std::lock_guard<std::mutex> lock(leader_mu);
    return {503, "text/plain; charset=utf-8",
            "not serving: this master is not the leader" +
                (not_leader_why.empty() ? std::string() : ": " + not_leader_why) + "\n"};
  }

  static std::map<std::string, obs::HttpRoute> RoutesOf(MasterServer& s) {
    return s.impl_->Routes();
  }

  std::map<std::string, obs::HttpRoute> Routes() {
    std::map<std::string, obs::HttpRoute> r;
    r["/metrics"] = {[this] {
      return obs::HttpResponse{200, obs::kExpositionContentType, metrics.Render()};
    }};
    r["/health"] = {[this] { return Health(); }, /*is_public=*/true};
    r["/status.json"] = {[this] {
      return obs::HttpResponse{200, "application/json", StatusJson()};
    }};
    // The page holds no data (it asks /status.json, with the token when one is needed).
    r["/"] = {[] {
                return obs::HttpResponse{200, "text/html; charset=utf-8", obs::kStatusPageHtml};
              },
              /*is_public=*/true};
    return r;
  }

  std::shared_ptr<rpc::Node::Stub> NodeStub(const std::string& endpoint) {
    return node_stubs.Get(endpoint);
  }

  // Sends every commit of a plan in parallel and records which nodes acknowledged.
  void SendCommits(std::vector<store::NodeCommit>* commits) {
    if (commits->empty()) return;
    struct Call {
      std::shared_ptr<rpc::Node::Stub> stub;  // kept until the call is over
      grpc::ClientContext ctx;
      rpc::CommitRequest req;
      rpc::Status reply;
    };
    std::vector<std::unique_ptr<Call>> calls;
    std::mutex mu;
    std::condition_variable cv;
    size_t outstanding = commits->size();
    for (size_t i = 0; i < commits->size(); ++i) {
      store::NodeCommit& c = (*commits)[i];
      auto call = std::make_unique<Call>();
      call->ctx.set_deadline(std::chrono::system_clock::now() +
                             std::chrono::milliseconds(options.rpc_timeout_ms));
      auth->Sign(&call->ctx, store::method::kCommit);
      ToProto(c.node, call->req.mutable_node());
      for (const auto& r : c.records) *call->req.add_records() = store::RecordToProto(r);
      call->req.set_term(term());
      Call* raw = call.get();
      calls.push_back(std::move(call));
      raw->stub = NodeStub(c.control_endpoint);
      raw->stub->async()->Commit(&raw->ctx, &raw->req, &raw->reply, [&, raw, i](grpc::Status gs) {
        const bool ok = gs.ok() && raw->reply.code() == KVB_OK;
        if (!ok) {
          KVB_LOG(WARN) << "inventory commit to " << store::ToString((*commits)[i].node)
                        << " failed: "
                        << (gs.ok() ? FromProto(raw->reply).ToString() : gs.error_message());
        }
        std::lock_guard<std::mutex> lock(mu);
        (*commits)[i].ok = ok;
        if (--outstanding == 0) cv.notify_all();
      });
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return outstanding == 0; });
  }

  void TickLoop() {
    const uint64_t period_ms = TickPeriodMs(options.node_ttl_ms);
    std::unique_lock<std::mutex> lock(tick_mu);
    while (!stopping) {
      tick_cv.wait_for(lock, std::chrono::milliseconds(period_ms), [&] { return stopping; });
      if (stopping) break;
      lock.unlock();
      if (gate && !gate->Valid()) {  // replaced: expire nothing, schedule nothing
        lock.lock();
        continue;
      }
      const uint64_t tick_ns = util::MonoNs();
      store::TickSummary s = state->Tick(tick_ns);
      if (Status pub = PublishInflight(/*growth_only=*/false); !pub.ok()) {
        KVB_LOG(WARN) << pub.ToString();
      }
      if (s.nodes_expired) {
        for (const store::NodeStats& n : state->Stats().nodes) {
          if (n.state == store::NodeState::kDead && n.last_heartbeat_ns >= tick_ns) {
            AddEvent("expired", "node " + store::ToString(n.identity) +
                                    " expired: no heartbeat within the TTL");
          }
        }
      }
      if (s.drains_finished) {
        AddEvent("drained", std::to_string(s.drains_finished) + " node drain(s) finished");
      }
      if (s.paused_ms) {
        AddEvent("paused", "the master did not run for " + std::to_string(s.paused_ms) + " ms");
      }
      if (s.paused_ms) {
        KVB_LOG(WARN) << "the master did not run for " << s.paused_ms
                      << " ms (frozen or paused); every node's TTL starts over";
      }
      if (s.nodes_expired) {
        KVB_LOG(WARN) << s.nodes_expired << " node(s) expired (silent past TTL: up to "
                      << s.expired_silence_ms << " ms without a heartbeat; the previous tick ran "
                      << s.since_last_tick_ms << " ms earlier)";
      }
      if (s.tasks_created) KVB_LOG(INFO) << s.tasks_created << " re-replication task(s) scheduled";
      {
        std::lock_guard<std::mutex> fail_lock(task_fail_mu);
        if (task_failures > 0) {
          KVB_LOG(WARN) << task_failures << " re-replication task(s) failed (retried elsewhere); "
                        << "first " << first_task_failure;
          task_failures = 0;
        }
      }
      lock.lock();
    }
  }

  // The secret of this registration of `id`: the same for the same incarnation, a new one for
  // a new incarnation. Empty when no proof is asked for.
  std::string SecretFor(const rpc::NodeIdentity& id) {
    if (!admin_required) return {};
    std::lock_guard<std::mutex> lock(secrets_mu);
    NodeSecret& s = node_secrets[id.node_id()];
    if (s.secret.empty() || s.incarnation != id.incarnation()) {
      s.incarnation = id.incarnation();
      s.secret = store::RandomSecret();
    }
    return s.secret;
  }

  // Authorizes a destructive call: OK when nothing is asked for (no token), when the call
  // proves the admin token, or, for a call about `self_node` (Drain, Deregister), when it
  // proves that node's registration secret. Else PERMISSION_DENIED naming what is missing;
  // nothing was changed.
  grpc::Status Authorize(const grpc::ServerContext& ctx, std::string_view method,
                         const rpc::NodeIdentity* self_node) {
    if (!admin_required) return grpc::Status::OK;
    std::string why;
    if (self_node != nullptr) {
      store::CallKey node_key;
      {
        std::lock_guard<std::mutex> lock(secrets_mu);
        auto it = node_secrets.find(self_node->node_id());
        if (it != node_secrets.end() && it->second.incarnation == self_node->incarnation()) {
          node_key = store::CallKey(it->second.secret, store::kNodeKeyPurpose);
        }
      }
      if (!node_key.empty() && auth->CheckExtra(ctx, store::kNodeHeader, node_key, method, &why)) {
        return grpc::Status::OK;
      }
    }
    const std::string what =
        std::string(method) + (self_node ? " of node " + self_node->node_id() + " by another" : "");
    if (admin_key.empty()) {
      KVB_LOG(WARN) << "refused " << what << " from " << ctx.peer()
                    << ": no admin token is configured (KVBRIDGE_ADMIN_TOKEN)";
      return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                          what +
                              " needs the admin token, and this master has none: set "
                              "KVBRIDGE_ADMIN_TOKEN on the master and the caller");
    }
    if (auth->CheckExtra(ctx, store::kAdminHeader, admin_key, method, &why)) {
      return grpc::Status::OK;
    }
    KVB_LOG(WARN) << "refused " << what << " from " << ctx.peer() << ": " << why
                  << " (the admin token, KVBRIDGE_ADMIN_TOKEN)";
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        what + " needs the admin token (KVBRIDGE_ADMIN_TOKEN): " + why);
  }

  // --- node-facing ---
  grpc::Status RegisterNode(grpc::ServerContext* ctx, const rpc::RegisterNodeRequest* req,
                            rpc::RegisterNodeReply* reply) override {
    KVB_AUTH(ctx, store::method::kRegisterNode);
    std::vector<store::InventoryRecord> inventory;
    inventory.reserve(req->inventory_size());
    for (const auto& r : req->inventory()) inventory.push_back(store::RecordFromProto(r));
    return Register(ctx, *req, inventory, reply);
  }

  // The registration of a node whose inventory comes in chunks: every message is read (and
  // converted, so that at most one chunk is held as a message) before the node is registered
  // once with all of it. Later messages may carry nothing but inventory.
  grpc::Status RegisterNodeStream(grpc::ServerContext* ctx,
                                  grpc::ServerReader<rpc::RegisterNodeRequest>* stream,
                                  rpc::RegisterNodeReply* reply) override {
    KVB_AUTH(ctx, store::method::kRegisterNodeStream);
    rpc::RegisterNodeRequest head, chunk;
    if (!stream->Read(&head)) {
      return {grpc::StatusCode::INVALID_ARGUMENT, "RegisterNodeStream: no message"};
    }
    std::vector<store::InventoryRecord> inventory;
    inventory.reserve(head.inventory_size());
    for (const auto& r : head.inventory()) inventory.push_back(store::RecordFromProto(r));
    head.clear_inventory();
    size_t chunks = 1;
    while (stream->Read(&chunk)) {
      ++chunks;
      for (const auto& r : chunk.inventory()) inventory.push_back(store::RecordFromProto(r));
    }
    if (ctx->IsCancelled()) {
      return {grpc::StatusCode::CANCELLED, "RegisterNodeStream: the node gave up"};
    }
    KVB_LOG(DEBUG) << "node " << head.node().node_id() << " sent " << inventory.size()
                   << " inventory records in " << chunks << " message(s)";
    return Register(ctx, head, inventory, reply);
  }

  // RegisterNode and RegisterNodeStream after the proof check: the registration `head` (its
  // own inventory field is not read) with the node's whole `inventory`.
  grpc::Status Register(grpc::ServerContext* ctx, const rpc::RegisterNodeRequest& head,
                        const std::vector<store::InventoryRecord>& inventory,
                        rpc::RegisterNodeReply* reply) {
    const rpc::RegisterNodeRequest* req = &head;
    if (Status st = CheckDescriptor(*req); !st.ok()) {
      KVB_LOG(WARN) << "refused the registration of " << req->node().node_id() << " from "
                    << ctx->peer() << ": " << st.ToString();
      ToProto(st, reply->mutable_status());
      return grpc::Status::OK;
    }
    store::NodeRegistration reg;
    reg.identity = FromProto(req->node());
    reg.engine_descriptor = req->engine_descriptor();
    reg.control_endpoint = req->rpc_address();
    reg.draining = req->draining();
    reg.registered_before = req->registered_before();
    for (const auto& s : req->segments()) {
      reg.segments.push_back(store::SegmentInfo{
          s.segment_id(), s.capacity(), s.tier() == 2 ? store::Tier::kSsd : store::Tier::kDram});
    }
    // A new incarnation of a registered node id takes its place (a restart); token holders may
    // do that, but it is said loudly.
    uint64_t replaced = 0;
    for (const auto& n : state->GetNodeDirectory({req->node().node_id()}).nodes) {
      if (n.identity.incarnation != req->node().incarnation()) replaced = n.identity.incarnation;
    }
    auto r = state->RegisterNode(reg, inventory, util::MonoNs());
    if (!r.ok() && !r.status().Is(StatusCode::kAlreadyExists)) {
      ToProto(r.status(), reply->mutable_status());
      return grpc::Status::OK;
    }
    if (r.ok() && replaced != 0) {
      KVB_LOG(WARN) << "node " << store::ToString(reg.identity) << " (from " << ctx->peer()
                    << ") takes over node id " << req->node().node_id() << " from "
                    << store::ToString(store::NodeIdentity{req->node().node_id(), replaced})
                    << ", which is dropped: a restart, or someone holding the cluster token";
    }
    ToProto(Status::OK(), reply->mutable_status());
    reply->set_term(term());
    if (gate) gate->Registered(req->node().node_id());
    reply->set_node_secret(SecretFor(req->node()));
    reply->set_heartbeat_interval_ms(
        static_cast<uint32_t>(r.ok() ? r->heartbeat_interval_ms : options.node_ttl_ms / 3));
    if (r.ok()) {
      for (const auto& f : r->frees) *reply->add_frees() = store::RecordToProto(f);
      for (uint64_t seq : r->free_seqs) reply->add_free_seqs(seq);
      reply->set_more(r->more);
      AddEvent(replaced ? "restarted" : "registered",
               "node " + store::ToString(reg.identity) +
                   (replaced ? " registered again (restart)" : " registered") + " with " +
                   std::to_string(r->records_accepted) + " inventory records");
      KVB_LOG(INFO) << "node " << store::ToString(reg.identity) << " registered ("
                    << r->records_accepted << " inventory records accepted, "
                    << inventory.size() - std::min(inventory.size(), r->records_accepted)
                    << " dropped)";
      if (r->no_alloc_ms > 0) {
        KVB_LOG(WARN) << "node " << store::ToString(reg.identity)
                      << " registered again: no new data goes to its DRAM for " << r->no_alloc_ms
                      << " ms, until writes and read leases of its previous registration have "
                         "run out";
      }
    } else if (auto queued = state->UnackedFrees(reg.identity); queued.ok()) {
      // Registered already: the first reply was lost, maybe with frees. They are still queued.
      for (const auto& f : queued->frees) *reply->add_frees() = store::RecordToProto(f);
      for (uint64_t seq : queued->free_seqs) reply->add_free_seqs(seq);
      reply->set_more(queued->more);
    }
    if (!inventory.empty() && faults.Take(&faults.register_lose_reply)) {
      return {grpc::StatusCode::UNAVAILABLE, "fault injection: RegisterNode reply lost"};
    }
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext* ctx, const rpc::HeartbeatRequest* req,
                         rpc::HeartbeatReply* reply) override {
    KVB_AUTH(ctx, store::method::kHeartbeat);
    // Liveness first, under its own lock: never behind a data-plane call holding the table.
    state->Touch(FromProto(req->node()), util::MonoNs());
    auto r = state->Heartbeat(FromProto(req->node()), req->frees_acked(), util::MonoNs());
    if (Status pub = PublishInflight(); r.ok() && !pub.ok()) {
      // Its tasks and promotions are not handed out (they time out and are scheduled again);
      // its frees come again in the next reply.
      return {grpc::StatusCode::UNAVAILABLE, "Heartbeat: " + pub.ToString()};
    }
    ToProto(r.ok() ? Status::OK() : r.status(), reply->mutable_status());
    reply->set_term(term());
    if (!r.ok()) return grpc::Status::OK;
    for (const auto& f : r->frees) *reply->add_frees() = store::RecordToProto(f);
    for (uint64_t seq : r->free_seqs) reply->add_free_seqs(seq);
    const uint64_t now = util::MonoNs();
    for (const auto& t : r->tasks) {
      auto* out = reply->add_tasks();
      out->set_task_id(t.task_id);
      out->set_key(t.key);
      out->set_version(t.version);
      ToProto(t.source, out->mutable_source());
      ToProto(t.dest, out->mutable_dest());
      out->set_dest_descriptor(t.dest_descriptor);
      out->set_dest_rpc_address(t.dest_control_endpoint);
      out->set_checksum(t.checksum);
      out->set_timeout_ms(
          static_cast<uint32_t>(t.deadline_ns > now ? (t.deadline_ns - now) / 1000000 : 0));
    }
    for (const auto& d : r->demotions) {
      auto* out = reply->add_demotions();
      *out->mutable_source() = store::RecordToProto(d.source);
      *out->mutable_dest() = store::RecordToProto(d.dest);
      out->set_timeout_ms(
          static_cast<uint32_t>(d.deadline_ns > now ? (d.deadline_ns - now) / 1000000 : 0));
    }
    reply->set_drained(r->drained);
    reply->set_more(r->more);
    if (!r->frees.empty() && faults.Take(&faults.heartbeat_lose_reply)) {
      return {grpc::StatusCode::UNAVAILABLE, "fault injection: Heartbeat reply lost"};
    }
    return grpc::Status::OK;
  }

  grpc::Status DemoteDone(grpc::ServerContext* ctx, const rpc::DemoteDoneRequest* req,
                          rpc::Status* reply) override {
    KVB_AUTH(ctx, store::method::kDemoteDone);
    if (faults.Take(&faults.demote_done_lose_request)) {
      return {grpc::StatusCode::UNAVAILABLE, "fault injection: DemoteDone request lost"};
    }
    const bool ok = req->status().code() == KVB_OK;
    if (!ok) {
      KVB_LOG(WARN) << "demotion of a replica on " << req->node().node_id()
                    << " failed: " << FromProto(req->status()).ToString();
    }
    grpc::Status answer = Done(state->DemoteDone(FromProto(req->node()), req->key(), req->version(),
                                                 req->dest_replica_id(), ok, util::MonoNs()),
                               reply);
    if (faults.Take(&faults.demote_done_lose_reply)) {
      return {grpc::StatusCode::UNAVAILABLE, "fault injection: DemoteDone reply lost"};
    }
    return answer;
  }

  grpc::Status TaskDone(grpc::ServerContext* ctx, const rpc::TaskDoneRequest* req,
                        rpc::Status* reply) override {
    KVB_AUTH(ctx, store::method::kTaskDone);
    if (faults.Take(&faults.task_done_lose_request)) {
      return {grpc::StatusCode::UNAVAILABLE, "fault injection: TaskDone request lost"};
    }
    grpc::Status answer = ApplyTaskDone(req, reply);
    if (faults.Take(&faults.task_done_lose_reply)) {
      return {grpc::StatusCode::UNAVAILABLE, "fault injection: TaskDone reply lost"};
    }
    return answer;
  }

  grpc::Status ApplyTaskDone(const rpc::TaskDoneRequest* req, rpc::Status* reply) {
    const bool ok = req->status().code() == KVB_OK;
    if (!ok) {
      // Summarized by the ticker: after a node loss hundreds can fail at once.
      std::lock_guard<std::mutex> lock(task_fail_mu);
      if (task_failures++ == 0) {
        first_task_failure =
            "on " + req->node().node_id() + ": " + FromProto(req->status()).ToString();
      }
    }
    auto plan = state->TaskDone(req->task_id(), FromProto(req->node()), ok, util::MonoNs());
    if (!plan.ok()) return Done(plan.status(), reply);
    if (plan->commits.empty()) return Done(Status::OK(), reply);
    SendCommits(&plan->commits);
    return Done(state->FinishTask(plan.value(), util::MonoNs()), reply);
  }

  grpc::Status Drain(grpc::ServerContext* ctx, const rpc::NodeIdentity* req,
                     rpc::Status* reply) override {
    KVB_AUTH(ctx, store::method::kDrain);
    if (grpc::Status a = Authorize(*ctx, store::method::kDrain, req); !a.ok()) return a;
    KVB_LOG(INFO) << "node " << req->node_id() << " asked to drain";
    AddEvent("draining", "node " + req->node_id() + " asked to drain");
    return Done(state->StartDrain(FromProto(*req), util::MonoNs()), reply);
  }

  grpc::Status Deregister(grpc::ServerContext* ctx, const rpc::NodeIdentity* req,
                          rpc::Status* reply) override {
    KVB_AUTH(ctx, store::method::kDeregister);
    if (grpc::Status a = Authorize(*ctx, store::method::kDeregister, req); !a.ok()) return a;
    Status st = state->Deregister(FromProto(*req), util::MonoNs());
    if (st.ok()) AddEvent("deregistered", "node " + req->node_id() + " left the cluster");
    if (st.ok() && admin_required) {
      std::lock_guard<std::mutex> lock(secrets_mu);
      auto it = node_secrets.find(req->node_id());
      if (it != node_secrets.end() && it->second.incarnation == req->incarnation()) {
        node_secrets.erase(it);
      }
    }
    return Done(st, reply);
  }

  // --- client-facing ---
  // The four calls of the lean port: the gRPC handler checks the call's proof and the gate,
  // the lean port the gate (its connection proved the token), then both run the same body.
  grpc::Status PutStart(grpc::ServerContext* ctx, const rpc::PutStartRequest* req,
                        rpc::PutStartReply* reply) override {
    KVB_AUTH(ctx, store::method::kPutStart);
    return DoPutStart(req, reply);
  }
  grpc::Status DoPutStart(const rpc::PutStartRequest* req, rpc::PutStartReply* reply) {
    Timed timed(put_start_metrics.seconds);
    put_start_metrics.keys->Inc(req->keys_size());
    std::vector<store::PutItem> items(req->keys_size());
    for (int i = 0; i < req->keys_size(); ++i) {
      items[i].key = req->keys(i);
      if (i < req->sizes_size()) {
        items[i].sizes.assign(req->sizes(i).sizes().begin(), req->sizes(i).sizes().end());
      }
    }
    store::PutOptions po;
    po.replica_num = req->replica_num();
    po.client_node_id = req->client_node_id();
    po.overwrite = req->overwrite();
    po.pinned = req->hard_pin();
    switch (req->soft_pin()) {
      case rpc::SOFT_PIN_ENABLE:
        po.soft_pin = store::SoftPin::kEnable;
        break;
      case rpc::SOFT_PIN_DISABLE:
        po.soft_pin = store::SoftPin::kDisable;
        break;
      default:  // PRESERVE, and values of a newer client this master does not know
        po.soft_pin = store::SoftPin::kPreserve;
    }
    po.soft_pin_ttl_ms = req->soft_pin_ttl_ms();
    const uint64_t now = util::MonoNs();
    auto results = state->PutStart(items, po, now);
    if (Status pub = PublishInflight(); !pub.ok()) {
      // Nothing handed out may be written where a successor would not know to wait.
      std::vector<store::KeyVersion> revoke;
      for (size_t i = 0; i < results.size(); ++i) {
        if (results[i].ok()) revoke.push_back({items[i].key, results[i]->version});
      }
      (void)state->PutRevoke(revoke, util::MonoNs());
      return {grpc::StatusCode::UNAVAILABLE, "PutStart: " + pub.ToString()};
    }
    for (auto& r : results) {
      auto* item = reply->add_items();
      if (!r.ok()) {
        ToProto(r.status(), item->mutable_status());
        continue;
      }
      // OK is the absent status (code 0): no message per key.
      item->set_version(r->version);
      for (const auto& loc : r->replicas) ToProto(loc, item->add_replicas());
      item->set_deadline_ms(
          static_cast<uint32_t>(r->deadline_ns > now ? (r->deadline_ns - now) / 1000000 : 0));
    }
    return grpc::Status::OK;
  }

  grpc::Status PutEnd(grpc::ServerContext* ctx, const rpc::PutEndRequest* req,
                      rpc::KeyStatusReply* reply) override {
    KVB_AUTH(ctx, store::method::kPutEnd);
    return DoPutEnd(req, reply);
  }
  grpc::Status DoPutEnd(const rpc::PutEndRequest* req, rpc::KeyStatusReply* reply) {
    Timed timed(put_end_metrics.seconds);
    put_end_metrics.keys->Inc(req->items_size());
    std::vector<store::PutEndItem> items(req->items_size());
    for (int i = 0; i < req->items_size(); ++i) {
      const auto& in = req->items(i);
      items[i].key = in.key();
      items[i].version = in.version();
      items[i].replica_ok.assign(in.replica_ok().begin(), in.replica_ok().end());
      items[i].checksum = in.checksum();
    }
    store::PutEndPlan plan = state->BeginPutEnd(items, util::MonoNs());
    // The commits for nodes in the caller's process go back in the reply (the caller applies
    // them before it reports the put done); the others are sent and waited for.
    std::vector<store::NodeCommit> local, remote;
    for (store::NodeCommit& c : plan.commits) {
      const bool is_local =
          std::any_of(req->local_nodes().begin(), req->local_nodes().end(), [&](const auto& n) {
            return n.node_id() == c.node.node_id && n.incarnation() == c.node.incarnation;
          });
      (is_local ? local : remote).push_back(std::move(c));
    }
    SendCommits(&remote);
    plan.commits = std::move(remote);
    const uint64_t commit_term = term();
    for (store::NodeCommit& c : local) {
      rpc::CommitRequest* out = reply->add_local_commits();
      ToProto(c.node, out->mutable_node());
      for (const auto& r : c.records) *out->add_records() = store::RecordToProto(r);
      out->set_term(commit_term);
      c.ok = true;
      plan.commits.push_back(std::move(c));
    }
    std::vector<Status> done = state->FinishPutEnd(plan, util::MonoNs());
    // Replaced while committing: a successor may not know these objects, so none is
    // acknowledged (the caller's put fails; the bytes at the nodes are freed later).
    if (grpc::Status g = Gate(store::method::kPutEnd); !g.ok()) return g;
    for (const Status& st : done) ToProto(st, reply->add_statuses());
    return grpc::Status::OK;
  }

  grpc::Status PutRevoke(grpc::ServerContext* ctx, const rpc::PutRevokeRequest* req,
                         rpc::KeyStatusReply* reply) override {
    KVB_AUTH(ctx, store::method::kPutRevoke);
    std::vector<store::KeyVersion> items;
    for (const auto& kv : req->items()) items.push_back({kv.key(), kv.version()});
    for (const Status& st : state->PutRevoke(items, util::MonoNs())) {
      ToProto(st, reply->add_statuses());
    }
    return grpc::Status::OK;
  }

  grpc::Status GetReplicas(grpc::ServerContext* ctx, const rpc::GetReplicasRequest* req,
                           rpc::GetReplicasReply* reply) override {
    KVB_AUTH(ctx, store::method::kGetReplicas);
    return DoGetReplicas(req, reply);
  }
  grpc::Status DoGetReplicas(const rpc::GetReplicasRequest* req, rpc::GetReplicasReply* reply) {
    Timed timed(get_metrics.seconds);
    get_metrics.keys->Inc(req->keys_size());
    std::vector<std::string> keys(req->keys().begin(), req->keys().end());
    const uint64_t now = util::MonoNs();
    for (auto& r : state->GetReplicas(keys, req->client_node_id(), now, req->sizes_only())) {
      auto* item = reply->add_items();
      if (!req->sizes_only()) {
        if (!r.ok() || r->replicas.empty()) {
          get_miss->Inc();
        } else if (std::any_of(r->replicas.begin(), r->replicas.end(),
                               [](const store::ReplicaLocation& l) {
                                 return l.tier != store::Tier::kSsd;
                               })) {
          get_dram->Inc();
        } else {
          get_ssd->Inc();
        }
      }
      if (!r.ok()) {
        ToProto(r.status(), item->mutable_status());
        continue;
      }
      // OK is the absent status (code 0): no message per key.
      item->set_version(r->version);
      for (uint64_t s : r->sizes) item->add_sizes(s);
      item->set_checksum(r->checksum);
      for (const auto& loc : r->replicas) ToProto(loc, item->add_replicas());
      item->set_lease_ms(static_cast<uint32_t>(
          r->lease_expiry_ns > now ? (r->lease_expiry_ns - now) / 1000000 : 0));
    }
    return grpc::Status::OK;
  }

  grpc::Status Exists(grpc::ServerContext* ctx, const rpc::KeysRequest* req,
                      rpc::ExistsReply* reply) override {
    KVB_AUTH(ctx, store::method::kExists);
    return DoExists(req, reply);
  }
  grpc::Status DoExists(const rpc::KeysRequest* req, rpc::ExistsReply* reply) {
    std::vector<std::string> keys(req->keys().begin(), req->keys().end());
    for (bool e : state->Exists(keys)) reply->add_exists(e);
    return grpc::Status::OK;
  }

  grpc::Status FastPath(grpc::ServerContext* ctx, const rpc::Empty*,
                        rpc::FastPathReply* reply) override {
    KVB_AUTH(ctx, store::method::kFastPath);
    reply->set_port(fast ? fast->port() : 0);
    return grpc::Status::OK;
  }

  // A call on the lean port: its request parsed on an arena with its reply, the gate checked,
  // then the gRPC method's body.
  grpc::Status ServeFast(store::fast::Method m, std::string_view in, std::string* out) {
    google::protobuf::ArenaOptions ao;
    ao.start_block_size = 16 << 10;
    ao.max_block_size = 256 << 10;
    google::protobuf::Arena arena(ao);
    fast_calls->Inc();
    switch (m) {
      case store::fast::Method::kPutStart:
        return FastCall<rpc::PutStartRequest, rpc::PutStartReply>(
            &arena, in, out, store::method::kPutStart,
            [this](const auto* q, auto* r) { return DoPutStart(q, r); });
      case store::fast::Method::kPutEnd:
        return FastCall<rpc::PutEndRequest, rpc::KeyStatusReply>(
            &arena, in, out, store::method::kPutEnd,
            [this](const auto* q, auto* r) { return DoPutEnd(q, r); });
      case store::fast::Method::kGetReplicas:
        return FastCall<rpc::GetReplicasRequest, rpc::GetReplicasReply>(
            &arena, in, out, store::method::kGetReplicas,
            [this](const auto* q, auto* r) { return DoGetReplicas(q, r); });
      case store::fast::Method::kExists:
        return FastCall<rpc::KeysRequest, rpc::ExistsReply>(
            &arena, in, out, store::method::kExists,
            [this](const auto* q, auto* r) { return DoExists(q, r); });
    }
    return {grpc::StatusCode::UNIMPLEMENTED, "no such method on the lean port"};
  }
  template <class Req, class Reply, class Body>
  grpc::Status FastCall(google::protobuf::Arena* arena, std::string_view in, std::string* out,
                        std::string_view method, const Body& body) {
    auto* req = google::protobuf::Arena::CreateMessage<Req>(arena);
    if (!req->ParseFromArray(in.data(), static_cast<int>(in.size()))) {
      return {grpc::StatusCode::INVALID_ARGUMENT,
              std::string(method) + ": the request on the lean port does not parse"};
    }
    if (grpc::Status g = Gate(method); !g.ok()) return g;
    auto* reply = google::protobuf::Arena::CreateMessage<Reply>(arena);
    grpc::Status st = body(req, reply);
    if (st.ok() && !reply->SerializeToString(out)) {
      return {grpc::StatusCode::INTERNAL, std::string(method) + ": the reply does not serialize"};
    }
    return st;
  }

  grpc::Status Place(grpc::ServerContext* ctx, const rpc::PlaceRequest* req,
                     rpc::PlaceReply* reply) override {
    KVB_AUTH(ctx, store::method::kPlace);
    std::vector<std::string> targets(req->targets().begin(), req->targets().end());
    Result<uint64_t> id = state->Place(req->key(), targets, req->move_from(), util::MonoNs());
    ToProto(id.ok() ? Status::OK() : id.status(), reply->mutable_status());
    if (id.ok()) {
      reply->set_task_id(*id);
      AddEvent(req->move_from().empty() ? "copy" : "move",
               "placement task " + std::to_string(*id) + " started");
    }
    return grpc::Status::OK;
  }

  grpc::Status QueryPlacement(grpc::ServerContext* ctx, const rpc::PlacementQuery* req,
                              rpc::PlacementReply* reply) override {
    KVB_AUTH(ctx, store::method::kQueryPlacement);
    const uint64_t now = util::MonoNs();
    Result<store::PlacementStatus> st = state->QueryPlacement(req->task_id(), now);
    ToProto(st.ok() ? Status::OK() : st.status(), reply->mutable_status());
    if (!st.ok()) return grpc::Status::OK;
    // The master's clock is monotonic; the reply's times are the wall clock's.
    auto unix_ms = [&](uint64_t ns) {
      return static_cast<uint64_t>(UnixMs()) - (now - std::min(ns, now)) / 1000000;
    };
    reply->set_key(st->key);
    reply->set_move(st->move);
    reply->set_state(static_cast<uint32_t>(st->state));
    reply->set_message(st->message);
    reply->set_source(st->source);
    reply->set_created_unix_ms(unix_ms(st->created_ns));
    reply->set_updated_unix_ms(unix_ms(st->updated_ns));
    return grpc::Status::OK;
  }

  grpc::Status Remove(grpc::ServerContext* ctx, const rpc::KeysRequest* req,
                      rpc::KeyStatusReply* reply) override {
    KVB_AUTH(ctx, store::method::kRemove);
    Timed timed(remove_metrics.seconds);
    remove_metrics.keys->Inc(req->keys_size());
    const uint64_t now = util::MonoNs();
    for (const auto& k : req->keys()) ToProto(state->Remove(k, now), reply->add_statuses());
    return grpc::Status::OK;
  }

  grpc::Status RemoveAll(grpc::ServerContext* ctx, const rpc::Empty*, rpc::Status* reply) override {
    KVB_AUTH(ctx, store::method::kRemoveAll);
    if (grpc::Status a = Authorize(*ctx, store::method::kRemoveAll, nullptr); !a.ok()) return a;
    const size_t n = state->RemoveAll(util::MonoNs());
    KVB_LOG(INFO) << "RemoveAll removed " << n << " objects";
    AddEvent("remove_all", "RemoveAll removed " + std::to_string(n) + " objects");
    return Done(Status::OK(), reply);
  }

  // Destructive like RemoveAll: the admin token's proof when the cluster has a token.
  grpc::Status RemoveByRegex(grpc::ServerContext* ctx, const rpc::RegexRequest* req,
                             rpc::RemoveByRegexReply* reply) override {
    KVB_AUTH(ctx, store::method::kRemoveByRegex);
    if (grpc::Status a = Authorize(*ctx, store::method::kRemoveByRegex, nullptr); !a.ok()) {
      return a;
    }
    Result<size_t> n = state->RemoveByRegex(req->pattern(), util::MonoNs());
    if (n.ok()) {
      reply->set_removed(*n);
      KVB_LOG(INFO) << "RemoveByRegex '" << req->pattern() << "' removed " << *n << " objects";
      AddEvent("remove_by_regex",
               "RemoveByRegex '" + req->pattern() + "' removed " + std::to_string(*n) + " objects");
    }
    ToProto(n.status(), reply->mutable_status());
    return grpc::Status::OK;
  }

  grpc::Status ReportBadReplica(grpc::ServerContext* ctx, const rpc::BadReplicaRequest* req,
                                rpc::Status* reply) override {
    KVB_AUTH(ctx, store::method::kReportBadReplica);
    if (req->node_unreachable()) {
      return Done(state->ReportUnreachableNode(FromProto(req->node()), util::MonoNs()), reply);
    }
    const Status st = state->ReportBadReplica(req->key(), req->version(), FromProto(req->node()),
                                              util::MonoNs(), req->segment_id(), req->offset());
    if (st.ok()) {
      AddEvent("bad_replica", "a replica (" + std::to_string(req->key().size()) +
                                  "-byte key) on node " + req->node().node_id() +
                                  " reported bad by a reader was dropped");
    }
    return Done(st, reply);
  }

  grpc::Status GetNodeDescriptors(grpc::ServerContext* ctx, const rpc::NodeDescriptorsRequest* req,
                                  rpc::NodeDescriptorsReply* reply) override {
    KVB_AUTH(ctx, store::method::kGetNodeDescriptors);
    std::vector<std::string> ids(req->node_ids().begin(), req->node_ids().end());
    store::NodeDirectory dir = state->GetNodeDirectory(ids);
    reply->set_directory_version(dir.directory_version);
    for (const auto& n : dir.nodes) {
      auto* out = reply->add_nodes();
      ToProto(n.identity, out->mutable_node());
      out->set_engine_descriptor(n.engine_descriptor);
      out->set_rpc_address(n.control_endpoint);
    }
    return grpc::Status::OK;
  }

  grpc::Status Stats(grpc::ServerContext* ctx, const rpc::Empty*, rpc::StatsReply* reply) override {
    KVB_AUTH(ctx, store::method::kStats);
    store::MasterStats s = state->Stats();
    for (const auto& n : s.nodes) {
      auto* out = reply->add_nodes();
      ToProto(n.identity, out->mutable_node());
      out->set_state(store::NodeStateName(n.state));
      out->set_capacity(n.capacity);
      out->set_used(n.used);
      out->set_replicas(n.replicas);
      out->set_ssd_capacity(n.ssd_capacity);
      out->set_ssd_used(n.ssd_used);
    }
    reply->set_objects(s.objects);
    reply->set_pending(s.pending);
    reply->set_bytes(s.bytes);
    reply->set_evictions_total(s.evictions_total);
    reply->set_bad_replicas_total(s.bad_replicas_total);
    reply->set_unreachable_reports_total(s.unreachable_reports_total);
    reply->set_nodes_expired_total(s.nodes_expired_total);
    reply->set_under_replicated(s.under_replicated);
    reply->set_demotions_total(s.demotions_total);
    reply->set_ssd_replicas(s.ssd_replicas);
    reply->set_promotions_total(s.promotions_total);
    reply->set_departed_copies(s.departed_copies);
    return grpc::Status::OK;
  }
};

MasterServer::MasterServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MasterServer::~MasterServer() = default;

const std::string& MasterServer::address() const { return impl_->address; }
uint16_t MasterServer::fast_port() const { return impl_->fast ? impl_->fast->port() : 0; }

const std::string& MasterServer::metrics_address() const { return impl_->metrics_address; }

void MasterServer::SetLeader(bool is_leader, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(impl_->leader_mu);
    impl_->not_leader_why = is_leader ? "" : why;
  }
  if (impl_->is_leader.exchange(is_leader) != is_leader) {
    impl_->AddEvent(is_leader ? "leader" : "not_leader",
                    is_leader ? "this master leads the cluster"
                              : "this master stopped leading" + (why.empty() ? "" : ": " + why));
  }
  if (grpc::HealthCheckServiceInterface* h = impl_->server->GetHealthCheckService()) {
    h->SetServingStatus(rpc::Master::service_full_name(), is_leader);
    h->SetServingStatus("", is_leader);
  }
}

Result<std::unique_ptr<MasterServer>> MasterServer::Start(const MasterOptions& options) {
  return Impl::Launch(options, nullptr, 0);
}

std::map<std::string, obs::HttpRoute> store::LeaderRoutes(MasterServer& server) {
  return MasterServer::Impl::RoutesOf(server);
}

Result<std::unique_ptr<MasterServer>> store::LaunchLeader(const MasterOptions& options,
                                                          std::shared_ptr<LeaderGate> gate,
                                                          uint64_t first_version) {
  return MasterServer::Impl::Launch(options, std::move(gate), first_version);
}

Result<std::unique_ptr<MasterServer>> MasterServer::Impl::Launch(
    const MasterOptions& options, std::shared_ptr<store::LeaderGate> gate, uint64_t first_version) {
  store::MasterConfig cfg;
  cfg.node_ttl_ms = options.node_ttl_ms;
  // The tick loop runs every min(200, ttl/6) ms (at least 20): a gap of three periods, and at
  // least a quarter TTL, is not scheduling jitter but a pause of the whole master.
  cfg.pause_threshold_ms =
      std::max<uint64_t>(3 * TickPeriodMs(options.node_ttl_ms), options.node_ttl_ms / 4);
  cfg.start_ns = util::MonoNs();
  cfg.lease_ms = options.lease_ms;
  cfg.put_timeout_ms = options.put_timeout_ms;
  cfg.soft_pin_ttl_ms = options.soft_pin_ttl_ms;
  cfg.min_replicas = options.min_replicas;
  cfg.high_watermark = options.high_watermark;
  cfg.low_watermark = options.low_watermark;
  cfg.demote_high_watermark = options.demote_high_watermark;
  cfg.demote_low_watermark = options.demote_low_watermark;
  cfg.promote_after_reads = options.promote_after_reads;
  cfg.drain_timeout_ms = options.drain_timeout_ms;
  cfg.task_timeout_ms = options.task_timeout_ms;
  cfg.departed_ttl_ms = options.departed_node_ttl_ms;
  cfg.max_departed_nodes = static_cast<size_t>(options.max_departed_nodes);
  cfg.max_departed_copies = options.max_departed_copies;
  // A late writer's bytes: a destination that stops reading its sockets for a TTL is declared
  // dead (and falls under the re-registration wait); 1 s more covers queued bytes and a couple
  // of TCP retransmissions (200 ms minimum timeout, doubling). docs/store.md "Late writes".
  cfg.late_write_margin_ms = uint64_t{options.node_ttl_ms} + 1000;
  // What a predecessor may have handed out: puts and tasks issued just before it stopped (a
  // promotion's target is held for twice the task timeout), and its read leases.
  const uint64_t restart_hold_ms =
      std::max({uint64_t{options.put_timeout_ms}, 2 * uint64_t{options.task_timeout_ms},
                uint64_t{options.lease_ms}}) +
      cfg.late_write_margin_ms;
  cfg.restart_hold_until_ns = util::MonoNs() + restart_hold_ms * 1000000;
  // Versions start at wall-clock microseconds, so a put that no node recorded before a master
  // restart can never see its version handed out again by the new master.
  cfg.first_version = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                                std::chrono::system_clock::now().time_since_epoch())
                                                .count());
  // Free sequence numbers likewise: a node's acknowledgement of the old master's frees is
  // below every number the new one hands out.
  // An elected leader starts above every version its predecessors could have handed out
  // (MasterElection keeps the floor in etcd), whatever the clocks of their hosts say.
  cfg.first_version = std::max(cfg.first_version, first_version);
  if (gate) {
    // Publish where writers may still write before handing ranges out (docs/ha.md), so a
    // successor holds back only those chunks; and hold back only what the predecessor published.
    cfg.track_inflight = true;
    cfg.inflight_window_ms =
        std::max(uint64_t{options.put_timeout_ms}, 2 * uint64_t{options.task_timeout_ms}) +
        cfg.late_write_margin_ms;
    cfg.inherited_inflight = gate->inherited;
    cfg.inflight_authoritative = gate->inherited_authoritative;
  }
  cfg.first_free_seq = cfg.first_version;
  auto state = store::MasterState::Create(cfg);
  if (!state.ok()) return state.status().WithContext("master configuration");
  auto impl = std::make_unique<Impl>();
  if (Status st = impl->faults.Parse(options.faults); !st.ok()) return st;
  impl->options = options;
  impl->auth = std::make_unique<store::RpcAuth>(options.cluster_token, options.rpc_auth_skew_ms);
  impl->admin_required = !options.cluster_token.empty() || !options.admin_token.empty();
  impl->admin_key = store::CallKey(options.admin_token, store::kAdminKeyPurpose);
  impl->state = std::move(state).value();
  impl->gate = std::move(gate);
  auto server = store::StartServer(options.listen, impl.get(), "master", &impl->address);
  if (!server.ok()) return server.status();
  impl->server = std::move(server).value();
  impl->auth->WarnIfDisabled("master's control plane", impl->address);
  if (grpc::HealthCheckServiceInterface* h = impl->server->GetHealthCheckService()) {
    h->SetServingStatus(rpc::Master::service_full_name(), true);
  }
  impl->start_ns = util::MonoNs();
  impl->SetUpMetrics();
  if (options.fast_port >= 0) {
    std::string host, port;
    if (!util::SplitHostPort(impl->address, &host, &port)) host.clear();
    Impl* raw = impl.get();
    auto fast = store::fast::Server::Start(
        host, static_cast<uint16_t>(options.fast_port), impl->auth.get(), "master",
        [raw](store::fast::Method m, std::string_view in, std::string* out) {
          return raw->ServeFast(m, in, out);
        });
    if (!fast.ok()) return fast.status().WithContext("MasterOptions::fast_port");
    impl->fast = std::move(fast).value();
  }
  auto http = obs::StartEndpoint(
      options.metrics_listen, options.metrics_listen_best_effort, impl->Routes(),
      options.metrics_token.empty() ? options.cluster_token : options.metrics_token, "master");
  if (!http.ok()) return http.status();
  impl->http = std::move(http).value();
  if (impl->http) impl->metrics_address = impl->http->address();
  Impl* raw = impl.get();
  impl->ticker = std::thread([raw] { raw->TickLoop(); });
  return std::unique_ptr<MasterServer>(new MasterServer(std::move(impl)));
}

Result<ClusterStatus> QueryClusterStatus(const std::string& master_address, uint32_t timeout_ms,
                                         const std::string& cluster_token) {
  store::MasterClient::Options o;
  o.address = master_address;
  o.cluster_token = cluster_token;
  o.retry.rpc_timeout_ms = timeout_ms;
  return store::MasterClient(std::move(o)).Stats();
}

}  // namespace kvbridge

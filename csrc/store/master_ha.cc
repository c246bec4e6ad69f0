#include "store/master_ha.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <utility>

#include "obs/http_server.h"
#include "obs/metrics.h"
#include "util/logging.h"

namespace kvbridge::store {

namespace {

void SleepMs(uint64_t ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

// Sleeps up to `ms` in short steps, returning early once `stopping()`.
bool SleepUnlessStopping(uint64_t ms, const std::function<bool()>& stopping) {
  const uint64_t until = util::MonoNs() + util::MsToNs(ms);
  while (util::MonoNs() < until) {
    if (stopping && stopping()) return false;
    SleepMs(std::min<uint64_t>(20, ms));
  }
  return !(stopping && stopping());
}

uint64_t WallUs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

int64_t LeaseSeconds(uint32_t lease_ms) {
  return std::max<int64_t>(2, (int64_t{lease_ms} + 999) / 1000);
}

}  // namespace

Result<EtcdAddress> ParseEtcdFor(std::string_view address, std::string_view what) {
  auto parsed = ParseEtcdAddress(address);
  if (!parsed.ok()) return parsed.status().WithContext(what);
  return parsed;
}

std::string EncodeInflight(const InflightMap& map) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(map.incarnation));
  std::string out = buf;
  for (const InflightMap::Segment& s : map.segments) {
    std::snprintf(
        buf, sizeof(buf), " %llu:%llu:%llx", static_cast<unsigned long long>(s.segment_id),
        static_cast<unsigned long long>(s.chunk_bytes), static_cast<unsigned long long>(s.chunks));
    out += buf;
  }
  return out;
}

Result<InflightMap> DecodeInflight(const std::string& node_id, const std::string& value) {
  InflightMap map;
  map.node_id = node_id;
  const char* p = value.c_str();
  int used = 0;
  unsigned long long inc = 0;
  if (std::sscanf(p, "%llx%n", &inc, &used) != 1) {
    return Status::Protocol("in-flight map of node " + node_id + " is '" + value +
                            "', not '<incarnation> <segment>:<chunk bytes>:<chunks>...'");
  }
  map.incarnation = inc;
  p += used;
  unsigned long long seg = 0, chunk = 0, chunks = 0;
  while (std::sscanf(p, " %llu:%llu:%llx%n", &seg, &chunk, &chunks, &used) == 3) {
    map.segments.push_back({seg, chunk, chunks});
    p += used;
  }
  while (*p == ' ') ++p;
  if (*p != '\0') {
    return Status::Protocol("in-flight map of node " + node_id + " is '" + value +
                            "', not '<incarnation> <segment>:<chunk bytes>:<chunks>...'");
  }
  return map;
}

// --- MasterElection ---

MasterElection::MasterElection(Options options)
    : options_(std::move(options)),
      keys_(options_.etcd.prefix),
      etcd_(options_.etcd.endpoints, options_.call_timeout_ms) {}

MasterElection::~MasterElection() = default;

void MasterElection::SetLeader(std::string leader) {
  std::lock_guard<std::mutex> lock(mu_);
  leader_ = std::move(leader);
}

std::string MasterElection::leader() const {
  std::lock_guard<std::mutex> lock(mu_);
  return leader_;
}

Result<uint64_t> MasterElection::NextEpoch() {
  for (int attempt = 0; attempt < 16; ++attempt) {
    auto kv = etcd_.Get(keys_.epoch);
    if (!kv.ok()) return kv.status();
    unsigned long long prev_epoch = 0, prev_first = 0;
    if (kv->has_value() &&
        std::sscanf((*kv)->value.c_str(), "%llu %llu", &prev_epoch, &prev_first) != 2) {
      return Status::Protocol("etcd key " + keys_.epoch + " holds '" + (*kv)->value +
                              "', not '<epoch> <first version>'");
    }
    prev_epoch_ = prev_epoch;
    const uint64_t epoch = prev_epoch + 1;
    const uint64_t first = std::max<uint64_t>(WallUs(), prev_first + kVersionsPerTerm);
    auto put = etcd_.PutIfUnchanged(keys_.epoch, kv->has_value() ? (*kv)->mod_revision : 0,
                                    std::to_string(epoch) + " " + std::to_string(first));
    if (!put.ok()) return put.status();
    if (*put) {
      first_version_ = first;
      return epoch;
    }
  }
  return Status::Unavailable("etcd key " + keys_.epoch + " kept changing under 16 attempts");
}

std::shared_ptr<LeaderGate> MasterElection::Campaign(const std::function<bool()>& stopping) {
  const int64_t ttl_s = LeaseSeconds(options_.lease_ms);
  std::string last_error, last_leader;
  while (!(stopping && stopping())) {
    const uint64_t t0 = util::MonoNs();
    Status failed;
    auto lease = etcd_.GrantLease(ttl_s);
    if (!lease.ok()) {
      failed = lease.status();
    } else if (auto c = etcd_.CreateIfAbsent(keys_.leader, options_.advertise, lease->id);
               !c.ok()) {
      failed = c.status();
      (void)etcd_.RevokeLease(lease->id);
    } else if (!c->created) {
      (void)etcd_.RevokeLease(lease->id);
      if (c->current.value != last_leader) {
        KVB_LOG(INFO) << "master standby: the leader is " << c->current.value << " (etcd key "
                      << keys_.leader << ")";
        last_leader = c->current.value;
      }
      SetLeader(c->current.value);
      // Wait for the key to go (the leader's lease ran out, or it stepped down).
      while (SleepUnlessStopping(100, stopping)) {
        auto kv = etcd_.Get(keys_.leader);
        if (!kv.ok()) continue;  // etcd unreachable: keep asking
        if (!kv->has_value()) break;
        SetLeader((*kv)->value);
      }
      continue;
    } else {
      lease_id_ = lease->id;
      lease_ttl_s_ = lease->ttl_s;
      leader_revision_ = c->revision;
      auto epoch = NextEpoch();
      if (!epoch.ok()) {
        failed = epoch.status();
        Resign();
      } else {
        std::vector<std::string> nodes;
        if (auto members = etcd_.GetPrefix(keys_.nodes); members.ok()) {
          for (const EtcdKv& kv : *members) nodes.push_back(kv.key.substr(keys_.nodes.size()));
        } else {
          KVB_LOG(WARN) << "new leader: cannot list the nodes in etcd ("
                        << members.status().ToString() << "); not waiting for any";
        }
        auto gate = std::make_shared<LeaderGate>(*epoch, nodes, options_.takeover_wait_ms);
        // Where the predecessor's writers may still write. Without a complete list (first
        // leader, or etcd did not answer) a node coming back waits as after a restart.
        if (auto maps = etcd_.GetPrefix(keys_.inflight); maps.ok() && prev_epoch_ > 0) {
          gate->inherited_authoritative = true;
          for (const EtcdKv& kv : *maps) {
            auto map = DecodeInflight(kv.key.substr(keys_.inflight.size()), kv.value);
            if (!map.ok()) {
              KVB_LOG(WARN) << "new leader: " << map.status().ToString()
                            << "; nodes coming back wait as after a master restart";
              gate->inherited_authoritative = false;
              break;
            }
            gate->inherited.push_back(std::move(map).value());
          }
        }
        const int64_t revision = leader_revision_;
        gate->publish = [this, revision](const std::vector<InflightMap>& maps) -> Status {
          std::vector<std::pair<std::string, std::string>> kvs;
          for (const InflightMap& m : maps)
            kvs.emplace_back(keys_.inflight + m.node_id, EncodeInflight(m));
          auto ok = etcd_.PutAllWhile(keys_.leader, revision, kvs);
          if (!ok.ok()) return ok.status();
          if (!*ok)
            return Status::StalePeer("the leader key " + keys_.leader +
                                     " is no longer this master's");
          return Status::OK();
        };
        const uint64_t ttl_ns = util::MsToNs(uint64_t(lease->ttl_s) * 1000);
        gate->ExtendTo(t0 + ttl_ns - ttl_ns / 4);
        SetLeader(options_.advertise);
        KVB_LOG(INFO) << "master elected leader at " << options_.advertise << " (epoch " << *epoch
                      << ", lease " << lease->ttl_s << " s, waiting for " << nodes.size()
                      << " node(s) listed in etcd to register)";
        return gate;
      }
    }
    if (failed.ToString() != last_error) {
      KVB_LOG(WARN) << "master election: " << failed.ToString() << "; trying again";
      last_error = failed.ToString();
    }
    SleepUnlessStopping(200, stopping);
  }
  return nullptr;
}

Status MasterElection::KeepLeading(LeaderGate* gate, const std::function<bool()>& stopping) {
  const uint64_t ttl_ms = uint64_t(lease_ttl_s_) * 1000;
  Status last = Status::OK();
  bool lapsed = false;  // the gate ran out before a renewal came back
  while (SleepUnlessStopping(lapsed ? 50 : ttl_ms / 4, stopping)) {
    const uint64_t t = util::MonoNs();
    auto left = etcd_.KeepAlive(lease_id_);
    if (left.status().Is(StatusCode::kNotFound)) {
      gate->Revoke();
      return Status::StalePeer("the leader's etcd lease expired: " + left.status().ToString());
    }
    if (left.ok()) {
      // Still our key, created at our election: nobody can have been elected meanwhile (a
      // successor creates the key anew), so a lapse is over and leading goes on with the same
      // state. Anything else: another leader exists or may; step down.
      auto kv = etcd_.Get(keys_.leader);
      if (kv.ok() && (!kv->has_value() || (*kv)->create_revision != leader_revision_)) {
        gate->Revoke();
        return Status::StalePeer("the leader key " + keys_.leader + " is no longer this master's");
      }
      if (kv.ok()) {
        const uint64_t ns = util::MsToNs(uint64_t(*left) * 1000);
        gate->ExtendTo(t + ns - ns / 4);
        if (lapsed) {
          KVB_LOG(WARN) << "master at " << options_.advertise
                        << " renewed its etcd lease again and goes on leading (it answered "
                           "nothing while the renewal was late)";
        }
        lapsed = false;
        continue;
      }
      last = kv.status();
    } else {
      last = left.status();
    }
    if (!lapsed && !gate->Valid()) {
      // Not renewed in time: stop acting at once (Gate refuses every call), but keep trying:
      // etcd decides whether the lease survived.
      lapsed = true;
      KVB_LOG(WARN) << "master at " << options_.advertise << " could not renew its etcd lease ("
                    << last.ToString() << "); answering nothing until it can";
    }
  }
  gate->Revoke();
  return Status::Cancelled("stopping");
}

void MasterElection::Resign() {
  if (leader_revision_ != 0) (void)etcd_.DeleteIfCreatedAt(keys_.leader, leader_revision_);
  if (lease_id_ != 0) (void)etcd_.RevokeLease(lease_id_);
  leader_revision_ = 0;
  lease_id_ = 0;
}

// --- LeaderResolver ---

LeaderResolver::LeaderResolver(EtcdAddress etcd, uint32_t call_timeout_ms)
    : keys_(etcd.prefix), etcd_(std::move(etcd.endpoints), call_timeout_ms) {}

std::string LeaderResolver::Describe() const {
  return etcd_.Describe() + " (key " + keys_.leader + ")";
}

Result<std::string> LeaderResolver::Leader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!cached_.empty()) return cached_;
  }
  auto kv = etcd_.Get(keys_.leader);
  if (!kv.ok()) return kv.status().WithContext("finding the master leader");
  if (!kv->has_value()) {
    return Status::Unavailable("no master leader is elected in " + Describe());
  }
  std::lock_guard<std::mutex> lock(mu_);
  cached_ = (*kv)->value;
  return cached_;
}

void LeaderResolver::Forget(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  if (cached_ == address) cached_.clear();
}

// --- NodeMembership ---

NodeMembership::NodeMembership(EtcdAddress etcd, std::string node_id, std::string value,
                               uint32_t ttl_s)
    : keys_(etcd.prefix),
      key_(keys_.nodes + node_id),
      value_(std::move(value)),
      ttl_s_(std::max<uint32_t>(2, ttl_s)),
      etcd_(std::move(etcd.endpoints), 1000) {
  thread_ = std::thread([this] { Run(); });
}

NodeMembership::~NodeMembership() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
  if (lease_id_ != 0) (void)etcd_.RevokeLease(lease_id_);
}

Status NodeMembership::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

void NodeMembership::Run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    lock.unlock();
    Status st;
    if (lease_id_ != 0) {
      auto left = etcd_.KeepAlive(lease_id_);
      if (!left.ok()) st = left.status();
      if (st.Is(StatusCode::kNotFound)) lease_id_ = 0;  // expired: put the key again
    }
    if (lease_id_ == 0) {
      auto lease = etcd_.GrantLease(ttl_s_);
      if (!lease.ok()) {
        st = lease.status();
      } else if (auto put = etcd_.Put(key_, value_, lease->id); !put.ok()) {
        st = put.status();
        (void)etcd_.RevokeLease(lease->id);
      } else {
        lease_id_ = lease->id;
        st = Status::OK();
      }
    }
    lock.lock();
    if (!st.ok() && status_.ok()) {
      KVB_LOG(WARN) << "node membership key " << key_ << ": " << st.ToString();
    }
    status_ = st;
    cv_.wait_for(lock, std::chrono::milliseconds(st.ok() ? ttl_s_ * 1000 / 3 : 200),
                 [&] { return stopping_; });
  }
}

}  // namespace kvbridge::store

// --- HaMaster ---

namespace kvbridge {

struct HaMaster::Impl {
  MasterOptions options;
  std::unique_ptr<store::MasterElection> election;
  std::atomic<bool> stopping{false};
  mutable std::mutex mu;
  std::unique_ptr<MasterServer> server;  // while leading
  std::shared_ptr<store::LeaderGate> gate;
  // The HTTP endpoint (options.metrics_listen), one for the process's life: while this master
  // leads it serves the leader's routes (the MasterServer runs without an endpoint of its own,
  // so no address changes hands at an election); otherwise it says so: /health 503 naming
  // the leader, /metrics kvbridge_master_is_leader 0.
  std::unique_ptr<obs::HttpServer> http;
  std::map<std::string, obs::HttpRoute> leader_routes;  // under mu, while leading
  std::thread thread;

  // Route `path` to the leader's handler while leading, else to `standby`.
  obs::HttpRoute Route(const std::string& path, obs::HttpRoute standby) {
    auto fallback = standby.handler;
    standby.handler = [this, path, fallback] {
      {
        // Held while the leader's handler runs: its server is stopped only after its routes
        // were dropped under this lock.
        std::lock_guard<std::mutex> lock(mu);
        auto it = leader_routes.find(path);
        if (it != leader_routes.end()) return it->second.handler();
      }
      return fallback();
    };
    return standby;
  }

  std::map<std::string, obs::HttpRoute> Routes() {
    std::map<std::string, obs::HttpRoute> r;
    r["/health"] = Route(
        "/health", {[this] {
                      const std::string leader = election->leader();
                      return obs::HttpResponse{
                          503, "text/plain; charset=utf-8",
                          "not serving: this master is a standby; the leader is " +
                              (leader.empty() ? std::string("not known yet") : leader) + "\n"};
                    },
                    /*is_public=*/true});
    r["/metrics"] = Route("/metrics", {[] {
                            return obs::HttpResponse{
                                200, obs::kExpositionContentType,
                                "# HELP kvbridge_master_is_leader 1 when this master leads the "
                                "cluster, else 0.\n# TYPE kvbridge_master_is_leader gauge\n"
                                "kvbridge_master_is_leader 0\n"};
                          }});
    r["/status.json"] = Route(
        "/status.json", {[this] {
          return obs::HttpResponse{
              200, "application/json",
              "{\"is_leader\": false, \"leader\": " + obs::JsonString(election->leader()) + "}\n"};
        }});
    r["/"] = Route("/", {[this] {
                           return obs::HttpResponse{200, "text/plain; charset=utf-8",
                                                    "kvbridge master (standby); the leader is " +
                                                        election->leader() + "\n"};
                         },
                         /*is_public=*/true});
    return r;
  }

  void Run() {
    const auto stop = [this] { return stopping.load(); };
    while (!stopping.load()) {
      std::shared_ptr<store::LeaderGate> g = election->Campaign(stop);
      if (!g) break;
      MasterOptions leader_options = options;
      leader_options.metrics_listen.clear();  // served by this process's endpoint (Routes)
      auto started = store::LaunchLeader(leader_options, g, election->first_version());
      if (!started.ok()) {
        KVB_LOG(ERROR) << "elected, but the master cannot start: " << started.status().ToString()
                       << "; stepping down";
        election->Resign();
        std::this_thread::sleep_for(std::chrono::seconds(1));
        continue;
      }
      {
        std::lock_guard<std::mutex> lock(mu);
        server = std::move(started).value();
        gate = g;
        leader_routes = store::LeaderRoutes(*server);
      }
      const Status why = election->KeepLeading(g.get(), stop);
      std::unique_ptr<MasterServer> old;
      {
        std::lock_guard<std::mutex> lock(mu);
        old = std::move(server);
        gate.reset();
        leader_routes.clear();
      }
      if (!why.Is(StatusCode::kCancelled)) {
        KVB_LOG(WARN) << "master at " << options.advertise << " stops leading: " << why.ToString()
                      << "; campaigning again";
      }
      old.reset();  // its server stops answering
      election->Resign();
    }
    election->Resign();
  }
};

HaMaster::HaMaster(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HaMaster::~HaMaster() {
  impl_->stopping.store(true);
  if (impl_->thread.joinable()) impl_->thread.join();
}

Result<std::unique_ptr<HaMaster>> HaMaster::Start(const MasterOptions& options) {
  auto etcd = store::ParseEtcdFor(options.etcd, "MasterOptions::etcd (KVBRIDGE_MASTER_ETCD)");
  if (!etcd.ok()) return etcd.status();
  if (options.ha_lease_ms < 2000) {
    return Status::InvalidArgument("MasterOptions::ha_lease_ms (KVBRIDGE_HA_LEASE_MS) is " +
                                   std::to_string(options.ha_lease_ms) +
                                   " ms; etcd grants leases of 2 s or more");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  std::string& advertise = impl->options.advertise;
  if (advertise.empty()) advertise = options.listen;
  const size_t colon = advertise.rfind(':');
  const std::string host = colon == std::string::npos ? "" : advertise.substr(0, colon);
  const std::string port = colon == std::string::npos ? "" : advertise.substr(colon + 1);
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || port.empty() || port == "0") {
    return Status::InvalidArgument(
        "an HA master needs the address clients and nodes call it at, and '" + advertise +
        "' is not one (a wildcard host or port 0): set MasterOptions::advertise "
        "(KVBRIDGE_MASTER_ADVERTISE, --advertise) to host:port");
  }
  store::MasterElection::Options eo;
  eo.etcd = std::move(etcd).value();
  eo.advertise = advertise;
  eo.lease_ms = options.ha_lease_ms;
  eo.takeover_wait_ms = options.ha_takeover_wait_ms;
  eo.call_timeout_ms = std::max<uint32_t>(200, options.ha_lease_ms / 4);
  impl->election = std::make_unique<store::MasterElection>(std::move(eo));
  auto http = obs::StartEndpoint(
      options.metrics_listen, options.metrics_listen_best_effort, impl->Routes(),
      options.metrics_token.empty() ? options.cluster_token : options.metrics_token, "master");
  if (!http.ok()) return http.status();
  impl->http = std::move(http).value();
  Impl* raw = impl.get();
  impl->thread = std::thread([raw] { raw->Run(); });
  return std::unique_ptr<HaMaster>(new HaMaster(std::move(impl)));
}

bool HaMaster::is_leader() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->gate && impl_->gate->Valid();
}

std::string HaMaster::leader() const { return impl_->election->leader(); }

uint64_t HaMaster::epoch() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->gate ? impl_->gate->epoch() : 0;
}

std::string HaMaster::address() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->server ? impl_->server->address() : std::string();
}

}  // namespace kvbridge

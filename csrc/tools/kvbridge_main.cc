// `kvbridge`: the daemons and the operator's view of a cluster.
//
//   kvbridge master [--listen HOST:PORT] [--node-ttl-ms N] [--lease-ms N]
//                   [--metrics-listen HOST:PORT|off] [--config FILE]
//                   [--etcd HOST:PORT,...[/PREFIX] [--advertise HOST:PORT] [--ha-lease-ms N]
//                    [--ha-takeover-wait-ms N]]   (several masters, one leader elected in etcd)
//   kvbridge node   [--master HOST:PORT] [--dram-bytes N] [--node-id ID] [--listen HOST:PORT,...]
//                   [--rpc-listen HOST:PORT] [--drain-timeout-ms N] [--ssd-path DIR]
//                   [--ssd-bytes N] [--metrics-listen HOST:PORT|off] [--config FILE]
//   kvbridge status [--master HOST:PORT] [--json] [--watch [--interval S]]
//
// Settings come from, strongest first: flags, KVBRIDGE_* environment variables, the config file
// (lines `key = value`; a key `x_y` stands for KVBRIDGE_X_Y), built-in defaults.
// A node drains on SIGTERM (its objects move elsewhere first) and stops at once on SIGINT.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/store.h"

using namespace kvbridge;

namespace {

int Usage(const char* why = nullptr) {
  if (why) std::fprintf(stderr, "kvbridge: %s\n\n", why);
  std::fprintf(stderr,
               "usage:\n"
               "  kvbridge master [--listen HOST:PORT] [--node-ttl-ms N] [--lease-ms N]\n"
               "                  [--metrics-listen HOST:PORT|off] [--config FILE]\n"
               "                  [--etcd HOST:PORT,... [--advertise HOST:PORT]\n"
               "                   [--ha-lease-ms N] [--ha-takeover-wait-ms N]]\n"
               "  kvbridge node   [--master HOST:PORT] [--dram-bytes N] [--node-id ID]\n"
               "                  [--listen HOST:PORT,...] [--rpc-listen HOST:PORT]\n"
               "                  [--drain-timeout-ms N] [--ssd-path DIR] [--ssd-bytes N]\n"
               "                  [--metrics-listen HOST:PORT|off] [--config FILE]\n"
               "  kvbridge status [--master HOST:PORT] [--json] [--watch [--interval S]]\n"
               "Every flag has a KVBRIDGE_* variable (docs/configuration.md). A node drains on\n"
               "SIGTERM and stops at once on SIGINT. The master serves /metrics, /health and a\n"
               "status page on 0.0.0.0:9480, a node /metrics and /health on 0.0.0.0:9481, unless\n"
               "--metrics-listen says otherwise (docs/operations.md).\n");
  return 2;
}

// Loads `key = value` lines into the environment without overriding variables already set.
bool LoadConfigFile(const std::string& path) {
  std::ifstream f(path);
  if (!f) {
    std::fprintf(stderr, "kvbridge: cannot read config file %s\n", path.c_str());
    return false;
  }
  std::string line;
  int n = 0;
  while (std::getline(f, line)) {
    ++n;
    const size_t hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    const size_t eq = line.find('=');
    auto trim = [](std::string s) {
      while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
      size_t i = 0;
      while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
      return s.substr(i);
    };
    if (trim(line).empty()) continue;
    if (eq == std::string::npos) {
      std::fprintf(stderr, "kvbridge: %s:%d: expected 'key = value'\n", path.c_str(), n);
      return false;
    }
    std::string key = trim(line.substr(0, eq)), value = trim(line.substr(eq + 1));
    std::string env;
    for (char c : key)
      env.push_back(std::isalnum(static_cast<unsigned char>(c)) ? std::toupper(c) : '_');
    if (env.rfind("KVBRIDGE_", 0) != 0) env = "KVBRIDGE_" + env;
    setenv(env.c_str(), value.c_str(), /*overwrite=*/0);
  }
  return true;
}

// Flags of the form --name VALUE; "--json" style booleans have no value.
struct Flags {
  std::map<std::string, std::string> values;
  bool Has(const std::string& k) const { return values.count(k) != 0; }
  std::string Get(const std::string& k) const {
    auto it = values.find(k);
    return it == values.end() ? std::string() : it->second;
  }
};

bool ParseFlags(int argc, char** argv, int first, const std::vector<std::string>& with_value,
                const std::vector<std::string>& booleans, Flags* out, std::string* why) {
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) {
      *why = "unexpected argument '" + a + "'";
      return false;
    }
    a = a.substr(2);
    if (std::find(booleans.begin(), booleans.end(), a) != booleans.end()) {
      out->values[a] = "1";
    } else if (std::find(with_value.begin(), with_value.end(), a) != with_value.end()) {
      if (i + 1 >= argc) {
        *why = "--" + a + " needs a value";
        return false;
      }
      out->values[a] = argv[++i];
    } else {
      *why = "unknown flag --" + a;
      return false;
    }
  }
  return true;
}

bool ToUint64(const std::string& flag, const std::string& s, uint64_t* out) {
  char* end = nullptr;
  errno = 0;
  unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || errno != 0) {
    std::fprintf(stderr, "kvbridge: --%s: '%s' is not a number\n", flag.c_str(), s.c_str());
    return false;
  }
  *out = v;
  return true;
}

template <typename T>
bool SetNumber(const Flags& f, const std::string& flag, T* out) {
  if (!f.Has(flag)) return true;
  uint64_t v;
  if (!ToUint64(flag, f.Get(flag), &v)) return false;
  *out = static_cast<T>(v);
  return true;
}

// The daemons' HTTP endpoint (docs/operations.md): the flag, else KVBRIDGE_METRICS_LISTEN (read
// by FromEnv into *listen), else `default_listen`, which, unlike an address asked for, may be
// busy (several nodes on one host): the daemon then warns and runs without it.
void SetMetricsListen(const Flags& f, const char* default_listen, std::string* listen,
                      bool* best_effort) {
  if (f.Has("metrics-listen")) {
    *listen = f.Get("metrics-listen") == "off" ? "" : f.Get("metrics-listen");
  } else if (std::getenv("KVBRIDGE_METRICS_LISTEN") == nullptr) {
    *listen = default_listen;
    *best_effort = true;
  }
}

// Blocks SIGTERM/SIGINT in every thread (call before starting any) and waits for one.
sigset_t BlockStopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

// An HA master: campaigns in etcd until a signal; leads when elected (HaMaster).
int RunHaMaster(const MasterOptions& o) {
  sigset_t stop = BlockStopSignals();
  auto master = HaMaster::Start(o);
  if (!master.ok()) {
    std::fprintf(stderr, "kvbridge master: %s\n", master.status().ToString().c_str());
    return 1;
  }
  std::printf("kvbridge master campaigning in etcd %s as %s\n", o.etcd.c_str(),
              o.advertise.empty() ? o.listen.c_str() : o.advertise.c_str());
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop, &sig);
  std::fprintf(stderr, "kvbridge master: %s, stepping down\n", strsignal(sig));
  return 0;
}

int RunMaster(const Flags& f) {
  MasterOptions o = MasterOptions::FromEnv();
  if (f.Has("listen")) o.listen = f.Get("listen");
  if (f.Has("etcd")) o.etcd = f.Get("etcd");
  if (f.Has("advertise")) o.advertise = f.Get("advertise");
  if (!SetNumber(f, "node-ttl-ms", &o.node_ttl_ms) || !SetNumber(f, "lease-ms", &o.lease_ms) ||
      !SetNumber(f, "ha-lease-ms", &o.ha_lease_ms) ||
      !SetNumber(f, "ha-takeover-wait-ms", &o.ha_takeover_wait_ms)) {
    return 2;
  }
  SetMetricsListen(f, "0.0.0.0:9480", &o.metrics_listen, &o.metrics_listen_best_effort);
  if (!o.etcd.empty()) return RunHaMaster(o);
  sigset_t stop = BlockStopSignals();
  auto master = MasterServer::Start(o);
  if (!master.ok()) {
    std::fprintf(stderr, "kvbridge master: %s\n", master.status().ToString().c_str());
    return 1;
  }
  const std::string& http = master.value()->metrics_address();
  std::printf("kvbridge master listening on %s%s%s\n", master.value()->address().c_str(),
              http.empty() ? "" : ", status page and /metrics on http://", http.c_str());
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop, &sig);
  std::fprintf(stderr, "kvbridge master: %s, stopping\n", strsignal(sig));
  return 0;
}

int RunNode(const Flags& f) {
  NodeOptions o = NodeOptions::FromEnv();
  if (f.Has("master")) o.master_address = f.Get("master");
  if (f.Has("node-id")) o.engine.node_id = f.Get("node-id");
  if (f.Has("listen")) o.engine.listen = f.Get("listen");
  if (f.Has("rpc-listen")) o.rpc_listen = f.Get("rpc-listen");
  if (f.Has("ssd-path")) o.ssd_path = f.Get("ssd-path");
  if (!SetNumber(f, "dram-bytes", &o.dram_bytes) || !SetNumber(f, "ssd-bytes", &o.ssd_bytes) ||
      !SetNumber(f, "drain-timeout-ms", &o.drain_timeout_ms)) {
    return 2;
  }
  SetMetricsListen(f, "0.0.0.0:9481", &o.metrics_listen, &o.metrics_listen_best_effort);
  sigset_t stop = BlockStopSignals();
  auto node = StorageNode::Start(o);
  if (!node.ok()) {
    std::fprintf(stderr, "kvbridge node: %s\n", node.status().ToString().c_str());
    return 1;
  }
  const Status ssd = node.value()->ssd_status();
  const std::string& http = node.value()->metrics_address();
  std::printf("kvbridge node %s serving %llu bytes, master %s%s%s%s%s\n",
              node.value()->id().ToString().c_str(), (unsigned long long)o.dram_bytes,
              o.master_address.c_str(),
              ssd.ok() ? ", SSD tier at " : (o.ssd_path.empty() ? "" : ", no SSD tier: "),
              ssd.ok() ? o.ssd_path.c_str() : (o.ssd_path.empty() ? "" : ssd.ToString().c_str()),
              http.empty() ? "" : ", /metrics on http://", http.c_str());
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop, &sig);
  if (sig == SIGTERM) {
    std::fprintf(stderr, "kvbridge node: SIGTERM, draining (up to %u ms)\n", o.drain_timeout_ms);
    Status st = node.value()->Drain();
    std::fprintf(stderr, "kvbridge node: drain %s\n", st.ok() ? "complete" : st.ToString().c_str());
  }
  return 0;
}

std::string Bytes(uint64_t b) {
  char buf[32];
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

// One answer of `kvbridge status`; 1 when the master did not answer.
int PrintStatus(const Flags& f, const std::string& master, const StoreOptions& so) {
  // The token from the environment or the config file, never a flag (argv is public).
  auto st = QueryClusterStatus(master, so.rpc_timeout_ms, so.engine.cluster_token);
  if (!st.ok()) {
    std::fprintf(stderr, "kvbridge status: %s\n", st.status().ToString().c_str());
    return 1;
  }
  const ClusterStatus& c = st.value();
  if (f.Has("json")) {
    std::printf(
        "{\"master\": \"%s\", \"objects\": %llu, \"pending_puts\": %llu, "
        "\"stored_bytes\": %llu, \"under_replicated\": %llu, \"evictions_total\": %llu, "
        "\"bad_replicas_total\": %llu, \"unreachable_reports_total\": %llu, "
        "\"nodes_expired_total\": %llu, "
        "\"demotions_total\": %llu, \"promotions_total\": %llu, \"ssd_replicas\": %llu, "
        "\"departed_copies\": %llu, \"nodes\": [",
        master.c_str(), (unsigned long long)c.objects, (unsigned long long)c.pending_puts,
        (unsigned long long)c.stored_bytes, (unsigned long long)c.under_replicated,
        (unsigned long long)c.evictions_total, (unsigned long long)c.bad_replicas_total,
        (unsigned long long)c.unreachable_reports_total, (unsigned long long)c.nodes_expired_total,
        (unsigned long long)c.demotions_total, (unsigned long long)c.promotions_total,
        (unsigned long long)c.ssd_replicas, (unsigned long long)c.departed_copies);
    for (size_t i = 0; i < c.nodes.size(); ++i) {
      const NodeStatus& n = c.nodes[i];
      std::printf(
          "%s{\"node_id\": \"%s\", \"incarnation\": \"%016llx\", \"state\": \"%s\", "
          "\"capacity_bytes\": %llu, \"used_bytes\": %llu, \"replicas\": %llu, "
          "\"ssd_capacity_bytes\": %llu, \"ssd_used_bytes\": %llu}",
          i ? ", " : "", n.id.node_id.c_str(), (unsigned long long)n.id.incarnation,
          n.state.c_str(), (unsigned long long)n.capacity_bytes, (unsigned long long)n.used_bytes,
          (unsigned long long)n.replicas, (unsigned long long)n.ssd_capacity_bytes,
          (unsigned long long)n.ssd_used_bytes);
    }
    std::printf("]}\n");
    return 0;
  }
  std::printf(
      "master %s: %llu objects (%s), %llu puts in progress, %llu under-replicated\n"
      "since start: %llu evicted, %llu bad replicas dropped, %llu reads could not reach a "
      "node, %llu nodes expired, %llu demoted to SSD, %llu promoted back (%llu replicas on SSD "
      "now)\n"
      "copies remembered for nodes that left: %llu\n\n",
      master.c_str(), (unsigned long long)c.objects, Bytes(c.stored_bytes).c_str(),
      (unsigned long long)c.pending_puts, (unsigned long long)c.under_replicated,
      (unsigned long long)c.evictions_total, (unsigned long long)c.bad_replicas_total,
      (unsigned long long)c.unreachable_reports_total, (unsigned long long)c.nodes_expired_total,
      (unsigned long long)c.demotions_total, (unsigned long long)c.promotions_total,
      (unsigned long long)c.ssd_replicas, (unsigned long long)c.departed_copies);
  std::printf("%-24s %-18s %-9s %12s %12s %6s %9s %12s %12s\n", "NODE", "INCARNATION", "STATE",
              "CAPACITY", "USED", "USED%", "REPLICAS", "SSD", "SSD USED");
  for (const NodeStatus& n : c.nodes) {
    const double pct = n.capacity_bytes ? 100.0 * n.used_bytes / n.capacity_bytes : 0;
    std::printf("%-24s %016llx   %-9s %12s %12s %5.1f%% %9llu %12s %12s\n", n.id.node_id.c_str(),
                (unsigned long long)n.id.incarnation, n.state.c_str(),
                Bytes(n.capacity_bytes).c_str(), Bytes(n.used_bytes).c_str(), pct,
                (unsigned long long)n.replicas,
                n.ssd_capacity_bytes ? Bytes(n.ssd_capacity_bytes).c_str() : "-",
                n.ssd_capacity_bytes ? Bytes(n.ssd_used_bytes).c_str() : "-");
  }
  return 0;
}

int RunStatus(const Flags& f) {
  StoreOptions so = StoreOptions::FromEnv();
  const std::string master = f.Has("master") ? f.Get("master") : so.master_address;
  if (!f.Has("watch")) {
    if (f.Has("interval")) return Usage("--interval goes with --watch");
    return PrintStatus(f, master, so);
  }
  double interval_s = 2;
  if (f.Has("interval")) {
    char* end = nullptr;
    const std::string v = f.Get("interval");
    interval_s = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !(interval_s >= 0.1)) {
      std::fprintf(stderr, "kvbridge status: --interval: '%s' is not a number of seconds >= 0.1\n",
                   v.c_str());
      return 2;
    }
  }
  // Until interrupted: the screen cleared and redrawn (on a terminal), or one answer after the
  // other (piped). A master that does not answer is said and asked again.
  const bool tty = isatty(STDOUT_FILENO);
  for (;;) {
    if (tty) std::printf("\033[H\033[2J");
    time_t now = time(nullptr);
    char when[32];
    std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", std::localtime(&now));
    if (!f.Has("json")) {
      std::printf("every %gs, %s (Ctrl-C to stop)\n", interval_s, when);
    }
    std::fflush(stdout);
    PrintStatus(f, master, so);
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::duration<double>(interval_s));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Usage();
  const std::string cmd = argv[1];
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    Usage();
    return 0;
  }
  Flags f;
  std::string why;
  bool ok;
  if (cmd == "master") {
    ok = ParseFlags(argc, argv, 2,
                    {"listen", "node-ttl-ms", "lease-ms", "metrics-listen", "config", "etcd",
                     "advertise", "ha-lease-ms", "ha-takeover-wait-ms"},
                    {}, &f, &why);
  } else if (cmd == "node") {
    ok = ParseFlags(argc, argv, 2,
                    {"master", "dram-bytes", "node-id", "listen", "rpc-listen", "drain-timeout-ms",
                     "ssd-path", "ssd-bytes", "metrics-listen", "config"},
                    {}, &f, &why);
  } else if (cmd == "status") {
    ok = ParseFlags(argc, argv, 2, {"master", "interval", "config"}, {"json", "watch"}, &f, &why);
  } else {
    return Usage(("unknown command '" + cmd + "'").c_str());
  }
  if (!ok) return Usage(why.c_str());
  if (f.Has("config") && !LoadConfigFile(f.Get("config"))) return 2;
  if (cmd == "master") return RunMaster(f);
  if (cmd == "node") return RunNode(f);
  return RunStatus(f);
}

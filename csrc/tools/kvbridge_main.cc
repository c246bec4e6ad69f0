// `kvbridge`: the daemons and the operator's view of a cluster.
//
//   kvbridge master [flags]   the store's master (several with --etcd: one leader elected)
//   kvbridge node   [flags]   a storage node
//   kvbridge status [flags]   a master's view of the cluster
//   kvbridge COMMAND --help   that command's flags, each with its KVBRIDGE_* variable
//
// The Python package's `kvbridge` console script runs this program for these commands.
// Settings come from, strongest first: flags, KVBRIDGE_* environment variables, the config file
// (lines `key = value`; a key `x_y` stands for KVBRIDGE_X_Y), built-in defaults
// (docs/configuration.md; tests/python/test_option_drift.py holds the flags to that table).
// A node drains on SIGTERM (its objects move elsewhere first) and stops at once on SIGINT or on
// a second signal during the drain (exit status 128 + the signal).
// Exit status: 0 ok, 1 a kvbridge error (startup, or a master that did not answer), 2 bad usage.
#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/store.h"

using namespace kvbridge;

namespace {

// One flag of a command: `--name VALUE`, or `--name` alone when `value` is null.
struct FlagSpec {
  const char* name;
  const char* value;
  const char* help;
};

struct Command {
  const char* name;
  const char* summary;
  std::vector<FlagSpec> flags;
};

const FlagSpec kConfigFlag{"config", "FILE",
                           "read `key = value` lines (node_ttl_ms = 3000 is KVBRIDGE_NODE_TTL_MS); "
                           "flags and variables win"};
const FlagSpec kJsonFlag{"json", nullptr, "machine-readable output: one JSON object per line"};
const FlagSpec kHelpFlag{"help", nullptr, "print this and exit"};

const std::vector<Command>& Commands() {
  static const std::vector<Command> commands = {
      {"master",
       "runs the store's master until SIGINT/SIGTERM; with --etcd, one of several masters that "
       "elect a leader",
       {{"listen", "HOST:PORT", "gRPC address; port 0 picks one (KVBRIDGE_MASTER_LISTEN)"},
        {"node-ttl-ms", "N", "a node silent this long is dead (KVBRIDGE_NODE_TTL_MS)"},
        {"lease-ms", "N", "read lease of a get (KVBRIDGE_LEASE_MS)"},
        {"min-replicas", "N",
         "replicas that must be written for a put to count (KVBRIDGE_MIN_REPLICAS)"},
        {"metrics-listen", "HOST:PORT|off",
         "/metrics, /health and the status page (KVBRIDGE_METRICS_LISTEN; default 0.0.0.0:9480)"},
        {"etcd", "HOST:PORT,...[/PREFIX]",
         "elect a leader among masters in this etcd (KVBRIDGE_MASTER_ETCD)"},
        {"advertise", "HOST:PORT",
         "the address published while leading (KVBRIDGE_MASTER_ADVERTISE; default --listen)"},
        {"ha-lease-ms", "N", "the leader's etcd lease (KVBRIDGE_HA_LEASE_MS)"},
        {"ha-takeover-wait-ms", "N",
         "a new leader waits this long at most for the nodes to register "
         "(KVBRIDGE_HA_TAKEOVER_WAIT_MS)"},
        {"fast-port", "N|off",
         "the lean port for puts and gets on the --listen host; 0 picks one, off: gRPC only "
         "(KVBRIDGE_MASTER_FAST_PORT)"},
        kConfigFlag,
        kJsonFlag,
        kHelpFlag}},
      {"node",
       "runs a storage node; SIGTERM drains it (its objects move to other nodes), SIGINT or a "
       "second signal stops it at once",
       {{"master", "HOST:PORT", "the master, or etcd://HOST:PORT,...[/PREFIX] (KVBRIDGE_MASTER)"},
        {"dram-bytes", "SIZE", "DRAM contributed, e.g. 64G (KVBRIDGE_NODE_DRAM_BYTES)"},
        {"node-id", "ID", "this node's id (KVBRIDGE_NODE_ID; default <host>-<pid>)"},
        {"listen", "HOST:PORT,...", "data-plane endpoints, one per NIC (KVBRIDGE_LISTEN)"},
        {"rpc-listen", "HOST:PORT", "the node's control service (KVBRIDGE_NODE_RPC_LISTEN)"},
        {"drain-timeout-ms", "N",
         "upper bound of the drain on SIGTERM (KVBRIDGE_DRAIN_TIMEOUT_MS)"},
        {"ssd-path", "DIR", "directory of the SSD tier (KVBRIDGE_NODE_SSD_PATH; default none)"},
        {"ssd-bytes", "SIZE", "capacity of the SSD tier, e.g. 500G (KVBRIDGE_NODE_SSD_BYTES)"},
        {"metrics-listen", "HOST:PORT|off",
         "/metrics and /health (KVBRIDGE_METRICS_LISTEN; default 0.0.0.0:9481)"},
        kConfigFlag,
        kJsonFlag,
        kHelpFlag}},
      {"status",
       "prints a master's view of the cluster",
       {{"master", "HOST:PORT", "the master (KVBRIDGE_MASTER)"},
        {"timeout-ms", "N", "deadline of the call (KVBRIDGE_RPC_TIMEOUT_MS)"},
        {"watch", nullptr, "redraw every --interval seconds until interrupted"},
        {"interval", "S", "seconds between redraws (default 2)"},
        kConfigFlag,
        kJsonFlag,
        kHelpFlag}},
  };
  return commands;
}

const Command* FindCommand(const std::string& name) {
  for (const Command& c : Commands()) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

void PrintCommandHelp(FILE* out, const Command& c) {
  std::fprintf(out, "usage: kvbridge %s [flags]\n%s.\n\nflags:\n", c.name, c.summary);
  for (const FlagSpec& f : c.flags) {
    std::string left = std::string("--") + f.name + (f.value ? std::string(" ") + f.value : "");
    std::fprintf(out, "  %-32s %s\n", left.c_str(), f.help);
  }
}

int Usage(const char* why = nullptr, const Command* cmd = nullptr) {
  if (why) std::fprintf(stderr, "kvbridge: %s\n\n", why);
  if (cmd) {
    PrintCommandHelp(stderr, *cmd);
    return 2;
  }
  std::fprintf(stderr, "usage: kvbridge COMMAND [flags]\n\ncommands:\n");
  for (const Command& c : Commands()) std::fprintf(stderr, "  %-8s %s\n", c.name, c.summary);
  std::fprintf(stderr,
               "\n`kvbridge COMMAND --help` lists a command's flags. Every flag has a KVBRIDGE_* "
               "variable\n(docs/configuration.md).\n");
  return 2;
}

// A JSON string literal of `s`.
std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// A failure of a command: its name and message on stderr, and with --json also as
// {"error": NAME, "code": N, "message": ...} on stdout.
int Fail(bool json, const char* command, const Status& st) {
  if (json) {
    std::printf("{\"error\": %s, \"code\": %d, \"message\": %s}\n",
                JsonString(StatusCodeName(st.code())).c_str(), static_cast<int>(st.code()),
                JsonString(st.message()).c_str());
    std::fflush(stdout);
  }
  std::fprintf(stderr, "kvbridge %s: %s\n", command, st.ToString().c_str());
  return 1;
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

bool ParseFlags(int argc, char** argv, int first, const Command& cmd, Flags* out,
                std::string* why) {
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "-h") a = "--help";
    if (a.rfind("--", 0) != 0) {
      *why = "unexpected argument '" + a + "'";
      return false;
    }
    a = a.substr(2);
    auto spec = std::find_if(cmd.flags.begin(), cmd.flags.end(),
                             [&](const FlagSpec& f) { return a == f.name; });
    if (spec == cmd.flags.end()) {
      *why = "unknown flag --" + a;
      return false;
    }
    if (spec->value == nullptr) {
      out->values[a] = "1";
      continue;
    }
    if (i + 1 >= argc) {
      *why = "--" + a + " needs a value";
      return false;
    }
    out->values[a] = argv[++i];
  }
  return true;
}

template <typename T>
bool SetNumber(const Flags& f, const std::string& flag, T* out) {
  if (!f.Has(flag)) return true;
  const std::string s = f.Get(flag);
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (s.empty() || !std::isdigit(static_cast<unsigned char>(s[0])) || *end != '\0' || errno != 0 ||
      v > std::numeric_limits<T>::max()) {
    std::fprintf(stderr, "kvbridge: --%s: '%s' is not a number from 0 to %llu\n", flag.c_str(),
                 s.c_str(), static_cast<unsigned long long>(std::numeric_limits<T>::max()));
    return false;
  }
  *out = static_cast<T>(v);
  return true;
}

// A byte count: "1073741824", "512M", "64G", "1.5GiB" (K, M, G, T: powers of 1024).
bool SetSize(const Flags& f, const std::string& flag, uint64_t* out) {
  if (!f.Has(flag)) return true;
  const std::string s = f.Get(flag);
  if (!s.empty() && s.find_first_not_of("0123456789") == std::string::npos) {
    return SetNumber(f, flag, out);  // exact, beyond a double's 53 bits
  }
  char* end = nullptr;
  const double number = std::strtod(s.c_str(), &end);
  std::string unit(end);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  const std::string units = "KMGT";
  double scale = 1;
  size_t rest = 0;
  if (!unit.empty() && units.find(unit[0]) != std::string::npos) {
    scale = std::ldexp(1.0, 10 * static_cast<int>(units.find(unit[0]) + 1));
    rest = 1;
  }
  const std::string suffix = unit.substr(rest);
  const bool ok = end != s.c_str() && std::isdigit(static_cast<unsigned char>(s[0])) &&
                  (suffix.empty() || suffix == "B" || (rest == 1 && suffix == "IB")) &&
                  number * scale < 18446744073709551616.0;
  if (!ok) {
    std::fprintf(stderr, "kvbridge: --%s: not a size: '%s' (e.g. 512M, 64G)\n", flag.c_str(),
                 s.c_str());
    return false;
  }
  *out = static_cast<uint64_t>(number * scale);
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

// Stop lines: text on stderr, and with --json {"event": "stopped", ...} on stdout.
void Stopped(bool json, const char* role, const std::string& text, const std::string& result) {
  std::fprintf(stderr, "kvbridge %s: %s\n", role, text.c_str());
  if (json) {
    std::printf("{\"event\": \"stopped\", \"role\": \"%s\", \"result\": %s}\n", role,
                JsonString(result).c_str());
    std::fflush(stdout);
  }
}

// The allocator this process runs on: "tcmalloc" when the build linked it (csrc/tools/
// CMakeLists.txt, KVBRIDGE_DAEMON_ALLOCATOR), found by its own entry point, else "system".
const char* AllocatorName() {
  return dlsym(RTLD_DEFAULT, "tc_malloc") != nullptr ? "tcmalloc" : "system";
}

// An HA master: campaigns in etcd until a signal; leads when elected (HaMaster).
int RunHaMaster(const MasterOptions& o, bool json) {
  sigset_t stop = BlockStopSignals();
  auto master = HaMaster::Start(o);
  if (!master.ok()) return Fail(json, "master", master.status());
  const std::string& advertise = o.advertise.empty() ? o.listen : o.advertise;
  if (json) {
    std::printf(
        "{\"event\": \"campaigning\", \"role\": \"master\", \"etcd\": %s, "
        "\"advertise\": %s, \"allocator\": \"%s\"}\n",
        JsonString(o.etcd).c_str(), JsonString(advertise).c_str(), AllocatorName());
  } else {
    std::printf("kvbridge master campaigning in etcd %s as %s\n", o.etcd.c_str(),
                advertise.c_str());
  }
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop, &sig);
  master.value().reset();
  Stopped(json, "master", std::string(strsignal(sig)) + ", stepped down", "stopped");
  return 0;
}

int RunMaster(const Flags& f) {
  const bool json = f.Has("json");
  MasterOptions o = MasterOptions::FromEnv();
  if (f.Has("listen")) o.listen = f.Get("listen");
  if (f.Has("etcd")) o.etcd = f.Get("etcd");
  if (f.Has("advertise")) o.advertise = f.Get("advertise");
  if (!SetNumber(f, "node-ttl-ms", &o.node_ttl_ms) || !SetNumber(f, "lease-ms", &o.lease_ms) ||
      !SetNumber(f, "min-replicas", &o.min_replicas) ||
      !SetNumber(f, "ha-lease-ms", &o.ha_lease_ms) ||
      !SetNumber(f, "ha-takeover-wait-ms", &o.ha_takeover_wait_ms)) {
    return 2;
  }
  if (f.Has("fast-port") && f.Get("fast-port") == "off") {
    o.fast_port = -1;
  } else if (uint16_t port = 0; f.Has("fast-port")) {
    if (!SetNumber(f, "fast-port", &port)) return 2;
    o.fast_port = port;
  }
  SetMetricsListen(f, "0.0.0.0:9480", &o.metrics_listen, &o.metrics_listen_best_effort);
  if (!o.etcd.empty()) return RunHaMaster(o, json);
  sigset_t stop = BlockStopSignals();
  auto master = MasterServer::Start(o);
  if (!master.ok()) return Fail(json, "master", master.status());
  const std::string& address = master.value()->address();
  const std::string& http = master.value()->metrics_address();
  if (json) {
    std::printf(
        "{\"event\": \"ready\", \"role\": \"master\", \"address\": %s, "
        "\"metrics_address\": %s, \"fast_port\": %u, \"allocator\": \"%s\"}\n",
        JsonString(address).c_str(), JsonString(http).c_str(),
        static_cast<unsigned>(master.value()->fast_port()), AllocatorName());
  } else {
    std::printf("kvbridge master listening on %s%s%s\n", address.c_str(),
                http.empty() ? "" : ", status page and /metrics on http://", http.c_str());
  }
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop, &sig);
  master.value().reset();
  Stopped(json, "master", std::string(strsignal(sig)) + ", stopped", "stopped");
  return 0;
}

int RunNode(const Flags& f) {
  const bool json = f.Has("json");
  NodeOptions o = NodeOptions::FromEnv();
  if (f.Has("master")) o.master_address = f.Get("master");
  if (f.Has("node-id")) o.engine.node_id = f.Get("node-id");
  if (f.Has("listen")) o.engine.listen = f.Get("listen");
  if (f.Has("rpc-listen")) o.rpc_listen = f.Get("rpc-listen");
  if (f.Has("ssd-path")) o.ssd_path = f.Get("ssd-path");
  if (!SetSize(f, "dram-bytes", &o.dram_bytes) || !SetSize(f, "ssd-bytes", &o.ssd_bytes) ||
      !SetNumber(f, "drain-timeout-ms", &o.drain_timeout_ms)) {
    return 2;
  }
  SetMetricsListen(f, "0.0.0.0:9481", &o.metrics_listen, &o.metrics_listen_best_effort);
  sigset_t stop = BlockStopSignals();
  auto node = StorageNode::Start(o);
  if (!node.ok()) return Fail(json, "node", node.status());
  const PeerId id = node.value()->id();
  const Status ssd = node.value()->ssd_status();
  const std::string& http = node.value()->metrics_address();
  if (json) {
    std::printf(
        "{\"event\": \"ready\", \"role\": \"node\", \"node_id\": %s, \"incarnation\": "
        "%llu, \"dram_bytes\": %llu, \"master\": %s, \"ssd\": %s, \"ssd_error\": %s, "
        "\"metrics_address\": %s, \"allocator\": \"%s\"}\n",
        JsonString(id.node_id).c_str(), (unsigned long long)id.incarnation,
        (unsigned long long)o.dram_bytes, JsonString(o.master_address).c_str(),
        ssd.ok() ? "true" : "false",
        JsonString(ssd.ok() || o.ssd_path.empty() ? "" : ssd.ToString()).c_str(),
        JsonString(http).c_str(), AllocatorName());
  } else {
    std::printf("kvbridge node %s serving %llu bytes, master %s%s%s%s%s\n", id.ToString().c_str(),
                (unsigned long long)o.dram_bytes, o.master_address.c_str(),
                ssd.ok() ? ", SSD tier at " : (o.ssd_path.empty() ? "" : ", no SSD tier: "),
                ssd.ok() ? o.ssd_path.c_str() : (o.ssd_path.empty() ? "" : ssd.ToString().c_str()),
                http.empty() ? "" : ", /metrics on http://", http.c_str());
  }
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop, &sig);
  std::string result = "stopped without draining (SIGINT)";
  if (sig == SIGTERM) {
    const size_t objects = node.value()->object_count();
    std::fprintf(stderr, "kvbridge node: SIGTERM, draining %zu objects (up to %u ms)\n", objects,
                 o.drain_timeout_ms);
    if (json) {
      std::printf("{\"event\": \"draining\", \"role\": \"node\", \"objects\": %zu}\n", objects);
      std::fflush(stdout);
    }
    // A second signal during the drain stops at once.
    std::thread([stop] {
      int again = 0;
      sigwait(&stop, &again);
      std::fprintf(stderr, "kvbridge node: %s during the drain, stopping at once\n",
                   strsignal(again));
      _exit(128 + again);
    }).detach();
    Status st = node.value()->Drain();
    result = st.ok() ? "drained" : "drain incomplete: " + st.ToString();
  }
  node.value().reset();
  Stopped(json, "node", id.node_id + " " + result, result);
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
  if (!st.ok()) return Fail(f.Has("json"), "status", st.status());
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
  if (!SetNumber(f, "timeout-ms", &so.rpc_timeout_ms)) return 2;
  if (!f.Has("watch")) {
    if (f.Has("interval")) return Usage("--interval goes with --watch", FindCommand("status"));
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
  // Stopped by SIGINT/SIGTERM whatever it inherited: a shell starts background jobs with SIGINT
  // ignored, and an ignored signal never reaches sigwait or ends `status --watch`.
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  if (argc < 2) return Usage();
  const std::string name = argv[1];
  if (name == "-h" || name == "--help" || name == "help") {
    Usage();
    return 0;
  }
  const Command* cmd = FindCommand(name);
  if (cmd == nullptr) return Usage(("unknown command '" + name + "'").c_str());
  Flags f;
  std::string why;
  if (!ParseFlags(argc, argv, 2, *cmd, &f, &why)) return Usage(why.c_str(), cmd);
  // After the parse: `--help` with other flags also says whether they are known.
  if (f.Has("help")) {
    PrintCommandHelp(stdout, *cmd);
    return 0;
  }
  if (f.Has("config") && !LoadConfigFile(f.Get("config"))) return 2;
  if (name == "master") return RunMaster(f);
  if (name == "node") return RunNode(f);
  return RunStatus(f);
}

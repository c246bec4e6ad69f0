// kvb_bench_master_scale: the master's memory per object, and whether its put/get rates stay
// flat, as its table grows to millions of objects (issue 22).
//
// Starts a real `kvbridge master` and one `kvbridge node` (processes on loopback, from this
// build) and fills the store from an in-process StoreClient with batched puts of small objects
// (one buffer of --object-bytes, 64 by default: the master's allocation unit) under keys of
// exactly 50 bytes, in steps (default 1 M and 5 M objects; --quick: 200 k and 1 M). At each
// step it reports
//   - the master's RSS (/proc/<pid>/status VmRSS) and (RSS - RSS of the empty master) / objects;
//   - the node's RSS likewise: its DRAM pool is faulted in at start (KVBRIDGE_DRAM_PREFAULT), so
//     the growth over the empty node is its inventory (records of what it holds), not data;
//   - put and get rates in objects/s over a fixed sample, each the median of three timings
//     (the machine is shared, so one timing alone moves a lot): the last 3 x --sample-batches
//     batches of the step's fill are timed apart in three slices (puts of fresh keys), and
//     --sample-batches batches of keys drawn at random (fixed seed) from all stored ones are
//     read back and checked (each object carries its key id) three times over;
//   - the master's CPU time per object put and got over those samples (/proc/<pid>/stat, all its
//     threads): what the rates cannot show on a shared machine, whether the
//     master's own work per operation grows with its table;
//   - the master's own object count (its status), which must equal the number put.
// Headline: the master's bytes per object at the largest step, against the goal (300 B: the
// headline's baseline, ratio = goal / value, so >= 1 meets it), and the put and get rates at the
// last step over those at the first (flat: about 1).
//
// Progress goes to stderr; the last stdout line is one JSON object (docs/benchmarks.md).
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "benchlib.h"
#include "local_cluster.h"

using namespace kvbridge;
using namespace kvbridge::bench;
namespace bl = kvbridge::benchlib;

namespace {

constexpr uint64_t kMagic = 0x6d7363616c656b76ull;  // stamped on every object
constexpr size_t kKeyBytes = 50;
constexpr double kGoal = 300;  // master bytes per object (issue 22)

struct Args {
  bool quick = false;
  std::vector<uint64_t> steps = {1000000, 5000000};
  int threads = 2;
  int batch = 512;
  int sample_batches = 64;
  uint64_t object_bytes = 64;
  std::string bin_dir = KVBRIDGE_BIN_DIR;
  std::string log_dir = "bench-out/master-scale-logs";
};

// "mscale-object-" and the id on 36 digits: 50 bytes.
std::string Key(uint64_t id) {
  char buf[kKeyBytes + 1];
  std::snprintf(buf, sizeof(buf), "mscale-object-%036" PRIu64, id);
  return std::string(buf, kKeyBytes);
}

// VmRSS of a process in bytes, 0 if unreadable.
uint64_t RssBytes(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::strtoull(line.c_str() + 6, nullptr, 10) * 1024;
  }
  return 0;
}

// CPU time of a process so far (all its threads, those that ended too), in ns: utime + stime of
// /proc/<pid>/stat, in clock ticks (10 ms); 0 if unreadable. Unlike a rate, it does not move
// with what else runs on the machine, so it tells a master that slows with its table from a
// busy VM.
uint64_t CpuNs(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');  // the command name may hold spaces
  if (paren == std::string::npos) return 0;
  std::istringstream in(stat.substr(paren + 2));
  std::string field;
  uint64_t utime = 0, stime = 0;
  // After the name: state is field 3; utime and stime are fields 14 and 15.
  for (int i = 3; i <= 15 && in >> field; ++i) {
    if (i == 14) utime = std::strtoull(field.c_str(), nullptr, 10);
    if (i == 15) stime = std::strtoull(field.c_str(), nullptr, 10);
  }
  return (utime + stime) * (1000000000ull / static_cast<uint64_t>(sysconf(_SC_CLK_TCK)));
}

struct Step {
  uint64_t objects = 0;
  uint64_t master_objects = 0;  // as the master's status says
  uint64_t master_rss = 0, node_rss = 0;
  double fill_seconds = 0, fill_rate = 0;
  double put_rate = 0, get_rate = 0;
  double master_put_cpu_us = 0, master_get_cpu_us = 0;  // master CPU per object put / got
  uint64_t failures = 0;
};

// Runs fn(0) .. fn(threads - 1) on threads of their own; the seconds until all returned.
template <typename Fn>
double OnThreads(int threads, Fn&& fn) {
  const auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) ts.emplace_back([&fn, t] { fn(t); });
  for (auto& th : ts) th.join();
  return SecondsSince(t0);
}

struct Worker {
  std::unique_ptr<Arena> src, dst;
};

int Run(const Args& a) {
  for (size_t i = 0; i < a.steps.size(); ++i) {
    if (a.steps[i] == 0 || (i > 0 && a.steps[i] <= a.steps[i - 1])) {
      std::fprintf(stderr, "master-scale: --steps must be increasing and > 0\n");
      return 2;
    }
  }
  constexpr int kTimings = 3;  // per rate, median taken
  const uint64_t sample_keys = uint64_t(a.sample_batches) * a.batch;
  if (a.steps.front() < kTimings * sample_keys) {
    std::fprintf(stderr,
                 "master-scale: the first step is smaller than the put sample (%" PRIu64 ")\n",
                 kTimings * sample_keys);
    return 2;
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const uint64_t obj = (a.object_bytes + 63) / 64 * 64;
  // The pool: the largest step at most 70% full, so no put ever evicts (the default eviction
  // watermark is 90%).
  const uint64_t pool = std::max<uint64_t>(64ull << 20, a.steps.back() * obj / 7 * 10);
  ClusterConfig cc;
  cc.kvbridge_bin = a.bin_dir + "/kvbridge";
  cc.nodes = 1;
  cc.dram_bytes = (pool + (2ull << 20) - 1) / (2ull << 20) * (2ull << 20);
  cc.node_ttl_ms = 10000;  // a 2-core machine under full load must not lose its node
  cc.log_dir = a.log_dir;
  std::fprintf(stderr, "master-scale: starting a master and a node (%" PRIu64 " MiB DRAM)...\n",
               cc.dram_bytes >> 20);
  LocalCluster cluster;
  std::string why;
  if (!cluster.Start(cc, &why)) {
    std::fprintf(stderr, "master-scale: cannot start the cluster: %s\n", why.c_str());
    return 1;
  }
  const std::vector<pid_t> pids = cluster.Pids();  // master first, then the node
  if (pids.size() != 2) {
    std::fprintf(stderr, "master-scale: expected 2 daemons, found %zu\n", pids.size());
    return 1;
  }
  const pid_t master_pid = pids[0], node_pid = pids[1];

  StoreOptions so;
  so.master_address = cluster.master_address();
  so.replica_num = 1;
  so.rpc_timeout_ms = 30000;
  so.transfer_deadline_ms = 30000;
  so.engine = EngineOptions::FromEnv();
  so.engine.node_id = "master-scale-client";
  so.engine.transports = {"tcp"};
  auto created = StoreClient::Create(so);
  if (!created.ok()) {
    std::fprintf(stderr, "master-scale: %s\n", created.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<StoreClient> client = std::move(created).value();
  const size_t arena_bytes = size_t(a.batch) * obj;
  std::vector<Worker> workers(a.threads);
  for (auto& w : workers) {
    w.src = std::make_unique<Arena>(arena_bytes);
    w.dst = std::make_unique<Arena>(arena_bytes);
    if (!client->RegisterBuffer(w.src->data, arena_bytes).ok() ||
        !client->RegisterBuffer(w.dst->data, arena_bytes).ok()) {
      std::fprintf(stderr, "master-scale: RegisterBuffer failed\n");
      return 1;
    }
  }
  auto refs = [&](Arena& ar, size_t n) {
    std::vector<std::vector<BufferRef>> b(n);
    for (size_t j = 0; j < n; ++j) b[j] = {BufferRef{ar.data + j * obj, a.object_bytes}};
    return b;
  };

  // The empty cluster (node registered, pool faulted in), after the daemons settled.
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const uint64_t master_rss0 = RssBytes(master_pid), node_rss0 = RssBytes(node_pid);
  std::fprintf(stderr, "master-scale: empty master RSS %.1f MiB, node RSS %.1f MiB\n",
               master_rss0 / 1048576.0, node_rss0 / 1048576.0);

  // Puts ids [first, last) in batches from every thread; returns (seconds, failures).
  auto put_range = [&](uint64_t first, uint64_t last) {
    std::atomic<uint64_t> next{first};
    std::atomic<uint64_t> failed{0};
    const double seconds = OnThreads(a.threads, [&](int t) {
      Worker& w = workers[t];
      std::vector<std::string> keys;
      for (;;) {
        const uint64_t b = next.fetch_add(a.batch);
        if (b >= last) return;
        const size_t n = std::min<uint64_t>(a.batch, last - b);
        keys.resize(n);
        for (size_t j = 0; j < n; ++j) {
          keys[j] = Key(b + j);
          auto* word = reinterpret_cast<uint64_t*>(w.src->data + j * obj);
          word[0] = kMagic;
          word[1] = b + j;
        }
        auto bufs = refs(*w.src, n);
        for (const Status& s : client->BatchPutFrom(keys, bufs)) failed += !s.ok();
      }
    });
    return std::make_pair(seconds, failed.load());
  };

  // sample_batches batches of random stored ids, checked; returns (seconds, failures).
  std::mt19937_64 rng(22);
  auto draw_sample = [&](uint64_t stored) {
    std::vector<std::vector<uint64_t>> ids(a.sample_batches);
    std::uniform_int_distribution<uint64_t> pick(0, stored - 1);
    for (auto& v : ids) {
      v.resize(a.batch);
      for (auto& id : v) id = pick(rng);
    }
    return ids;
  };
  auto get_sample = [&](const std::vector<std::vector<uint64_t>>& ids) {
    std::atomic<size_t> next{0};
    std::atomic<uint64_t> failed{0};
    const double seconds = OnThreads(a.threads, [&](int t) {
      Worker& w = workers[t];
      std::vector<std::string> keys(a.batch);
      for (;;) {
        const size_t i = next.fetch_add(1);
        if (i >= ids.size()) return;
        for (int j = 0; j < a.batch; ++j) keys[j] = Key(ids[i][j]);
        auto bufs = refs(*w.dst, a.batch);
        auto got = client->BatchGetInto(keys, bufs);
        for (int j = 0; j < a.batch; ++j) {
          const auto* word = reinterpret_cast<const uint64_t*>(w.dst->data + j * obj);
          failed += !got[j].ok() || *got[j] != a.object_bytes || word[0] != kMagic ||
                    word[1] != ids[i][j];
        }
      }
    });
    return std::make_pair(seconds, failed.load());
  };

  std::vector<Step> steps;
  uint64_t stored = 0, failures = 0;
  for (uint64_t target : a.steps) {
    Step s;
    s.objects = target;
    std::fprintf(stderr, "master-scale: filling to %" PRIu64 " objects...\n", target);
    const auto t0 = Clock::now();
    const uint64_t sample_first = target - kTimings * sample_keys;
    s.failures += put_range(stored, sample_first).second;
    std::vector<double> put_rates, get_rates;
    uint64_t cpu0 = CpuNs(master_pid);
    for (int i = 0; i < kTimings; ++i) {
      auto [put_s, put_failed] =
          put_range(sample_first + i * sample_keys, sample_first + (i + 1) * sample_keys);
      put_rates.push_back(sample_keys / put_s);
      s.failures += put_failed;
    }
    s.fill_seconds = SecondsSince(t0);
    s.fill_rate = (target - stored) / s.fill_seconds;
    s.put_rate = median(put_rates);
    s.master_put_cpu_us = (CpuNs(master_pid) - cpu0) / 1e3 / (kTimings * sample_keys);
    stored = target;
    const auto ids = draw_sample(stored);
    cpu0 = CpuNs(master_pid);
    for (int i = 0; i < kTimings; ++i) {
      auto [get_s, get_failed] = get_sample(ids);
      get_rates.push_back(sample_keys / get_s);
      s.failures += get_failed;
    }
    s.get_rate = median(get_rates);
    s.master_get_cpu_us = (CpuNs(master_pid) - cpu0) / 1e3 / (kTimings * sample_keys);
    failures += s.failures;
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    s.master_rss = RssBytes(master_pid);
    s.node_rss = RssBytes(node_pid);
    auto view =
        QueryClusterStatus(cluster.master_address(), 10000, EngineOptions::FromEnv().cluster_token);
    s.master_objects = view.ok() ? view->objects : 0;
    if (s.master_objects != target) ++failures;
    std::fprintf(
        stderr,
        "master-scale: %" PRIu64 " objects (master says %" PRIu64
        "): master %.1f B/object (RSS %.1f MiB), node %.1f B/object; fill %.0f/s, "
        "put %.0f/s, get %.0f/s (master CPU %.2f / %.2f us per object), %" PRIu64 " failed\n",
        target, s.master_objects, double(s.master_rss - master_rss0) / target,
        s.master_rss / 1048576.0, (double(s.node_rss) - double(node_rss0)) / target, s.fill_rate,
        s.put_rate, s.get_rate, s.master_put_cpu_us, s.master_get_cpu_us, s.failures);
    steps.push_back(s);
  }
  for (auto& w : workers) {
    (void)client->UnregisterBuffer(w.src->data);
    (void)client->UnregisterBuffer(w.dst->data);
  }
  client.reset();
  cluster.Stop();

  auto per_object = [](uint64_t rss, uint64_t rss0, uint64_t n) {
    return (double(rss) - double(rss0)) / double(n);
  };
  bl::Json items;
  items.BeginArray();
  for (const Step& s : steps) {
    items.BeginObject()
        .Field("objects", s.objects)
        .Field("master_objects", s.master_objects)
        .Field("master_rss_bytes", s.master_rss)
        .Field("master_bytes_per_object", per_object(s.master_rss, master_rss0, s.objects), 1)
        .Field("node_rss_bytes", s.node_rss)
        .Field("node_bytes_per_object", per_object(s.node_rss, node_rss0, s.objects), 1)
        .Field("fill_objects_per_s", s.fill_rate, 0)
        .Field("fill_seconds", s.fill_seconds, 1)
        .Field("put_objects_per_s", s.put_rate, 0)
        .Field("get_objects_per_s", s.get_rate, 0)
        .Field("master_cpu_us_per_put", s.master_put_cpu_us, 3)
        .Field("master_cpu_us_per_get", s.master_get_cpu_us, 3)
        .Field("failures", s.failures)
        .EndObject();
  }
  items.EndArray();
  const Step& first = steps.front();
  const Step& last = steps.back();
  const double value = per_object(last.master_rss, master_rss0, last.objects);
  bl::Json j;
  j.BeginObject()
      .Field("benchmark", "master-scale")
      .Field("quick", a.quick)
      .Key("headline")
      .BeginObject()
      .Field("metric", "master RSS bytes per object at " + std::to_string(last.objects) +
                           " objects (50-byte keys, " + std::to_string(a.object_bytes) +
                           "-byte objects, replica_num 1)")
      .Field("value", value, 1)
      .Field("baseline", kGoal, 0)
      .Field("baseline_name", "the goal (issue 22): at most 300 B per object")
      .Field("ratio", bl::Ratio(kGoal, value), 3)  // >= 1: the goal is met
      .Field("goal", kGoal, 0)
      .Field("node_bytes_per_object", per_object(last.node_rss, node_rss0, last.objects), 1)
      .Field("put_rate_last_over_first", bl::Ratio(last.put_rate, first.put_rate), 3)
      .Field("get_rate_last_over_first", bl::Ratio(last.get_rate, first.get_rate), 3)
      .Field("master_cpu_per_put_last_over_first",
             bl::Ratio(last.master_put_cpu_us, first.master_put_cpu_us), 3)
      .Field("master_cpu_per_get_last_over_first",
             bl::Ratio(last.master_get_cpu_us, first.master_get_cpu_us), 3)
      .EndObject()
      .Field("key_bytes", uint64_t{kKeyBytes})
      .Field("object_bytes", a.object_bytes)
      .Field("batch_keys", a.batch)
      .Field("sample_keys", sample_keys)
      .Field("timings_per_rate", kTimings)
      .Field("threads", a.threads)
      .Field("node_dram_bytes", cc.dram_bytes)
      .Field("empty_master_rss_bytes", master_rss0)
      .Field("empty_node_rss_bytes", node_rss0)
      .Field("failures", failures)
      .Key("steps")
      .Raw(items.str())
      .EndObject();
  bl::PrintResult(j);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  bl::Flags f("kvb_bench_master_scale",
              "The master's RSS per object and its put/get rates as its table grows to millions "
              "of objects\n(benchmarks/run master-scale; docs/benchmarks.md).");
  f.Bool("quick", &a.quick, "short run: --steps 200000,1000000 unless given");
  f.UInt64List("steps", &a.steps, "object counts to fill to, increasing (default 1000000,5000000)");
  f.Int("threads", &a.threads, "client threads", 1);
  f.Int("batch", &a.batch, "keys per batch", 1);
  f.Int("sample-batches", &a.sample_batches,
        "batches per timing of the put and get rates (three timings each, median)", 1);
  f.UInt64("object-bytes", &a.object_bytes, "bytes per object (at least 16)", 16);
  f.String("bin", &a.bin_dir, "directory holding the `kvbridge` program");
  f.String("logs", &a.log_dir, "where the daemons' logs go");
  f.ParseOrExit(argc, argv);
  if (a.quick && !f.Given("steps")) a.steps = {200000, 1000000};
  InstallCleanupOnSignals();
  return Run(a);
}

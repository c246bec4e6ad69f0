// kvb_store_demo: the KV-page store under a HiCache-like workload, losing a node halfway.
//
// Starts a local cluster as real processes (a `kvbridge master` and 3 `kvbridge node`s on
// loopback), then drives it from an in-process StoreClient (replica_num 2) with several
// threads. Each step of a thread is one request of 128 pages (K and V buffers of 64 KiB each,
// in registered memory) keyed by a chained hash of the request's token prefix, so requests
// share prefixes, as SGLang HiCache does it: batch_exists on the 128 keys, batch_get_into for
// the prefix that hit (prefetch), batch_put_from for the rest (backup). Every page's bytes are
// derived from its key and every page read is verified. At 40% of the run one node is killed
// with SIGKILL. The demo prints a table (before/after the kill), the time until every object
// again has 2 replicas on live nodes, writes a CSV timeline and, given a Python with matplotlib,
// a PNG plot. Exit code 1 if any operation failed or the replicas were not restored.
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "benchlib.h"
#include "local_cluster.h"

using namespace kvbridge;
using namespace kvbridge::bench;
namespace bl = kvbridge::benchlib;

namespace {

constexpr size_t kBuf = 64 * 1024;  // one buffer (K or V)
constexpr size_t kPage = 2 * kBuf;  // one page = K + V
constexpr int kBatch = 128;         // pages per request
constexpr double kBucketS = 0.25;   // timeline resolution

struct Args {
  double seconds = 20;
  double warmup_s = 3;  // run before the measured time starts (not counted)
  bool quick = false;
  int threads = 4;
  int nodes = 3;
  uint64_t dram_mib = 512;
  uint32_t ttl_ms = 1000;
  double kill_at = 0.4;  // fraction of the run
  int docs = 8;          // distinct shared prefixes ("system prompts / conversations")
  double restore_timeout_s = 30;
  std::string bin_dir = KVBRIDGE_BIN_DIR;
  std::string out_dir = "bench-out";
  std::string python;  // a Python with matplotlib, for the PNG; empty = skip the plot
  std::string plot_script = KVBRIDGE_SOURCE_DIR "/benchmarks/plot_timeline.py";
};

// What one request (one 128-page step of one thread) did.
struct Step {
  double t_end = 0;       // seconds since the run started
  double latency_ms = 0;  // exists + get + put
  uint16_t hit = 0;       // pages that exists() reported
  uint16_t got = 0;       // pages read and verified
  uint16_t put = 0;       // pages stored
  uint16_t failed = 0;    // pages whose get or put failed, or read wrong bytes
  uint16_t missed = 0;    // exists() said yes, the get said NOT_FOUND (evicted in between)
};

struct Shared {
  StoreClient* client = nullptr;
  Clock::time_point t0;
  std::atomic<bool> stop{false};
  // Running totals for the progress line.
  std::atomic<uint64_t> pages_read{0}, pages_stored{0}, pages_hit{0}, pages_failed{0};
  std::atomic<uint64_t> warmup_failed{0};  // failures count in the warm-up too
  std::mutex err_mu;
  std::map<std::string, int> errors;  // each failure message (the first 20 kinds) -> count
  void Error(const std::string& what) {
    std::lock_guard<std::mutex> lock(err_mu);
    if (errors.size() < 20 || errors.count(what)) errors[what]++;
  }
};

std::string KeyOf(uint64_t h) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "kvp-%016" PRIx64, h);
  return buf;
}

// One client thread: requests until told to stop.
void Worker(int t, const Args& a, Shared& s, uint8_t* arena, std::vector<Step>* steps) {
  std::mt19937_64 rng(0x5EED0000ull + t);
  // Zipf-like popularity over the shared prefixes.
  std::vector<double> w;
  for (int d = 0; d < a.docs; ++d) w.push_back(1.0 / (d + 1));
  std::discrete_distribution<int> pick_doc(w.begin(), w.end());
  std::uniform_int_distribution<int> pick_shared(32, 112);
  uint64_t nonce = 0;
  std::vector<uint64_t> hashes(kBatch);
  std::vector<std::string> keys(kBatch);
  std::vector<std::vector<BufferRef>> bufs(kBatch);
  for (int j = 0; j < kBatch; ++j) {
    uint8_t* p = arena + j * kPage;
    bufs[j] = {BufferRef{p, kBuf}, BufferRef{p + kBuf, kBuf}};
  }
  while (!s.stop.load(std::memory_order_relaxed)) {
    // The request's pages: the doc's shared prefix, then this request's own continuation.
    const int doc = pick_doc(rng);
    const int shared = pick_shared(rng);
    const uint64_t own = Mix64((uint64_t(t) << 48) ^ ++nonce ^ 0xC0FFEEull);
    uint64_t h = Mix64(0xD0C0000ull + doc);
    for (int j = 0; j < kBatch; ++j) {
      const uint64_t token = j < shared ? Mix64((uint64_t(doc) << 32) | j) : Mix64(own + j);
      h = Mix64(h ^ token);  // chained: a page's key depends on every token before it
      hashes[j] = h;
      keys[j] = KeyOf(h);
    }
    Step st;
    const auto start = Clock::now();
    auto exists = s.client->BatchExists(keys);
    int hit = 0;
    if (!exists.ok()) {
      s.Error("exists: " + exists.status().ToString());
      st.failed = kBatch;  // the whole request failed
    } else {
      while (hit < kBatch && (*exists)[hit]) ++hit;
    }
    st.hit = static_cast<uint16_t>(hit);
    // Prefetch: read the hit prefix; the usable prefix ends at the first page not read.
    int usable = hit;
    std::vector<bool> read_ok(kBatch, false);
    if (exists.ok() && hit > 0) {
      auto got = s.client->BatchGetInto(std::span(keys.data(), hit), std::span(bufs.data(), hit));
      usable = -1;
      for (int j = 0; j < hit; ++j) {
        bool ok = false;
        if (got[j].ok()) {
          ok = got[j].value() == kPage && CheckWords(arena + j * kPage, kPage, hashes[j], 0);
          if (!ok) {
            ++st.failed;
            s.Error(got[j].value() == kPage ? "get: wrong bytes" : "get: wrong size");
          }
        } else if (got[j].status().IsNotFound()) {
          ++st.missed;
        } else {
          ++st.failed;
          s.Error("get: " + got[j].status().ToString());
        }
        if (ok) {
          ++st.got;
          read_ok[j] = true;
        } else if (usable < 0) {
          usable = j;
        }
      }
      if (usable < 0) usable = hit;
    }
    // Backup: store the pages from the end of the usable prefix on (those that exist already
    // succeed without being rewritten).
    if (exists.ok() && usable < kBatch) {
      for (int j = usable; j < kBatch; ++j) {
        FillWords(arena + j * kPage, kPage, hashes[j], 0);
      }
      const size_t n = kBatch - usable;
      auto put = s.client->BatchPutFrom(std::span(keys.data() + usable, n),
                                        std::span(bufs.data() + usable, n));
      for (size_t j = 0; j < n; ++j) {
        if (put[j].ok()) {
          st.put += !read_ok[usable + j];  // a page read already is not counted twice
        } else {
          ++st.failed;
          s.Error("put: " + put[j].ToString());
        }
      }
    }
    st.latency_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    st.t_end = SecondsSince(s.t0);
    if (st.t_end < 0) {  // finished in the warm-up: not in the figures
      s.warmup_failed += st.failed;
      continue;
    }
    steps->push_back(st);
    s.pages_read += st.got;
    s.pages_stored += st.put;
    s.pages_hit += st.hit;
    s.pages_failed += st.failed;
  }
}

struct Phase {
  Phase(const char* n, double f, double t) : name(n), from(f), to(t) {}
  const char* name;
  double from, to;  // seconds
  double secs = 0;
  uint64_t pages = 0, bytes = 0, failed = 0, missed = 0, hit = 0, requested = 0;
  bl::Samples lat;  // per request (ms)
};

void Accumulate(Phase& p, const Step& s) {
  p.pages += s.got + s.put;
  p.bytes += uint64_t(s.got + s.put) * kPage;
  p.failed += s.failed;
  p.missed += s.missed;
  p.hit += s.hit;
  p.requested += kBatch;
  p.lat.Add(s.latency_ms);
}

// Runs `argv` and waits for it; its exit code, or -1.
int RunProgram(const std::vector<std::string>& argv_in) {
  std::vector<std::string> args = argv_in;
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  bl::Flags f("kvb_store_demo",
              "The store under a HiCache-like load on a local master + 3 nodes, one node killed "
              "with SIGKILL\nat --kill-at of the run (`make demo`; docs/benchmarks.md).");
  f.Bool("quick", &a.quick, "short run: --seconds 8 and --warmup-s 1.5 unless given");
  f.Double("seconds", &a.seconds, "measured seconds", 0.001);
  f.Double("warmup-s", &a.warmup_s, "seconds run before the measured time (not counted)", 0);
  f.Int("threads", &a.threads, "client threads", 1);
  f.UInt64("dram-mib", &a.dram_mib, "DRAM pool of each node (MiB)", 16);
  f.Int("docs", &a.docs, "distinct shared prefixes", 1);
  f.Double("kill-at", &a.kill_at, "when the node is killed, as a fraction of the run (0-1)", 0);
  f.Double("restore-timeout-s", &a.restore_timeout_s,
           "how long to wait for the replicas after the run", 0);
  f.String("bin", &a.bin_dir, "directory holding the `kvbridge` program");
  f.String("out", &a.out_dir, "where the CSV timeline, the PNG and the daemons' logs go");
  f.String("python", &a.python, "a Python with matplotlib, to draw the PNG (skipped without)");
  f.ParseOrExit(argc, argv);
  if (a.quick && !f.Given("seconds")) a.seconds = 8;
  if (a.quick && !f.Given("warmup-s")) a.warmup_s = 1.5;
  if (a.kill_at <= 0 || a.kill_at >= 1) {
    std::cerr << "kvb_store_demo: bad value for --kill-at: " << a.kill_at
              << " is not between 0 and 1 (exclusive) (try --help)\n";
    return 2;
  }
  InstallCleanupOnSignals();
  MakeDirs(a.out_dir);

  // ---- the cluster
  ClusterConfig cc;
  cc.kvbridge_bin = a.bin_dir + "/kvbridge";
  cc.nodes = 3;
  cc.dram_bytes = a.dram_mib << 20;
  cc.node_ttl_ms = a.ttl_ms;
  cc.log_dir = a.out_dir + "/store-demo-logs";
  std::fprintf(stderr, "demo: starting a master and %d nodes (%" PRIu64 " MiB DRAM each)...\n",
               cc.nodes, a.dram_mib);
  auto cluster = std::make_unique<LocalCluster>();
  std::string why;
  if (!cluster->Start(cc, &why)) {
    std::fprintf(stderr, "demo: cannot start the cluster: %s\n", why.c_str());
    return 1;
  }
  std::fprintf(stderr, "demo: master at %s, %d nodes ACTIVE; daemon logs in %s\n",
               cluster->master_address().c_str(), cc.nodes, cc.log_dir.c_str());

  StoreOptions so;
  so.master_address = cluster->master_address();
  so.replica_num = 2;
  so.transfer_deadline_ms = 3000;
  so.engine = EngineOptions::FromEnv();
  so.engine.node_id = "demo-client";
  so.engine.transports = {"tcp"};
  so.engine.progress_timeout_ms = 500;
  so.engine.default_deadline_ms = 3000;
  auto created = StoreClient::Create(so);
  if (!created.ok()) {
    std::fprintf(stderr, "demo: %s\n", created.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<StoreClient> client = std::move(created).value();
  std::vector<std::unique_ptr<Arena>> arenas;
  for (int t = 0; t < a.threads; ++t) {
    arenas.push_back(std::make_unique<Arena>(kBatch * kPage));
    Status st = client->RegisterBuffer(arenas.back()->data, arenas.back()->size);
    if (!st.ok()) {
      std::fprintf(stderr, "demo: RegisterBuffer: %s\n", st.ToString().c_str());
      return 1;
    }
  }

  // ---- the run
  std::fprintf(stderr,
               "demo: %d client threads, 128-page requests (2 x 64 KiB per page), replica_num 2, "
               "%.0f s; node1 gets kill -9 at %.1f s\n",
               a.threads, a.seconds, a.seconds * a.kill_at);
  Shared s;
  s.client = client.get();
  s.t0 = Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(a.warmup_s));
  std::vector<std::vector<Step>> steps(a.threads);
  std::vector<std::thread> workers;
  for (int t = 0; t < a.threads; ++t) {
    workers.emplace_back(Worker, t, std::cref(a), std::ref(s), arenas[t]->data, &steps[t]);
  }
  if (a.warmup_s > 0) {
    std::fprintf(stderr, "demo: warming up for %.1f s (not counted)...\n", a.warmup_s);
    std::this_thread::sleep_until(s.t0);
  }
  const int victim = 1;
  const std::string victim_id = LocalCluster::NodeId(victim);
  double t_kill = -1;

  // Watches the master from the kill on: when the victim is no longer ACTIVE, and when every
  // object again has 2 replicas on ACTIVE nodes (no put in flight, so the count is settled).
  double t_dead = -1, t_restored = -1;
  std::string last_view;
  auto watch = [&] {
    for (;;) {
      const double now = SecondsSince(s.t0);
      if (now > a.seconds + a.restore_timeout_s) break;
      auto st = QueryClusterStatus(cluster->master_address(), 2000, so.engine.cluster_token);
      if (st.ok()) {
        bool victim_active = false;
        uint64_t replicas = 0;
        int active = 0;
        for (const auto& n : st->nodes) {
          if (n.state != "ACTIVE") continue;
          ++active;
          replicas += n.replicas;
          victim_active |= n.id.node_id == victim_id;
        }
        if (!victim_active && t_dead < 0) t_dead = now;
        char buf[224];
        std::snprintf(buf, sizeof(buf),
                      "%d ACTIVE nodes, %" PRIu64 " objects, %" PRIu64
                      " replicas on ACTIVE nodes, %" PRIu64 " puts in flight, %" PRIu64
                      " objects waiting for a copy",
                      active, st->objects, replicas, st->pending_puts, st->under_replicated);
        last_view = buf;
        // Node counts include copies still being made: restored once none is left to make.
        if (!victim_active && st->pending_puts == 0 && st->objects > 0 &&
            replicas == 2 * st->objects && st->under_replicated == 0) {
          t_restored = now;
          break;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  };
  std::thread watcher;

  // The run: a progress line a second, and the kill when its time comes.
  auto at = [&](double secs) {
    return s.t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(secs));
  };
  const Clock::time_point kill_time = at(a.seconds * a.kill_at), end_time = at(a.seconds);
  Clock::time_point next_report = at(1);
  uint64_t last_read = 0, last_stored = 0, last_hit = 0;
  while (Clock::now() < end_time) {
    std::this_thread::sleep_until(
        std::min({next_report, end_time, t_kill < 0 ? kill_time : end_time}));
    if (t_kill < 0 && Clock::now() >= kill_time) {
      cluster->KillNode(victim);
      t_kill = SecondsSince(s.t0);
      std::fprintf(stderr, "demo: t=%4.1f s: kill -9 %s\n", t_kill, victim_id.c_str());
      watcher = std::thread(watch);
    }
    if (Clock::now() >= next_report) {
      next_report += std::chrono::seconds(1);
      const uint64_t r = s.pages_read, w = s.pages_stored, h = s.pages_hit;
      const uint64_t n = (r - last_read) + (w - last_stored);
      std::fprintf(stderr,
                   "demo: t=%4.1f s: %6" PRIu64 " pages read, %6" PRIu64
                   " stored, hit %3.0f%%, "
                   "%" PRIu64 " failed so far\n",
                   SecondsSince(s.t0), r - last_read, w - last_stored,
                   n ? 100.0 * (h - last_hit) / n : 0.0, s.pages_failed.load());
      last_read = r;
      last_stored = w;
      last_hit = h;
    }
  }
  s.stop = true;
  for (auto& w : workers) w.join();
  const double t_end = SecondsSince(s.t0);
  std::fprintf(stderr, "demo: workload stopped at t=%.2f s; waiting for the replicas...\n", t_end);
  if (watcher.joinable()) watcher.join();

  // ---- figures
  Phase phases[3] = {
      {"before kill", 0, t_kill}, {"after kill", t_kill, t_end}, {"total", 0, t_end}};
  const size_t nbuckets = static_cast<size_t>(t_end / kBucketS) + 1;
  std::vector<uint64_t> b_pages(nbuckets), b_bytes(nbuckets), b_failed(nbuckets);
  uint64_t failed_total = 0, missed_total = 0;
  for (const auto& v : steps) {
    for (const Step& st : v) {
      Accumulate(st.t_end < t_kill ? phases[0] : phases[1], st);
      Accumulate(phases[2], st);
      const size_t b = std::min(nbuckets - 1, static_cast<size_t>(st.t_end / kBucketS));
      b_pages[b] += st.got + st.put;
      b_bytes[b] += uint64_t(st.got + st.put) * kPage;
      b_failed[b] += st.failed;
      failed_total += st.failed;
      missed_total += st.missed;
    }
  }
  for (Phase& p : phases) p.secs = p.to - p.from;

  const std::string csv = a.out_dir + "/store-demo-timeline.csv";
  {
    std::ofstream f(csv);
    f << "t_s,pages_per_s,gbps,failures\n";
    for (size_t b = 0; b < nbuckets; ++b) {
      const double t = (b + 1) * kBucketS;
      if (t > t_end + 1e-9) break;  // the last, partial bucket would read low
      char line[128];
      std::snprintf(line, sizeof(line), "%.2f,%.1f,%.4f,%" PRIu64 "\n", t, b_pages[b] / kBucketS,
                    b_bytes[b] / kBucketS / 1e9, b_failed[b]);
      f << line;
    }
  }

  std::printf(
      "\nkvbridge store demo: %d client threads, HiCache-like requests of %d pages "
      "(K+V = 2 x 64 KiB each), replica_num 2,\n3 storage nodes of %" PRIu64
      " MiB DRAM each; %s killed with SIGKILL at t=%.1f s of %.1f s (after %.1f s of "
      "warm-up, not counted).\n\n",
      a.threads, kBatch, a.dram_mib, victim_id.c_str(), t_kill, t_end, a.warmup_s);
  std::printf("%-12s %7s %10s %8s %6s %9s %9s %8s\n", "phase", "secs", "pages/s", "GB/s", "hit%",
              "p50 ms", "p99 ms", "failed");
  for (Phase& p : phases) {
    const double hit = p.requested ? 100.0 * p.hit / p.requested : 0;
    const double p50 = p.lat.Percentile(50), p99 = p.lat.Percentile(99);
    std::printf("%-12s %7.1f %10.0f %8.3f %5.0f%% %9.1f %9.1f %8" PRIu64 "\n", p.name, p.secs,
                p.secs > 0 ? p.pages / p.secs : 0, p.secs > 0 ? p.bytes / p.secs / 1e9 : 0, hit,
                p50, p99, p.failed);
  }
  std::printf(
      "\n  pages/s and GB/s: pages read (verified) + pages stored, 128 KiB each, counted "
      "once (not per replica).\n"
      "  p50/p99: latency of one request = batch_exists + batch_get_into (hit prefix) + "
      "batch_put_from (rest).\n");
  std::printf(
      "  misses (exists said yes, evicted before the get; re-stored, not failures): %" PRIu64 "\n",
      missed_total);
  if (!s.errors.empty()) {
    std::printf("  failures by kind:\n");
    for (const auto& [what, n] : s.errors) std::printf("    %6d  %s\n", n, what.c_str());
  }
  bool restored = t_restored >= 0;
  failed_total += s.warmup_failed;
  if (s.warmup_failed > 0) {
    std::printf("  failed operations in the warm-up: %" PRIu64 "  <-- FAIL\n",
                s.warmup_failed.load());
  }
  std::printf("\n  failed operations: %" PRIu64 "%s\n", failed_total,
              failed_total == 0 ? " (every page read was verified byte for byte)" : "  <-- FAIL");
  if (t_dead >= 0) {
    std::printf("  %s seen as not ACTIVE: %.1f s after the kill (node TTL %u ms)\n",
                victim_id.c_str(), t_dead - t_kill, a.ttl_ms);
  }
  if (restored && t_restored <= t_end) {
    std::printf("  replicas restored: %.1f s after the kill, under load (%s)\n",
                t_restored - t_kill, last_view.c_str());
  } else if (restored) {
    std::printf(
        "  replicas restored: %.1f s after the kill, confirmed %.1f s after the workload "
        "stopped (%s)\n"
        "    (while puts are in flight the master's replica counts include unfinished "
        "puts, so the check\n    needs a moment without puts)\n",
        t_restored - t_kill, t_restored - t_end, last_view.c_str());
  } else {
    std::printf(
        "  replicas restored: not within %.0f s after the workload stopped (last view: "
        "%s)  <-- FAIL\n",
        a.restore_timeout_s, last_view.c_str());
  }
  std::printf("  timeline: %s\n", csv.c_str());

  // ---- the plot
  const std::string png = a.out_dir + "/store-demo.png";
  if (a.python.empty()) {
    std::printf("  plot: skipped (no --python given; scripts/setup_venv.sh makes one)\n");
  } else if (access(a.python.c_str(), X_OK) != 0) {
    std::printf(
        "  plot: skipped (%s does not exist: the plotting venv could not be made; see "
        "scripts/setup_venv.sh's output)\n",
        a.python.c_str());
  } else {
    char kill_at[32], title[160];
    std::snprintf(kill_at, sizeof(kill_at), "%.2f", t_kill);
    std::snprintf(title, sizeof(title),
                  "kvbridge store: %d threads, 128-page requests, replica_num 2, 3 nodes",
                  a.threads);
    std::vector<std::string> cmd = {
        a.python,  a.plot_script, "--csv",     csv,     "--out",        png,
        "--title", title,         "--kill-at", kill_at, "--kill-label", "kill -9 " + victim_id};
    char mark[96];
    if (t_dead >= 0 && t_dead <= t_end) {
      std::snprintf(mark, sizeof(mark), "%.2f=%s not ACTIVE", t_dead, victim_id.c_str());
      cmd.insert(cmd.end(), {"--mark", mark});
    }
    if (t_restored >= 0 && t_restored <= t_end) {
      std::snprintf(mark, sizeof(mark), "%.2f=2 replicas again", t_restored);
      cmd.insert(cmd.end(), {"--mark", mark});
    }
    const int rc = RunProgram(cmd);
    if (rc == 0) {
      std::printf("  plot: %s\n", png.c_str());
    } else if (rc == 3) {
      std::printf("  plot: skipped (%s has no matplotlib; scripts/setup_venv.sh installs it)\n",
                  a.python.c_str());
    } else {
      std::printf("  plot: skipped (%s %s exited with %d; see above)\n", a.python.c_str(),
                  a.plot_script.c_str(), rc);
    }
  }

  // ---- cleanup, and a check that no daemon outlives the demo
  client.reset();
  std::vector<pid_t> pids = cluster->Pids();
  cluster.reset();
  int left = 0;
  for (pid_t p : pids) left += kill(p, 0) == 0;
  if (left > 0) std::printf("  WARNING: %d daemon processes still running after cleanup\n", left);
  std::fflush(stdout);
  return failed_total == 0 && restored && left == 0 ? 0 : 1;
}

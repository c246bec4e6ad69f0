// kvb_bench_store: the KV-page store's batch put and batch get throughput and per-batch
// latency, against the transfer engine's own READ of the same bytes measured in the same run.
//
// Starts a local cluster as real processes (`kvbridge master` + 2 `kvbridge node`s on loopback)
// and drives it from an in-process StoreClient with a few threads, in batches of 128 pages of
// 2 x 64 KiB buffers (K and V) in registered memory:
//   put   batch_put_from of fresh keys (a put of an existing key is a no-op and would flatter
//         the figure), in rounds that fill the pool to ~70% (below the eviction watermark);
//         the pool is emptied between rounds, outside the timed part;
//   get   batch_get_into of 128 consecutive stored keys, for the time given;
// for replica_num 1 and 2 (the pool is emptied in between). Each page read is checked to be
// the page asked for (every page carries its key id).
// Baseline, interleaved in slices with the replica_num 1 gets: the store client's own
// TransferEngine (peered with the nodes by the gets) READs the same layout, 128 pages x 2 ops of
// 64 KiB per batch with the same threads, straight from the nodes' pool segments (pages
// alternating between the nodes, offsets inside the bytes the pool holds): the same processes,
// connections and buffers, without the control plane, placement and checksums. Checked first:
// the baseline's reads return stored pages.
//
// Progress goes to stderr; the last stdout line is one JSON object (docs/performance.md).
// With KVBRIDGE_CLUSTER_TOKEN (and KVBRIDGE_ADMIN_TOKEN, to empty the pool between rounds) set,
// the daemons and the client run with them (docs/security.md).
#include <atomic>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <iostream>
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

constexpr size_t kBuf = 64 * 1024;
constexpr size_t kPage = 2 * kBuf;
constexpr uint64_t kMagic = 0x6b7662726964676full;  // "kvbridgo", stamped on every page
// The DRAM pool is the first (and only) memory a storage node registers with its engine.
constexpr SegmentId kNodePoolSegment = 1;

struct Args {
  bool quick = false;
  int threads = 4;
  int batch = 128;
  int nodes = 2;
  double seconds = 4.0;  // per measurement
  uint64_t dram_mib = 1024;
  std::string bin_dir = KVBRIDGE_BIN_DIR;
  std::string log_dir = "bench-out/store-bench-logs";
};

struct Measure {
  std::string op;
  uint32_t replica_num = 0;
  double seconds = 0;
  uint64_t batches = 0, pages = 0, failures = 0;
  bl::Samples lat_ms;  // per batch
  double gbps() const { return bl::Gbps(static_cast<double>(pages) * kPage, seconds); }
  void Add(const Measure& o) {
    seconds += o.seconds;
    batches += o.batches;
    pages += o.pages;
    failures += o.failures;
    lat_ms.Merge(o.lat_ms);
  }
};

std::string Key(uint32_t rn, uint64_t id) {
  return "bench-r" + std::to_string(rn) + "-" + std::to_string(id);
}

// Runs `threads` loops of `one_batch(thread, &pages_ok, &pages_failed)` until `seconds` pass
// or a call returns false (nothing left to do).
template <typename F>
Measure RunLoops(int threads, double seconds, F one_batch) {
  std::vector<bl::Samples> lat(threads);
  std::vector<uint64_t> pages(threads, 0), failed(threads, 0), batches(threads, 0);
  std::vector<std::thread> ts;
  const auto t0 = Clock::now();
  const auto until =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      while (Clock::now() < until) {
        const auto s = Clock::now();
        uint64_t ok = 0, bad = 0;
        const bool more = one_batch(t, &ok, &bad);
        if (ok + bad == 0) break;  // nothing was done: out of work
        lat[t].Add(std::chrono::duration<double, std::milli>(Clock::now() - s).count());
        pages[t] += ok;
        failed[t] += bad;
        ++batches[t];
        if (!more) break;
      }
    });
  }
  for (auto& th : ts) th.join();
  Measure m;
  m.seconds = SecondsSince(t0);
  for (int t = 0; t < threads; ++t) {
    m.lat_ms.Merge(lat[t]);
    m.pages += pages[t];
    m.failures += failed[t];
    m.batches += batches[t];
  }
  return m;
}

void Report(const Measure& m) {
  std::fprintf(stderr,
               "store: %-11s replica_num %u: %.3f GB/s, batch p50 %.2f ms, p99 %.2f ms "
               "(%" PRIu64 " batches, %" PRIu64 " pages, %" PRIu64 " failed, %.1f s)\n",
               m.op.c_str(), m.replica_num, m.gbps(), m.lat_ms.Percentile(50),
               m.lat_ms.Percentile(99), m.batches, m.pages, m.failures, m.seconds);
}

// Removes every object and waits until the master shows the pool empty.
bool EmptyPool(StoreClient& client, const std::string& master) {
  Status cleared = client.RemoveAll();
  if (!cleared.ok()) std::fprintf(stderr, "store: RemoveAll: %s\n", cleared.ToString().c_str());
  const auto until = Clock::now() + std::chrono::seconds(15);
  while (Clock::now() < until) {
    auto view = QueryClusterStatus(master, 3000, EngineOptions::FromEnv().cluster_token);
    uint64_t used = 0;
    if (view.ok()) {
      for (const auto& n : view->nodes) used += n.used_bytes;
    }
    if (view.ok() && view->objects == 0 && used == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::fprintf(stderr, "store: the pool did not empty after RemoveAll\n");
  return false;
}

struct NodePool {
  std::string id;
  uint64_t used = 0;
};

int Run(const Args& a) {
  ClusterConfig cc;
  cc.kvbridge_bin = a.bin_dir + "/kvbridge";
  cc.nodes = a.nodes;
  cc.dram_bytes = a.dram_mib << 20;
  cc.log_dir = a.log_dir;
  std::fprintf(stderr, "store: starting a master and %d nodes (%" PRIu64 " MiB DRAM each)...\n",
               a.nodes, a.dram_mib);
  LocalCluster cluster;
  std::string why;
  if (!cluster.Start(cc, &why)) {
    std::fprintf(stderr, "store: cannot start the cluster: %s\n", why.c_str());
    return 1;
  }
  const size_t arena_bytes = size_t(a.batch) * kPage;
  std::vector<std::unique_ptr<Arena>> src, dst;
  for (int t = 0; t < a.threads; ++t) {
    src.push_back(std::make_unique<Arena>(arena_bytes));
    dst.push_back(std::make_unique<Arena>(arena_bytes));
    for (size_t p = 0; p < size_t(a.batch); ++p) {
      FillWords(src[t]->data + p * kPage, kPage, Mix64(t * 1000 + p), 0);
    }
  }
  auto refs = [&](Arena& ar) {
    std::vector<std::vector<BufferRef>> b(a.batch);
    for (int j = 0; j < a.batch; ++j) {
      uint8_t* p = ar.data + j * kPage;
      b[j] = {BufferRef{p, kBuf}, BufferRef{p + kBuf, kBuf}};
    }
    return b;
  };
  const uint64_t pool_pages = a.nodes * (a.dram_mib << 20) / kPage;

  std::vector<Measure> results;
  Measure baseline;
  baseline.op = "engine_read";
  bool baseline_checked = false;
  std::string baseline_why;
  uint64_t next_id = 0;  // key ids: never reused in this run
  for (uint32_t rn : {1u, 2u}) {
    StoreOptions so;
    so.master_address = cluster.master_address();
    so.replica_num = rn;
    so.engine = EngineOptions::FromEnv();
    so.admin_token = StoreOptions::FromEnv().admin_token;  // empties the pool between rounds
    so.engine.node_id = "bench-client";
    so.engine.transports = {"tcp"};
    auto created = StoreClient::Create(so);
    if (!created.ok()) {
      std::fprintf(stderr, "store: %s\n", created.status().ToString().c_str());
      return 1;
    }
    std::unique_ptr<StoreClient> client = std::move(created).value();
    for (int t = 0; t < a.threads; ++t) {
      if (!client->RegisterBuffer(src[t]->data, arena_bytes).ok() ||
          !client->RegisterBuffer(dst[t]->data, arena_bytes).ok()) {
        std::fprintf(stderr, "store: RegisterBuffer failed\n");
        return 1;
      }
    }

    // ---- puts of fresh keys. A round fills the pool to ~70% (below the eviction watermark);
    // between rounds, outside the timed part, the pool is emptied.
    const uint64_t round_pages = pool_pages * 7 / 10 / rn / a.batch * a.batch;
    Measure put;
    put.op = "batch_put";
    put.replica_num = rn;
    std::vector<uint64_t> batches;  // first key id of each stored batch of the last round
    std::fprintf(stderr, "store: put, replica_num %u ...\n", rn);
    for (int round = 0; put.seconds < a.seconds; ++round) {
      if (round > 0 && !EmptyPool(*client, cluster.master_address())) break;
      const uint64_t round_first = next_id;
      std::atomic<uint64_t> next{round_first};
      std::vector<std::vector<uint64_t>> first_ids(a.threads);
      Measure r =
          RunLoops(a.threads, a.seconds - put.seconds, [&](int t, uint64_t* ok, uint64_t* bad) {
            const uint64_t first = next.fetch_add(a.batch);
            if (first + a.batch > round_first + round_pages) return false;
            std::vector<std::string> keys(a.batch);
            for (int j = 0; j < a.batch; ++j) {
              keys[j] = Key(rn, first + j);
              // The page's key id, so whoever reads it can tell which page it is.
              auto* w = reinterpret_cast<uint64_t*>(src[t]->data + j * kPage);
              w[0] = kMagic;
              w[1] = first + j;
            }
            auto bufs = refs(*src[t]);
            auto st = client->BatchPutFrom(keys, bufs);
            bool all_ok = true;
            for (const Status& s : st) {
              (s.ok() ? *ok : *bad) += 1;
              all_ok &= s.ok();
            }
            if (all_ok) first_ids[t].push_back(first);
            return true;
          });
      next_id = next.load();
      put.Add(r);
      batches.clear();
      for (const auto& v : first_ids) batches.insert(batches.end(), v.begin(), v.end());
      if (r.batches == 0) break;
    }
    Report(put);
    if (batches.empty()) {
      std::fprintf(stderr, "store: no put batch succeeded; see %s\n", a.log_dir.c_str());
      return 1;
    }

    // ---- the baseline's check: the first page of each node's pool is one of ours.
    std::vector<NodePool> pools;
    if (rn == 1) {
      auto view = QueryClusterStatus(cluster.master_address(), 3000,
                                     EngineOptions::FromEnv().cluster_token);
      if (view.ok()) {
        for (const auto& n : view->nodes) {
          if (n.state == "ACTIVE" && n.used_bytes >= kPage) {
            pools.push_back({n.id.node_id, n.used_bytes});
          }
        }
      }
      // The client's engine knows the nodes once a get went to them.
      std::vector<std::string> k1 = {Key(rn, batches[0])};
      (void)client->BatchGetInto(k1, std::vector<std::vector<BufferRef>>{refs(*dst[0])[0]});
      baseline_checked = !pools.empty();
      for (const NodePool& p : pools) {
        TransferOp op{OpCode::kRead, dst[0]->data, kPage, p.id, kNodePoolSegment, 0};
        Status st = client->engine().Transfer(std::span(&op, 1));
        const auto* w = reinterpret_cast<const uint64_t*>(dst[0]->data);
        if (!st.ok() || w[0] != kMagic) {
          baseline_checked = false;
          baseline_why =
              p.id + ": " + (st.ok() ? "segment 1 offset 0 holds no stored page" : st.ToString());
        }
      }
      if (!baseline_checked) {
        std::fprintf(stderr, "store: baseline skipped: %s\n",
                     baseline_why.empty() ? "no node holds data" : baseline_why.c_str());
      }
    }

    // ---- gets of 128 consecutive stored keys; for replica_num 1 interleaved with the
    // baseline in slices, so that a noisy neighbour on the machine hits both alike.
    Measure get;
    get.op = "batch_get";
    get.replica_num = rn;
    const bool with_baseline = rn == 1 && baseline_checked;
    const int slices = with_baseline ? 3 : 1;
    std::fprintf(stderr, "store: get, replica_num %u (%zu stored batches)%s ...\n", rn,
                 batches.size(),
                 with_baseline ? ", interleaved with the engine READ baseline" : "");
    for (int slice = 0; slice < slices; ++slice) {
      get.Add(RunLoops(a.threads, a.seconds / slices, [&](int t, uint64_t* ok, uint64_t* bad) {
        thread_local std::mt19937_64 rng(std::random_device{}());
        const uint64_t first = batches[rng() % batches.size()];
        std::vector<std::string> keys(a.batch);
        for (int j = 0; j < a.batch; ++j) keys[j] = Key(rn, first + j);
        auto bufs = refs(*dst[t]);
        auto got = client->BatchGetInto(keys, bufs);
        for (int j = 0; j < a.batch; ++j) {
          const auto* w = reinterpret_cast<const uint64_t*>(dst[t]->data + j * kPage);
          const bool good =
              got[j].ok() && got[j].value() == kPage && w[0] == kMagic && w[1] == first + j;
          (good ? *ok : *bad) += 1;
        }
        return true;
      }));
      if (!with_baseline) continue;
      TransferEngine& engine = client->engine();
      baseline.Add(RunLoops(a.threads, a.seconds / slices, [&](int t, uint64_t* ok, uint64_t* bad) {
        thread_local std::mt19937_64 rng(std::random_device{}());
        std::vector<TransferOp> ops;
        ops.reserve(2 * a.batch);
        for (int j = 0; j < a.batch; ++j) {
          const NodePool& p = pools[j % pools.size()];
          const uint64_t off = (rng() % (p.used / kPage)) * kPage;
          uint8_t* local = dst[t]->data + j * kPage;
          ops.push_back(TransferOp{OpCode::kRead, local, kBuf, p.id, kNodePoolSegment, off});
          ops.push_back(
              TransferOp{OpCode::kRead, local + kBuf, kBuf, p.id, kNodePoolSegment, off + kBuf});
        }
        const bool good = engine.Transfer(ops).ok();
        (good ? *ok : *bad) += a.batch;
        return true;
      }));
    }
    Report(get);
    if (with_baseline) Report(baseline);
    results.push_back(std::move(put));
    results.push_back(std::move(get));

    (void)EmptyPool(*client, cluster.master_address());
    for (int t = 0; t < a.threads; ++t) {
      (void)client->UnregisterBuffer(src[t]->data);
      (void)client->UnregisterBuffer(dst[t]->data);
    }
  }
  cluster.Stop();

  bl::Json items;
  items.BeginArray();
  auto add = [&](const Measure& m) {
    items.BeginObject()
        .Field("op", m.op)
        .Field("replica_num", m.replica_num)
        .Field("batch_pages", a.batch)
        .Field("buffers_per_page", 2)
        .Field("buffer_bytes", uint64_t{kBuf})
        .Field("threads", a.threads)
        .Field("gbps", m.gbps(), 3)
        .Field("p50_ms", m.lat_ms.Percentile(50), 3)
        .Field("p99_ms", m.lat_ms.Percentile(99), 3)
        .Field("batches", m.batches)
        .Field("pages", m.pages)
        .Field("failures", m.failures)
        .Field("seconds", m.seconds, 2)
        .EndObject();
  };
  uint64_t failures = 0;
  for (const Measure& m : results) {
    add(m);
    failures += m.failures;
  }
  if (baseline_checked) add(baseline);
  items.EndArray();
  // batch_get, replica_num 1
  const double value = results.size() > 1 ? results[1].gbps() : std::nan("");
  const double base = baseline_checked ? baseline.gbps() : std::nan("");
  bl::Json j;
  j.BeginObject()
      .Field("benchmark", "store")
      .Field("quick", a.quick)
      .Key("headline")
      .BeginObject()
      .Field("metric", "batch get GB/s (replica_num 1, 128-page batches)")
      .Field("value", value, 3)
      .Field("baseline", base, 3)
      .Field("baseline_name",
             "transfer engine READ of the same 128 x 2 x 64 KiB batches from the same nodes' "
             "pools, same run, same threads")
      .Field("ratio", bl::Ratio(value, base), 3)
      .EndObject()
      .Field("failures", failures)
      .Key("results")
      .Raw(items.str())
      .EndObject();
  bl::PrintResult(j);
  return failures == 0 && baseline_checked ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  bl::Flags f("kvb_bench_store",
              "The store's batch put/get GB/s on a local master + nodes, against the engine's "
              "READ of the same bytes\n(benchmarks/run store; docs/benchmarks.md).");
  f.Bool("quick", &a.quick, "short run: --seconds 1.5 unless given");
  f.Int("threads", &a.threads, "client threads", 1);
  f.Double("seconds", &a.seconds, "seconds per measurement", 0.001);
  f.UInt64("dram-mib", &a.dram_mib, "DRAM pool of each node (MiB)", 16);
  f.String("bin", &a.bin_dir, "directory holding the `kvbridge` program");
  f.String("logs", &a.log_dir, "where the daemons' logs go");
  f.ParseOrExit(argc, argv);
  if (a.quick && !f.Given("seconds")) a.seconds = 1.5;
  InstallCleanupOnSignals();
  return Run(a);
}

// kvb_bench_transfer: transfer-engine throughput and latency between two processes on
// loopback, against a raw-socket baseline measured in the same run.
//
// The initiator re-executes itself as the target (--role target). The target registers a
// region with its engine and also serves a raw-socket baseline: plain blocking send/recv of
// the same bytes over as many connections as the engine has lanes. Progress goes to stderr;
// the last stdout line is one JSON object (docs/performance.md).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "benchlib.h"
#include "kvbridge/engine.h"
#include "util/hex.h"

using namespace kvbridge;
namespace bl = kvbridge::benchlib;
using Clock = std::chrono::steady_clock;

namespace {

struct Args {
  std::string role = "initiator";
  bool quick = false;
  int threads = 4;  // submitter threads (and raw-baseline connections)
  int batch = 8;    // ops per batch
  // Batches each submitter keeps in flight (Submit, then Wait for the oldest once `window` are
  // out): 1 is Transfer() one batch at a time; more keeps the wire busy between batches the way
  // an engine submitting per layer does, and as ucx_perftest keeps a window of puts.
  int window = 1;
  int lanes = 4;         // tcp.lanes_per_peer
  double seconds = 2.0;  // per configuration
  std::vector<uint64_t> blocks = {4096, 16384, 65536, 262144, 1u << 20, 4u << 20};
  uint64_t region = 256u << 20;
  std::string transport = "tcp";    // the plugin both processes use
  std::vector<std::string> config;  // "key=value" plugin settings, both processes
  bool no_raw = false;              // skip the raw-socket baseline
  bool no_latency = false;          // throughput rows only
  // Every op of a batch moves the same local block to the same remote block (what ucx_perftest
  // does with its one buffer): the footprint is one block, not one batch.
  bool same_block = false;
  // "plain": zeroed heap memory (4 KiB pages); "thp": anonymous memory with MADV_HUGEPAGE, as
  // the DRAM pool allocates its segments (plugins/storage_dram/dram_pool.cc).
  std::string memory = "plain";
  // Which ops the rows measure, in this order ("write", "read" or both, comma-separated).
  std::string ops = "write,read";
  std::vector<OpCode> codes;  // parsed from `ops`
};

// A benchmark region, zeroed (every page faulted in before measuring).
class Region {
 public:
  Region(size_t bytes, bool thp) : bytes_(bytes) {
    if (!thp) {
      plain_.assign(bytes, 0);
      data_ = plain_.data();
      return;
    }
    constexpr size_t kHuge = 2u << 20;
    mapped_ = (bytes + kHuge - 1) / kHuge * kHuge;
    void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::cerr << "kvb_bench_transfer: mmap of " << mapped_ << " bytes: " << strerror(errno)
                << "\n";
      std::exit(1);
    }
    if (madvise(p, mapped_, MADV_HUGEPAGE) != 0) {
      std::cerr << "kvb_bench_transfer: --memory thp: MADV_HUGEPAGE: " << strerror(errno) << "\n";
      std::exit(1);
    }
    data_ = static_cast<char*>(p);
    memset(data_, 0, mapped_);
  }
  ~Region() {
    if (mapped_ != 0) munmap(data_, mapped_);
  }
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;
  char* data() { return data_; }
  size_t size() const { return bytes_; }

 private:
  size_t bytes_;
  size_t mapped_ = 0;
  std::vector<char> plain_;
  char* data_ = nullptr;
};

// Engine options both roles share: the transport and the --config plugin settings.
EngineOptions BaseOptions(const Args& a, const char* node_id) {
  EngineOptions o = EngineOptions::FromEnv();
  o.node_id = node_id;
  o.transports = {a.transport};
  for (const std::string& kv : a.config) {
    const size_t eq = kv.find('=');
    o.plugin_config[kv.substr(0, eq)] = eq == std::string::npos ? "" : kv.substr(eq + 1);
  }
  return o;
}

// Raw baseline request: {op (1 = client sends `bytes`, 2 = server sends `bytes`), bytes}.
struct RawRequest {
  uint32_t op;
  uint32_t pad;
  uint64_t bytes;
};

void ServeRaw(int fd, char* region, size_t region_len) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  RawRequest rq;
  while (bl::RecvAll(fd, &rq, sizeof(rq))) {
    if (rq.bytes > region_len) break;
    if (rq.op == 1) {
      if (!bl::RecvAll(fd, region, rq.bytes)) break;
      uint8_t ack = 1;
      if (!bl::SendAll(fd, &ack, 1)) break;
    } else {
      if (!bl::SendAll(fd, region, rq.bytes)) break;
    }
  }
  close(fd);
}

int RunTarget(const Args& a) {
  EngineOptions o = BaseOptions(a, "bench-target");
  auto engine = TransferEngine::Create(o);
  if (!engine.ok()) {
    std::cout << "ERR " << engine.status().ToString() << std::endl;
    return 1;
  }
  Region region(a.region, a.memory == "thp");
  if (!engine.value()->RegisterMemory(region.data(), region.size()).ok()) return 1;
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  listen(lfd, 64);
  socklen_t len = sizeof(addr);
  getsockname(lfd, reinterpret_cast<sockaddr*>(&addr), &len);
  Region raw_region(a.region, a.memory == "thp");
  std::thread([&] {
    for (;;) {
      int fd = accept(lfd, nullptr, nullptr);
      if (fd < 0) return;
      std::thread(ServeRaw, fd, raw_region.data(), raw_region.size()).detach();
    }
  }).detach();
  std::cout << "RAW " << ntohs(addr.sin_port) << std::endl;
  std::cout << "DESC " << util::HexEncode(engine.value()->LocalDescriptor()) << std::endl;
  std::string line;
  while (std::getline(std::cin, line) && line != "QUIT") {
  }
  return 0;
}

struct Measure {
  double gbps = 0;
  bl::Samples lat_us;  // one per batch
  uint64_t failures = 0;
  double p50_us() const { return lat_us.Percentile(50); }
  double p99_us() const { return lat_us.Percentile(99); }
};

// What one call of a loop's body did: a batch ended (ok or failed), or one was only submitted
// (windowed loops, until the window is full).
enum class Step { kOk, kFailed, kSubmitted };

// Runs `threads` loops of `one_batch` for `seconds`; each call that ends a batch moved
// `batch_bytes` (the loop body returns bool, or Step where it keeps batches in flight).
template <typename F>
Measure RunLoops(int threads, double seconds, size_t batch_bytes, F one_batch) {
  std::atomic<bool> stop{false};
  std::vector<bl::Samples> lat(threads);
  std::vector<uint64_t> done(threads, 0), failed(threads, 0);
  std::vector<std::thread> ts;
  auto t0 = Clock::now();
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      while (!stop.load(std::memory_order_relaxed)) {
        auto s = Clock::now();
        const auto r = one_batch(t);
        Step step;
        if constexpr (std::is_same_v<decltype(r), const bool>) {
          step = r ? Step::kOk : Step::kFailed;
        } else {
          step = r;
        }
        if (step == Step::kSubmitted) continue;
        lat[t].Add(std::chrono::duration<double, std::micro>(Clock::now() - s).count());
        (step == Step::kOk ? done[t] : failed[t])++;
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (auto& th : ts) th.join();
  double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  Measure m;
  uint64_t batches = 0;
  for (int t = 0; t < threads; ++t) {
    m.lat_us.Merge(lat[t]);
    batches += done[t];
    m.failures += failed[t];
  }
  m.gbps = bl::Gbps(static_cast<double>(batches) * batch_bytes, elapsed);
  return m;
}

int Connect(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return -1;
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

int RunInitiator(const Args& a, const char* self_exe) {
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) return 1;
  pid_t pid = fork();
  if (pid == 0) {
    dup2(to_child[0], 0);
    dup2(from_child[1], 1);
    close(to_child[1]);
    close(from_child[0]);
    std::vector<std::string> args = {
        self_exe,      "--role",    "target",   "--region", std::to_string(a.region),
        "--transport", a.transport, "--memory", a.memory};
    for (const std::string& kv : a.config) {
      args.push_back("--config");
      args.push_back(kv);
    }
    std::vector<char*> argv;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    execv(self_exe, argv.data());
    _exit(127);
  }
  close(to_child[0]);
  close(from_child[1]);
  FILE* in = fdopen(from_child[0], "r");
  char buf[1 << 16];
  uint16_t raw_port = 0;
  std::string desc;
  while (fgets(buf, sizeof(buf), in)) {
    std::string l(buf);
    if (!l.empty() && l.back() == '\n') l.pop_back();
    if (l.rfind("RAW ", 0) == 0) raw_port = static_cast<uint16_t>(std::stoi(l.substr(4)));
    if (l.rfind("DESC ", 0) == 0) {
      if (!util::HexDecode(l.substr(5), &desc)) {
        std::cerr << "target sent a malformed descriptor\n";
        return 1;
      }
      break;
    }
    if (l.rfind("ERR", 0) == 0) {
      std::cerr << "target failed: " << l << "\n";
      return 1;
    }
  }
  EngineOptions o = BaseOptions(a, "bench-initiator");
  if (a.transport == "tcp") o.plugin_config["tcp.lanes_per_peer"] = std::to_string(a.lanes);
  auto engine_r = TransferEngine::Create(o);
  if (!engine_r.ok()) {
    std::cerr << engine_r.status().ToString() << "\n";
    return 1;
  }
  auto& engine = *engine_r.value();
  Region local(a.region, a.memory == "thp");
  if (!engine.RegisterMemory(local.data(), local.size()).ok()) return 1;
  auto peer = engine.AddPeer(desc);
  if (!peer.ok()) {
    std::cerr << peer.status().ToString() << "\n";
    return 1;
  }
  std::vector<int> raw_fds;
  for (int t = 0; t < a.threads && !a.no_raw; ++t) raw_fds.push_back(Connect(raw_port));

  struct Row {
    std::string mode;  // "throughput": threads x batch; "latency": one op at a time
    std::string op;
    size_t block;
    int threads, batch, window;
    Measure engine, raw;
  };
  std::vector<Row> rows;
  struct Mode {
    const char* name;
    int threads, batch, window;
  };
  const Mode modes[] = {{"throughput", a.threads, a.batch, a.window}, {"latency", 1, 1, 1}};
  for (const Mode& mode : modes) {
    if (a.no_latency && std::string(mode.name) == "latency") continue;
    for (size_t block : a.blocks) {
      const size_t batch_bytes = block * mode.batch;
      const size_t area = a.region / mode.threads;
      if (batch_bytes > area) continue;
      for (OpCode code : a.codes) {
        const char* name = code == OpCode::kWrite ? "write" : "read";
        std::cerr << "transfer: " << mode.name << " " << name << " block " << block << " B ..."
                  << std::flush;
        // Windowed: each thread's batches in flight, oldest first; drained after the run.
        const int window = mode.window;
        std::vector<std::deque<BatchId>> inflight(mode.threads);
        Measure e = RunLoops(mode.threads, a.seconds, batch_bytes, [&](int t) {
          std::vector<TransferOp> ops;
          ops.reserve(mode.batch);
          for (int i = 0; i < mode.batch; ++i) {
            size_t off = t * area + (a.same_block ? 0 : i * block);
            ops.push_back(TransferOp{code, local.data() + off, block, "bench-target", 1, off});
          }
          if (window == 1) return engine.Transfer(ops).ok() ? Step::kOk : Step::kFailed;
          auto id = engine.Submit(ops);
          if (!id.ok()) return Step::kFailed;
          inflight[t].push_back(*id);
          if (static_cast<int>(inflight[t].size()) < window) return Step::kSubmitted;
          const BatchId oldest = inflight[t].front();
          inflight[t].pop_front();
          return engine.Wait(oldest).status.ok() ? Step::kOk : Step::kFailed;
        });
        for (auto& q : inflight)
          for (BatchId id : q) engine.Wait(id);
        Measure r;
        if (!a.no_raw)
          r = RunLoops(mode.threads, a.seconds, batch_bytes, [&](int t) {
            RawRequest rq{code == OpCode::kWrite ? 1u : 2u, 0, batch_bytes};
            char* p = local.data() + t * area;
            if (!bl::SendAll(raw_fds[t], &rq, sizeof(rq))) return false;
            if (code == OpCode::kWrite) {
              uint8_t ack;
              return bl::SendAll(raw_fds[t], p, batch_bytes) && bl::RecvAll(raw_fds[t], &ack, 1);
            }
            return bl::RecvAll(raw_fds[t], p, batch_bytes);
          });
        std::cerr << " " << e.gbps << " GB/s, p50 " << e.p50_us() << " us, p99 " << e.p99_us()
                  << " us";
        if (!a.no_raw) std::cerr << " (raw " << r.gbps << " GB/s, p50 " << r.p50_us() << " us)";
        std::cerr << "\n";
        rows.push_back({mode.name, name, block, mode.threads, mode.batch, mode.window, std::move(e),
                        std::move(r)});
      }
    }
  }
  for (int fd : raw_fds) close(fd);
  FILE* out = fdopen(to_child[1], "w");
  fputs("QUIT\n", out);
  fflush(out);
  waitpid(pid, nullptr, 0);

  // Rows: the engine's figures, and the raw-socket baseline's (null with --no-raw).
  double e_sum = 0, r_sum = 0, tail_64k = std::nan("");  // null without a 64 KiB latency row
  int n = 0;
  bl::Json j;
  j.BeginObject().Field("benchmark", "transfer").Field("quick", a.quick);
  bl::Json items;
  items.BeginArray();
  for (const auto& row : rows) {
    if (row.mode == "latency" && row.block == 65536 && row.engine.p50_us() > 0) {
      const double t = row.engine.p99_us() / row.engine.p50_us();
      tail_64k = std::isnan(tail_64k) ? t : std::max(tail_64k, t);
    }
    if (row.mode == "throughput" && row.block >= 262144) {
      e_sum += row.engine.gbps;
      r_sum += row.raw.gbps;
      ++n;
    }
    const double nan = std::nan("");
    items.BeginObject()
        .Field("mode", row.mode)
        .Field("op", row.op)
        .Field("block_bytes", uint64_t{row.block})
        .Field("batch", row.batch)
        .Field("threads", row.threads)
        .Field("window", row.window)
        .Field("lanes", a.lanes)
        .Field("gbps", row.engine.gbps, 3)
        .Field("p50_us", row.engine.p50_us(), 1)
        .Field("p99_us", row.engine.p99_us(), 1)
        .Field("failures", row.engine.failures)
        .Field("baseline_gbps", a.no_raw ? nan : row.raw.gbps, 3)
        .Field("baseline_p50_us", a.no_raw ? nan : row.raw.p50_us(), 1)
        .Field("baseline_p99_us", a.no_raw ? nan : row.raw.p99_us(), 1)
        .Field("ratio", bl::Ratio(row.engine.gbps, a.no_raw ? nan : row.raw.gbps), 3)
        .EndObject();
  }
  items.EndArray();
  const double value = n ? e_sum / n : std::nan(""),
               baseline = n && !a.no_raw ? r_sum / n : std::nan("");
  j.Key("headline")
      .BeginObject()
      .Field("metric", "GB/s at >=256KiB blocks")
      .Field("value", value, 3)
      .Field("baseline", baseline, 3)
      .Field("baseline_name", "raw sockets, same run, same connection count")
      .Field("ratio", bl::Ratio(value, baseline), 3)
      .EndObject()
      .Field("p99_over_p50_at_64KiB", tail_64k, 2)
      .Key("results")
      .Raw(items.str())
      .EndObject();
  bl::PrintResult(j);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  Args a;
  bl::Flags f("kvb_bench_transfer",
              "Transfer-engine GB/s and latency between two processes on loopback, against raw "
              "sockets in the same run\n(benchmarks/run transfer; docs/benchmarks.md).");
  f.Bool("quick", &a.quick, "short run: --seconds at most 0.6");
  f.Int("threads", &a.threads, "submitter threads (and raw-baseline connections)", 1);
  f.Int("batch", &a.batch, "ops per batch", 1);
  f.Int("window", &a.window,
        "batches each submitter keeps in flight in the throughput rows (1: one Transfer() at a "
        "time; the latency rows always use 1)",
        1);
  f.Int("lanes", &a.lanes, "tcp.lanes_per_peer of the initiator (tcp only)", 1);
  f.Double("seconds", &a.seconds, "seconds per configuration", 0.001);
  f.UInt64List("blocks", &a.blocks, "block sizes in bytes");
  f.UInt64("region", &a.region, "bytes registered on each side", 4096);
  f.String("transport", &a.transport, "the transport plugin both processes use");
  f.Repeated("config", &a.config, "key=value plugin setting for both processes");
  f.Bool("no-raw", &a.no_raw, "skip the raw-socket baseline (its figures are null)");
  f.Bool("no-latency", &a.no_latency, "throughput rows only");
  f.Bool("same-block", &a.same_block,
         "every op of a batch uses the same local and remote block (one block's footprint)");
  f.String("memory", &a.memory,
           "plain (heap, 4 KiB pages) or thp (MADV_HUGEPAGE, as the DRAM pool allocates)");
  f.String("ops", &a.ops, "which ops to measure, in order: write, read or write,read");
  f.String("role", &a.role, "");  // internal: the re-executed target
  f.ParseOrExit(argc, argv);
  for (uint64_t b : a.blocks) {
    if (b == 0) {
      std::cerr << "kvb_bench_transfer: bad value for --blocks: a block of 0 bytes\n";
      return 2;
    }
  }
  if (a.memory != "plain" && a.memory != "thp") {
    std::cerr << "kvb_bench_transfer: bad value for --memory: '" << a.memory
              << "' (plain or thp)\n";
    return 2;
  }
  for (size_t at = 0; at <= a.ops.size();) {
    const size_t comma = std::min(a.ops.find(',', at), a.ops.size());
    const std::string op = a.ops.substr(at, comma - at);
    if (op != "write" && op != "read") {
      std::cerr << "kvb_bench_transfer: bad value for --ops: '" << a.ops
                << "' (write, read or both, comma-separated)\n";
      return 2;
    }
    a.codes.push_back(op == "write" ? OpCode::kWrite : OpCode::kRead);
    at = comma + 1;
  }
  if (a.quick) a.seconds = std::min(a.seconds, 0.6);
  if (a.role == "target") return RunTarget(a);
  return RunInitiator(a, "/proc/self/exe");
}

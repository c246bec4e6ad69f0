// kvb_bench_ssd (`benchmarks/run ssd`): the ssd storage plugin's put/get throughput and IOPS for
// 64 KiB to 4 MiB objects, against plain O_DIRECT pwrite/pread of the same sizes on the same file
// system, measured in the same run with the same number of threads.
//
// Each put returns only once its object is durable (O_DIRECT write + group-committed
// fdatasync); the baseline writes with O_DIRECT and calls fdatasync once at the end, which is
// what a plain sequential write of the disk costs. Reads are O_DIRECT on both sides (no page
// cache). Progress goes to stderr; the last stdout line is one JSON object whose headline is
// the plugin's GB/s over the baseline's for objects of 1 MiB and more (goal: 0.8).
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "benchlib.h"
#include "core/host_services.h"
#include "core/plugin_host.h"

namespace {

namespace fs = std::filesystem;
namespace bl = kvbridge::benchlib;
using kvbridge::core::HostServices;
using kvbridge::core::PluginHost;
using kvbridge::core::StorageInstance;

constexpr uint64_t kMiB = 1u << 20;

struct Args {
  bool quick = false;
  std::string dir = std::string(KVBRIDGE_SOURCE_DIR) + "/bench-out/ssd-bench";
  int threads = 4;
  uint64_t mib_per_size = 1024;  // bytes written (and read) per object size and side
  int rounds = 3;                // each measurement is the median of this many
  std::string io = "auto";
  std::vector<uint64_t> sizes = {64 << 10, 256 << 10, 1 << 20, 4 << 20};  // bytes
};

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The median of the rounds by the benchmarks' one percentile rule (benchlib.h).
double Median(const std::vector<double>& v) { return bl::Percentile(v, 50); }

// Runs fn(thread, index) for index in [0, n), handing out indexes in order to `threads` threads.
// Returns the wall time in seconds.
double Parallel(int threads, uint64_t n, const std::function<void(int, uint64_t)>& fn) {
  std::atomic<uint64_t> next{0};
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      for (uint64_t i; (i = next.fetch_add(1)) < n;) fn(t, i);
    });
  }
  for (auto& th : ts) th.join();
  return Seconds(t0);
}

void Die(const std::string& msg) {
  std::fprintf(stderr, "kvb_bench_ssd: %s\n", msg.c_str());
  std::exit(1);
}

std::string FsName(const std::string& dir) {
  struct statfs s;
  if (statfs(dir.c_str(), &s) != 0) return "unknown";
  switch (static_cast<unsigned long>(s.f_type)) {
    case 0xEF53:
      return "ext4";
    case 0x58465342:
      return "xfs";
    case 0x9123683E:
      return "btrfs";
    case 0x01021994:
      return "tmpfs";
    case 0x6969:
      return "nfs";
    case 0x794c7630:
      return "overlayfs";
    default: {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "0x%lx", static_cast<unsigned long>(s.f_type));
      return buf;
    }
  }
}

// Page-aligned buffers, one per thread, holding `bytes` of a pattern.
std::vector<uint8_t*> Buffers(int threads, uint64_t bytes, bool fill) {
  std::vector<uint8_t*> out;
  for (int t = 0; t < threads; ++t) {
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(4096, bytes));
    if (p == nullptr) Die("out of memory");
    if (fill) {
      for (uint64_t i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(i * 31 + i / 4096);
    } else {
      std::memset(p, 0, bytes);
    }
    out.push_back(p);
  }
  return out;
}

struct Rates {
  double write_s = 0, read_s = 0;
};

// Plain O_DIRECT pwrite of n blocks of `size` bytes (fdatasync at the end), then pread of them.
Rates Baseline(const Args& a, uint64_t size, uint64_t n, const std::vector<uint8_t*>& src,
               const std::vector<uint8_t*>& dst) {
  const std::string path = a.dir + "/baseline.dat";
  int flags = O_RDWR | O_CREAT | O_TRUNC | O_DIRECT;
  int fd = open(path.c_str(), flags, 0644);
  if (fd < 0 && errno == EINVAL) fd = open(path.c_str(), flags & ~O_DIRECT, 0644);
  if (fd < 0) Die("cannot open " + path + ": " + std::strerror(errno));
  Rates r;
  const auto t0 = std::chrono::steady_clock::now();
  Parallel(a.threads, n, [&](int t, uint64_t i) {
    if (pwrite(fd, src[t], size, static_cast<off_t>(i * size)) != static_cast<ssize_t>(size)) {
      Die("baseline pwrite: " + std::string(std::strerror(errno)));
    }
  });
  if (fdatasync(fd) != 0) Die("baseline fdatasync failed");
  r.write_s = Seconds(t0);
  r.read_s = Parallel(a.threads, n, [&](int t, uint64_t i) {
    if (pread(fd, dst[t], size, static_cast<off_t>(i * size)) != static_cast<ssize_t>(size)) {
      Die("baseline pread: " + std::string(std::strerror(errno)));
    }
  });
  close(fd);
  unlink(path.c_str());
  return r;
}

// Host services that pass log lines to stderr and keep the "ready" line.
struct BenchHost {
  explicit BenchHost(std::map<std::string, std::string> config)
      : inner(std::move(config), std::nullopt,
              [this](int32_t level, const char* plugin, const char* msg) {
                if (level >= KVB_LOG_WARN) std::fprintf(stderr, "  %s: %s\n", plugin, msg);
                const std::string m = msg;
                if (m.find(" ready in ") != std::string::npos) {
                  std::lock_guard<std::mutex> lk(mu);
                  ready = m;
                }
              }) {}
  HostServices inner;
  std::mutex mu;
  std::string ready;
};

// n puts of `size` bytes through the plugin, then n gets; returns the times.
Rates ThroughPlugin(const Args& a, PluginHost& plugins, uint64_t size, uint64_t n,
                    const std::vector<uint8_t*>& src, const std::vector<uint8_t*>& dst,
                    std::string* io_line) {
  const std::string dir = a.dir + "/store";
  fs::remove_all(dir);
  BenchHost host({{"ssd.io", a.io}});
  kvbridge::core::StorageConfig config;
  config.node_id = "bench";
  config.capacity_bytes = n * (size + 8192) + 1024 * kMiB;
  config.path = dir;
  config.services = host.inner.table();
  auto created = plugins.CreateStorage("ssd", config);
  if (!created.ok()) Die(created.status().ToString());
  std::unique_ptr<StorageInstance> s = std::move(created).value();
  {
    std::lock_guard<std::mutex> lk(host.mu);
    const size_t at = host.ready.find(" O_DIRECT, ");
    *io_line = at != std::string::npos ? host.ready.substr(at + 1) : host.ready;
    const size_t end = io_line->find(", never evicts");
    if (end != std::string::npos) io_line->resize(end);
  }
  auto key = [&](uint64_t i) { return "obj-" + std::to_string(size) + "-" + std::to_string(i); };
  Rates r;
  r.write_s = Parallel(a.threads, n, [&](int t, uint64_t i) {
    const std::string k = key(i);
    kvb_iovec_t iov{src[t], size};
    const kvbridge::Status st = s->Put(k, {&iov, 1});
    if (!st.ok()) Die("put " + k + " failed: " + st.ToString());
  });
  r.read_s = Parallel(a.threads, n, [&](int t, uint64_t i) {
    const std::string k = key(i);
    kvb_iovec_t iov{dst[t], size};
    uint64_t length = 0;
    const kvbridge::Status st = s->Get(k, {&iov, 1}, &length);
    if (!st.ok() || length != size) Die("get " + k + " failed: " + st.ToString());
    if (std::memcmp(dst[t], src[t], 64) != 0 ||
        std::memcmp(dst[t] + size - 64, src[t] + size - 64, 64) != 0) {
      Die("get " + k + " returned other bytes");
    }
  });
  s.reset();
  fs::remove_all(dir);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  bl::Flags f("kvb_bench_ssd",
              "The ssd storage plugin's put/get GB/s against plain O_DIRECT write/read on the "
              "same file system\nin the same run (benchmarks/run ssd; docs/benchmarks.md).");
  f.Bool("quick", &a.quick, "--mib 256 and --rounds 1 unless given");
  f.String("dir", &a.dir, "directory on the disk to measure (not tmpfs)");
  f.Int("threads", &a.threads, "threads on both sides", 1);
  f.UInt64("mib", &a.mib_per_size, "MiB written (and read) per object size and side", 8);
  f.Int("rounds", &a.rounds, "alternated rounds; each figure is their median", 1);
  f.String("io", &a.io, "the plugin's ssd.io", {"auto", "uring", "sync"});
  f.UInt64List("sizes", &a.sizes, "object sizes in KiB", 1024);
  f.ParseOrExit(argc, argv);
  for (uint64_t size : a.sizes) {
    if (size == 0 || size % 4096 != 0) {
      std::fprintf(stderr,
                   "kvb_bench_ssd: bad value for --sizes: %llu KiB is not a multiple of 4 KiB "
                   "(O_DIRECT) (try --help)\n",
                   static_cast<unsigned long long>(size >> 10));
      return 2;
    }
  }
  if (a.quick && !f.Given("mib")) a.mib_per_size = 256;
  if (a.quick && !f.Given("rounds")) a.rounds = 1;
  std::error_code ec;
  fs::create_directories(a.dir, ec);
  if (ec) Die("cannot create " + a.dir + ": " + ec.message());
  const std::string fs_name = FsName(a.dir);
  if (fs_name == "tmpfs") {
    std::fprintf(stderr,
                 "kvb_bench_ssd: WARNING: %s is on tmpfs: this measures memory, not a disk; pass "
                 "--dir on the SSD\n",
                 a.dir.c_str());
  }
  std::fprintf(stderr, "kvb_bench_ssd: %s (%s), %d threads, %llu MiB per size, %d round(s)%s\n",
               a.dir.c_str(), fs_name.c_str(), a.threads,
               static_cast<unsigned long long>(a.mib_per_size), a.rounds, a.quick ? ", quick" : "");

  std::shared_ptr<PluginHost> plugins = PluginHost::Acquire({KVBRIDGE_PLUGIN_BUILD_DIR});
  std::string io_line;
  bl::Json items;
  items.BeginArray();
  double value = 0, baseline = 0, w_sum = 0, bw_sum = 0, r_sum = 0, br_sum = 0;
  int headline_n = 0;
  for (uint64_t size : a.sizes) {
    const uint64_t n = std::max<uint64_t>(16, a.mib_per_size * kMiB / size);
    auto src = Buffers(a.threads, size, true);
    auto dst = Buffers(a.threads, size, false);
    std::vector<double> bw, br, pw, pr, wratio, rratio;
    for (int round = 0; round < a.rounds; ++round) {
      // Alternate the two sides so that drift of the device hits both alike.
      const Rates b = Baseline(a, size, n, src, dst);
      const Rates p = ThroughPlugin(a, *plugins, size, n, src, dst, &io_line);
      bw.push_back(b.write_s);
      br.push_back(b.read_s);
      pw.push_back(p.write_s);
      pr.push_back(p.read_s);
      // Ratios of the same round: the device's drift between rounds cancels out.
      wratio.push_back(b.write_s / p.write_s);
      rratio.push_back(b.read_s / p.read_s);
    }
    for (auto* p : src) std::free(p);
    for (auto* p : dst) std::free(p);
    const double bytes = static_cast<double>(n * size);
    const double w = bl::Gbps(bytes, Median(pw)), r = bl::Gbps(bytes, Median(pr));
    const double bw_gbps = bl::Gbps(bytes, Median(bw)), br_gbps = bl::Gbps(bytes, Median(br));
    std::fprintf(stderr,
                 "  %7llu KiB x %5llu: put %.3f GB/s (%.0f IOPS) vs O_DIRECT write %.3f GB/s; get "
                 "%.3f GB/s (%.0f IOPS) vs O_DIRECT read %.3f GB/s\n",
                 static_cast<unsigned long long>(size >> 10), static_cast<unsigned long long>(n), w,
                 n / Median(pw), bw_gbps, r, n / Median(pr), br_gbps);
    items.BeginObject()
        .Field("object_bytes", size)
        .Field("objects", n)
        .Field("write_gbps", w, 3)
        .Field("write_iops", n / Median(pw), 0)
        .Field("read_gbps", r, 3)
        .Field("read_iops", n / Median(pr), 0)
        .Field("baseline_write_gbps", bw_gbps, 3)
        .Field("baseline_write_iops", n / Median(bw), 0)
        .Field("baseline_read_gbps", br_gbps, 3)
        .Field("baseline_read_iops", n / Median(br), 0)
        .Field("write_ratio", Median(wratio), 3)
        .Field("read_ratio", Median(rratio), 3)
        .EndObject();
    if (size >= kMiB) {
      value += w + r;
      baseline += bw_gbps + br_gbps;
      w_sum += w;
      bw_sum += bw_gbps;
      r_sum += r;
      br_sum += br_gbps;
      headline_n += 2;
    }
  }
  fs::remove_all(a.dir + "/store", ec);
  if (headline_n == 0) Die("no object size of 1 MiB or more: no headline");
  value /= headline_n;
  baseline /= headline_n;
  items.EndArray();
  bl::Json j;
  j.BeginObject()
      .Field("benchmark", "ssd")
      .Field("quick", a.quick)
      .Field("dir", a.dir)
      .Field("fs", fs_name)
      .Field("threads", a.threads)
      .Field("io", io_line)
      .Key("headline")
      .BeginObject()
      .Field("metric",
             "ssd plugin put+get GB/s (objects >= 1 MiB, each put durable) / plain O_DIRECT "
             "write+read GB/s")
      .Field("value", value, 3)
      .Field("baseline", baseline, 3)
      .Field("baseline_name",
             "O_DIRECT pwrite (one fdatasync at the end) and pread of the same sizes, same "
             "threads, same file system, same run")
      .Field("ratio", bl::Ratio(value, baseline), 3)
      .Field("write_ratio", bl::Ratio(w_sum, bw_sum), 3)
      .Field("read_ratio", bl::Ratio(r_sum, br_sum), 3)
      .Field("goal", 0.8, 1)
      .EndObject()
      .Key("results")
      .Raw(items.str())
      .EndObject();
  bl::PrintResult(j);
  return 0;
}
